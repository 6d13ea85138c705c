"""FedAKT (Liu et al., J. Systems Architecture 2025): adapter-guided knowledge transfer."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.architecture import drop_batch_counters
from lightning_pfl.assignment import GroupShare
from lightning_pfl.engine import Architecture, LossFn, Params, weighted_cross_entropy
from lightning_pfl.errors import ConfigError
from lightning_pfl.losses import weighted_mean
from lightning_pfl.methods.fedgh import HeterogeneousModels
from lightning_pfl.models import build_network
from lightning_pfl.params import client_mean
from lightning_pfl.privacy import privatizes
from lightning_pfl.validation import NonNegativeFloat


class FedAKT(HeterogeneousModels):
    """FedAKT: heterogeneous local models exchange knowledge through a small shared adapter.

    Our reading of the paper (only its abstract is available to us; the pFedKT comparison
    names it without details): every client keeps its own model (extractor f_i and header
    h_i, any architecture) and holds a copy of a small homogeneous adapter extractor a (the
    only thing uploaded, FedAvg'd by the server, sample-weighted). Each round a client trains
    its model and the received adapter jointly on

        L = CE(h_i(f_i(x)), y) + CE(h_i(a(x)), y) + mu * ||f_i(x) - a(x)||^2 / d

    - header dual-use (HDU): the local header h_i classifies both the local representation
      and the adapter's, so it learns from both views;
    - feature-based mutual distillation (FMD): the squared distance between the two
      representations (mean over the d features), with gradients into both extractors, pulls
      each toward the other: the adapter carries other clients' knowledge into f_i and takes
      f_i's back to the server.

    The personalized model is h_i(f_i(x)) as last trained. The adapter's own classifier is
    never used or sent; its representation size must equal the headers' d.

    Args:
        adapter: the adapter network, ``{"net": registry name, "net_args": {...}}`` (default:
            ``net``); only its feature extractor is used.
        distill_weight: mu, the weight of the mutual distillation term (not given in the
            abstract; our default 1).
        architectures: client architecture groups (see
            :class:`~lightning_pfl.methods.fedgh.HeterogeneousModels`).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    honours_conditions = True

    def __init__(
        self,
        adapter: dict[str, Any] | None = None,
        distill_weight: NonNegativeFloat = 1.0,
        architectures: dict[str, dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(architectures, **kwargs)
        h = self.hp
        spec = adapter or {"net": h.net, "net_args": h.net_args or {}}
        with self.seeded_init():
            try:
                net = build_network(
                    spec["net"], h.input_shape, h.num_classes, **(spec.get("net_args") or {})
                )
            except (ConfigError, KeyError) as error:
                raise ConfigError(f"model.init_args.adapter: {error}") from None
        self.adapter_arch = Architecture(net)
        head = self.adapter_arch.head_names
        self.adapter = drop_batch_counters(net)
        for p in (p for n, p in self.adapter.named_parameters() if n in head):
            p.requires_grad_(False)  # the adapter's classifier is never used
        width = max(self.adapter_arch.shapes[n] for n in head)[-1]
        if self.adapter_arch.stateful or any(a.stateful for a in self.groups.archs.values()):
            raise ConfigError("FedAKT: use networks without batch norm.")
        if width != self.representation_size:
            raise ConfigError(
                f"FedAKT: the adapter's representation size {width} must equal the headers' "
                f"{self.representation_size}."
            )
        self.losses = {kind: self.joint_loss(arch) for kind, arch in self.groups.archs.items()}

    def shared_names(self) -> tuple[str, ...]:
        """The adapter tensors that are sent and averaged (its extractor)."""
        return tuple(n for n, p in self.adapter.named_parameters() if p.requires_grad)

    def joint_loss(self, arch: Architecture) -> LossFn:
        """L = CE(h(f(x))) + CE(h(a(x))) + mu ||f(x) - a(x)||^2 / d for one client group."""
        adapter, mu = self.adapter_arch, self.hp.distill_weight

        def loss(params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            model = {n[6:]: t for n, t in params.items() if n.startswith("model.")}
            shared = {n[8:]: t for n, t in params.items() if n.startswith("adapter.")}
            z = arch.features(model, x, train=True)
            z_adapter = adapter.features(shared, x, train=True)
            local = weighted_cross_entropy(arch.classify(model, z), y, w)
            dual = weighted_cross_entropy(arch.classify(model, z_adapter), y, w)
            distill = weighted_mean((z - z_adapter).float().pow(2).mean(-1), w)
            return local + dual + mu * distill

        return loss

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        shared = [p for p in self.adapter.parameters() if p.requires_grad]
        return torch.optim.SGD(shared, lr=1.0)  # lr 1 on w - mean(w_i): plain FedAvg

    @privatizes(
        "the update of the adapter's extractor (the whole upload), clipped as one vector; each "
        "client's own model never leaves it"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        batches = self.draw_batches(clients, round_idx)
        state = dict(self.adapter.named_parameters())
        sent = {
            n: state[n].detach().expand(len(clients), *state[n].shape) for n in self.shared_names()
        }
        trained = {n: t.clone() for n, t in sent.items()}

        def train(group: GroupShare) -> Tensor:
            kind, rows, members = group.name, group.rows, group.members
            model = {f"model.{n}": t for n, t in self.gather_models(kind, members).items()}
            adapter = {f"adapter.{n}": t[rows].clone() for n, t in sent.items()}
            result = self.local_train(
                model | adapter,
                members,
                round_idx,
                loss_fn=self.losses[kind],
                batches=batches.select(rows),
                arch=group.arch,
            )
            self.scatter_models(
                kind,
                members,
                {n[6:]: t for n, t in result.params.items() if n.startswith("model.")},
            )
            for n in trained:
                trained[n][rows] = result.params[f"adapter.{n}"]
            return result.loss

        losses = self.groups.train_groups(clients, train)
        if self.client_dp is None:
            received, weights = trained, self.client_weights(clients, round_idx)
        else:  # FedAvg's DP on the adapter
            received, weights = self.dp_uploads(round_idx, sent, trained)
        if self.client_dp is not None or not self.nothing_arrived(clients, round_idx):
            for n in received:
                mean = client_mean(received[n], weights)
                state[n].grad = state[n].detach() - mean.to(state[n].dtype)
        self.record_communication(down=sent, up=trained)
        return losses
