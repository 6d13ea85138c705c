"""The pFedHN hypernetwork: client embedding -> MLP -> one linear head per target tensor."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm as add_spectral_norm

REFERENCE_MEAN_SQUARE = 0.5

HeadInit = Literal["pytorch", "target"]
"""How the output heads start: ``pytorch`` is ``nn.Linear``'s default initialization (the pFedHN
paper's code), ``target`` is :func:`match_target_init` (ours, not in the paper)."""

# The defaults of pFedHN's two parametrization options (``hn_feature_scale``, ``hn_head_init``)
# for every method that builds its hypernetwork from them (PFedHN, PFedHNPC, PFedHNBudgets,
# PFedLHN, PeFLL): the paper's parametrization. This is the one place to change them.
DEFAULT_FEATURE_SCALE: bool = False
DEFAULT_HEAD_INIT: HeadInit = "pytorch"


class FeatureScale(nn.Module):
    """Multiplies hypernetwork features by a constant fixed at initialization.

    Not in the pFedHN paper nor its code, whose heads read the MLP's output as it is (pFedHN's
    ``hn_feature_scale: false``, the default; the constant then stays 1).

    A server step with learning rate lr on an output head moves client i's generated weights by
    lr * ||h_i||^2 times its delta, and momentum beta stretches that to
    lr * ||h_i||^2 / (1 - beta) over the following rounds, where h_i are the features the heads
    read. Without a fixed scale the effective step therefore depends on the HN's depth and
    width: E||h||^2 is about 0.5 for pFedHN's CIFAR HN (3 hidden layers of 100) but 36 for its
    one-layer MNIST HN, whose server step (lr 1e-2, momentum 0.9) then moves a client's weights
    3.6 times its delta: the server overshoots every client's trained model and training
    diverges with 100 clients. The constant sets E||h||^2 over the initial embeddings to
    ``REFERENCE_MEAN_SQUARE`` = 0.5, the value of the CIFAR HN the paper's learning rates were
    tuned on, so those learning rates mean the same for every hypernetwork. It is a buffer
    (checkpointed), not a parameter.
    """

    scale: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    @torch.no_grad()
    def calibrate(self, features: Tensor) -> None:
        """Set the constant from the features of the initial embeddings (``[N, width]``)."""
        mean_square = features.float().pow(2).sum(-1).mean().clamp_min(1e-12)
        self.scale.fill_(math.sqrt(REFERENCE_MEAN_SQUARE / float(mean_square)))

    def forward(self, features: Tensor) -> Tensor:
        return features * self.scale


@torch.no_grad()
def match_target_init(
    heads: Sequence[nn.Module], features: Tensor, targets: Sequence[Tensor]
) -> None:
    """Rescale the output heads so generated tensors start at their target's own init scale.

    Not in the pFedHN paper nor its code, whose heads keep ``nn.Linear``'s default
    initialization (pFedHN's ``hn_head_init: pytorch``, the default).

    Head k (an ``nn.Linear`` with PyTorch's default initialization) generates target tensor t_k
    from features h. Over ``features`` (those of the initial embeddings) its outputs W h + b
    have some standard deviation g_k; the head becomes s W h + s b + mu_k with s = sigma_k / g_k,
    where mu_k and sigma_k are the mean and standard deviation of t_k in the target network's
    own initialization. Generated values then have mean mu_k and standard deviation sigma_k
    (e.g. 0.021 for a 784 -> 100 layer, where the unscaled head of pFedHN's one-layer MNIST HN
    gives 0.35), while the split between the part shared by all clients (the bias) and the
    client-specific part (W h) stays that of the default initialization. A constant target
    tensor (a norm layer's weight of ones) is generated exactly, with W = 0.
    """
    for head, target in zip(heads, targets, strict=True):
        weight = getattr(head, "weight", None)
        bias = getattr(head, "bias", None)
        if not isinstance(weight, Tensor) or not isinstance(bias, Tensor):
            raise TypeError(f"a hypernetwork head must be an nn.Linear, got {type(head).__name__}")
        values = target.float()
        sigma = float(values.std()) if values.numel() > 1 else 0.0
        generated = features.float() @ weight.T.float() + bias.float()
        scale = sigma / float(generated.std().clamp_min(1e-12))
        weight.mul_(scale)
        bias.mul_(scale).add_(float(values.mean()))


