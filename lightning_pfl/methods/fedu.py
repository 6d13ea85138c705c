"""FedU (Dinh et al., 2021): federated multi-task learning with Laplacian regularization."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import Params
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.local import Local
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat


def laplacian_step(models: Params, adjacency: Tensor, step: float) -> Params:
    """w_i <- w_i - step * sum_j a_ij (w_i - w_j) for stacked models ``[C, ...]``.

    ``adjacency`` is the ``[C, C]`` similarity a_ij of the round's clients (the diagonal is
    ignored); ``step`` is eta * lambda.
    """
    a = adjacency.clone()
    a.fill_diagonal_(0.0)
    degree = a.sum(1)
    out = {}
    for name, w in models.items():
        flat = w.flatten(1)
        pulled = flat - step * (degree.to(flat.dtype).unsqueeze(1) * flat - a.to(flat.dtype) @ flat)
        out[name] = pulled.view_as(w)
    return out


class FedU(Local):
    """FedU: each client keeps its own model, pulled towards its neighbours' every round.

    Round for the sampled clients S: each client i runs local SGD on its own model w_i (R
    steps, its momentum kept across rounds, as :class:`~lightning_pfl.methods.local.Local`),
    sends it to the server, and gets back
    w_i <- w_i - eta * lambda * sum_{j in S} a_ij (w_i - w_j), one gradient step on the graph
    Laplacian regularizer lambda/2 sum_ij a_ij ||w_i - w_j||^2 (eta: the local learning rate).
    Batch-norm statistics are pulled the same way.

    Args:
        lam: Laplacian regularization weight lambda (the paper tunes it per dataset; with
            eta = 0.05 and 5 clients per round, lambda = 1 moves a model 20% of the way to the
            mean of the others).
        adjacency: the N x N similarity graph a_ij (None: fully connected, a_ij = 1).
        local_momentum: client SGD momentum (the authors' code, CharlieDinh/FedU_FMTL
            ``FLAlgorithms/users/userFedU.py``: plain SGD, 0).
        local_weight_decay: client SGD weight decay (the authors' code: 0).
        local_max_grad_norm: client gradient clip (the authors' code: none).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    honours_conditions = True

    def __init__(
        self,
        lam: NonNegativeFloat = 1.0,
        adjacency: list[list[float]] | None = None,
        local_momentum: Momentum = 0.0,
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
        n = self.hp.num_clients
        graph = (
            torch.ones(n, n) if adjacency is None else torch.tensor(adjacency, dtype=torch.float)
        )
        if graph.shape != (n, n) or bool((graph < 0).any()):
            raise ConfigError(
                f"model.init_args.adjacency must be a {n} x {n} matrix of non-negative weights."
            )
        self.adjacency: Tensor
        self.register_buffer("adjacency", graph)

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        params = self.store.gather("params", clients, self.device)
        momentum = self.store.gather("momentum", clients, self.device)
        result = self.local_train(params, clients, round_idx, momentum=momentum)
        # S: the clients whose models arrived; the others get nothing back and keep w_i
        arrived = self.arrived(clients, round_idx).to(self.adjacency)
        a = self.adjacency[clients][:, clients] * arrived[:, None] * arrived[None, :]
        pulled = laplacian_step(result.params, a, self.hp.local_lr * self.hp.lam)
        self.store.scatter(
            "params", clients, self.where_arrived(clients, round_idx, pulled, params)
        )
        self.store.scatter("momentum", clients, result.momentum)
        self.record_communication(down=pulled, up=result.params)
        return result.loss
