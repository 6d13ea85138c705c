"""FedOpt (Reddi et al., ICLR 2021): FedAdagrad, FedAdam and FedYogi, adaptive server
optimizers on the clients' averaged update."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat

Adaptivity = Literal["adagrad", "adam", "yogi"]


class AdaptiveServerOptimizer(torch.optim.Optimizer):
    """Algorithm 2's server step on the pseudo-gradient ``p.grad = -Delta_t`` (FedAvg's sign):

    ``m_t = beta1 m_{t-1} + (1 - beta1) Delta_t``;
    ``v_t = v_{t-1} + Delta_t^2`` (adagrad), ``beta2 v_{t-1} + (1 - beta2) Delta_t^2`` (adam),
    ``v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)`` (yogi);
    ``x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)``, from ``m_{-1} = 0``, ``v_{-1} = tau^2``.
    No bias correction (the paper's algorithm has none). m and v are the optimizer state, so
    checkpoints carry them.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        adaptivity: Adaptivity,
        lr: float,
        beta1: float,
        beta2: float,
        tau: float,
    ) -> None:
        defaults = {"lr": lr, "beta1": beta1, "beta2": beta2, "tau": tau}
        super().__init__(params, defaults)
        self.adaptivity = adaptivity

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:  # Lightning's hooks around the step run in the closure
            with torch.enable_grad():
                closure()
        for group in self.param_groups:
            beta1, beta2, tau = group["beta1"], group["beta2"], group["tau"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                delta = -p.grad
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.full_like(p, tau**2)
                m, v = state["m"], state["v"]
                m.mul_(beta1).add_(delta, alpha=1 - beta1)
                square = delta * delta
                if self.adaptivity == "adagrad":
                    v.add_(square)
                elif self.adaptivity == "adam":
                    v.mul_(beta2).add_(square, alpha=1 - beta2)
                else:
                    v.sub_((1 - beta2) * square * torch.sign(v - square))
                p.add_(group["lr"] * m / (v.sqrt() + tau))


class FedOpt(FedAvg):
    """FedOpt: FedAvg's clients, an adaptive optimizer (FedAdagrad, FedAdam, FedYogi) on the
    server.

    Round (Algorithm 2): the sampled clients start from x_t and take K local SGD steps (lr
    eta_l); the server averages their updates uniformly, ``Delta_t = mean_S (x_i - x_t)``, and
    applies :class:`AdaptiveServerOptimizer` with server lr eta, betas beta1, beta2 and
    adaptivity tau. Batch-norm buffers are set to the uniform mean. Every client's
    personalized model is the global model. Under ``conditions`` S is the clients that reported
    back; a round where none did leaves x_t, m and v as they were.

    Args:
        adaptivity: the server optimizer: ``adagrad`` (FedAdagrad), ``adam`` (FedAdam) or
            ``yogi`` (FedYogi).
        server_lr: eta, the server learning rate (paper: tuned on a grid per task).
        beta1: beta_1, the first-moment decay (paper: 0.9).
        beta2: beta_2, the second-moment decay of FedAdam and FedYogi (paper: 0.99).
        tau: tau, the adaptivity (paper: tuned in {1e-5, ..., 1e-1}); also v_{-1} = tau^2.
        local_lr: eta_l, the client learning rate (paper: tuned on a grid per task).
        local_momentum: client SGD momentum (paper: plain SGD).
        local_weight_decay: client weight decay (paper: none).
        local_max_grad_norm: client gradient clip (paper: none).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (K: ``local_steps`` or
            ``local_epochs``; paper: E local epochs).
    """

    honours_conditions = True

    def __init__(
        self,
        adaptivity: Adaptivity = "adam",
        server_lr: PositiveFloat = 1e-2,
        beta1: Momentum = 0.9,
        beta2: Momentum = 0.99,
        tau: PositiveFloat = 1e-3,
        local_lr: PositiveFloat = 5e-3,
        local_momentum: Momentum = 0.0,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("server_momentum", 0.0) != 0.0:
            raise ConfigError(
                "model.init_args.server_momentum: FedOpt's server momentum is beta1; set "
                "model.init_args.beta1 instead and leave server_momentum at 0."
            )
        super().__init__(
            server_lr=server_lr,
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        return AdaptiveServerOptimizer(
            self.net.parameters(), h.adaptivity, h.server_lr, h.beta1, h.beta2, h.tau
        )

    def client_weights(
        self, clients: Tensor, round_idx: int | None = None, uniform: bool = True
    ) -> Tensor:
        """Algorithm 2 averages the sampled clients' updates uniformly."""
        return super().client_weights(clients, round_idx, uniform=True)
