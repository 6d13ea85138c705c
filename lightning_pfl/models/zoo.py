"""The model zoo of model-heterogeneous PFL (MH-pFedHN): networks registered by name.

Each network here is a :class:`~lightning_pfl.models.targets.TargetNetwork` registered with
:func:`~lightning_pfl.models.targets.register_network`, so any method can use it as ``net`` or
in a per-client assignment (``architectures:``/``supervisors:``). Sizes follow the input shape
(8x8x1 digits, 28x28x1, 32x32x3, 64x64x3 all work):

============== ===================================================================================
name           network (Zhang et al.'s zoo; widths for CIFAR-100)
============== ===================================================================================
zoo_cnn        LeNet-style: conv3x3 16, pool, conv3x3 32, pool, fc -> 108 -> 64 -> C (2048 in)
zoo_mlp        MLP: flatten -> 128 -> 64 -> C
vgg8           simplified VGG-8: 3x3 convs 16,16 pool 32,32 pool 64,64 pool, fc -> 180 -> 64 -> C
resnet10/12/18 CIFAR-style ResNet (Table 19): blocks (3,3,4) / (1,5,6) / (6,6,6), 16/32/64 channels
squeezenet1_0  SqueezeNet 1.0 (Fire modules), classifier as pooled features -> Linear
squeezenet1_1  SqueezeNet 1.1
============== ===================================================================================

The ResNets are the paper's Appendix Table 19: a 3x3 conv stem with 16 channels, three stages of
basic blocks (two 3x3 convs each) at 16/32/64 channels (strides 1, 2, 2), an 8x8 average pool
(the global mean on 32x32 inputs; here the global mean for every input size) and a Linear
classifier; blocks per stage (3, 3, 4) for ResNet-10, (1, 5, 6) for ResNet-12 and (6, 6, 6) for
ResNet-18 (the names count blocks, not layers). ``blocks``/``widths`` override them (tiny test
and CPU configs). Where Table 19 is silent the block is ours: batch norm after every conv, no
conv biases, a 1x1 conv + batch norm projection shortcut where the shape changes; parameter
counts on CIFAR-100 are within 0.3% of the authors' code's (ResNet-10 352,308 vs 353,028; the
other zoo networks' equal). Batch norm's running statistics are per-client state (see
:class:`~lightning_pfl.engine.Architecture`). SqueezeNet on inputs under 64 pixels starts
with a 3x3 stride-1 conv instead of the ImageNet stem, and its final 1x1 conv + average pool is
written as average pool + Linear (the same map without the last ReLU) so that it has a
classifier layer; its dropout is left out (deterministic client steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pfl.models.targets import (
    Derived,
    TargetNetwork,
    _channels,
    _flat,
    _image,
    register_network,
)


def he_init(layers: Sequence[nn.Conv2d | nn.Linear]) -> None:
    """He initialization (normal, fan-in, gain sqrt(2)) and zero biases for ReLU ``layers``.

    Deep ReLU networks without normalization need it (torchvision's VGG and SqueezeNet use it
    too): PyTorch's default layer init (weight variance 1/(3 fan-in)) shrinks the input's
    signal ~2.5x per layer, so at init the logits of the eight-layer VGG-8 vary over inputs by
    ~1e-4 of the input's spread and SqueezeNet's by ~1e-8: the network predicts a constant and
    local SGD has almost no gradient to leave it with. Hypernetworks whose outputs are in units
    of the initialization (:class:`~lightning_pfl.models.multihead_hypernetwork.FlatCodec`)
    would generate models at that scale too. Networks with batch norm (the ResNets) or of a few
    layers (LeNet-style CNN, MLP) keep PyTorch's default.
    """
    for layer in layers:
        nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
        if layer.bias is not None:
            nn.init.zeros_(layer.bias)


def _conv_side(size: int, pools: int) -> int:
    for _ in range(pools):
        size //= 2
    if size < 1:
        raise ValueError(f"inputs are too small for {pools} poolings")
    return size


class ZooCNN(TargetNetwork):
    """The paper's LeNet-style CNN: conv3x3 (c1) pool, conv3x3 (c2) pool, fc h1 -> h2 -> C."""

    classifier_name = "fc3"

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        input_size: int = 32,
        channels: tuple[int, int] = (16, 32),
        hidden: tuple[int, int] = (108, 64),
    ) -> None:
        super().__init__()
        side = _conv_side(input_size, 2)
        self.conv1 = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.conv2 = nn.Conv2d(channels[0], channels[1], 3, padding=1)
        self.fc1 = nn.Linear(channels[1] * side * side, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.fc3 = nn.Linear(hidden[1], num_classes)

    def features(self, x: Tensor) -> Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.relu(self.fc2(F.relu(self.fc1(x.flatten(1)))))


class ZooMLP(TargetNetwork):
    """The paper's MLP: flatten -> h1 -> h2 -> C with ReLU."""

    classifier_name = "fc3"

    def __init__(
        self, in_features: int = 3072, num_classes: int = 10, hidden: tuple[int, int] = (128, 64)
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.fc3 = nn.Linear(hidden[1], num_classes)

    def features(self, x: Tensor) -> Tensor:
        return F.relu(self.fc2(F.relu(self.fc1(x.flatten(1)))))


class VGG8(TargetNetwork):
    """Simplified VGG-8: three pairs of 3x3 convs (c, c, 2c, 2c, 4c, 4c) each followed by a
    2x2 max pool, then fc -> h1 -> h2 -> C (c = 16, hidden (180, 64) in the paper). No
    normalization, so the convs and hidden fc layers start from :func:`he_init`."""

    classifier_name = "fc3"

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        input_size: int = 32,
        width: int = 16,
        hidden: tuple[int, int] = (180, 64),
    ) -> None:
        super().__init__()
        side = _conv_side(input_size, 3)
        widths = [width, width, 2 * width, 2 * width, 4 * width, 4 * width]
        convs, previous = [], in_channels
        for w in widths:
            convs.append(nn.Conv2d(previous, w, 3, padding=1))
            previous = w
        self.convs = nn.ModuleList(convs)
        self.fc1 = nn.Linear(previous * side * side, hidden[0])
        self.fc2 = nn.Linear(hidden[0], hidden[1])
        self.fc3 = nn.Linear(hidden[1], num_classes)
        he_init([*self.convs, self.fc1, self.fc2])

    def features(self, x: Tensor) -> Tensor:
        for i, conv in enumerate(self.convs):
            x = F.relu(conv(x))
            if i % 2 == 1:
                x = F.max_pool2d(x, 2)
        return F.relu(self.fc2(F.relu(self.fc1(x.flatten(1)))))


class BasicBlock(nn.Module):
    """Two 3x3 conv + batch norm layers with an identity (or 1x1 conv) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.stride = stride
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            # a 1x1 conv on the subsampled input: the same map as a stride-2 1x1 conv, which
            # corrupts the heap on CPU for channels-last inputs (seen with torch 2.14)
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        skip = self.shortcut(x[..., :: self.stride, :: self.stride])
        return F.relu(self.bn2(self.conv2(out)) + skip)


class ResNet(TargetNetwork):
    """CIFAR-style ResNet: conv3x3 stem, stages of basic blocks (``blocks[s]`` blocks of
    ``widths[s]`` channels; strides 1, 2, 2, ...), global average pool, Linear classifier
    ``fc``. ``layers`` is the flat sequence of blocks."""

    classifier_name = "fc"

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        blocks: Sequence[int] = (3, 3, 4),
        widths: Sequence[int] = (16, 32, 64),
    ) -> None:
        super().__init__()
        if len(blocks) != len(widths) or min(blocks) < 1:
            raise ValueError(f"give one positive block count per stage width, got {blocks}")
        self.stem = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(widths[0])
        layers: list[nn.Module] = []
        previous = widths[0]
        for stage, (count, width) in enumerate(zip(blocks, widths, strict=True)):
            for b in range(count):
                layers.append(BasicBlock(previous, width, 2 if stage and not b else 1))
                previous = width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(previous, num_classes)

    def features(self, x: Tensor) -> Tensor:
        return self.layers(F.relu(self.bn(self.stem(x)))).mean((-2, -1))


class Fire(nn.Module):
    """SqueezeNet's Fire module: 1x1 squeeze, then 1x1 and 3x3 expands concatenated."""

    def __init__(self, cin: int, squeeze: int, expand: int) -> None:
        super().__init__()
        self.squeeze = nn.Conv2d(cin, squeeze, 1)
        self.expand1 = nn.Conv2d(squeeze, expand, 1)
        self.expand3 = nn.Conv2d(squeeze, expand, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        s = F.relu(self.squeeze(x))
        return torch.cat([F.relu(self.expand1(s)), F.relu(self.expand3(s))], 1)


# (squeeze, expand) of every Fire module, "M" = max pool 3x3 stride 2 (ceil mode)
SQUEEZENET_LAYOUTS: dict[str, list[Any]] = {
    "1_0": [(16, 64), (16, 64), (32, 128), "M", (32, 128), (48, 192), (48, 192), (64, 256), "M"]
    + [(64, 256)],
    "1_1": [(16, 64), (16, 64), "M", (32, 128), (32, 128), "M", (48, 192), (48, 192)]
    + [(64, 256), (64, 256)],
}


class SqueezeNet(TargetNetwork):
    """SqueezeNet 1.0 / 1.1 (Iandola et al.); ``width`` scales every channel count. No
    normalization, so every conv starts from :func:`he_init`."""

    classifier_name = "fc"

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        input_size: int = 32,
        version: str = "1_1",
        width: float = 1.0,
    ) -> None:
        super().__init__()
        if version not in SQUEEZENET_LAYOUTS:
            raise ValueError(f"version must be one of {sorted(SQUEEZENET_LAYOUTS)}")

        def w(n: int) -> int:
            return max(1, round(width * n))

        stem = w(96 if version == "1_0" else 64)
        if input_size >= 64:
            kernel, stride = (7, 2) if version == "1_0" else (3, 2)
            self.stem = nn.Conv2d(in_channels, stem, kernel, stride)
        else:
            self.stem = nn.Conv2d(in_channels, stem, 3, 1, 1)
        layers: list[nn.Module] = [nn.MaxPool2d(3, 2, ceil_mode=True)]
        previous = stem
        for item in SQUEEZENET_LAYOUTS[version]:
            if item == "M":
                layers.append(nn.MaxPool2d(3, 2, ceil_mode=True))
            else:
                squeeze, expand = item
                layers.append(Fire(previous, w(squeeze), w(expand)))
                previous = 2 * w(expand)
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(previous, num_classes)
        he_init([m for m in self.modules() if isinstance(m, nn.Conv2d)])

    def features(self, x: Tensor) -> Tensor:
        return self.layers(F.relu(self.stem(x))).mean((-2, -1))


class ResNet10(ResNet):
    """ResNet-10 of the paper's Table 19: blocks (3, 3, 4) per stage."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        blocks: Sequence[int] = (3, 3, 4),
        widths: Sequence[int] = (16, 32, 64),
    ) -> None:
        super().__init__(in_channels, num_classes, blocks, widths)


class ResNet12(ResNet):
    """ResNet-12 of the paper's Table 19: blocks (1, 5, 6) per stage."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        blocks: Sequence[int] = (1, 5, 6),
        widths: Sequence[int] = (16, 32, 64),
    ) -> None:
        super().__init__(in_channels, num_classes, blocks, widths)


