"""MAPPER (Mansour et al., 2020): a per-client mixture of a local and the global model."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.engine import (
    ParamGroup,
    Params,
    SGDConfig,
    TrainResult,
    prefixed,
    split_prefixed,
    weighted_cross_entropy,
)
from lightning_pfl.losses import weighted_mean
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedprox import ANCHOR, anchor
from lightning_pfl.validation import PositiveFloat, UnitInterval


def mixture_log_probs(local_logits: Tensor, global_logits: Tensor, gate: Tensor) -> Tensor:
    """``log(lambda p_local + (1 - lambda) p_global)`` with ``lambda = sigmoid(gate)``."""
    local = F.log_softmax(local_logits.float(), -1) + F.logsigmoid(gate.float())
    glob = F.log_softmax(global_logits.float(), -1) + F.logsigmoid(-gate.float())
    return torch.logaddexp(local, glob)


class MAPPER(FedAvg):
    """MAPPER (model interpolation): each client predicts with
    ``lambda_i h_local_i + (1 - lambda_i) h_global``, a mixture of the two models' class
    probabilities, and learns its own local model and mixture weight.

    The gate is the paper's one scalar lambda per client (no gating network on the input),
    parameterized as ``lambda = sigmoid(a)`` so that it stays in [0, 1] (the paper projects
    onto [0, 1]); a starts at 0 (lambda = 0.5). Round for a sampled client: it receives the
    global model h_G and, at every local step on the same batch, trains a copy of h_G on its
    cross-entropy (FedAvg) and its local model and a on the negative log-likelihood of the
    mixture with the received h_G, which stays fixed for the round. The paper learns the local
    model and lambda after FedAvg has trained the global model; here they are learned alongside
    it, so that every round's evaluation is a MAPPER prediction. Mixing with the received h_G
    (not the copy being trained, which fits the client's data within the round) keeps the
    training mixture the one evaluated: against the trained copy, lambda learns to trust a
    global model that the client never predicts with. The local model and a stay on the
    client; the trained copy of h_G is uploaded and averaged. The personalized model is the
    mixture.

    Args:
        gate_lr: SGD learning rate of a (None: ``local_lr``); the gate has no weight decay.
        initial_lambda: lambda before training (0.5).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (both models use the local
            SGD settings; optimizers are fresh every round).
    """

    def __init__(
        self,
        gate_lr: PositiveFloat | None = None,
        initial_lambda: UnitInterval = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("MAPPER trains two models jointly")
        self.store.add_field("local", self.arch.initial_params())
        gate = torch.logit(torch.tensor(float(initial_lambda)).clamp(1e-6, 1 - 1e-6))
        self.store.add_field("gate", {"gate": gate})
        self.loss_fn = self.mapper_loss  # one object per run (recorded rounds are keyed by it)

    def mapper_loss(
        self, params: Params, frozen: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor:
        """CE of the global model + NLL of the mixture with the received global model."""
        glob, local = split_prefixed(params, "global", "local")
        global_logits = self.arch(glob, x, train=True)
        received = split_prefixed(frozen, ANCHOR.rstrip("."))[0]
        received_logits = self.arch(received, x, train=True)
        local_logits = self.arch(local, x, train=True)
        mixed = mixture_log_probs(local_logits, received_logits, params["gate"])
        nll = weighted_mean(F.nll_loss(mixed, y, reduction="none"), w)
        return weighted_cross_entropy(global_logits, y, w) + nll

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        h = self.hp
        local = self.store.gather("local", clients, self.device)
        gate = self.store.gather("gate", clients, self.device)
        params = prefixed("global", start) | prefixed("local", local) | gate
        gate_sgd = SGDConfig(h.gate_lr or h.local_lr, h.local_momentum)
        groups = [
            ParamGroup(tuple(prefixed("global", start)), self.local_sgd()),
            ParamGroup(tuple(prefixed("local", local)), self.local_sgd()),
            ParamGroup(("gate",), gate_sgd),
        ]
        received = anchor(start, tuple(start))
        result = self.local_train(params, clients, round_idx, groups, self.loss_fn, received)
        glob, local = split_prefixed(result.params, "global", "local")
        self.store.scatter("local", clients, local)
        self.store.scatter("gate", clients, {"gate": result.params["gate"]})
        return TrainResult(glob, {}, result.loss, result.steps)

    def personalized_params(self, clients: Tensor) -> Params:
        local = self.store.gather("local", clients, self.device)
        return (
            prefixed("global", self.payload(clients))
            | prefixed("local", local)
            | self.store.gather("gate", clients, self.device)
        )

    def predict(self, params: Params, x: Tensor) -> Tensor:
        glob, local = split_prefixed(params, "global", "local")
        return mixture_log_probs(self.arch(local, x), self.arch(glob, x), params["gate"])

    def mixture_weights(self) -> Tensor:
        """lambda of every client."""
        return torch.sigmoid(self.store.fields["gate"]["gate"])
