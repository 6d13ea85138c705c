"""Ditto (Li et al., ICML 2021): FedAvg plus a regularized personal model per client."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_pfl.engine import Params, TrainResult
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedprox import anchor, proximal_loss
from lightning_pfl.validation import NonNegativeFloat, PositiveInt

PERSONAL_PHASE = 1


class Ditto(FedAvg):
    """Ditto: a global model trained by FedAvg and a personal model v_k kept by each client.

    Round for a sampled client k: receive the global model w^t; train it as FedAvg does and
    upload it (the server averages, sample-weighted); then train the personal model v_k from
    its last value on ``F_k(v) + lambda/2 ||v - w^t||^2`` (``w^t`` the received global model,
    frozen) for the same number of local steps (or ``personal_epochs`` epochs), on batches
    drawn apart from the global model's. v_k starts at the initial global model w^0 and never
    leaves the client. Personalized model: v_k.

    Args:
        lam: regularization strength lambda towards the global model (the paper tunes it in
            {0.01, 0.1, 1, 2}; 0.1 here). lambda = 0 is local training beside FedAvg.
        personal_epochs: local epochs of v_k per round (None: the same ``local_steps`` /
            ``local_epochs`` as the global model, the paper's setting).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self, lam: NonNegativeFloat = 0.1, personal_epochs: PositiveInt | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.trainable = tuple(self.arch.shapes)
        self.personal_loss = proximal_loss(self.cross_entropy, lam, self.trainable)
        self.store.add_field("v", self.arch.initial_state())

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        h = self.hp
        received = anchor(start, self.trainable)
        result = super().train_clients(round_idx, clients, start)
        epochs = h.personal_epochs if h.personal_epochs is not None else h.local_epochs
        personal = self.local_train(
            self.store.gather("v", clients, self.device),
            clients,
            round_idx,
            loss_fn=self.personal_loss,
            context=received,
            batches=self.draw_batches(clients, round_idx, epochs, PERSONAL_PHASE),
        )
        self.store.scatter("v", clients, personal.params)
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        return self.store.gather("v", clients, self.device)
