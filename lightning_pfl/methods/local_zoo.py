"""Local training with per-client architectures: the model-heterogeneous Local baseline."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.assignment import GroupShare
from lightning_pfl.engine import LossFn, cross_entropy_loss
from lightning_pfl.methods.fedgh import HeterogeneousModels


class HeterogeneousLocal(HeterogeneousModels):
    """Local training where every client has its own architecture (MH-pFedHN's "Local" row).

    As :class:`~lightning_pfl.methods.local.Local`: each sampled client continues training its
    own model (the clients of one architecture start from that architecture's seeded
    initialization) with its own SGD, whose momentum persists across rounds; nothing is sent,
    so every ``comm/*`` key stays 0. Clients of one architecture train together (one vmap per
    architecture) and their accuracy is also reported as ``{val,test}/arch_<name>/acc``.

    Args:
        architectures: client architecture groups (see :mod:`lightning_pfl.assignment`;
            default: every client uses ``net``).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    shares_header = False
    honours_conditions = True

    def __init__(
        self, architectures: dict[str, dict[str, Any]] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(architectures, **kwargs)
        self.losses: dict[str, LossFn] = {}
        for kind, arch in self.groups.archs.items():
            momentum = {n: torch.zeros_like(p) for n, p in arch.initial_params().items()}
            self.store.add_field(f"momentum.{kind}", momentum, len(self.groups.members(kind)))
            self.losses[kind] = cross_entropy_loss(arch)

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        batches = self.draw_batches(clients, round_idx)

        def train(group: GroupShare) -> Tensor:
            kind, members = group.name, group.members
            store_rows = self.groups.row_of[members.cpu()]
            result = self.local_train(
                self.gather_models(kind, members),
                members,
                round_idx,
                loss_fn=self.losses[kind],
                momentum=self.store.gather(f"momentum.{kind}", store_rows, self.device),
                batches=batches.select(group.rows),
                arch=group.arch,
            )
            self.scatter_models(kind, members, result.params)
            self.store.scatter(f"momentum.{kind}", store_rows, result.momentum)
            return result.loss

        return self.groups.train_groups(clients, train)
