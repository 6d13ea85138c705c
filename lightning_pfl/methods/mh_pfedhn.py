"""MH-pFedHN, MH-pFedHNG and MH-pFedHNGD (Zhang et al., "Hypernetworks for Model-Heterogeneous
Personalized Federated Learning"): one server hypernetwork for clients of any architecture.

The code is split the way the protocol is. The *client side* (:meth:`MHPFedHN.client_update`)
knows each client's architecture, maps a flat vector onto it (:class:`FlatCodec`, a fixed
parameter order), trains it and returns the flat delta. The *server side* (``self.hnet``, a
:class:`MultiHeadHyperNetwork` built from the clients' parameter counts, and
:meth:`MHPFedHN.server_gradients`) only ever sees counts, flat vectors and flat deltas.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from lightning_pfl.assignment import NetworkGroups
from lightning_pfl.datamodule import Split
from lightning_pfl.engine import (
    Architecture,
    ClientBatches,
    LossFn,
    Params,
    cross_entropy_loss,
    weighted_cross_entropy,
)
from lightning_pfl.losses import distillation_loss
from lightning_pfl.methods.base import FederatedMethod, NovelAdaptation
from lightning_pfl.models import build_network
from lightning_pfl.models.multihead_hypernetwork import (
    FlatCodec,
    HeadSharing,
    MultiHeadHyperNetwork,
)
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Range,
    UnitInterval,
)

Fraction = Annotated[float, Range(gt=0, le=1)]
SEP = "/"  # personalized params are keyed "<architecture>/<tensor>" (evaluation dispatches on it)


class MHPFedHN(FederatedMethod):
    """MH-pFedHN: a multi-head hypernetwork generates every client's (heterogeneous) model.

    Round: for each architecture among the round's clients (one vmapped group each), the
    server generates the clients' flat vectors g_i = h(v_i; phi) (``[C, K_i]``); each client
    maps g_i onto its model, trains it locally and uploads delta_i = g_i - g~_i (in the flat
    coordinates, top-``upload_fraction`` entries by magnitude only); the server sets
    grad(phi, v) = (1/C) sum_i (d g_i / d(phi, v))^T delta_i, the gradient of the surrogate
    (1/C) sum_i <g_i(phi, v), delta_i>, clips it to ``hn_max_grad_norm`` and takes an Adam step.

    Architectures are assigned to clients by ``architectures`` (see
    :class:`~lightning_pfl.assignment.NetworkGroups`): ``{name: {net, net_args, share|clients}}``;
    accuracy per architecture is logged as ``{val,test}/arch_<name>/acc``. Batch-norm running
    statistics stay on the client (per-client state, never generated nor uploaded).

    Args:
        architectures: the clients' architectures (default: every client uses ``net``).
        output_size: N, outputs of one head layer; client i has tau_i = ceil(K_i / N) slots.
        embed_dim: embedding size (paper: 64).
        hidden_dim: MLP width (paper: 128).
        n_layers: MLP layers, each with a ReLU (paper: 3, 64 -> 128 -> 128 -> 128).
        embed_std: standard deviation of the embeddings' initialization (paper: 0.002).
        head_sharing: ``tau`` (paper: equal tau share a head), ``client`` (a head per client)
            or ``none`` (one output layer for every slot): the paper's Table 3 study.
        parametrization: ``standardized`` (ours, default): heads start with unit-variance
            outputs and a client maps flat value g of tensor t to mu_t + sigma_t g, with mu_t,
            sigma_t its own initialization's mean and std (known only to the client), so every
            layer starts at its usual scale; ``raw`` (paper): theta = g, default head init.
        upload_fraction: share of each delta's entries uploaded (largest magnitudes; the rest
            count as 0); the paper's Table 12 uses 0.3. Uploads then count values + int32 indices.
        hn_lr: Adam learning rate of phi and the embeddings (paper: 2e-4).
        hn_weight_decay: Adam weight decay.
        hn_max_grad_norm: clip of the server gradient norm (paper: 50; None: off).
        local_lr, local_momentum, local_weight_decay, local_epochs, batch_size: client SGD
            (paper: 1e-3, 0.9, 1e-4, 2 epochs, 64).
        net: the default architecture (and the base class's target; default ``zoo_cnn``).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    def __init__(
        self,
        architectures: dict[str, dict[str, Any]] | None = None,
        output_size: PositiveInt = 3072,
        embed_dim: PositiveInt = 64,
        hidden_dim: PositiveInt = 128,
        n_layers: PositiveInt = 3,
        embed_std: PositiveFloat = 0.002,
        head_sharing: HeadSharing = "tau",
        parametrization: Literal["standardized", "raw"] = "standardized",
        upload_fraction: Fraction = 1.0,
        hn_lr: PositiveFloat = 2e-4,
        hn_weight_decay: NonNegativeFloat = 0.0,
        hn_max_grad_norm: PositiveFloat | None = 50.0,
        net: str = "zoo_cnn",
        local_lr: PositiveFloat = 1e-3,
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 1e-4,
        local_epochs: PositiveInt | None = 2,
        batch_size: PositiveInt = 64,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            net=net,
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_epochs=local_epochs,
            batch_size=batch_size,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        h = self.hp
        # ------------------------------------------------------------- client side
        with self.seeded_init():
            self.zoo = NetworkGroups(
                architectures or {net: {"net": net, "net_args": h.net_args or {}}},
                h.num_clients,
                tuple(h.input_shape),
                h.num_classes,
                h.seed,
                "model.init_args.architectures",
            )
        standardized = parametrization == "standardized"
        self.codecs = {
            kind: FlatCodec(arch.initial_params(), standardized)
            for kind, arch in self.zoo.archs.items()
        }
        self.losses = {kind: cross_entropy_loss(arch) for kind, arch in self.zoo.archs.items()}
        for kind, arch in self.zoo.archs.items():
            if arch.stateful:
                rows = len(self.zoo.members(kind))
                self.store.add_field(f"buffers.{kind}", arch.initial_buffers(), rows)
        kinds = [self.zoo.names[g] for g in self.zoo.group_of.tolist()]
        counts = [self.codecs[kind].count for kind in kinds]  # what clients tell the server
        # ------------------------------------------------------------- server side
        with self.seeded_init():
            self.hnet = MultiHeadHyperNetwork(
                counts + self.extra_counts(),
                output_size,
                embed_dim,
                hidden_dim,
                n_layers,
                embed_std,
                head_sharing,
                standardized,
            )

    def extra_counts(self) -> list[int]:
        """Counts of hypernetwork rows after the clients' (MH-pFedHNG: the global model)."""
        return []

    def client_groups(self) -> dict[str, Tensor]:
        return self.zoo.client_groups("arch")

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        return torch.optim.Adam(self.hnet.parameters(), lr=h.hn_lr, weight_decay=h.hn_weight_decay)

    # ----------------------------------------------------------------- client side
    def client_update(
        self,
        codec: FlatCodec,
        arch: Architecture,
        clients: Tensor,
        flat: Tensor,
        round_idx: int,
        batches: ClientBatches,
        loss_fn: LossFn,
        frozen: Params | None = None,
        buffers: tuple[str, Tensor] | None = None,
    ) -> tuple[Tensor, Params, Tensor]:
        """``clients`` (all of architecture ``arch``) train the model decoded from ``flat``.

        Returns the flat delta g - g~ (sparsified to ``upload_fraction``), the trained
        parameters and buffers (kept by the clients) and the mean training loss per client.
        Batch-norm buffers are read from and written back to the store's ``buffers`` =
        (field, rows).
        """
        params = codec.to_params(flat)
        if arch.stateful and buffers is not None:
            params |= self.store.gather(*buffers, self.device)
        result = self.local_train(
            params, clients, round_idx, loss_fn=loss_fn, frozen=frozen, batches=batches, arch=arch
        )
        if arch.stateful and buffers is not None:
            self.store.scatter(*buffers, {n: result.params[n] for n in arch.buffer_shapes})
        delta = flat - codec.to_flat(result.params)
        return self.sparsify(delta), result.params, result.loss

    def sparsify(self, delta: Tensor) -> Tensor:
        """Keep each row's top ``upload_fraction`` entries by magnitude (others 0)."""
        fraction = self.hp.upload_fraction
        if fraction >= 1.0:
            return delta
        k = max(1, math.ceil(fraction * delta.shape[1]))
        index = delta.abs().topk(k, dim=1).indices
        return torch.zeros_like(delta).scatter(1, index, delta.gather(1, index))

    def uploaded(self, delta: Tensor) -> dict[str, Tensor]:
        """What a delta costs on the wire: dense values, or values and int32 indices."""
        if self.hp.upload_fraction >= 1.0:
            return {"delta": delta}
        k = max(1, math.ceil(self.hp.upload_fraction * delta.shape[1]))
        values = delta.new_empty(len(delta), k)
        return {"values": values, "index": values.new_empty(values.shape, dtype=torch.int32)}

    # ----------------------------------------------------------------- server side
    def server_gradients(
        self, generated: list[Tensor], deltas: list[Tensor], weights: Tensor
    ) -> None:
        """grad(phi, v) = sum_i w_i (d g_i / d(phi, v))^T delta_i over flat vectors ``generated``
        (a list of ``[C_j, K_j]`` with their graphs) and flat ``deltas``, then clipped: the
        gradient of the surrogate sum_i w_i <g_i(phi, v), delta_i>. Parameters no generated
        vector depends on (heads of absent sizes) get no gradient (Adam skips them)."""
        params = list(self.hnet.parameters())
        offsets = [0]
        for g in generated:
            offsets.append(offsets[-1] + len(g))
        grad_outputs = [
            weights[a:b, None].to(d) * d
            for a, b, d in zip(offsets[:-1], offsets[1:], deltas, strict=True)
        ]
        grads = torch.autograd.grad(generated, params, grad_outputs, allow_unused=True)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if self.hp.hn_max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.hp.hn_max_grad_norm)

    # ----------------------------------------------------------------- the round
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        losses, down, up = self.personal_round(round_idx, clients)
        self.record_communication(down=down, up=up)
        return losses

    def personal_round(
        self, round_idx: int, clients: Tensor, teachers: Params | None = None
    ) -> tuple[Tensor, Params, Params]:
        """Generate, train per architecture group, upload deltas, set the server gradient.

        ``teachers`` are per-client frozen tensors handed to the personal loss (MH-pFedHNGD).
        Returns the losses and what was sent down and up.
        """
        batches = self.draw_batches(clients, round_idx)
        ids = clients.cpu()
        losses = torch.zeros(len(clients), device=self.device)
        generated: list[Tensor] = []
        deltas: list[Tensor] = []
        down: Params = {}
        up: Params = {}
        for kind, rows in self.zoo.split(clients):
            members, on_cpu = clients[rows], ids[rows.cpu()]
            flat = self.hnet(on_cpu.tolist())  # server: the members' flat vectors
            delta, _, loss = self.client_update(
                self.codecs[kind],
                self.zoo.archs[kind],
                members,
                flat.detach(),
                round_idx,
                batches.select(rows),
                self.personal_loss(kind),
                None if teachers is None else {n: t[rows] for n, t in teachers.items()},
                (f"buffers.{kind}", self.zoo.row_of[on_cpu]),
            )
            losses[rows] = loss
            generated.append(flat)
            deltas.append(delta)
            down[kind] = flat
            up |= {f"{kind}.{n}": t for n, t in self.uploaded(delta).items()}
        # generated[j] holds the rows of group j; weights follow that order (uniform: 1/C)
        weights = torch.full((len(clients),), 1.0 / len(clients), device=self.device)
        self.server_gradients(generated, deltas, weights)
        return losses, down, up

    def personal_loss(self, kind: str) -> LossFn:
        """The personal models' local loss (MH-pFedHN: cross-entropy)."""
        return self.losses[kind]

    # ----------------------------------------------------------------- evaluation
    def personalized_params(self, clients: Tensor) -> Params:
        groups = list(self.zoo.split(clients))
        if len(groups) != 1:
            raise ValueError("personalized_params takes clients of one architecture")
        kind = groups[0][0]
        with torch.no_grad():
            params = self.codecs[kind].to_params(self.hnet(clients.cpu().tolist()))
        if self.zoo.archs[kind].stateful:
            rows = self.zoo.row_of[clients.cpu()]
            params |= self.store.gather(f"buffers.{kind}", rows, self.device)
        return {f"{kind}{SEP}{n}": t for n, t in params.items()}

    def predict(self, params: Params, x: Tensor) -> Tensor:
        kind = next(iter(params)).split(SEP, 1)[0]
        own = {n.split(SEP, 1)[1]: t for n, t in params.items()}
        return self.zoo.archs[kind](own, x)

    @torch.no_grad()
    def evaluate(self, clients: Tensor, split: Split) -> tuple[Tensor, Tensor, Tensor]:
        """As the base class, one architecture at a time."""
        out = tuple(torch.zeros(len(clients), device=self.device) for _ in range(3))
        for _, rows in self.zoo.split(clients):
            for total, part in zip(out, super().evaluate(clients[rows], split), strict=True):
                total[rows] = part
        return out  # type: ignore[return-value]

    def results(self) -> dict[str, Any]:
        return super().results() | {
            "client_parameters": {k: c.count for k, c in self.codecs.items()},
            "slots": {k: math.ceil(c.count / self.hp.output_size) for k, c in self.codecs.items()},
            "architecture_clients": {k: len(ids) for k, ids in self.client_groups().items()},
            "hypernetwork_parameters": sum(p.numel() for p in self.hnet.parameters()),
        }

    def novel_adaptation(self, clients: Tensor) -> NovelAdaptation:
        """Novel clients adapt their slot embeddings (all tau_i rows of each) and the heads no
        other row uses (a size only novel clients have, or ``head_sharing: client``), which
        never trained; heads shared with trained rows stay frozen. The loss is each client's
        training-mode cross-entropy (also for MH-pFedHNGD, a novel client has no teacher),
        whose forwards update the novel clients' batch-norm statistics in the store."""
        ids = clients.cpu()
        stateful = [kind for kind, arch in self.zoo.archs.items() if arch.stateful]
        buffers = [t for kind in stateful for t in self.store.fields[f"buffers.{kind}"].values()]

        def loss(index: Tensor, weight: Tensor) -> Tensor:
            total = torch.zeros((), device=self.device)
            for kind, rows in self.zoo.split(clients):
                members, arch = ids[rows.cpu()], self.zoo.archs[kind]
                params = self.codecs[kind].to_params(self.hnet(members.tolist()))
                field, store_rows = f"buffers.{kind}", self.zoo.row_of[members]
                if arch.stateful:
                    params |= self.store.gather(field, store_rows, self.device)
                x, y = self.data.fetch(index[rows.to(index.device)])
                logits, state = torch.func.vmap(arch.forward_train)(params, x)
                if arch.stateful:
                    self.store.scatter(field, store_rows, state)
                w = weight[rows.to(weight.device)]
                total = total + torch.func.vmap(weighted_cross_entropy)(logits, y, w).sum()
            return total

        heads = self.hnet.heads_only_of(ids.tolist())
        return NovelAdaptation([self.hnet.embeddings, *heads], loss, buffers)


