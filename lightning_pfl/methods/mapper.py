"""MAPPER (Mansour et al., 2020): a per-client mixture of a local and the global model."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.engine import ParamGroup, Params, SGDConfig, TrainResult, weighted_cross_entropy
from lightning_pfl.losses import weighted_mean
from lightning_pfl.methods.apfl import ProjectedStep
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedprox import ANCHOR, anchor
from lightning_pfl.params import prefixed, split_prefixed
from lightning_pfl.privacy import privatizes
from lightning_pfl.validation import NonNegativeInt, PositiveFloat, UnitInterval


def mixture_log_probs(local_logits: Tensor, global_logits: Tensor, gate: Tensor) -> Tensor:
    """``log(lambda p_local + (1 - lambda) p_global)`` with ``lambda = sigmoid(gate)``."""
    local = F.log_softmax(local_logits.float(), -1) + F.logsigmoid(gate.float())
    glob = F.log_softmax(global_logits.float(), -1) + F.logsigmoid(-gate.float())
    return torch.logaddexp(local, glob)


def interpolated_log_probs(local_logits: Tensor, global_logits: Tensor, lam: Tensor) -> Tensor:
    """``log(lambda p_local + (1 - lambda) p_global)`` for lambda in [0, 1], ends included.

    Computed as ``m + log(lambda e^(log p_local - m) + (1 - lambda) e^(log p_global - m))``
    with ``m`` the larger log-probability, so that the value and the gradient in lambda,
    ``(p_local - p_global) / mixture``, stay finite at lambda = 0 and 1 (where
    ``log lambda`` is not).
    """
    local = F.log_softmax(local_logits.float(), -1)
    glob = F.log_softmax(global_logits.float(), -1)
    top = torch.maximum(local, glob).detach()
    lam = lam.float()
    mixed = lam * (local - top).exp() + (1 - lam) * (glob - top).exp()
    return top + mixed.clamp_min(torch.finfo(mixed.dtype).tiny).log()


class MAPPER(FedAvg):
    """MAPPER (model interpolation): each client predicts with
    ``lambda_i h_local_i + (1 - lambda_i) h_global``, a mixture of the two models' class
    probabilities, and learns its own local model and mixture weight.

    ``schedule: after_fedavg`` (the paper's order): the first R rounds (``fedavg_rounds``) are
    FedAvg and train the global model h_G; from round R on h_G is final: the server no longer
    changes it, every client's local model starts from it (``local_start: global``, ours), and
    each sampled client receives it and fits its local model and lambda on the negative
    log-likelihood of the mixture with h_G, uploading nothing. Evaluations up to round
    R report the FedAvg model (nothing is fitted yet), later ones the mixture.
    ``schedule: joint``: every round, at every local step on the same batch, a client trains a
    copy of the received h_G on its cross-entropy (FedAvg) and its local model and lambda on the
    NLL of the mixture with the received h_G, which stays fixed for the round (the copy being
    trained fits the client's data within the round: against it, lambda learns to trust a
    global model the client never predicts with); the trained copy is uploaded and averaged,
    and every evaluation is a mixture.

    The gate is the paper's one scalar lambda per client (no gating network on the input),
    trained by projected SGD: ``lambda <- Proj_[0,1](lambda - eta_lambda grad)`` after every
    step (``gate: projected``, the paper's), or parameterized as ``lambda = sigmoid(a)`` with a
    trained by SGD with the local momentum (``gate: sigmoid``). The local model and lambda
    never leave the client.

    Args:
        schedule: ``after_fedavg`` (the paper's: FedAvg first, then the local models and lambdas
            are fitted against the final global model) or ``joint`` (both in every round).
        fedavg_rounds: R, the FedAvg rounds of ``after_fedavg`` (None: half of
            ``trainer.max_steps``; give it when a resumed run changes ``max_steps``). R >=
            ``max_steps`` never fits.
        gate: how lambda is trained: ``projected`` (the paper's): lambda itself, plain SGD (no
            momentum, weight decay or clipping) projected onto [0, 1] after every step;
            ``sigmoid``: ``lambda = sigmoid(a)``, a trained by SGD with the local momentum.
        gate_lr: eta_lambda, the SGD learning rate of lambda (``projected``) or a
            (``sigmoid``) (None: ``local_lr``); the gate has no weight decay.
        initial_lambda: lambda before training (0.5).
        local_start: where the local models start: ``global``, the global model when their
            fit starts (``after_fedavg``: every client's local model is set to the final FedAvg
            model after round R; ours, the paper's choice was not reachable; ``joint``: the
            initialization, the round-0 global model) or ``initial`` (the network's initialization;
            with ``after_fedavg`` a random local model loses to the FedAvg model, lambda
            reaches 0 in the first fitting round and the local model then gets no gradient:
            benchmarks/results/digits_mapper_local_start/).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (both models use the local
            SGD settings; optimizers are fresh every round).
    """

    honours_conditions = True

    def __init__(
        self,
        schedule: Literal["after_fedavg", "joint"] = "after_fedavg",
        fedavg_rounds: NonNegativeInt | None = None,
        gate: Literal["projected", "sigmoid"] = "projected",
        gate_lr: PositiveFloat | None = None,
        initial_lambda: UnitInterval = 0.5,
        local_start: Literal["global", "initial"] = "global",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("MAPPER trains two models jointly")
        self.store.add_field("local", self.arch.initial_params())
        lam = torch.tensor(float(initial_lambda))
        stored = lam if gate == "projected" else torch.logit(lam.clamp(1e-6, 1 - 1e-6))
        self.store.add_field("gate", {"gate": stored})
        # one object per run each (recorded rounds are keyed by the loss)
        self.loss_fn = self.mapper_loss
        self.fit_loss_fn = self.mixture_loss

    @property
    def fedavg_rounds(self) -> int | None:
        """R of ``after_fedavg`` (None for ``joint``)."""
        h = self.hp
        if h.schedule == "joint":
            return None
        if h.fedavg_rounds is not None:
            return int(h.fedavg_rounds)
        return int(self.trainer.max_steps) // 2 if self._trainer is not None else 0

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        if self.hp.local_start == "global" and self.global_step == self.fedavg_rounds:
            self.start_local_models()

    def start_local_models(self) -> None:
        """Every client's local model becomes the final FedAvg model (``local_start: global``)."""
        state = self.global_state()
        clients = torch.arange(self.hp.num_clients)
        local = {n: state[n].expand(len(clients), *state[n].shape) for n in self.arch.shapes}
        self.store.scatter("local", clients, local)

    def mixture_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor:
        """NLL of the mixture of the local model with the received (frozen) global model."""
        local = split_prefixed(params, "local")[0]
        received = split_prefixed(context, ANCHOR.rstrip("."))[0]
        received_logits = self.arch(received, x, train=True)
        local_logits = self.arch(local, x, train=True)
        gate = params["gate"]
        if self.hp.gate == "projected":
            gate = ProjectedStep.apply(gate, self.gate_lr)
        mixed = self.mixture(local_logits, received_logits, gate)
        return weighted_mean(F.nll_loss(mixed, y, reduction="none"), w)

    def mapper_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor:
        """``joint``: CE of the global model + NLL of the mixture with the received one."""
        glob = split_prefixed(params, "global")[0]
        global_logits = self.arch(glob, x, train=True)
        return weighted_cross_entropy(global_logits, y, w) + self.mixture_loss(
            params, context, x, y, w
        )

    @privatizes(
        "the update of every shared tensor (the whole upload), clipped as one vector; the "
        "rounds after FedAvg upload nothing"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        rounds = self.fedavg_rounds
        if rounds is None or round_idx < rounds:
            return super().run_round(round_idx, clients)
        sent = self.payload(clients)
        result = self.fit_mixture(round_idx, clients, sent, joint=False)
        self.record_communication(down=sent, up={})
        return result.loss

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        if self.fedavg_rounds is not None:  # a FedAvg round of ``after_fedavg``
            return self.local_train(start, clients, round_idx)
        return self.fit_mixture(round_idx, clients, start, joint=True)

    def fit_mixture(
        self, round_idx: int, clients: Tensor, start: Params, joint: bool
    ) -> TrainResult:
        """Train the clients' local models and lambdas against the received global model
        ``start`` (``joint``: and a copy of it on its CE); the trained copy is returned."""
        h = self.hp
        local = self.store.gather("local", clients, self.device)
        gate = self.store.gather("gate", clients, self.device)
        params = prefixed("local", local) | gate
        momentum = h.local_momentum if h.gate == "sigmoid" else 0.0
        groups = [
            ParamGroup(tuple(prefixed("local", local)), self.local_sgd()),
            ParamGroup(("gate",), SGDConfig(self.gate_lr, momentum)),
        ]
        if joint:
            params |= prefixed("global", start)
            groups.insert(0, ParamGroup(tuple(prefixed("global", start)), self.local_sgd()))
        loss_fn = self.loss_fn if joint else self.fit_loss_fn
        received = anchor(start, tuple(start))
        result = self.local_train(params, clients, round_idx, groups, loss_fn, received)
        self.store.scatter("local", clients, split_prefixed(result.params, "local")[0])
        trained = result.params["gate"]
        if h.gate == "projected":  # the last step lands on the projection up to rounding
            trained = trained.clamp(0.0, 1.0)
        self.store.scatter("gate", clients, {"gate": trained})
        glob = split_prefixed(result.params, "global")[0] if joint else start
        return TrainResult(glob, {}, result.loss, result.steps)

    def personalized_params(self, clients: Tensor) -> Params:
        local = self.store.gather("local", clients, self.device)
        return (
            prefixed("global", self.payload(clients))
            | prefixed("local", local)
            | self.store.gather("gate", clients, self.device)
        )

    @property
    def gate_lr(self) -> float:
        """eta_lambda (``gate_lr``, else ``local_lr``)."""
        return float(self.hp.gate_lr if self.hp.gate_lr is not None else self.hp.local_lr)

    def mixture(self, local_logits: Tensor, global_logits: Tensor, gate: Tensor) -> Tensor:
        """Log-probabilities of the mixture; ``gate`` is lambda or a (``sigmoid``)."""
        if self.hp.gate == "projected":
            return interpolated_log_probs(local_logits, global_logits, gate)
        return mixture_log_probs(local_logits, global_logits, gate)

    def predict(self, params: Params, x: Tensor) -> Tensor:
        glob, local = split_prefixed(params, "global", "local")
        rounds = self.fedavg_rounds
        if rounds is not None and self.current_round <= rounds:  # nothing fitted yet: FedAvg
            return F.log_softmax(self.arch(glob, x).float(), -1)
        return self.mixture(self.arch(local, x), self.arch(glob, x), params["gate"])

    def mixture_weights(self) -> Tensor:
        """lambda of every client."""
        gate = self.store.fields["gate"]["gate"]
        return gate if self.hp.gate == "projected" else torch.sigmoid(gate)
