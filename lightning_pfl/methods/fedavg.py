"""FedAvg (McMahan et al., 2017) with an optional server optimizer (FedAvgM, Hsu et al.)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import Params
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.models import build_network


class FedAvg(FederatedMethod):
    """Federated averaging; the personalized model of every client is the global model.

    The server applies the pseudo-gradient ``w - sum_i p_i w_i`` (p_i proportional to client
    i's training samples) with SGD; ``server_lr=1, server_momentum=0`` is exactly FedAvg's
    sample-weighted average.

    Args:
        server_lr: server learning rate (1 = plain FedAvg).
        server_momentum: server momentum (0 = plain FedAvg; > 0 = FedAvgM).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    def __init__(self, server_lr: float = 1.0, server_momentum: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        h = self.hp
        self.net = build_network(h.net, h.input_shape, h.num_classes, **(h.net_args or {}))
        self.net.load_state_dict(self.arch.initial_params())

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        return torch.optim.SGD(self.net.parameters(), lr=h.server_lr, momentum=h.server_momentum)

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        start = self.personalized_params(clients)
        result = self.local_train({n: p.clone() for n, p in start.items()}, clients, round_idx)
        self.aggregate(result.params, self.client_weights(clients))
        self.record_communication(down=start, up=result.params)
        return result.loss

    def aggregate(self, trained: Params, weights: Tensor) -> None:
        """Set the server pseudo-gradient to ``w - sum_i weights_i * trained_i``."""
        for name, p in self.net.named_parameters():
            w = weights.to(p.dtype).view(-1, *([1] * p.dim()))
            p.grad = p.detach() - (w * trained[name].to(p.dtype)).sum(0)

    def personalized_params(self, clients: Tensor) -> Params:
        return {
            n: p.detach().expand(len(clients), *p.shape) for n, p in self.net.named_parameters()
        }
