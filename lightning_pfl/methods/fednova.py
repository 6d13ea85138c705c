"""FedNova (Wang et al., NeurIPS 2020): normalized averaging for clients with unequal local work."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.scaffold import per_client
from lightning_pfl.params import client_mean
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat


def momentum_norm(steps: Tensor, rho: float) -> Tensor:
    """``||a_i||_1`` of ``tau_i`` local steps of SGD with momentum rho (no dampening):
    ``a_i = [1 - rho^tau, 1 - rho^(tau-1), ..., 1 - rho] / (1 - rho)``, whose sum is
    ``(tau - rho (1 - rho^tau) / (1 - rho)) / (1 - rho)``; ``tau`` for plain SGD (rho = 0)."""
    tau = steps.double()
    if rho == 0.0:
        return tau
    return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)


class FedNova(FedAvg):
    """FedNova: each client's update is divided by its local work ``||a_i||_1`` before the
    weighted average, so clients taking more local steps do not pull the model towards their
    own objective.

    Round: client i trains tau_i local steps from x (``local_epochs`` over clients of unequal
    size give unequal tau_i; ``local_steps`` give equal ones, where FedNova is FedAvg) with SGD
    of momentum rho; its normalized update is ``eta d_i = (x - x_i) / ||a_i||_1``
    (:func:`momentum_norm`). The server steps along
    ``tau_eff sum_i p_i (x - x_i) / ||a_i||_1`` with ``tau_eff = sum_i p_i ||a_i||_1`` and
    ``p_i = n_i / sum_S n_j`` (FedAvg's weights): ``x <- x - tau_eff eta sum_i p_i d_i``.
    Batch-norm buffers: FedAvg's weighted mean. Every client's personalized model is the
    global model. Under ``conditions`` S is the clients that reported back and tau_i the steps
    each took (a straggler's cut ones); a round where none did leaves x as it was.

    Args:
        local_momentum: rho, the client SGD momentum that a_i accounts for (paper: 0.9 in its
            momentum runs; 0 = vanilla SGD, a_i = 1).
        local_weight_decay: client weight decay (part of the local gradient; paper: none
            stated here).
        local_max_grad_norm: client gradient clip (paper: none).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (``server_lr`` and
            ``server_momentum``: the paper's global momentum variant, 1 and 0 by default).
    """

    honours_conditions = True

    def __init__(
        self,
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        sent = self.payload(clients)
        result = self.local_train({n: t.clone() for n, t in sent.items()}, clients, round_idx)
        uploaded = {n: result.params[n] for n in sent}
        self.record_communication(down=sent, up=uploaded)
        if self.nothing_arrived(clients, round_idx):
            return result.loss
        p = self.client_weights(clients, round_idx)
        norm = momentum_norm(result.steps.to(self.device), self.hp.local_momentum).clamp_min(1)
        tau_eff = (p.double() * norm).sum()
        self.aggregate(uploaded, p)  # buffers: the weighted mean
        for name, param in self.net.named_parameters():
            x = param.detach()
            normalized = (x - uploaded[name]) / per_client(norm, uploaded[name])
            param.grad = (tau_eff * client_mean(normalized, p)).to(param.dtype)
        return result.loss
