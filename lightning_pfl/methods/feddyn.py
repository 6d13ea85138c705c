"""FedDyn (Acar et al., ICLR 2021): federated learning with dynamic regularization."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedprox import anchor, proximal_loss
from lightning_pfl.methods.scaffold import linear_loss
from lightning_pfl.params import prefixed
from lightning_pfl.privacy import private_uploads, privatizes
from lightning_pfl.server_state import NamedBuffers
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat

LINEAR = "linear"


class FedDyn(FedAvg):
    """FedDyn: each client minimizes ``L_k(theta) - <grad L_k(theta_k^{t-1}), theta> +
    alpha/2 ||theta - theta^{t-1}||^2``, a dynamic regularizer whose stationary points agree
    with the global objective's.

    Round (Algorithm 1): client k of P_t starts from the server model theta^{t-1}, takes K local
    SGD steps on its objective above (the gradient state ``grad L_k(theta_k^{t-1})`` kept by
    the client, zero before its first round) and updates its state
    ``grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha (theta_k^t - theta^{t-1})``. The
    server keeps h: ``h^t = h^{t-1} - alpha/m sum_{P_t} (theta_k^t - theta^{t-1})`` (m: all
    training clients) and sets ``theta^t = mean_{P_t} theta_k^t - h^t / alpha`` (uniform mean;
    batch-norm buffers: the uniform mean). Every client's personalized model is theta^t.

    Under ``conditions`` P_t is the clients that reported back: a client that did not keeps its
    gradient state (it took no step), h^t and the mean use the arrived clients only (m stays
    all training clients), and a round where none arrived leaves theta and h as they were.

    Args:
        alpha: alpha, the regularization coefficient (paper: {0.1, 0.01, 0.001}; its code's
            experiments: 0.01).
        local_lr: the client SGD learning rate (paper's code: 0.1).
        local_momentum: client SGD momentum (paper: plain SGD).
        local_weight_decay: client weight decay (paper's code: 1e-3 for every method).
        local_max_grad_norm: client gradient clip (paper's code: 10 for every method).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (paper's code: 5 local
            epochs of batch 50).
    """

    honours_conditions = True

    def __init__(
        self,
        alpha: PositiveFloat = 0.01,
        local_lr: PositiveFloat = 0.1,
        local_momentum: Momentum = 0.0,
        local_weight_decay: NonNegativeFloat = 1e-3,
        local_max_grad_norm: PositiveFloat | None = 10.0,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("server_lr", 1.0) != 1.0 or kwargs.get("server_momentum", 0.0) != 0.0:
            raise ConfigError(
                "model.init_args.server_lr / server_momentum: FedDyn's server sets theta^t = "
                "mean theta_k - h / alpha exactly; leave them at 1 and 0."
            )
        super().__init__(
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        zeros = {n: torch.zeros(s) for n, s in self.arch.shapes.items()}
        self.h = NamedBuffers(zeros)
        self.store.add_field("gradient", zeros)  # grad L_k(theta_k^{t-1})
        self.trainable = tuple(zeros)
        # one object for every round: a recorded round (CUDA graph) is keyed by the loss
        self.dynamic_loss = proximal_loss(
            linear_loss(self.cross_entropy, self.trainable, LINEAR), alpha, self.trainable
        )

    @privatizes(
        "the update theta_k^t - theta^{t-1} of every tensor (the whole upload), clipped as one "
        "vector; the server's h^t and theta^t both use the one noisy sum"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        alpha = self.hp.alpha
        sent = self.payload(clients)
        state = self.store.gather("gradient", clients, self.device)
        context = anchor(sent, self.trainable) | prefixed(LINEAR, {n: -g for n, g in state.items()})
        result = self.local_train(
            {n: t.clone() for n, t in sent.items()},
            clients,
            round_idx,
            loss_fn=self.dynamic_loss,
            context=context,
        )
        # a client that did not report back took no step: its drift is 0, its state kept
        drift = {n: result.params[n] - sent[n] for n in self.trainable}
        self.store.scatter("gradient", clients, {n: state[n] - alpha * drift[n] for n in drift})
        uploaded = {n: result.params[n] for n in sent}
        received, moved = uploaded, drift
        if self.client_dp is not None:  # DP-FedAvg's private uploads; qN = len(clients) here
            generator = self.client_dp_generator(round_idx)
            received = private_uploads(sent, uploaded, self.client_dp, generator)
            moved = {n: received[n] - sent[n] for n in drift}
            uniform = torch.full((len(clients),), 1 / len(clients), device=self.device)
        elif self.nothing_arrived(clients, round_idx):
            self.record_communication(down=sent, up=uploaded)
            return result.loss
        else:  # 1 / |P_t| over the arrived clients, float32 as the uniform mean always was
            uniform = self.client_weights(clients, round_idx, uniform=True).float()
        self.aggregate(received, uniform)  # p.grad = theta - mean theta_k; buffers: the mean
        with torch.no_grad():
            for name, p in self.net.named_parameters():
                h = self.h[name]
                h.sub_(alpha * moved[name].sum(0) / self.num_training_clients)
                # the unit server step then lands on theta^t = mean theta_k - h^t / alpha
                assert p.grad is not None
                p.grad.add_(h / alpha)
        self.record_communication(down=sent, up=uploaded)
        return result.loss

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=1.0)
