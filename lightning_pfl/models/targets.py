"""Client (target) networks. None has batch norm or buffers: clients are pure parameter dicts."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn


class CNNTarget(nn.Module):
    """The pFedHN "LeNet-based" target CNN.

    conv(in -> k, 5x5) ReLU maxpool2, conv(k -> 2k, 5x5) ReLU maxpool2, fc -> h1 ReLU,
    fc h1 -> h2 ReLU, fc h2 -> C. ``n_kernels`` is k (16 in the paper; 8/16/32 for its S/M/L
    budget study); ``hidden`` is (h1, h2): (120, 84) for pFedHN, (1920, 80) for pFedKT's Table 2
    CNN. Works for any square input of at least 16 pixels.
    """

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        n_kernels: int = 16,
        input_size: int = 32,
        hidden: tuple[int, int] = (120, 84),
    ) -> None:
        super().__init__()
        side = ((input_size - 4) // 2 - 4) // 2
        if side < 1:
            raise ValueError(f"CNNTarget needs inputs of at least 16 pixels, got {input_size}.")
        self.conv1 = nn.Conv2d(in_channels, n_kernels, 5)
        self.conv2 = nn.Conv2d(n_kernels, 2 * n_kernels, 5)
        self.fc1 = nn.Linear(2 * n_kernels * side * side, hidden[0])
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
    """A small CNN for 8x8 digits: conv 3x3 (16) pool, conv 3x3 (32) pool, fc 128 -> 64 -> C."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


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


NETWORKS: dict[str, Callable[..., nn.Module]] = {
    "cnn": _cnn,
    "kt_cnn": _kt_cnn,
    "mlp": _mlp,
    "digits_cnn": _digits,
}


def build_network(
    name: str, input_shape: Sequence[int], num_classes: int, **kwargs: Any
) -> nn.Module:
    """Build target network ``name`` for inputs of ``input_shape`` and ``num_classes`` outputs."""
    if name not in NETWORKS:
        raise ValueError(f"Unknown network '{name}'. Choose one of: {', '.join(NETWORKS)}.")
    return NETWORKS[name](tuple(input_shape), num_classes, **kwargs)