def set_delta_gradients(
    params: Sequence[nn.Parameter],
    generated: Sequence[Tensor],
    deltas: Sequence[Tensor],
    weights: Sequence[Tensor],
    max_norm: float | None,
    retain_graph: bool = False,
) -> None:
    """Set p.grad = sum_k sum_i w_ki (d g_ki / d p)^T delta_ki, then clip the norm to ``max_norm``.

    ``generated[k]`` is a tensor the hypernetwork generated for several clients, stacked
    ``[C_k, ...]`` with its graph, ``deltas[k]`` its clients' deltas (same shape) and
    ``weights[k]`` their weights ``[C_k]``. The result is the gradient of the surrogate
    sum_k sum_i w_ki <g_ki(p), delta_ki> at the current p (with delta = g - g~, that of
    sum_k sum_i w_ki 0.5 ||g_ki(p) - g~_ki||^2), computed in one backward pass. Parameters no
    generated tensor depends on get no gradient (``None``), so the optimizer leaves them as
    they are (no weight decay nor momentum step); ``max_norm`` None: no clipping.
    """
    grad_outputs = [
        w.to(g.dtype).view(-1, *([1] * (g.dim() - 1))) * d.to(g.dtype)
        for g, d, w in zip(generated, deltas, weights, strict=True)
    ]
    grads = torch.autograd.grad(
        list(generated), list(params), grad_outputs, allow_unused=True, retain_graph=retain_graph
    )
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)


def steps_in_turn(
    optimizer: torch.optim.Optimizer,
    params: Sequence[nn.Parameter],
    gradients: Sequence[Sequence[Tensor | None]],
) -> None:
    """One optimizer step per entry of ``gradients`` (each a gradient per parameter of
    ``params``, e.g. one client's), in order; the last is left set, for the step the base class
    takes at the end of the round."""
    for k, grads in enumerate(gradients):
        if k:
            optimizer.step()
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def apply_heads(
    features: Tensor, target_shapes: Mapping[str, tuple[int, ...]], heads: nn.ModuleList
) -> dict[str, Tensor]:
    """Every head's output on ``features`` ``[C, width]``, reshaped to its tensor: ``[C, *shape]``.

    Outputs are float32 even under autocast: they are the clients' master weights.
    """
    return {
        name: head(features).float().view(len(features), *shape)
        for (name, shape), head in zip(target_shapes.items(), heads, strict=True)
    }


class BaseHyperNetwork(nn.Module, ABC):
    """A hypernetwork whose parameters split into client embeddings and the rest (the two
    parameter groups of pFedHN's server optimizer, the first trained with ``embed_lr``)."""

    @abstractmethod
    def embedding_parameters(self) -> list[nn.Parameter]:
        """The client embeddings (or what stands for them)."""

    def body_parameters(self) -> list[nn.Parameter]:
        """Every parameter but :meth:`embedding_parameters`."""
        embedding_ids = {id(p) for p in self.embedding_parameters()}
        return [p for p in self.parameters() if id(p) not in embedding_ids]

    def personal_parameters(self) -> list[nn.Parameter]:
        """The parameters only one client's generated model reads (client-level DP leaves them
        unclipped, as that client's own): the embeddings, unless a subclass's embeddings are
        built from something every client reads."""
        return self.embedding_parameters()


