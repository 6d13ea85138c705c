"""Floco (Grinwald, Wiesner & Nakajima, NeurIPS 2024): federated learning over connected modes."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pfl.engine import (
    ParamGroup,
    Params,
    TrainResult,
    derive_seed,
    weighted_cross_entropy,
)
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.params import client_mean
from lightning_pfl.step_inputs import CLOCK, CLOCK_GROUP, at, start_clock, tick
from lightning_pfl.streams import FLOCO_STREAM
from lightning_pfl.validation import NonNegativeFloat, NonNegativeInt, PositiveInt

SIGNATURE_PHASE = 1  # the batches and simplex points of round tau's signature pass
SIMPLEX = "simplex"  # the M endpoints of the classifier weight, stacked [M, ...]
ALPHAS = "alphas"  # the round's sampled simplex points [S, M] in the loss's context tensors
REGION = "subregion"  # client store: the center beta_i of each client's subregion


def project_onto_simplex(kappa: Tensor, z: Tensor) -> Tensor:
    """Euclidean projection of the rows of ``kappa`` ``[..., M]`` onto ``{b >= 0, sum b = z}``
    (``z`` broadcasts against ``kappa[..., 0]``; Duchi et al., 2008)."""
    u = kappa.sort(-1, descending=True).values
    cssv = u.cumsum(-1) - z.unsqueeze(-1)
    ind = torch.arange(1, kappa.shape[-1] + 1, dtype=kappa.dtype, device=kappa.device)
    rho = (u - cssv / ind > 0).sum(-1, keepdim=True)
    theta = cssv.gather(-1, rho - 1) / rho.to(kappa.dtype)
    return (kappa - theta).clamp_min(0)


def riesz_log_energy(points: Tensor, eps: float = 1e-4) -> Tensor:
    """``log(sum_{i<j} 1/d_ij^2) - log(#pairs)`` of each set of points ``[..., N, M]``, distances
    below ``eps`` counted as ``eps``."""
    n = points.shape[-2]
    d = torch.cdist(points, points).clamp_min(eps)
    upper = torch.triu(torch.ones(n, n, dtype=torch.bool, device=points.device), 1)
    energy = (d**-2)[..., upper].sum(-1)
    return energy.log() - math.log(n * (n - 1) / 2)


def simplex_centers(signatures: Tensor, m: int, grid: int = 1000) -> Tensor:
    """Each client's subregion center ``[N, M]``: its signature's first M principal
    components, projected onto the simplex scaled by z (for z on a grid of ``grid`` values in
    [1e-4, 1]) and renormalized, at the z whose points have the lowest Riesz s-energy (the most
    evenly spread)."""
    x = signatures.double()
    u, s, vh = torch.linalg.svd(x - x.mean(0), full_matrices=False)
    signs = torch.sign(vh.gather(1, vh.abs().argmax(1, keepdim=True))).squeeze(1)
    kappa = torch.zeros(len(x), m, dtype=x.dtype, device=x.device)
    k = min(m, len(s))
    kappa[:, :k] = (u * s * signs)[:, :k]
    z = torch.linspace(1e-4, 1.0, grid, dtype=x.dtype, device=x.device)
    betas = project_onto_simplex(kappa.expand(grid, -1, -1), z.view(-1, 1))
    betas = betas / betas.sum(-1, keepdim=True)
    energy = riesz_log_energy(betas)
    return betas[energy.nan_to_num(math.inf).argmin()].float()


class Floco(FedAvg):
    """Floco: a solution simplex of M endpoint classifiers; each client trains its subregion.

    The classifier weight is a point of the simplex spanned by M endpoints W_1..W_M:
    ``W(alpha) = sum_m alpha_m W_m`` (the rest of the network is shared as in FedAvg). Round:
    the server sends the network and the endpoints; a client trains them with a fresh alpha at
    every local step: before round tau drawn uniformly from the whole simplex, from round tau on
    drawn from its subregion, ``beta_i + r u`` with ``r ~ U(0, rho)`` and u a random direction of
    unit L1 norm (the authors' sampler); the server averages everything (FedAvg). At round tau
    every training client first trains one round from the global model; the updates of its
    endpoints (its gradient signature) are reduced to M principal components and projected onto
    the simplex (scaled to spread the clients most evenly, lowest Riesz s-energy), which gives
    each client's subregion center beta_i (:func:`simplex_centers`). A client's model is
    ``W(beta_i)``: the simplex center before tau.

    The round's alphas are drawn on the server for every client and step and read by the loss
    at the current step (:mod:`lightning_pfl.step_inputs`).

    Args:
        endpoints: M, the simplex's endpoints (the authors' CIFAR-10 runs: 10).
        tau: the round of the projection (the authors' runs: 250, half of their 500 rounds).
        rho: L1 radius of a client's subregion (the authors: 0.1 on the Fold split, 0.3 on
            Dirichlet).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        endpoints: PositiveInt = 10,
        tau: NonNegativeInt = 250,
        rho: NonNegativeFloat = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if endpoints > self.num_training_clients:
            raise ConfigError(
                f"model.init_args.endpoints = {endpoints} exceeds the {self.num_training_clients}"
                " training clients, whose signatures give the M principal components; use at "
                f"most {self.num_training_clients}."
            )
        self.head_weight = f"{self.arch.head_module}.weight"
        shape = self.arch.shapes[self.head_weight]
        with self.seeded_init():
            ends = [nn.init.xavier_normal_(torch.empty(shape)) for _ in range(endpoints)]
        self.simplex = nn.Parameter(torch.stack(ends))
        self.store.add_field(REGION, {REGION: torch.full((endpoints,), 1.0 / endpoints)})
        self.model_names = tuple(n for n in self.arch.shapes if n != self.head_weight)

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        shared = [p for n, p in self.net.named_parameters() if n != self.head_weight]
        return torch.optim.SGD([*shared, self.simplex], lr=h.server_lr, momentum=h.server_momentum)

    def payload(self, clients: Tensor) -> Params:
        sent = {n: t for n, t in super().payload(clients).items() if n != self.head_weight}
        return sent | {SIMPLEX: self.simplex.detach().expand(len(clients), *self.simplex.shape)}

    def aggregate(self, trained: Params, weights: Tensor) -> None:
        super().aggregate(trained, weights)
        mean = client_mean(trained[SIMPLEX], weights)
        self.simplex.grad = self.simplex.detach() - mean.to(self.simplex.dtype)

    # ----------------------------------------------------------------- client side
    def floco_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        """Cross-entropy of the network whose classifier weight is ``W(alpha)``, alpha the
        current step's sample."""
        clock = params[CLOCK]
        alpha = at(context[ALPHAS], clock)
        model = {n: t for n, t in params.items() if n not in (CLOCK, SIMPLEX)}
        model[self.head_weight] = torch.einsum("m,m...->...", alpha, params[SIMPLEX])
        rest = {n: t for n, t in context.items() if n != ALPHAS}
        logits, buffers = self.arch.forward_train({**rest, **model}, x)
        loss = tick(weighted_cross_entropy(logits, y, weight), clock)
        return (loss, buffers) if buffers else loss

    def sample_alphas(self, clients: Tensor, steps: int, round_idx: int, phase: int = 0) -> Tensor:
        """``[C, steps, M]`` simplex points: uniform on the simplex before round tau and in the
        signature pass, in the client's subregion from round tau on."""
        h = self.hp
        rng = torch.Generator(self.device).manual_seed(
            derive_seed(h.seed, round_idx, FLOCO_STREAM, phase)
        )
        shape = (len(clients), steps, h.endpoints)
        u = torch.rand(shape, generator=rng, device=rng.device).to(self.device)
        if round_idx < h.tau or phase == SIGNATURE_PHASE:
            e = -torch.log1p(-u)  # Exp(1): normalized, uniform on the simplex
            return e / e.sum(-1, keepdim=True)
        v = 2 * u - 1
        direction = v / v.abs().sum(-1, keepdim=True)
        r = torch.rand(shape[:2], generator=rng, device=rng.device).to(self.device) * h.rho
        center = self.store.gather(REGION, clients, self.device)[REGION]
        return center[:, None] + r[..., None] * direction

    def train_clients(
        self, round_idx: int, clients: Tensor, start: Params, phase: int = 0
    ) -> TrainResult:
        batches = self.draw_batches(clients, round_idx, phase=phase)
        alphas = self.sample_alphas(clients, batches.index.shape[1], round_idx, phase)
        model = ParamGroup((*self.model_names, SIMPLEX), self.local_sgd())
        return self.local_train(
            start | start_clock(len(clients), self.device),
            clients,
            round_idx,
            groups=[model, CLOCK_GROUP],
            loss_fn=self.floco_loss,
            context={ALPHAS: alphas},
            batches=batches,
        )

    # ----------------------------------------------------------------- server side
    def project_clients(self, round_idx: int) -> tuple[Params, Params]:
        """Round tau: every training client trains once from the global model; its endpoints'
        update is its signature; :func:`simplex_centers` gives the subregion centers. Returns
        what was sent and received."""
        everyone = torch.arange(self.num_training_clients, device=self.device)
        sent = self.payload(everyone)
        result = self.train_clients(round_idx, everyone, dict(sent), phase=SIGNATURE_PHASE)
        # the signatures that arrived place their clients; the others keep the simplex center
        rows = self.arrived(everyone, round_idx).nonzero().squeeze(1)
        if len(rows):
            update = (sent[SIMPLEX] - result.params[SIMPLEX])[rows]
            centers = simplex_centers(update.flatten(1), self.hp.endpoints)
            self.store.scatter(REGION, everyone[rows], {REGION: centers})
        return sent, {SIMPLEX: result.params[SIMPLEX]}

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        extra: tuple[Params, Params] = ({}, {})
        if round_idx == self.hp.tau:
            extra = self.project_clients(round_idx)
        sent = self.payload(clients)
        result = self.train_with_personal(
            round_idx, clients, {n: t.clone() for n, t in sent.items()}
        )
        uploaded = {n: result.params[n] for n in sent}
        if not self.nothing_arrived(clients, round_idx):
            self.aggregate(uploaded, self.client_weights(clients, round_idx))
        self.record_communication(
            down=sent | {f"projection.{n}": t for n, t in extra[0].items()},
            up=uploaded | {f"projection.{n}": t for n, t in extra[1].items()},
        )
        return result.loss

    def personalized_params(self, clients: Tensor) -> Params:
        params = self.payload(clients)
        beta = self.store.gather(REGION, clients, self.device)[REGION]
        params[self.head_weight] = torch.einsum("cm,cm...->c...", beta, params.pop(SIMPLEX))
        return params
