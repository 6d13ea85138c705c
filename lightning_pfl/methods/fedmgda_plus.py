"""FedMGDA+ (Hu, Shaloudegi, Zhang & Yu, IEEE TNSE 2022): federated learning as multi-objective
optimization; the server steps along the min-norm convex combination of the client updates."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.params import client_mean
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    UnitInterval,
)

NORM_FLOOR = 1e-12  # a client whose update is zero keeps a zero normalized update


def project_onto_capped_simplex(v: Tensor, lower: Tensor, upper: Tensor) -> Tensor:
    """Euclidean projection of ``v`` ``[m]`` onto ``{lower <= x <= upper, sum x = 1}`` (needs
    ``sum lower <= 1 <= sum upper``): ``x = clamp(v - tau, lower, upper)`` with tau where the
    piecewise-linear, non-increasing ``s(tau) = sum clamp(v - tau, lower, upper)`` crosses 1,
    found exactly among its 2m breakpoints ``v - lower`` and ``v - upper`` and interpolated
    linearly between two of them."""
    breaks = torch.cat([v - lower, v - upper]).sort().values
    sums = (v - breaks[:, None]).clamp(lower, upper).sum(1)  # s(breaks), non-increasing
    k = ((sums >= 1).sum() - 1).clamp(0, len(breaks) - 2)
    left, right = breaks[k], breaks[k + 1]
    drop = sums[k] - sums[k + 1]
    tau = torch.where(
        drop > 0, left + (sums[k] - 1) / drop.clamp_min(1e-300) * (right - left), left
    )
    return (v - tau).clamp(lower, upper)


def min_norm_weights(
    gram: Tensor, epsilon: float, steps: int, center: Tensor | None = None
) -> Tensor:
    """``argmin_lambda lambda^T G lambda`` over the simplex with
    ``|lambda_i - lambda0_i| <= epsilon`` (``G = gram`` ``[m, m]``, the inner products of the m
    update vectors; lambda0 = ``center``, default uniform): ``steps`` iterations of accelerated
    projected gradient descent (FISTA, step ``1 / (2 lambda_max(G))``) from lambda0, each
    projected by :func:`project_onto_capped_simplex`."""
    m = gram.shape[0]
    if center is None:
        center = torch.full((m,), 1.0 / m, dtype=gram.dtype, device=gram.device)
    lower, upper = (center - epsilon).clamp_min(0), (center + epsilon).clamp_max(1)
    step = 1.0 / (2 * torch.linalg.eigvalsh(gram)[-1]).clamp_min(NORM_FLOOR)
    weights, point, t = center, center, 1.0
    for _ in range(steps):
        new = project_onto_capped_simplex(point - step * 2 * (gram @ point), lower, upper)
        t_next = (1 + (1 + 4 * t * t) ** 0.5) / 2
        point = new + (t - 1) / t_next * (new - weights)
        weights, t = new, t_next
    return weights


class FedMGDAPlus(FedAvg):
    """FedMGDA+: every participating client's objective is one objective of a multi-objective
    problem; the server moves along a common descent direction, the minimal-norm point of the
    convex hull of the (normalized) client updates, so that no participant's update is opposed.

    Round (Algorithm 1): the server sends w; client i runs local SGD from w to w_i and uploads
    it; the server forms ``g_i = w - w_i``, normalizes it (``g_i / ||g_i||``, ``normalize``),
    solves ``lambda* = argmin ||sum_i lambda_i g_i||^2`` over the simplex with
    ``||lambda - lambda0||_inf <= epsilon`` (:func:`min_norm_weights`: ``solver_steps`` FISTA
    iterations on the m x m Gram matrix) and steps ``w <- w - eta sum_i lambda*_i g_i`` (the
    pseudo-gradient ``sum_i lambda*_i g_i`` with SGD of lr eta). epsilon = 0 is FedAvg with
    normalized updates and weights lambda0; epsilon = 1 is MGDA. Batch-norm buffers: FedAvg's
    sample-weighted mean. Every client's personalized model is the global model.

    Args:
        epsilon: epsilon, the largest distance of each lambda_i from lambda0_i (the paper's
            experiments vary it; 0.1 here, FLGo's default).
        lambda0: the centre of the epsilon box: ``uniform`` (1/m) or ``samples`` (the clients'
            shares n_i / sum_S n_j of the training samples, FedAvg's weights; FLGo's choice).
        normalize: normalize each g_i to unit norm before the min-norm problem (the paper's
            FedMGDA+; False: the raw updates).
        server_lr: eta, the global learning rate (the paper's experiments vary it; 1 here,
            FLGo's default).
        solver_steps: FISTA iterations of the min-norm problem (implementation, not in the
            paper, which calls a QP solver).
        local_lr: the client SGD learning rate.
        local_momentum: client SGD momentum (paper: plain SGD).
        local_weight_decay: client weight decay (paper: none).
        local_max_grad_norm: client gradient clip (paper: none).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        epsilon: UnitInterval = 0.1,
        lambda0: Literal["uniform", "samples"] = "uniform",
        normalize: bool = True,
        server_lr: PositiveFloat = 1.0,
        solver_steps: PositiveInt = 200,
        local_lr: PositiveFloat = 5e-3,
        local_momentum: Momentum = 0.0,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            server_lr=server_lr,
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        h = self.hp
        sent = self.payload(clients)
        result = self.local_train({n: t.clone() for n, t in sent.items()}, clients, round_idx)
        uploaded = {n: result.params[n] for n in sent}
        self.record_communication(down=sent, up=uploaded)
        if self.nothing_arrived(clients, round_idx):
            return result.loss
        shares = self.client_weights(clients, round_idx)
        self.aggregate(uploaded, shares)  # buffers: the weighted mean
        # the m clients that reported back are the objectives (the server reads the mask)
        rows = self.arrived(clients, round_idx).nonzero().squeeze(1)
        shares = shares[rows]
        params = dict(self.net.named_parameters())
        updates = {n: (sent[n][rows] - uploaded[n][rows]).double() for n in params}  # w - w_i
        gram = sum(g.flatten(1) @ g.flatten(1).T for g in updates.values())
        assert isinstance(gram, Tensor)
        scale = torch.ones_like(gram[0])
        if h.normalize:
            scale = 1 / gram.diagonal().sqrt().clamp_min(NORM_FLOOR)
        center = shares.double() if h.lambda0 == "samples" else None
        weights = min_norm_weights(
            scale[:, None] * gram * scale[None, :], h.epsilon, h.solver_steps, center
        )
        for name, p in params.items():
            p.grad = client_mean(updates[name], weights * scale).to(p.dtype)
        return result.loss
