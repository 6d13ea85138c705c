"""FedRep (Collins et al., ICML 2021): a shared representation, heads trained first."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_pfl.engine import Params, TrainResult
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import PositiveInt

HEAD_PHASE, BODY_PHASE = 1, 2


class FedRep(FedAvg):
    """FedRep: each round a client first fits its head to the received body, then the body.

    Round for a sampled client i: receive the global representation (body) phi; train its own
    head h_i for tau = ``head_epochs`` epochs with phi frozen; then train the body for
    ``body_epochs`` epochs with the updated head frozen (a fresh SGD each stage, the local SGD
    settings); keep h_i and upload the body; the server averages the bodies (sample-weighted).
    The heads never leave the clients. Personalized model: the global body with the client's
    head. Batch-norm statistics (body tensors) are updated in both stages.

    Args:
        head_epochs: local epochs of the head stage, tau (paper: 10).
        body_epochs: local epochs of the representation stage (paper: 1).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`; ``local_epochs`` and
            ``local_steps`` are not used.
    """

    honours_conditions = True

    def __init__(
        self,
        head_epochs: PositiveInt = 10,
        body_epochs: PositiveInt = 1,
        local_epochs: PositiveInt | None = None,
        **kwargs: Any,
    ) -> None:
        if local_epochs is not None:
            raise ConfigError(
                "FedRep trains head_epochs then body_epochs epochs per round; remove "
                "model.init_args.local_epochs and set those two instead."
            )
        super().__init__(**kwargs)

    def personal_names(self) -> tuple[str, ...]:
        return self.arch.head_names

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        h = self.hp
        head = {n: start[n] for n in self.arch.head_names}
        body = {n: t for n, t in start.items() if n not in head}
        buffers = {n: t for n, t in body.items() if n in self.arch.buffer_shapes}
        weights = {n: t for n, t in body.items() if n not in buffers}
        head_stage = self.local_train(
            {**head, **buffers},
            clients,
            round_idx,
            context=weights,
            batches=self.draw_batches(clients, round_idx, h.head_epochs, HEAD_PHASE),
        )
        head = {n: head_stage.params[n] for n in head}
        body_stage = self.local_train(
            {**weights, **{n: head_stage.params[n] for n in buffers}},
            clients,
            round_idx,
            context=head,
            batches=self.draw_batches(clients, round_idx, h.body_epochs, BODY_PHASE),
        )
        steps = head_stage.steps + body_stage.steps
        loss = head_stage.loss * head_stage.steps + body_stage.loss * body_stage.steps
        return TrainResult(
            {**body_stage.params, **head},
            {**body_stage.momentum, **head_stage.momentum},
            loss / steps.clamp_min(1),
            steps,
        )
