"""FedAvg-FT: FedAvg whose global model each client fine-tunes locally before evaluation."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import ParamGroup, Params, SGDConfig, derive_seed, train_clients
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.streams import BATCH_STREAM, DROPOUT_STREAM
from lightning_pfl.validation import PositiveInt

FINETUNE_PHASE = 7  # batch stream of the fine-tuning epochs (apart from training's phases)


class FedAvgFT(FedAvg):
    """FedAvg, then each client fine-tunes the global model for E' local epochs.

    Training is plain FedAvg and is never changed by fine-tuning. A client's personalized
    model, whenever it is evaluated, is the current global model ``w^t`` after ``E'`` local
    epochs of SGD (the local SGD settings, a fresh optimizer) on the client's own training
    data; the batches (and dropout) are seeded by the round ``t``, so the same round's
    validation and test evaluate the same fine-tuned models and a resumed run reproduces them.
    The fine-tuned models are not kept. Under ``conditions`` training is FedAvg's; fine-tuning
    is evaluation, not part of a round, so every client fine-tunes all E' epochs (no client of
    an evaluation drops or straggles).

    Args:
        finetune_epochs: local fine-tuning epochs E' (1 in the usual FedAvg+FT baseline).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(self, finetune_epochs: PositiveInt = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def personalized_params(self, clients: Tensor) -> Params:
        return self.finetune(super().personalized_params(clients), clients, self.current_round)

    def finetune(
        self,
        params: Params,
        clients: Tensor,
        round_idx: int,
        names: tuple[str, ...] | None = None,
        sgd: SGDConfig | None = None,
    ) -> Params:
        """``params`` (stacked over ``clients``) after E' epochs of local SGD (not kept).

        ``names``: the parameters that are fine-tuned (default every one; the others stay
        fixed); ``sgd``: their SGD settings (default the local SGD settings). Runs on this
        process's clients only (evaluation gives every rank its own clients), so it calls the
        engine directly instead of :meth:`local_train`.
        """
        h = self.hp
        state = {n: t for n, t in params.items() if n in self.arch.buffer_shapes}
        tuned = names if names is not None else tuple(n for n in params if n not in state)
        trainable = {n: params[n].clone() for n in tuned}
        fixed = {n: t for n, t in params.items() if n not in state and n not in trainable}
        # draw_batches' seeds without its conditions' masks, which belong to the rounds
        seed = derive_seed(h.seed, round_idx, BATCH_STREAM, FINETUNE_PHASE)
        generator = torch.Generator(self.data.device).manual_seed(seed)
        batches = self.data.client_batches(
            clients, h.batch_size, generator, epochs=h.finetune_epochs
        )
        devices = [self.device] if self.device.type == "cuda" else []
        vectorize, threads = self.executor.path(self.arch)
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.manual_seed(derive_seed(h.seed, round_idx, DROPOUT_STREAM, FINETUNE_PHASE))
            result = train_clients(
                self.cross_entropy,
                trainable,
                [ParamGroup(tuple(trainable), sgd or self.local_sgd())],
                batches,
                self.data.fetch,
                context=fixed,
                state=state,
                vectorize=vectorize,
                threads=threads,
            )
        return {**fixed, **result.params, **result.state}
