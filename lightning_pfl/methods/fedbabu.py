"""FedBABU (Oh, Kim & Yun, ICLR 2022): federated training of the body, the head fine-tuned."""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor

from lightning_pfl.engine import Params, SGDConfig, TrainResult
from lightning_pfl.methods.fedavg_ft import FedAvgFT
from lightning_pfl.validation import Momentum, PositiveFloat, PositiveInt


class FedBABU(FedAvgFT):
    """FedBABU: the body is trained and averaged with the head frozen at its random init;
    every client fine-tunes the model before evaluation.

    Round for a sampled client: receive the global body; train it for the local steps (or
    ``local_epochs``) with the head fixed at the random initialization every client shares
    (it is never sent: the head's learning rate is 0 in the paper's local update); upload the
    body; the server averages the bodies (sample-weighted, as FedAvg). The head never changes
    during training.

    Personalized model (whenever it is evaluated): the global model (trained body, initial
    head) after tau fine-tuning epochs on the client's training data, with a fresh SGD at
    ``finetune_lr`` and ``finetune_momentum`` (the local weight decay and clip);
    ``finetune_part`` says what is fine-tuned (the reference code's personalization
    fine-tunes body and head: ``full``). As FedAvg-FT, the fine-tuning batches are seeded by
    the round, and the fine-tuned models are not kept (and not cut by ``conditions``).

    Args:
        finetune_epochs: fine-tuning epochs tau at evaluation (reference code: 5).
        finetune_part: ``full`` (body and head, the reference code's), ``head`` (the head
            alone, the body frozen) or ``body``.
        finetune_lr: learning rate of the fine-tuning (reference code: 1e-3 in every
            experiment, its training rate 0.1 after its two x0.1 decays). None: ``local_lr``,
            at which a few clients' fine-tuning diverges (benchmarks/fedbabu_eval.py).
        finetune_momentum: momentum of the fine-tuning SGD (reference code: 0.9, the momentum
            it trains with). None: ``local_momentum``.
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        finetune_epochs: PositiveInt = 5,
        finetune_part: Literal["full", "head", "body"] = "full",
        finetune_lr: PositiveFloat | None = 1e-3,
        finetune_momentum: Momentum | None = 0.9,
        **kwargs: Any,
    ) -> None:
        super().__init__(finetune_epochs=finetune_epochs, **kwargs)
        self.head = self.arch.head_names

    def payload(self, clients: Tensor) -> Params:
        """The body only: every client holds the fixed head from the initialization."""
        return {n: t for n, t in super().payload(clients).items() if n not in self.head}

    def frozen_head(self, clients: Tensor) -> Params:
        state = self.global_state()
        return {n: state[n].expand(len(clients), *state[n].shape) for n in self.head}

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        return self.local_train(start, clients, round_idx, context=self.frozen_head(clients))

    def finetune_sgd(self) -> SGDConfig:
        """The fine-tuning's SGD: ``finetune_lr`` and ``finetune_momentum`` (None: the local
        SGD's), the local weight decay and clip."""
        h, local = self.hp, self.local_sgd()
        return SGDConfig(
            local.lr if h.finetune_lr is None else h.finetune_lr,
            local.momentum if h.finetune_momentum is None else h.finetune_momentum,
            local.weight_decay,
            local.max_grad_norm,
        )

    def finetuned_names(self) -> tuple[str, ...]:
        """The tensors ``finetune_part`` fine-tunes."""
        body = tuple(n for n in self.arch.shapes if n not in self.head)
        names = {"full": tuple(self.arch.shapes), "head": self.head, "body": body}
        return names[self.hp.finetune_part]

    def personalized_params(self, clients: Tensor) -> Params:
        model = self.payload(clients) | self.frozen_head(clients)
        return self.finetune(
            model, clients, self.current_round, self.finetuned_names(), self.finetune_sgd()
        )