class ResNet18(ResNet):
    """ResNet-18 of the paper's Table 19: blocks (6, 6, 6) per stage."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        blocks: Sequence[int] = (6, 6, 6),
        widths: Sequence[int] = (16, 32, 64),
    ) -> None:
        super().__init__(in_channels, num_classes, blocks, widths)


class SqueezeNet10(SqueezeNet):
    """SqueezeNet 1.0."""

    def __init__(
        self, in_channels: int = 3, num_classes: int = 10, input_size: int = 32, width: float = 1.0
    ) -> None:
        super().__init__(in_channels, num_classes, input_size, "1_0", width)


class SqueezeNet11(SqueezeNet):
    """SqueezeNet 1.1."""

    def __init__(
        self, in_channels: int = 3, num_classes: int = 10, input_size: int = 32, width: float = 1.0
    ) -> None:
        super().__init__(in_channels, num_classes, input_size, "1_1", width)


ZOO_NETWORKS: dict[str, tuple[type[nn.Module], Derived]] = {
    "zoo_cnn": (ZooCNN, _image),
    "zoo_mlp": (ZooMLP, _flat),
    "vgg8": (VGG8, _image),
    "resnet10": (ResNet10, _channels),
    "resnet12": (ResNet12, _channels),
    "resnet18": (ResNet18, _channels),
    "squeezenet1_0": (SqueezeNet10, _image),
    "squeezenet1_1": (SqueezeNet11, _image),
}
for _name, (_cls, _derived) in ZOO_NETWORKS.items():
    register_network(_name, _cls, _derived)
