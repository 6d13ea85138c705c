"""FedGH (Yi et al., ACM MM 2023): heterogeneous models share a generalized global header."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap

from lightning_pfl.assignment import GroupShare, NetworkGroups
from lightning_pfl.datamodule import Split
from lightning_pfl.engine import Architecture, LossFn, Params, cross_entropy_loss
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.validation import Momentum, NonNegativeFloat, NonNegativeInt, PositiveFloat


def train_header(
    weight: Tensor, bias: Tensor, reps: Tensor, labels: Tensor, lr: float, epochs: int = 1
) -> tuple[Tensor, Tensor]:
    """The server's header training: theta <- theta - eta_theta grad CE(H(R_k^s; theta), s).

    One SGD step per uploaded (class-mean representation, class) pair, in upload order (client
    by client, class by class, the paper's Algorithm 1), repeated ``epochs`` times.

    Args:
        weight, bias: the global header H = Linear(d, C) (``[C, d]``, ``[C]``).
        reps: class-mean representations R_k^s, ``[P, d]``.
        labels: their classes s, ``[P]``.
        lr: eta_theta.
        epochs: passes over the pairs.
    """
    w, b = weight.detach().float(), bias.detach().float()
    with torch.enable_grad():
        for _ in range(epochs):
            for r, s in zip(reps.float(), labels, strict=True):
                w.requires_grad_(True)
                b.requires_grad_(True)
                loss = F.cross_entropy((r @ w.T + b)[None], s[None])
                gw, gb = torch.autograd.grad(loss, [w, b])
                w, b = (w - lr * gw).detach(), (b - lr * gb).detach()
    return w.to(weight.dtype), b.to(bias.dtype)


class HeterogeneousModels(FederatedMethod):
    """Base of methods whose clients keep whole models of per-client architectures.

    Client architectures are named groups in ``architectures`` (see
    :mod:`lightning_pfl.assignment`; default: every client uses ``net``); each client's model
    (parameters and buffers) lives in the client store under ``model.<group>``. Where
    ``shares_header`` (FedGH, FedAKT), every header (the last linear layer) must map the same
    representation size d to the classes, so that something of size d can be shared. Clients
    of one architecture train together (one vmap each) and their accuracy is also reported as
    ``<split>/arch_<name>/acc``. A client's personalized model is its own model as last trained.

    Args:
        architectures: client architecture groups (default: every client uses ``net``).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    shares_header = True  # whether every architecture's header must have one shape

    def __init__(
        self, architectures: dict[str, dict[str, Any]] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        h = self.hp
        default = {"net": {"net": h.net, "net_args": h.net_args or {}}}
        with self.seeded_init():
            self.groups = NetworkGroups(
                architectures or default,
                h.num_clients,
                tuple(h.input_shape),
                h.num_classes,
                h.seed,
                "model.init_args.architectures",
            )
        self.header_names: dict[str, tuple[str, str]] = {}
        shapes = set()
        for kind, arch in self.groups.archs.items():
            members = self.groups.members(kind)
            self.store.add_field(f"model.{kind}", arch.initial_state(), len(members))
            if not self.shares_header:
                continue
            names = sorted(arch.head_names, key=lambda n: not n.endswith("weight"))
            if len(names) != 2 or len(arch.shapes[names[0]]) != 2:
                raise ConfigError(
                    f"{type(self).__name__}: the header of '{kind}' must be one nn.Linear."
                )
            self.header_names[kind] = (names[0], names[1])
            shapes.add(arch.shapes[names[0]])
        if not self.shares_header:
            return
        if len(shapes) != 1:
            raise ConfigError(
                f"{type(self).__name__}: every client architecture must end in a header of the "
                f"same shape [classes, d] (a shared representation size d); got {sorted(shapes)}."
            )
        self.representation_size = next(iter(shapes))[1]

    def gather_models(self, kind: str, clients: Tensor) -> Params:
        """The stored models of ``clients`` (all of group ``kind``)."""
        return self.store.gather(f"model.{kind}", self.groups.row_of[clients.cpu()], self.device)

    def scatter_models(self, kind: str, clients: Tensor, models: Params) -> None:
        """Store the models of ``clients`` (all of group ``kind``); extra keys are ignored."""
        field = self.store.fields[f"model.{kind}"]
        kept = {n: models[n] for n in field}
        self.store.scatter(f"model.{kind}", self.groups.row_of[clients.cpu()], kept)

    # ----------------------------------------------------------------- evaluation
    def personalized_params(self, clients: Tensor) -> Params:
        kind = self.groups.group_of_clients(clients)
        return self.groups.tagged(kind, self.gather_models(kind, clients))

    def network_groups(self) -> NetworkGroups:
        return self.groups


class FedGH(HeterogeneousModels):
    """FedGH: every client keeps its own (possibly different) model; only the header is global.

    Round (Algorithm 1): the server sends the global header theta (a Linear(d, C) on the
    representation of dimension d every client architecture shares); each client replaces its
    header by theta and trains its whole model with cross-entropy; it then computes, over its
    training data, the mean representation R_k^s of each of its classes s and uploads these
    (with the class ids), never its model. The server trains theta with one SGD step of
    learning rate eta_theta per (R_k^s, s) pair (see :func:`train_header`).

    A client's personalized model is its own model as last trained (its extractor with the
    header it fine-tuned from the global one). Client architectures are named groups in
    ``architectures`` (see :mod:`lightning_pfl.assignment`); their headers must all map the
    same d to the classes. Clients of one architecture train together (one vmap each) and
    their accuracy is also reported as ``<split>/arch_<name>/acc``.

    Args:
        architectures: client architecture groups (default: every client uses ``net``).
        header_lr: eta_theta, the server's header learning rate (paper: the local learning
            rate is searched in {1e-3, 1e-2, 1e-1, 1}; default 1e-2).
        header_epochs: passes over the uploaded pairs per round (paper: 1).
        local_momentum: client SGD momentum (the authors' code, LipingYi/FedGH
            ``FedGH_mh.py`` and ``FedGH.py``: SGD with momentum 0.9).
        local_weight_decay: client SGD weight decay (the authors' code: ``--wd`` 1e-3).
        local_max_grad_norm: per-step gradient-norm clip of the clients (the authors' code:
            50).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod` (local training:
            fresh SGD every round, ``local_epochs`` / ``local_steps``, ``local_lr`` eta).
    """

    honours_conditions = True

    def __init__(
        self,
        architectures: dict[str, dict[str, Any]] | None = None,
        header_lr: PositiveFloat = 1e-2,
        header_epochs: NonNegativeInt = 1,
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 1e-3,
        local_max_grad_norm: PositiveFloat | None = 50.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            architectures,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        h = self.hp
        first = next(iter(self.groups.archs))
        init = self.groups.archs[first].initial_params()
        weight_name, bias_name = self.header_names[first]
        self.header = nn.Linear(init[weight_name].shape[1], h.num_classes)
        with torch.no_grad():
            self.header.weight.copy_(init[weight_name])
            self.header.bias.copy_(init[bias_name])
        self.losses: dict[str, LossFn] = {
            kind: cross_entropy_loss(arch) for kind, arch in self.groups.archs.items()
        }

    # ----------------------------------------------------------------- the round
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        h = self.hp
        batches = self.draw_batches(clients, round_idx)
        d = self.header.weight.shape[1]
        reps = torch.zeros(len(clients), h.num_classes, d, device=self.device)
        counts = torch.zeros(len(clients), h.num_classes, device=self.device)

        def train(group: GroupShare) -> Tensor:
            kind, rows, members, arch = group.name, group.rows, group.members, group.arch
            kept = self.gather_models(kind, members)
            weight_name, bias_name = self.header_names[kind]
            params = dict(kept)
            params[weight_name] = self.header.weight.detach().expand(len(rows), -1, -1).clone()
            params[bias_name] = self.header.bias.detach().expand(len(rows), -1).clone()
            result = self.local_train(
                params,
                members,
                round_idx,
                loss_fn=self.losses[kind],
                batches=batches.select(rows),
                arch=arch,
            )
            # a client that did not report back keeps its own header, not the one it was sent
            models = self.where_arrived(members, round_idx, result.params, kept)
            self.scatter_models(kind, members, models)
            reps[rows], counts[rows] = self.class_representations(arch, result.params, members)
            return result.loss

        losses = self.groups.train_groups(clients, train)
        present = counts > 0  # the server's one look at what was uploaded
        arrived = present & self.arrived(clients, round_idx).unsqueeze(-1)
        uploaded, labels = reps[arrived], arrived.nonzero()[:, 1]
        with torch.no_grad():
            w, b = train_header(
                self.header.weight, self.header.bias, uploaded, labels, h.header_lr, h.header_epochs
            )
            self.header.weight.copy_(w)
            self.header.bias.copy_(b)
        sent = {
            n: p.detach().expand(len(clients), *p.shape) for n, p in self.header.named_parameters()
        }
        # every sampled client's pairs: record_communication counts the arrived share
        up = {"representations": reps[present], "classes": present.nonzero()[:, 1]}
        self.record_communication(down=sent, up=up)
        return losses

    @torch.no_grad()
    def class_representations(
        self, arch: Architecture, params: Params, clients: Tensor, split: Split = "train"
    ) -> tuple[Tensor, Tensor]:
        """Mean representation of each class over each client's ``split`` data and the counts
        (``[C, classes, d]``, ``[C, classes]``; a class a client lacks has a zero mean)."""
        features = vmap(arch.features)
        sums: Tensor | None = None
        counts = torch.zeros(len(clients), self.hp.num_classes, device=self.device)
        by_size = self.data.by_size(clients, split)
        params = by_size.sort(params)
        for k, x, y, weight in by_size.blocks(self.hp.eval_batch_size):
            z = features({n: t[:k] for n, t in params.items()}, x).float()
            onehot = F.one_hot(y, self.hp.num_classes).float() * weight.unsqueeze(-1)
            part = torch.einsum("cbk,cbd->ckd", onehot, z)
            if sums is None:
                sums = part.new_zeros(len(clients), *part.shape[1:])
            sums[:k] += part
            counts[:k] += onehot.sum(1)
        assert sums is not None, "every client has training data"
        means = sums / counts.clamp_min(1).unsqueeze(-1)
        return by_size.unsort(means), by_size.unsort(counts)