class HyperNetwork(BaseHyperNetwork):
    """h(v_i; phi): maps client ``i``'s embedding v_i to every tensor of a target network.

    Linear(E, hidden), then ``n_hidden`` x [ReLU, Linear(hidden, hidden)], no activation before
    the heads, then one Linear(hidden, numel) head per target tensor reshaped to its shape.
    ``n_hidden=3`` is the pFedHN CIFAR hypernetwork; ``n_hidden=0`` its one-hidden-layer MNIST
    variant.

    Two choices at initialization that are not in the pFedHN paper nor its code make the server
    step the same for every target and HN size (see :class:`FeatureScale` and
    :func:`match_target_init`): with ``feature_scale`` the features entering the heads are
    scaled to a fixed mean square, and, given ``target_init`` (the target network's own initial
    tensors), each head starts so that generated tensors have the target's own initialization
    mean and scale. Without both this is the paper's hypernetwork (PFedHN passes its
    ``hn_feature_scale`` and ``hn_head_init``, whose defaults are the paper's).
    ``spectral_norm`` normalizes the heads' weights by their largest singular value, which
    overrides the second choice.

    Args:
        num_clients: number of embeddings (n).
        target_shapes: parameter name -> shape of every tensor to generate.
        embed_dim: embedding size E.
        hidden_dim: width of the MLP (100 in the paper).
        n_hidden: extra hidden layers after the first.
        spectral_norm: apply spectral normalization to every linear layer.
        target_init: the target network's initial tensors by name (None: PyTorch's default
            head initialization).
    """

    def __init__(
        self,
        num_clients: int,
        target_shapes: Mapping[str, tuple[int, ...]],
        embed_dim: int,
        hidden_dim: int = 100,
        n_hidden: int = 3,
        spectral_norm: bool = False,
        target_init: Mapping[str, Tensor] | None = None,
        feature_scale: bool = True,
    ) -> None:
        super().__init__()
        self.hidden_dim = hidden_dim
        self.spectral_norm = spectral_norm
        self.target_shapes = {name: tuple(shape) for name, shape in target_shapes.items()}
        self.embeddings = nn.Embedding(num_clients, embed_dim)
        layers: list[nn.Module] = [self.linear(embed_dim, hidden_dim)]
        for _ in range(n_hidden):
            layers += [nn.ReLU(), self.linear(hidden_dim, hidden_dim)]
        self.mlp = nn.Sequential(*layers)
        self.feature_scale = FeatureScale()
        if feature_scale:
            with torch.no_grad():
                self.feature_scale.calibrate(self.mlp(self.embeddings.weight))
        self.heads = self.new_heads(self.target_shapes, target_init)

    def linear(self, i: int, o: int) -> nn.Module:
        """A Linear(i, o) layer, spectrally normalized with ``spectral_norm``."""
        layer = nn.Linear(i, o)
        return add_spectral_norm(layer) if self.spectral_norm else layer

    def new_heads(
        self,
        target_shapes: Mapping[str, tuple[int, ...]],
        target_init: Mapping[str, Tensor] | None = None,
    ) -> nn.ModuleList:
        """One Linear(hidden, numel) head per tensor of ``target_shapes`` reading this network's
        features, rescaled to ``target_init`` over the features of the initial embeddings (see
        :func:`match_target_init`; not with ``spectral_norm``)."""
        heads = nn.ModuleList(
            self.linear(self.hidden_dim, math.prod(shape)) for shape in target_shapes.values()
        )
        with torch.no_grad():  # also with spectral norm: each forward is a power iteration
            features = self.features(torch.arange(self.embeddings.num_embeddings))
        if target_init is not None and not self.spectral_norm:
            match_target_init(list(heads), features, [target_init[n] for n in target_shapes])
        return heads

    def features(self, clients: Tensor) -> Tensor:
        """The features h(v_i) that every head reads (scaled with ``feature_scale``)."""
        return self.feature_scale(self.mlp(self.embeddings(clients)))

    def forward(self, clients: Tensor) -> dict[str, Tensor]:
        """Generate the target tensors of ``clients`` (shape [C]) stacked as [C, *shape] (float32,
        see :func:`apply_heads`)."""
        return apply_heads(self.features(clients), self.target_shapes, self.heads)

    def embedding_parameters(self) -> list[nn.Parameter]:
        return list(self.embeddings.parameters())
