"""Local: every client trains its own model on its own data, no communication."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import Params
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.novel_adaptation import NovelAdaptation


class Local(FederatedMethod):
    """Local training baseline.

    Each sampled client continues training its own model (all clients start from the same
    seeded initialization) with its own optimizer, whose momentum persists across rounds.
    Nothing is sent, so every ``comm/*`` key stays 0. A novel client
    (:class:`~lightning_pfl.novel.NovelClients`) trains its own model from the common
    initialization, as every client does.
    """

    honours_conditions = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store.add_field("params", self.arch.initial_state())  # with batch-norm statistics
        momentum = {n: torch.zeros_like(p) for n, p in self.arch.initial_params().items()}
        self.store.add_field("momentum", momentum)

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        params = self.store.gather("params", clients, self.device)
        momentum = self.store.gather("momentum", clients, self.device)
        result = self.local_train(params, clients, round_idx, momentum=momentum)
        self.store.scatter("params", clients, result.params)
        self.store.scatter("momentum", clients, result.momentum)
        return result.loss

    def personalized_params(self, clients: Tensor) -> Params:
        return self.store.gather("params", clients, self.device)

    def novel_adaptation(self, clients: Tensor) -> NovelAdaptation:
        """The novel clients' own models (still at the common initialization: never sampled)
        train on their data; batch-norm statistics are not adapted."""
        stored = self.store.fields["params"]
        tensors = [t for n, t in stored.items() if n in self.arch.shapes]
        return NovelAdaptation(tensors, self.novel_loss(lambda: self.personalized_params(clients)))
