"""CCVR (Luo et al., NeurIPS 2021): FedAvg, then the classifier calibrated on virtual
representations sampled from the clients' per-class feature Gaussians."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import grad, vmap

from lightning_pfl.engine import Params, derive_seed, weighted_cross_entropy
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedproto import feature_dim
from lightning_pfl.streams import CALIBRATION_STREAM
from lightning_pfl.validation import PositiveFloat, PositiveInt


@torch.no_grad()
def class_moments(method: FedAvg, params: Params, clients: Tensor) -> tuple[Tensor, ...]:
    """Each client's per-class feature statistics over its training split (evaluation mode):
    counts N_{c,k} ``[C, K]``, means mu_{c,k} ``[C, K, D]`` and unbiased covariances
    Sigma_{c,k} ``[C, K, D, D]`` (zero where N_{c,k} < 2)."""
    classes = method.hp.num_classes
    features = vmap(method.arch.features)
    by_size = method.data.by_size(clients, "train")
    params = by_size.sort(params)
    d = feature_dim(method)
    sums = torch.zeros(len(clients), classes, d, dtype=torch.float64, device=method.device)
    outer = sums.new_zeros(len(clients), classes, d, d)
    counts = sums.new_zeros(len(clients), classes)
    for k, x, y, weight in by_size.blocks(method.hp.eval_batch_size):
        z = features({n: t[:k] for n, t in params.items()}, x).double()  # [k, b, D]
        onehot = F.one_hot(y, classes).double() * weight.unsqueeze(-1)  # [k, b, K]
        sums[:k] += torch.einsum("cbk,cbd->ckd", onehot, z)
        outer[:k] += torch.einsum("cbk,cbd,cbe->ckde", onehot, z, z)
        counts[:k] += onehot.sum(1)
    sums, outer, counts = by_size.unsort(sums), by_size.unsort(outer), by_size.unsort(counts)
    n = counts[..., None]
    mean = sums / n.clamp_min(1)
    scatter = outer - n[..., None] * mean[..., :, None] * mean[..., None, :]
    cov = scatter / (n[..., None] - 1).clamp_min(1)
    return counts, mean, torch.where(n[..., None] > 1, cov, torch.zeros_like(cov))


def global_moments(counts: Tensor, mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The paper's server step: with N_c = sum_k N_{c,k},
    mu_c = sum_k N_{c,k} / N_c mu_{c,k} and
    Sigma_c = sum_k (N_{c,k} - 1) / (N_c - 1) Sigma_{c,k}
              + sum_k N_{c,k} / (N_c - 1) mu_{c,k} mu_{c,k}^T - N_c / (N_c - 1) mu_c mu_c^T
    (the pooled unbiased covariance). Returns N_c ``[K]``, mu_c ``[K, D]``, Sigma_c ``[K, D, D]``
    (zero where N_c < 2)."""
    total = counts.sum(0)  # [K]
    mu = torch.einsum("ck,ckd->kd", counts, mean) / total.clamp_min(1)[:, None]
    denom = (total - 1).clamp_min(1)[:, None, None]
    within = torch.einsum("ck,ckde->kde", (counts - 1).clamp_min(0), cov)
    between = torch.einsum("ck,ckd,cke->kde", counts, mean, mean)
    sigma = (within + between - total[:, None, None] * mu[:, :, None] * mu[:, None, :]) / denom
    return total, mu, torch.where(total[:, None, None] > 1, sigma, torch.zeros_like(sigma))


