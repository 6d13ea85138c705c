"""pFedMe (Dinh, Tran & Nguyen, NeurIPS 2020): personalized FL with Moreau envelopes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.func import grad_and_value

from lightning_pfl.engine import ParamGroup, Params, SGDConfig, TrainResult, weighted_cross_entropy
from lightning_pfl.errors import ConfigError, NonFiniteLossError
from lightning_pfl.losses import linear_surrogate
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.privacy import privatizes
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
)

THETA = "theta."
LocalUpdates = Literal["all", "sampled"]
Aggregation = Literal["uniform", "weighted"]


def moreau_solve(
    f: Callable[[Params], Tensor], theta: Params, w: Params, lam: float, lr: float, steps: int
) -> tuple[Params, Tensor]:
    """``steps`` gradient steps on h(theta) = f(theta) + lam/2 ||theta - w||^2 from ``theta``.

    Returns the last iterate (pFedMe's approximate theta_hat(w)) and f at the iterate before
    the last step. Nothing is differentiated through the solve (the inputs are detached).
    """
    theta = {n: t.detach() for n, t in theta.items()}
    w = {n: t.detach() for n, t in w.items()}
    value = theta[next(iter(theta))].new_zeros(())
    for _ in range(steps):
        grads, value = grad_and_value(f)(theta)
        theta = {n: t - lr * (grads[n] + lam * (t - w[n])) for n, t in theta.items()}
    return theta, value.detach()


class PFedMe(FedAvg):
    """pFedMe: each client's personalized model theta_i solves a Moreau-envelope problem.

    Round t (Algorithm 1 of the paper): the server sends w to the clients that update
    (``local_updates``: every training client, as the paper and the authors' code, or only the
    round's sampled clients S^t). Local step r of client i on a batch D: theta_i ~ argmin_theta
    f_i(theta; D) + lambda/2 ||theta - w_{i,r}||^2 by K gradient steps of size ``personal_lr``
    (warm-started from the previous step's theta_i, from the received global model at the
    round's start); then w_{i,r+1} = w_{i,r} - eta * lambda * (w_{i,r} - theta_i), an SGD step
    of size eta (``local_lr``) on the Moreau envelope, whose gradient is lambda (w -
    theta_hat(w)). After R local steps the clients of S^t (``clients_per_round`` S, drawn
    uniformly) upload w_{i,R}; the server sets w <- (1 - beta) w + beta * sum_{i in S^t} p_i
    w_{i,R} (``aggregation``: p_i = 1/S, the paper's equation, or sample shares, the authors'
    code; FedAvg's pseudo-gradient step with server learning rate beta). A client's
    personalized model is its last theta_i (the initial model before its first local update);
    ``train/loss`` is f_i at the last inner iterate, over the clients of S^t.

    Under ``conditions`` every client that trains has its own round's draws (``local_updates:
    all`` trains the clients outside S^t too, so they can drop or straggle as well): a client
    that drops keeps its theta_i, and the server's mean is over the clients of S^t that
    reported back (none: w stays as it was).

    Written on the engine: theta_i is trained next to w_i by one SGD group of lr 1 whose
    "gradient" is theta_old - theta_new, so the inner solve runs inside the loss, without host
    syncs, under vmap.

    Args:
        lam: regularization lambda (paper: 15).
        personal_lr: inner step size of the theta solve (paper, MNIST: 0.1).
        inner_steps: K inner steps per local step (paper: 5).
        beta: server mixing beta (paper: 1; 2 also reported).
        local_updates: which clients run their R local steps (and so move theta_i) each round:
            ``all`` training clients, of which only the sampled S^t upload (the paper's
            Algorithm 1; the server sends w to every client, n / S times the training of
            ``sampled``), or only the ``sampled`` clients S^t (the others keep their theta_i).
        aggregation: the weights p_i of the server's mean over S^t: ``uniform`` 1/S (the
            paper's update, w <- (1 - beta) w + beta/S sum_{i in S^t} w_{i,R}) or ``weighted``
            by the clients' training samples (the authors' code). ``client_dp`` needs
            ``uniform`` (DP-FedAvg's fixed denominator).
        local_lr: eta, the local-model step size (paper, MNIST: 0.005).
        local_momentum: momentum of the w update (paper: none).
        local_weight_decay: weight decay of the w update (paper: none).
        local_max_grad_norm: clip of lambda (w - theta) (paper: none).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (paper, MNIST: R = 20 local
            steps of batch 20).
    """

    honours_conditions = True

    def __init__(
        self,
        lam: PositiveFloat = 15.0,
        personal_lr: PositiveFloat = 0.1,
        inner_steps: PositiveInt = 5,
        beta: PositiveFloat = 1.0,
        local_updates: LocalUpdates = "all",
        aggregation: Aggregation = "uniform",
        local_lr: PositiveFloat = 0.005,
        local_momentum: Momentum = 0.0,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("server_lr", 1.0) != 1.0 or kwargs.get("server_momentum", 0.0) != 0.0:
            raise ConfigError("pFedMe's server step is beta: set model.init_args.beta.")
        super().__init__(
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        if self.client_dp is not None and aggregation != "uniform":
            raise ConfigError(
                "model.init_args.aggregation = 'weighted' with model.init_args.client_dp: "
                "DP-FedAvg averages the privatized uploads with its fixed weights 1/S; set "
                "aggregation: uniform (the paper's) or remove client_dp."
            )
        self.refuse_batch_norm("pFedMe")
        initial = self.arch.initial_params()
        self.store.add_field("theta", {THETA + n: t for n, t in initial.items()})
        # one object for every round: a recorded round (CUDA graph) is keyed by the loss
        self.client_loss = self.pfedme_loss

    @privatizes("the update of w uploaded by each client of S^t, clipped as one vector")
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        h = self.hp
        if h.local_updates == "all":
            trained = torch.arange(self.num_training_clients, device=clients.device)
            rows = clients  # client i is row i of ``trained``
        else:
            trained, rows = clients, torch.arange(len(clients), device=clients.device)
        sent = self.payload(trained)
        result = self.train_clients(round_idx, trained, {n: t.clone() for n, t in sent.items()})
        uploaded = {n: result.params[n][rows] for n in sent}
        if self.client_dp is None:
            if not self.nothing_arrived(clients, round_idx):
                uniform = h.aggregation == "uniform"
                self.aggregate(uploaded, self.client_weights(clients, round_idx, uniform))
        else:
            received = {n: t[rows] for n, t in sent.items()}
            self.aggregate(*self.dp_uploads(round_idx, received, uploaded))
        self.record_communication(down=sent, up=uploaded)
        if h.local_updates == "all":
            self.refuse_non_finite(result.loss, trained, round_idx)
        return result.loss[rows]

    @staticmethod
    def refuse_non_finite(losses: Tensor, clients: Tensor, round_idx: int) -> None:
        """The base class checks the losses of S^t; this checks every client that trained
        (server side: one host read per round)."""
        bad = ~torch.isfinite(losses)
        if bool(bad.any()):
            raise NonFiniteLossError(
                f"non-finite local training loss in round {round_idx} for clients "
                f"{clients[bad].tolist()[:10]}; lower model.init_args.local_lr or "
                "model.init_args.personal_lr, set model.init_args.local_max_grad_norm, or "
                "check the inputs."
            )

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        """w <- w - beta (w - sum_i p_i w_i) = (1 - beta) w + beta sum_i p_i w_i."""
        return torch.optim.SGD(self.net.parameters(), lr=self.hp.beta)

    def pfedme_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor
    ) -> Tensor:
        h = self.hp
        w = {n: params[n] for n in self.arch.shapes}
        theta_old = {n: params[THETA + n] for n in self.arch.shapes}

        def f(theta: Params) -> Tensor:
            return weighted_cross_entropy(self.arch(theta, x, train=True), y, weight)

        theta, value = moreau_solve(f, theta_old, w, h.lam, h.personal_lr, h.inner_steps)
        direction = {n: h.lam * (w[n] - theta[n]) for n in w}  # grad of the Moreau envelope
        direction |= {THETA + n: theta_old[n] - theta[n] for n in w}  # lr 1: theta_old -> theta
        return value + linear_surrogate(params, direction)

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        theta = {THETA + n: t.clone() for n, t in start.items()}
        groups = [
            ParamGroup(tuple(start), self.local_sgd()),
            ParamGroup(tuple(theta), SGDConfig(lr=1.0)),
        ]
        result = self.local_train(
            {**start, **theta}, clients, round_idx, groups, loss_fn=self.client_loss
        )
        # theta starts from the received w: a client that dropped (no step) keeps its own
        self.scatter_arrived("theta", clients, round_idx, {n: result.params[n] for n in theta})
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        theta = self.store.gather("theta", clients, self.device)
        return {n[len(THETA) :]: t for n, t in theta.items()}
