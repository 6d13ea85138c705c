"""FML (Shen et al., 2020): federated mutual learning of a shared meme model and a private model."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_pfl.engine import ParamGroup, Params, TrainResult, weighted_cross_entropy
from lightning_pfl.losses import distillation_loss
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.params import prefixed, split_prefixed
from lightning_pfl.validation import UnitInterval


class FML(FedAvg):
    """Federated Mutual Learning: a FedAvg'd meme model and a private model learn from each other.

    Round for a sampled client: it receives the meme model (the global model) and trains it
    together with its private model by deep mutual learning: at every local step, on the same
    batch,

    - private: ``L_local = alpha * CE(p_local) + (1 - alpha) * KL(p_meme || p_local)``,
    - meme: ``L_meme = beta * CE(p_meme) + (1 - beta) * KL(p_local || p_meme)``,

    each KL's target detached (:func:`~lightning_pfl.losses.distillation_loss` at T = 1), so one
    SGD step on ``L_local + L_meme`` updates both models simultaneously, as in DML. The private
    model stays on the client (the client store); the meme model is uploaded and averaged as in
    FedAvg. The personalized model is the private model (never-sampled clients keep its seeded
    initialization, the same as every client's). The logged training loss is
    ``L_local + L_meme``.

    Args:
        alpha: alpha, weight of the private model's cross-entropy (paper: 0.5).
        beta: beta, weight of the meme model's cross-entropy (paper: 0.5).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (both models use the local
            SGD settings; each model has its own gradient clip; optimizers are fresh every round).
    """

    honours_conditions = True

    def __init__(self, alpha: UnitInterval = 0.5, beta: UnitInterval = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("FML trains two models jointly")
        self.store.add_field("private", self.arch.initial_params())
        self.loss_fn = self.mutual_loss  # one object per run (recorded rounds are keyed by it)

    def mutual_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor:
        """``L_local + L_meme`` of one client's batch (params ``meme.*`` and ``private.*``)."""
        h = self.hp
        meme, private = split_prefixed(params, "meme", "private")
        meme_logits = self.arch(meme, x, train=True)
        private_logits = self.arch(private, x, train=True)
        local = h.alpha * weighted_cross_entropy(private_logits, y, w) + (
            1 - h.alpha
        ) * distillation_loss(private_logits, meme_logits, 1.0, w)
        shared = h.beta * weighted_cross_entropy(meme_logits, y, w) + (
            1 - h.beta
        ) * distillation_loss(meme_logits, private_logits, 1.0, w)
        return local + shared

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        private = self.store.gather("private", clients, self.device)
        params = prefixed("meme", start) | prefixed("private", private)
        groups = [
            ParamGroup(tuple(prefixed(p, start)), self.local_sgd()) for p in ("meme", "private")
        ]
        result = self.local_train(params, clients, round_idx, groups, self.loss_fn)
        meme, private = split_prefixed(result.params, "meme", "private")
        self.store.scatter("private", clients, private)
        return TrainResult(meme, {}, result.loss, result.steps)

    def personalized_params(self, clients: Tensor) -> Params:
        return self.store.gather("private", clients, self.device)
