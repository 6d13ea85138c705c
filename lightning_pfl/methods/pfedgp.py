"""pFedGP (Achituve et al., NeurIPS 2021): personal GP classifiers on a shared deep kernel."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pfl.engine import LossFn, ParamGroup, Params, TrainResult, derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.step_inputs import CLOCK, CLOCK_GROUP, at, start_clock, tick
from lightning_pfl.streams import SPLIT_STREAM
from lightning_pfl.validation import OpenUnitInterval, PositiveFloat

KERNEL = ("gp.log_lengthscale", "gp.log_noise")
NOISE_FLOOR = 1e-4  # GPyTorch's default lower bound of a Gaussian likelihood's noise
SPLIT_KEYS = "gp.split_keys"  # [C, S, B] uniform draws that split each local batch

Scale = float | Tensor


def rbf_kernel(a: Tensor, b: Tensor, lengthscale: Scale) -> Tensor:
    """k(a, b) = exp(-||a - b||^2 / (2 l^2)) for rows of ``a [N, d]`` and ``b [M, d]``.

    ||a - b||^2 is expanded as ||a||^2 + ||b||^2 - 2 a.b, so memory is O(N M), not the
    O(N M d) of broadcasting the differences (44 GB for 50 FashionMNIST clients of ~1,150
    points each in one evaluation chunk).
    """
    sq = a.pow(2).sum(-1).unsqueeze(-1) + b.pow(2).sum(-1).unsqueeze(-2) - 2 * a @ b.mT
    return torch.exp(-0.5 * sq.clamp_min(0) / lengthscale**2)


def masked_gram(z: Tensor, weight: Tensor, lengthscale: Scale, noise: Scale) -> Tensor:
    """K + s2 I over the real points (weight 1); a padding point (weight 0) is independent of
    all others with prior variance 1, so with target 0 it changes no solution."""
    k = rbf_kernel(z, z, lengthscale) * weight.unsqueeze(-1) * weight.unsqueeze(-2)
    eye = torch.eye(len(weight), dtype=k.dtype, device=k.device)
    return k + eye * (noise + (1 - weight)).unsqueeze(-1)


def gp_targets(y: Tensor, weight: Tensor, num_classes: int) -> Tensor:
    """One-vs-rest regression targets: one-hot labels, zero rows for padding, ``[N, C]``."""
    classes = torch.arange(num_classes, device=y.device)
    return (y.unsqueeze(-1) == classes).to(weight.dtype) * weight.unsqueeze(-1)  # vmap-safe


def gp_negative_log_likelihood(
    z: Tensor, y: Tensor, weight: Tensor, num_classes: int, lengthscale: Scale, noise: Scale
) -> Tensor:
    """Per-sample negative log marginal likelihood of independent GP regressions, one per class:
    (1/n) sum_c [0.5 y_c^T (K + s2 I)^-1 y_c + 0.5 log|K + s2 I| + 0.5 n log 2 pi]."""
    a = masked_gram(z, weight, lengthscale, noise)
    targets = gp_targets(y, weight, num_classes)
    chol = torch.linalg.cholesky(a)
    alpha = torch.cholesky_solve(targets, chol)
    n = weight.sum()
    pad_logdet = (1 - weight).sum() * torch.log1p(torch.as_tensor(noise, dtype=a.dtype))
    logdet = 2 * torch.log(torch.diagonal(chol)).sum() - pad_logdet
    fit = (targets * alpha).sum()
    const = n * torch.log(torch.as_tensor(2 * torch.pi, dtype=a.dtype))
    return 0.5 * (fit + num_classes * (logdet + const)) / n.clamp_min(1)


def predictive_split(y: Tensor, weight: Tensor, keys: Tensor, ratio: float) -> Tensor:
    """The scored points of a batch (1.0; the other real points condition the GP), stratified
    by class: of the n_c real points of class c, the floor(n_c * ratio) with the smallest
    ``keys`` (uniform draws; ties go to the earlier position) are scored, as the authors' code
    scores ``int(n_c * predict_ratio)`` randomly permuted points of each class."""
    position = torch.arange(len(y), device=y.device)
    same = (y.unsqueeze(-1) == y.unsqueeze(-2)).to(weight.dtype) * weight.unsqueeze(-2)
    earlier = (keys.unsqueeze(-2) < keys.unsqueeze(-1)) | (
        (keys.unsqueeze(-2) == keys.unsqueeze(-1))
        & (position.unsqueeze(-2) < position.unsqueeze(-1))
    )
    rank = (same * earlier.to(weight.dtype)).sum(-1)  # [i]: real points of i's class before i
    quota = torch.floor(same.sum(-1).double() * ratio).to(weight.dtype)
    return (rank < quota).to(weight.dtype) * weight


def gp_negative_log_predictive(
    z: Tensor,
    y: Tensor,
    weight: Tensor,
    scored: Tensor,
    num_classes: int,
    lengthscale: Scale,
    noise: Scale,
) -> Tensor:
    """Mean negative log predictive density of the scored points (``scored`` 1.0) under the
    per-class GP regressions conditioned on the other real points (the conditioning set D_c):
    per point, sum_c [0.5 (y_c - mu_c)^2 / (v + s2) + 0.5 log(v + s2) + 0.5 log 2 pi], with
    mu_c = k_*^T (K_c + s2 I)^-1 y_c and v = 1 - k_*^T (K_c + s2 I)^-1 k_* (each point's own
    predictive marginal, as the authors' code scores each point)."""
    given = weight * (1 - scored)
    chol = torch.linalg.cholesky(masked_gram(z, given, lengthscale, noise))
    cross = rbf_kernel(z, z, lengthscale) * given.unsqueeze(-2)  # [i, j]: k(z_i, z_j), j in D_c
    mean = cross @ torch.cholesky_solve(gp_targets(y, given, num_classes), chol)
    whitened = torch.linalg.solve_triangular(chol, cross.mT, upper=False)
    variance = (1 - whitened.pow(2).sum(-2)).clamp_min(0) + noise
    residual = (gp_targets(y, weight, num_classes) - mean).pow(2).sum(-1)
    log_normalizer = num_classes * (torch.log(variance) + math.log(2 * math.pi))
    return 0.5 * (scored * (residual / variance + log_normalizer)).sum() / scored.sum().clamp_min(1)


def gp_posterior_mean(
    z_train: Tensor,
    y_train: Tensor,
    weight: Tensor,
    z_test: Tensor,
    num_classes: int,
    lengthscale: Scale,
    noise: Scale,
) -> Tensor:
    """K_* (K + s2 I)^-1 Y: the posterior mean of every class's GP at ``z_test``, ``[M, C]``."""
    alpha = gp_weights(z_train, y_train, weight, num_classes, lengthscale, noise)
    return rbf_kernel(z_test, z_train, lengthscale) @ alpha


def gp_weights(
    z: Tensor, y: Tensor, weight: Tensor, num_classes: int, lengthscale: Scale, noise: Scale
) -> Tensor:
    """(K + s2 I)^-1 Y over the training points (zero rows for padding), ``[N, C]``."""
    chol = torch.linalg.cholesky(masked_gram(z, weight, lengthscale, noise))
    return torch.cholesky_solve(gp_targets(y, weight, num_classes), chol)


class PFedGP(FedAvg):
    """pFedGP: a shared deep kernel (feature extractor, FedAvg'd) and a GP per client.

    Each client classifies with Gaussian processes on the shared representation z = f(x; w)
    and a kernel k(z, z') = exp(-||z - z'||^2 / 2 l^2) on the L2-normalized representation,
    conditioned on its own training data, so the classifier is personal and needs no
    parameters of its own. Round: the server sends w; each client trains w for K local steps
    on the GP's objective on each batch; the server averages the extractors (FedAvg,
    sample-weighted). The network's own classifier is never used or sent.

    Objective (``objective``): the authors' code's default, the predictive likelihood, splits
    each batch at random by class into a conditioning set D_c and a scored set D_s (a share
    ``predict_ratio`` of each class's points, 0.5 as in the code, is scored), conditions the
    GP on D_c and minimizes the mean negative log predictive density of D_s; the split is
    drawn on the server per round (stream ``SPLIT_STREAM``) and each step reads its own.
    ``marginal``: the negative log marginal likelihood of the whole batch (the code's
    ``--objective marginal_likelihood``).

    Our GP classifier is one-vs-rest GP regression on one-hot labels (noise s2), a closed-form
    stand-in for the paper's Polya-Gamma augmented binary-tree GP classifier: it keeps what
    makes pFedGP personal (a non-parametric classifier on the client's data over a shared
    kernel), and its marginal likelihood and posterior are exact and differentiable inside the
    vmapped client step (Cholesky solves), which Gibbs sampling of Polya-Gamma variables is
    not. No GP library is used: GPyTorch is not a dependency and its models are stateful
    modules that do not run under ``torch.func.vmap``.

    Kernel hyperparameters: fixed by default, as in the authors' code (which rebuilds every
    client's GP tree with outputscale 8 and lengthscale 1 at every step and optimizes only
    the network). With ``learn_kernel`` they are part of the shared kernel: log l and
    log s2 are sent with w, trained by the clients' local SGD on the same objective and
    averaged with w (the server model holds them, so checkpoints carry them);
    s2 is floored at 1e-4 (GPyTorch's default noise bound).

    Prediction: the posterior mean K_* (K + s2 I)^-1 Y over all of the client's training
    points (the class with the largest mean wins).

    Args:
        lengthscale: l, the RBF lengthscale on the normalized representation (its starting
            value with ``learn_kernel``).
        noise: s2, the observation noise of the label regression (likewise).
        learn_kernel: learn l and s2 with the extractor (shared by all clients, FedAvg'd);
            False: keep them at ``lengthscale`` and ``noise``, as the authors' code does.
        objective: the extractor's training loss: ``predictive`` (the predictive likelihood
            of D_s given D_c, the authors' default) or ``marginal`` (the marginal likelihood
            of the batch).
        predict_ratio: the share of each class's batch points in the scored set D_s (the
            code's ``--predict-ratio``, 0.5); read only by the predictive objective.
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        lengthscale: PositiveFloat = 0.5,
        noise: PositiveFloat = 0.1,
        learn_kernel: bool = False,
        objective: Literal["predictive", "marginal"] = "predictive",
        predict_ratio: OpenUnitInterval = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("pFedGP")
        if learn_kernel and noise <= NOISE_FLOOR:
            raise ConfigError(
                f"model.init_args.noise = {noise} must exceed {NOISE_FLOOR} with learn_kernel "
                "(the learned noise is floored there); raise it or set learn_kernel: false."
            )
        self.kernel = nn.ParameterDict()
        if learn_kernel:
            for name, value in zip(KERNEL, (lengthscale, noise - NOISE_FLOOR), strict=True):
                self.kernel[name.split(".")[1]] = nn.Parameter(torch.tensor(math.log(value)))
        self.gp_loss = (
            self.predictive_likelihood_loss()
            if objective == "predictive"
            else self.marginal_likelihood_loss()
        )

    def kernel_hyperparameters(self, params: Params) -> tuple[Scale, Scale]:
        """(l, s2) of ``params``' kernel tensors, or the fixed ones without ``learn_kernel``."""
        if not self.hp.learn_kernel:
            return self.hp.lengthscale, self.hp.noise
        log_l, log_noise = (params[n].double() for n in KERNEL)
        return log_l.exp(), log_noise.exp() + NOISE_FLOOR

    def extractor(self, params: Params, x: Tensor, train: bool = False) -> Tensor:
        """The kernel's input: the L2-normalized representation."""
        net = {n: t for n, t in params.items() if not n.startswith("gp.")}
        return F.normalize(self.arch.features(net, x, train).float(), dim=-1)

    def marginal_likelihood_loss(self) -> LossFn:
        h = self.hp

        def loss(params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            joined = {**params, **context}
            z = self.extractor(joined, x, train=True)
            lengthscale, noise = self.kernel_hyperparameters(joined)
            return gp_negative_log_likelihood(
                z.double(), y, w.double(), h.num_classes, lengthscale, noise
            ).float()

        return loss

    def predictive_likelihood_loss(self) -> LossFn:
        h = self.hp

        def loss(params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            clock = params[CLOCK]
            joined = {n: t for n, t in {**params, **context}.items() if n != CLOCK}
            z = self.extractor(joined, x, train=True).double()
            lengthscale, noise = self.kernel_hyperparameters(joined)
            weight = w.double()
            scored = predictive_split(y, weight, at(context[SPLIT_KEYS], clock), h.predict_ratio)
            value = gp_negative_log_predictive(
                z, y, weight, scored, h.num_classes, lengthscale, noise
            )
            return tick(value.float(), clock)

        return loss

    def shared_extras(self) -> dict[str, nn.Parameter]:
        """With ``learn_kernel``, the kernel tensors (``gp.log_lengthscale``, ``gp.log_noise``)."""
        return {f"gp.{n}": p for n, p in self.kernel.items()}

    def payload(self, clients: Tensor) -> Params:
        """The extractor (and kernel) only: the classifier layer is replaced by the GP."""
        sent = super().payload(clients)
        return {n: t for n, t in sent.items() if n not in self.arch.head_names}

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        if self.hp.objective == "marginal":
            return self.local_train(start, clients, round_idx, loss_fn=self.gp_loss)
        batches = self.draw_batches(clients, round_idx)
        generator = torch.Generator().manual_seed(
            derive_seed(self.hp.seed, round_idx, SPLIT_STREAM)
        )
        keys = torch.rand(batches.index.shape, generator=generator, dtype=torch.float64)
        return self.local_train(
            start | start_clock(len(clients), self.device),
            clients,
            round_idx,
            groups=[ParamGroup(tuple(start), self.local_sgd()), CLOCK_GROUP],
            loss_fn=self.gp_loss,
            context={SPLIT_KEYS: keys.to(self.device)},
            batches=batches,
        )

    @torch.no_grad()
    def personalized_params(self, clients: Tensor) -> Params:
        """The extractor and, per client, its training representations and (K + s2 I)^-1 Y."""
        h = self.hp
        params = self.payload(clients)
        index, weight = next(
            self.data.eval_blocks(clients, "train", int(self.data.num_samples("train").max()))
        )
        x, y = self.data.fetch(index)
        z = torch.vmap(self.extractor)(params, x).double()
        lengthscale, noise = self.kernel_hyperparameters(self.global_state())
        alpha = torch.vmap(gp_weights, in_dims=(0, 0, 0, None, None, None))(
            z, y, weight.double(), h.num_classes, lengthscale, noise
        )
        return params | {"gp.z": z, "gp.alpha": alpha}

    def predict(self, params: Params, x: Tensor) -> Tensor:
        z = self.extractor(params, x).double()
        lengthscale, _ = self.kernel_hyperparameters(params)
        return (rbf_kernel(z, params["gp.z"], lengthscale) @ params["gp.alpha"]).float()
