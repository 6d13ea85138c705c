"""Client (target) networks. None has batch norm or buffers: clients are pure parameter dicts."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CNNTarget(nn.Module):
    """The pFedHN "LeNet-based" target CNN.

    conv(in -> k, 5x5) ReLU maxpool2, conv(k -> 2k, 5x5) ReLU maxpool2, fc -> h1 ReLU,
    fc h1 -> h2 ReLU, fc h2 -> C. ``n_kernels`` is k (16 in the paper; 8/16/32 for its S/M/L
    budget study); ``hidden`` is (h1, h2): (120, 84) for pFedHN, (1920, 80) for pFedKT's Table 2
    CNN. ``channels`` overrides (k, 2k) and ``padding`` pads the first conv (see
    :class:`LeNet5`). Works for any square input of at least 16 pixels (less with padding).
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        n_kernels: int = 16,
        input_size: int = 32,
        hidden: tuple[int, int] = (120, 84),
        channels: tuple[int, int] | None = None,
        padding: int = 0,
    ) -> None:
        super().__init__()
        c1, c2 = channels or (n_kernels, 2 * n_kernels)
        side = ((input_size + 2 * padding - 4) // 2 - 4) // 2
        if side < 1:
            smallest = 16 - 2 * padding
            raise ValueError(
                f"{type(self).__name__} needs inputs of at least {smallest} pixels, "
                f"got {input_size}."
            )
        self.conv1 = nn.Conv2d(in_channels, c1, 5, padding=padding)
        self.conv2 = nn.Conv2d(c1, c2, 5)
        self.fc1 = nn.Linear(c2 * side * side, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.fc3 = nn.Linear(hidden[1], num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class MLPTarget(nn.Module):
    """pFedHN's MNIST target: one hidden layer MLP (784 -> 100 -> 10 for MNIST)."""

    def __init__(self, in_features: int = 784, num_classes: int = 10, hidden: int = 100) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class DigitsCNN(nn.Module):
    """A small CNN for 8x8 digits: conv 3x3 (w) pool, conv 3x3 (2w) pool, fc 8w -> h -> C.

    Defaults ``width=16, hidden=64``; FedSimSup's digits supervisor uses ``width=4, hidden=40``
    (about 1/6 of the parameters).
    """

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, width: int = 16, hidden: int = 64
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class LeNet5(CNNTarget):
    """LeNet-5: conv 5x5 (6) pool, conv 5x5 (16) pool, fc 120 -> 84 -> C, ReLU activations.

    ``width`` scales every channel and hidden size (rounded, at least 1): 1.0 is LeNet-5
    (62k parameters on 32x32x3), 0.4 about 1/6 of it (FedSimSup's supervisor). Inputs under 32
    pixels get 2 pixels of padding on the first conv, as for 28x28 MNIST.
    """

    def __init__(
        self, in_channels: int = 3, num_classes: int = 10, input_size: int = 32, width: float = 1.0
    ) -> None:
        c1, c2, h1, h2 = (max(1, round(width * n)) for n in (6, 16, 120, 84))
        super().__init__(
            in_channels,
            num_classes,
            input_size=input_size,
            hidden=(h1, h2),
            channels=(c1, c2),
            padding=2 if input_size < 32 else 0,
        )


class SmallCNN(nn.Module):
    """A smaller CNN for any input size: conv 3x3 (w) pool, conv 3x3 (2w), global mean, fc -> C."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc(x.mean((-2, -1)))


class TransformerBlock(nn.Module):
    """Pre-norm encoder block: x + MHSA(LN(x)), then x + MLP(LN(x)) with GELU."""

    def __init__(self, dim: int, heads: int, mlp_dim: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"transformer dim {dim} is not divisible by heads {heads}.")
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp1 = nn.Linear(dim, mlp_dim)
        self.mlp2 = nn.Linear(mlp_dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, tokens, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, dim / heads]
        attention = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1)
        mixed = (attention @ v).transpose(1, 2).reshape(batch, tokens, dim)
        x = x + self.proj(mixed)
        return x + self.mlp2(F.gelu(self.mlp1(self.norm2(x))))


class SmallTransformer(nn.Module):
    """A small vision transformer: patch embedding, ``depth`` pre-norm blocks, mean-pooled head."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        input_size: int = 32,
        patch: int = 4,
        dim: int = 32,
        depth: int = 1,
        heads: int = 2,
        mlp_dim: int = 64,
    ) -> None:
        super().__init__()
        if input_size % patch:
            raise ValueError(f"patch {patch} does not divide the input size {input_size}.")
        self.embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.position = nn.Parameter(torch.randn((input_size // patch) ** 2, dim) * 0.02)
        self.blocks = nn.Sequential(*(TransformerBlock(dim, heads, mlp_dim) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2) + self.position
        return self.head(self.norm(self.blocks(tokens)).mean(1))


def _cnn(shape: Sequence[int], num_classes: int, **kw: Any) -> nn.Module:
    return CNNTarget(shape[0], num_classes, input_size=shape[-1], **kw)


def _mlp(shape: Sequence[int], num_classes: int, **kw: Any) -> nn.Module:
    return MLPTarget(math.prod(shape), num_classes, **kw)


def _kt_cnn(shape: Sequence[int], num_classes: int, **kw: Any) -> nn.Module:
    return CNNTarget(shape[0], num_classes, 16, shape[-1], hidden=(1920, 80), **kw)


def _digits(shape: Sequence[int], num_classes: int, **kw: Any) -> nn.Module:
    if tuple(shape[-2:]) != (8, 8):
        raise ValueError(f"digits_cnn expects 8x8 inputs, got {tuple(shape)}; use 'cnn' or 'mlp'.")
    return DigitsCNN(shape[0], num_classes, **kw)


def _lenet5(shape: Sequence[int], num_classes: int, **kw: Any) -> nn.Module:
    return LeNet5(shape[0], num_classes, shape[-1], **kw)


def _small_cnn(shape: Sequence[int], num_classes: int, **kw: Any) -> nn.Module:
    return SmallCNN(shape[0], num_classes, **kw)


def _transformer(shape: Sequence[int], num_classes: int, **kw: Any) -> nn.Module:
    return SmallTransformer(shape[0], num_classes, shape[-1], **kw)


NETWORKS: dict[str, Callable[..., nn.Module]] = {
    "cnn": _cnn,
    "kt_cnn": _kt_cnn,
    "mlp": _mlp,
    "digits_cnn": _digits,
    "lenet5": _lenet5,
    "small_cnn": _small_cnn,
    "transformer": _transformer,
}


def build_network(
    name: str, input_shape: Sequence[int], num_classes: int, **kwargs: Any
) -> nn.Module:
    """Build target network ``name`` for inputs of ``input_shape`` and ``num_classes`` outputs."""
    if name not in NETWORKS:
        raise ValueError(f"Unknown network '{name}'. Choose one of: {', '.join(NETWORKS)}.")
    return NETWORKS[name](tuple(input_shape), num_classes, **kwargs)