def sample_virtual(
    total: Tensor, mu: Tensor, sigma: Tensor, per_class: int, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor]:
    """M_c = ``per_class`` draws from N(mu_c, Sigma_c) per class: features ``[K * M, D]``,
    labels and weights (0 for classes no client has)."""
    classes, d = mu.shape
    # Sigma = V diag(l) V^T; clamp the round-off negatives of a PSD matrix
    eigenvalues, vectors = torch.linalg.eigh(sigma)
    root = vectors * eigenvalues.clamp_min(0).sqrt()[:, None, :]
    noise = torch.randn(classes, per_class, d, generator=generator, dtype=mu.dtype)
    z = mu[:, None, :] + torch.einsum("kmd,ked->kme", noise.to(mu.device), root)
    labels = torch.arange(classes, device=mu.device).repeat_interleave(per_class)
    weight = (total > 0).to(mu.dtype).repeat_interleave(per_class)
    return z.flatten(0, 1), labels, weight


class CCVR(FedAvg):
    """CCVR: Classifier Calibration with Virtual Representations.

    Training is FedAvg, untouched. Whenever the model is evaluated, the server calibrates the
    global classifier: every training client sends, for each class c it has, the count
    N_{c,k}, mean mu_{c,k} and covariance Sigma_{c,k} of the global model's features (the
    classifier's input, evaluation mode) on its training data; the server combines them into
    the pooled per-class Gaussian N(mu_c, Sigma_c) (:func:`global_moments`), draws M_c virtual
    representations per class (:func:`sample_virtual`) and trains only the classifier on them
    with cross-entropy and plain SGD (shuffled batches of ``batch_size``) for
    ``calibration_epochs`` epochs, starting from the global classifier. Every client's model
    is the global feature extractor with the calibrated classifier. Draws and batch order are
    seeded by the round, so the validation and the test of one round, and a resumed run, see
    the same classifier; the global model itself is never changed by calibration.

    Args:
        virtual_per_class: M_c, virtual representations per class (FL-bench's 200).
        calibration_epochs: epochs of classifier training over the virtual representations.
        calibration_lr: SGD learning rate of the calibration (None: ``local_lr``).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        virtual_per_class: PositiveInt = 200,
        calibration_epochs: PositiveInt = 1,
        calibration_lr: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("CCVR calibrates on feature statistics of one global model")
        self._calibrated: tuple[int, Params] | None = None

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        self._calibrated = None
        return super().run_round(round_idx, clients)

    @torch.no_grad()
    def calibrated_head(self) -> Params:
        """The global classifier after calibration on this round's virtual representations."""
        h = self.hp
        round_idx = self.current_round
        if self._calibrated is not None and self._calibrated[0] == round_idx:
            return self._calibrated[1]
        state = self.global_state()
        clients = torch.arange(self.num_training_clients, device=self.device)
        expanded = {n: t.expand(len(clients), *t.shape) for n, t in state.items()}
        total, mu, sigma = global_moments(*class_moments(self, expanded, clients))
        generator = torch.Generator().manual_seed(
            derive_seed(h.seed, round_idx, CALIBRATION_STREAM)
        )
        z, y, weight = sample_virtual(total, mu, sigma, h.virtual_per_class, generator)
        z = z.float()
        head = {n: state[n].clone() for n in self.arch.head_names}
        lr = h.calibration_lr or h.local_lr
        for _ in range(h.calibration_epochs):
            order = torch.randperm(len(y), generator=generator).to(self.device)
            for batch in order.split(h.batch_size):
                grads = self.head_gradient(head, z[batch], y[batch], weight[batch])
                head = {n: t - lr * grads[n] for n, t in head.items()}
        self._calibrated = (round_idx, head)
        return head

    def head_gradient(self, head: Params, z: Tensor, y: Tensor, weight: Tensor) -> Params:
        """Gradient of the classifier's mean cross-entropy on virtual representations
        (``torch.func``: evaluation runs under inference mode, where autograd cannot)."""

        def loss(head: Params) -> Tensor:
            return weighted_cross_entropy(self.arch.classify(head, z), y, weight)

        return grad(loss)(head)

    def personalized_params(self, clients: Tensor) -> Params:
        head = self.calibrated_head()
        params = super().personalized_params(clients)
        return params | {n: t.expand(len(clients), *t.shape) for n, t in head.items()}
