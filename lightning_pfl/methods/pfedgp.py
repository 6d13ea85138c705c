"""pFedGP (Achituve et al., NeurIPS 2021): personal GP classifiers on a shared deep kernel."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.engine import LossFn, Params, TrainResult
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import PositiveFloat


def rbf_kernel(a: Tensor, b: Tensor, lengthscale: float) -> Tensor:
    """k(a, b) = exp(-||a - b||^2 / (2 l^2)) for rows of ``a [N, d]`` and ``b [M, d]``.

    ||a - b||^2 is expanded as ||a||^2 + ||b||^2 - 2 a.b, so memory is O(N M), not the
    O(N M d) of broadcasting the differences (44 GB for 50 FashionMNIST clients of ~1,150
    points each in one evaluation chunk).
    """
    sq = a.pow(2).sum(-1).unsqueeze(-1) + b.pow(2).sum(-1).unsqueeze(-2) - 2 * a @ b.mT
    return torch.exp(-0.5 * sq.clamp_min(0) / lengthscale**2)


def masked_gram(z: Tensor, weight: Tensor, lengthscale: float, noise: float) -> Tensor:
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
    z: Tensor, y: Tensor, weight: Tensor, num_classes: int, lengthscale: float, noise: float
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


def gp_posterior_mean(
    z_train: Tensor,
    y_train: Tensor,
    weight: Tensor,
    z_test: Tensor,
    num_classes: int,
    lengthscale: float,
    noise: float,
) -> Tensor:
    """K_* (K + s2 I)^-1 Y: the posterior mean of every class's GP at ``z_test``, ``[M, C]``."""
    alpha = gp_weights(z_train, y_train, weight, num_classes, lengthscale, noise)
    return rbf_kernel(z_test, z_train, lengthscale) @ alpha


def gp_weights(
    z: Tensor, y: Tensor, weight: Tensor, num_classes: int, lengthscale: float, noise: float
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
    on the GP's negative log marginal likelihood of each batch; the server averages the
    extractors (FedAvg, sample-weighted). The network's own classifier is never used or sent.

    Our GP classifier is one-vs-rest GP regression on one-hot labels (noise s2), a closed-form
    stand-in for the paper's Polya-Gamma augmented binary-tree GP classifier: it keeps what
    makes pFedGP personal (a non-parametric classifier on the client's data over a shared
    kernel), and its marginal likelihood and posterior are exact and differentiable inside the
    vmapped client step (Cholesky solves), which Gibbs sampling of Polya-Gamma variables is
    not. No GP library is used: GPyTorch is not a dependency and its models are stateful
    modules that do not run under ``torch.func.vmap``.

    Prediction: the posterior mean K_* (K + s2 I)^-1 Y over all of the client's training
    points (the class with the largest mean wins).

    Args:
        lengthscale: l, the RBF lengthscale on the normalized representation.
        noise: s2, the observation noise of the label regression.
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    def __init__(
        self, lengthscale: PositiveFloat = 0.5, noise: PositiveFloat = 0.1, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("pFedGP")
        self.gp_loss = self.marginal_likelihood_loss()

    def extractor(self, params: Params, x: Tensor, train: bool = False) -> Tensor:
        """The kernel's input: the L2-normalized representation."""
        return F.normalize(self.arch.features(params, x, train).float(), dim=-1)

    def marginal_likelihood_loss(self) -> LossFn:
        h = self.hp

        def loss(params: Params, frozen: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            z = self.extractor({**params, **frozen}, x, train=True)
            return gp_negative_log_likelihood(
                z.double(), y, w.double(), h.num_classes, h.lengthscale, h.noise
            ).float()

        return loss

    def payload(self, clients: Tensor) -> Params:
        """The extractor only: the classifier layer is replaced by the GP."""
        sent = super().payload(clients)
        return {n: t for n, t in sent.items() if n not in self.arch.head_names}

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        return self.local_train(start, clients, round_idx, loss_fn=self.gp_loss)

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
        alpha = torch.vmap(gp_weights, in_dims=(0, 0, 0, None, None, None))(
            z, y, weight.double(), h.num_classes, h.lengthscale, h.noise
        )
        return params | {"gp.z": z, "gp.alpha": alpha}

    def predict(self, params: Params, x: Tensor) -> Tensor:
        net = {n: t for n, t in params.items() if not n.startswith("gp.")}
        z = self.extractor(net, x).double()
        return (rbf_kernel(z, params["gp.z"], self.hp.lengthscale) @ params["gp.alpha"]).float()
