"""A server-side conditional generator of representations, trained without data to match an
ensemble of client classifiers (FedGen's G_w(z | y); usable by any data-free distillation).

:class:`ConditionalGenerator` maps a label y and noise eps ~ N(0, I) to a representation z of
the size the target network's classifier reads (``Architecture.features``).
:func:`ensemble_cross_entropy` is the objective that makes z "look like class y" to the clients'
classifiers: the cross-entropy of the softmax of their mean logits. :func:`train_generator`
takes the server's steps on it; :func:`sample_labels` draws labels from a prior without a host
sync. The randomness comes from explicit ``torch.Generator`` objects, so a run resumes exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import vmap

from lightning_pfl.engine import Architecture, Params


class ConditionalGenerator(nn.Module):
    """``G_w(z | y)``: ``[eps, onehot(y)]`` -> Linear -> BatchNorm -> ReLU -> Linear -> z.

    Args:
        num_classes: number of labels y.
        feature_dim: size of the generated representation z.
        noise_dim: size of the noise eps ~ N(0, I).
        hidden_dim: width of the hidden layer.
    """

    def __init__(
        self, num_classes: int, feature_dim: int, noise_dim: int = 32, hidden_dim: int = 256
    ) -> None:
        super().__init__()
        self.num_classes, self.noise_dim = num_classes, noise_dim
        self.hidden = nn.Sequential(
            nn.Linear(noise_dim + num_classes, hidden_dim),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(),
        )
        self.out = nn.Linear(hidden_dim, feature_dim)

    def forward(self, y: Tensor, eps: Tensor) -> Tensor:
        """Representations for labels ``y`` ``[N]`` and noise ``eps`` ``[N, noise_dim]``."""
        onehot = F.one_hot(y, self.num_classes).to(eps.dtype)
        return self.out(self.hidden(torch.cat([eps, onehot], -1)))

    def noise(self, n: int, rng: torch.Generator) -> Tensor:
        """``n`` noise vectors eps ~ N(0, I) from ``rng``."""
        device = self.out.weight.device
        return torch.randn(n, self.noise_dim, generator=rng, device=rng.device).to(device)

    @torch.no_grad()
    def sample(self, y: Tensor, rng: torch.Generator) -> Tensor:
        """``z ~ G_w(. | y)`` for labels of any shape ``[...]`` -> ``[..., feature_dim]``, in
        evaluation mode (running batch-norm statistics), without gradients."""
        was_training = self.training
        self.eval()
        z = self(y.flatten(), self.noise(y.numel(), rng))
        self.train(was_training)
        return z.view(*y.shape, -1)


def sample_labels(prior: Tensor, shape: tuple[int, ...], rng: torch.Generator) -> Tensor:
    """Labels ``y ~ prior`` (a probability vector) of the given shape, by inverse CDF."""
    u = torch.rand(shape, generator=rng, device=rng.device).to(prior.device)
    cdf = prior.double().cumsum(0)
    return torch.searchsorted(cdf / cdf[-1], u.double().contiguous()).clamp(max=len(prior) - 1)


def ensemble_cross_entropy(arch: Architecture, heads: Params, z: Tensor, y: Tensor) -> Tensor:
    """``l(softmax((1/K) sum_k g(z; theta_k^p)), y)``: cross-entropy of the mean logits of the
    K classifiers ``heads`` (stacked ``[K, ...]``, named as in ``arch``) on ``z``."""
    logits = vmap(arch.classify, in_dims=(0, None))(heads, z).mean(0)
    return F.cross_entropy(logits.float(), y)


def train_generator(
    generator: ConditionalGenerator,
    optimizer: torch.optim.Optimizer,
    arch: Architecture,
    heads: Params,
    prior: Tensor,
    steps: int,
    batch_size: int,
    rng: torch.Generator,
) -> Tensor:
    """``steps`` optimizer steps on :func:`ensemble_cross_entropy` with ``y ~ prior`` and fresh
    noise per step (training mode); returns the mean loss."""
    heads = {n: t.detach() for n, t in heads.items()}
    generator.train()
    total = torch.zeros((), device=prior.device)
    for _ in range(steps):
        y = sample_labels(prior, (batch_size,), rng)
        with torch.enable_grad():
            loss = ensemble_cross_entropy(
                arch, heads, generator(y, generator.noise(batch_size, rng)), y
            )
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        total = total + loss.detach()
    return total / max(steps, 1)