class MHPFedHNG(MHPFedHN):
    """MH-pFedHNG: MH-pFedHN plus a global model generated by the hypernetwork.

    The global model (by default the architecture with the fewest parameters, K_g = min_i K_i)
    is one more hypernetwork row with its own embeddings v_g, generated through the head of its
    tau_g. Round: every sampled client first trains a copy of the global model for
    ``global_epochs`` epochs; the server sets the gradient of phi and v_g from the
    sample-weighted mean of the global deltas, sum_i p_i delta_g,i, clips it and takes an Adam
    step; then the personal round of :class:`MHPFedHN` runs from the updated phi (a second Adam
    step). Batch-norm statistics of a client's copy of the global model stay with the client.

    Args:
        global_net: the global model's architecture: a group of ``architectures``, or a
            registry network name (the paper's Tables 5 and 9, a global model of another
            architecture); default: the group with the fewest parameters.
        global_net_args: ``net_args`` of ``global_net`` when it is a registry name.
        global_epochs: local epochs on the global model (default ``local_epochs``).
        **kwargs: see :class:`MHPFedHN`.
    """

    def __init__(
        self,
        global_net: str | None = None,
        global_net_args: dict[str, Any] | None = None,
        global_epochs: PositiveInt | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    def extra_counts(self) -> list[int]:
        h = self.hp
        kind = h.global_net or min(self.zoo.names, key=lambda k: self.codecs[k].count)
        if kind in self.zoo.archs:
            self.global_arch, self.global_codec = self.zoo.archs[kind], self.codecs[kind]
        else:
            with self.seeded_init():
                args = h.global_net_args or {}
                net = build_network(kind, h.input_shape, h.num_classes, **args)
            self.global_arch = Architecture(net)
            standardized = h.parametrization == "standardized"
            self.global_codec = FlatCodec(self.global_arch.initial_params(), standardized)
        self.global_loss = cross_entropy_loss(self.global_arch)
        if self.global_arch.stateful:
            self.store.add_field("global_buffers", self.global_arch.initial_buffers())
        return [self.global_codec.count]

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        h = self.hp
        flat = self.hnet([h.num_clients])  # server: the global model's flat vector [1, K_g]
        sent = flat.detach().expand(len(clients), -1)
        epochs = h.global_epochs or h.local_epochs
        delta, trained, _ = self.client_update(
            self.global_codec,
            self.global_arch,
            clients,
            sent,
            round_idx,
            self.draw_batches(clients, round_idx, epochs, phase=1),
            self.global_loss,
            buffers=("global_buffers", clients) if self.global_arch.stateful else None,
        )
        mean = (self.client_weights(clients)[:, None].to(delta) * delta).sum(0, keepdim=True)
        self.server_gradients([flat], [mean], torch.ones(1, device=self.device))
        assert self.server_optimizer is not None, "configure_optimizers() sets it"
        self.server_optimizer.step()
        self.server_optimizer.zero_grad()
        teachers = {f"teacher.{n}": t for n, t in trained.items()} if self.distills() else None
        losses, down, up = self.personal_round(round_idx, clients, teachers)
        down["global"] = sent
        up |= {f"global.{n}": t for n, t in self.uploaded(delta).items()}
        self.record_communication(down=down, up=up)
        return losses

    def distills(self) -> bool:
        """Whether personal training distills from the trained global model (GD)."""
        return False


class MHPFedHNGD(MHPFedHNG):
    """MH-pFedHNGD: MH-pFedHNG whose personal training distills from the global model.

    Personal loss: lambda CE(student) + (1 - lambda) T^2 KL(p_teacher^T || p_student^T)
    (:func:`~lightning_pfl.losses.distillation_loss`), the teacher being the client's copy of
    the global model as it just trained it this round (evaluation mode).

    Args:
        distill_temperature: T (paper: CIFAR-100 15, Tiny-ImageNet 24, EMNIST 10).
        distill_weight: lambda, the weight of cross-entropy (paper: 0.01, 0.2, 0.1).
        **kwargs: see :class:`MHPFedHNG`.
    """

    def __init__(
        self,
        distill_temperature: PositiveFloat = 15.0,
        distill_weight: UnitInterval = 0.01,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.distill_losses = {kind: self.distillation(kind) for kind in self.zoo.names}

    def distills(self) -> bool:
        return True

    def personal_loss(self, kind: str) -> LossFn:
        return self.distill_losses[kind]

    def distillation(self, kind: str) -> LossFn:
        """lambda CE + (1 - lambda) T^2 KL for a client of ``kind``; the teacher's tensors are
        the ``teacher.``-prefixed frozen ones."""
        student, teacher_arch = self.zoo.archs[kind], self.global_arch
        weight, temperature = self.hp.distill_weight, self.hp.distill_temperature
        prefix = len("teacher.")

        def loss(
            params: Params, frozen: Params, x: Tensor, y: Tensor, w: Tensor
        ) -> Tensor | tuple[Tensor, Params]:
            teacher = {n[prefix:]: t for n, t in frozen.items() if n.startswith("teacher.")}
            own = {n: t for n, t in frozen.items() if not n.startswith("teacher.")}
            logits, buffers = student.forward_train({**own, **params}, x)
            target = teacher_arch(teacher, x)
            value = weight * weighted_cross_entropy(logits, y, w) + (
                1 - weight
            ) * distillation_loss(logits, target, temperature, w)
            return (value, buffers) if buffers else value

        return loss
