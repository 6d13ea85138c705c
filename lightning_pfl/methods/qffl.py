"""q-FFL (Li et al., ICLR 2020): fair resource allocation, solved by q-FedAvg / q-FedSGD."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat

LOSS_FLOOR = 1e-10  # the authors' code adds it to F_k before its powers


class QFFL(FedAvg):
    """q-FFL: minimizes ``sum_k p_k F_k^{q+1}(w) / (q+1)``, so clients with a larger loss get
    more weight (q = 0: FedAvg's objective).

    Round (q-FedAvg, Algorithm 3): the server sends w^t; client k computes ``F_k(w^t)``, its
    mean training loss under w^t (on all its training samples), and runs local SGD from w^t
    (lr eta_l) to ``wbar_k``; with L the Lipschitz estimate,
    ``Delta w_k = L (w^t - wbar_k)``, ``Delta_k = F_k^q(w^t) Delta w_k`` and
    ``h_k = q F_k^{q-1}(w^t) ||Delta w_k||^2 + L F_k^q(w^t)``; the server steps
    ``w^{t+1} = w^t - sum_k Delta_k / sum_k h_k`` (as FedAvg's pseudo-gradient with a unit
    server lr). q-FedSGD (Algorithm 2) is one local step on the client's whole data
    (``local_steps: 1`` with ``batch_size`` at least the largest client's training set, and
    ``local_lr = 1/L``): then ``Delta w_k = grad F_k(w^t)``. Batch-norm buffers: FedAvg's
    weighted mean. Every client's personalized model is the global model. Under
    ``conditions`` both sums run over the clients that reported back (none: w^t stays).

    Args:
        q: q, the fairness exponent (paper: tuned per dataset in {0.001, ..., 15}; 1 here).
        lipschitz: L, the Lipschitz-constant estimate; None: ``1 / local_lr`` (the authors'
            code).
        local_lr: eta_l, the client SGD step.
        local_momentum: client SGD momentum (paper: plain SGD; L = 1/eta_l assumes it).
        local_weight_decay: client weight decay (paper: none).
        local_max_grad_norm: client gradient clip (paper: none).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        q: NonNegativeFloat = 1.0,
        lipschitz: PositiveFloat | None = None,
        local_lr: PositiveFloat = 5e-3,
        local_momentum: Momentum = 0.0,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )

    @property
    def lipschitz(self) -> float:
        """L: the configured estimate, else ``1 / local_lr``."""
        h = self.hp
        return float(h.lipschitz) if h.lipschitz is not None else 1.0 / h.local_lr

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        q, lip = self.hp.q, self.lipschitz
        sent = self.payload(clients)
        _, samples, loss_sum = self.evaluate_clients(clients, "train", params=sent)
        loss = (loss_sum / samples).double() + LOSS_FLOOR  # F_k(w^t)
        result = self.local_train({n: t.clone() for n, t in sent.items()}, clients, round_idx)
        uploaded = {n: result.params[n] for n in sent}
        params = dict(self.net.named_parameters())
        delta_w = {n: lip * (sent[n] - uploaded[n]).double() for n in params}
        squared = torch.stack([d.flatten(1).pow(2).sum(1) for d in delta_w.values()]).sum(0)
        h = q * loss ** (q - 1) * squared + lip * loss**q
        if not self.nothing_arrived(clients, round_idx):
            self.aggregate(uploaded, self.client_weights(clients, round_idx))  # buffers: the mean
            arrived = self.arrived(clients, round_idx)
            # Delta_k / sum h = F_k^q Delta w_k / sum h, both sums over the arrived clients
            scale = torch.where(arrived, loss**q, 0.0) / torch.where(arrived, h, 0.0).sum()
            for name, p in params.items():
                weight = scale.view(-1, *([1] * (delta_w[name].dim() - 1)))
                p.grad = (weight * delta_w[name]).sum(0).to(p.dtype)
        self.record_communication(down=sent, up=uploaded | {"h_k": h.float()})
        return result.loss
