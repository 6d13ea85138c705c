"""MH-pFedHN: the model zoo, the multi-head hypernetwork and the three methods."""

from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from lightning_pfl.engine import Architecture
from lightning_pfl.models import build_network

ZOO = [
    "zoo_cnn",
    "zoo_mlp",
    "vgg8",
    "resnet10",
    "resnet12",
    "resnet18",
    "squeezenet1_0",
    "squeezenet1_1",
]
SHAPES = [((1, 8, 8), 10), ((1, 28, 28), 62), ((3, 32, 32), 100), ((3, 64, 64), 200)]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_networks_build_for_every_input_shape(name: str) -> None:
    for shape, classes in SHAPES:
        net = build_network(name, shape, classes)
        assert net(torch.randn(2, *shape)).shape == (2, classes)
        assert net(torch.randn(2, *shape), features_only=True).dim() == 2


def test_zoo_sizes_follow_the_paper_on_cifar100() -> None:
    # LeNet-style: conv 3->16, conv 16->32, fc 2048->108->64->100
    cnn = build_network("zoo_cnn", (3, 32, 32), 100)
    assert cnn.fc1.in_features == 2048  # type: ignore[union-attr]
    vgg = build_network("vgg8", (3, 32, 32), 100)
    assert vgg.fc1.in_features == 1024  # type: ignore[union-attr]
    mlp = build_network("zoo_mlp", (3, 32, 32), 100)
    assert sum(p.numel() for p in mlp.parameters()) == 3072 * 128 + 128 + 128 * 64 + 64 + 6500
    depth = {"resnet10": 10, "resnet12": 12, "resnet18": 18}
    for name, layers in depth.items():
        net = build_network(name, (3, 32, 32), 100)
        convs = [n for n, m in net.named_modules() if isinstance(m, torch.nn.Conv2d)]
        main = [n for n in convs if "shortcut" not in n]
        assert len(main) + 1 == layers, name  # convs + the classifier


@pytest.mark.parametrize("name", ZOO)
def test_zoo_networks_are_vmappable_with_per_client_state(name: str) -> None:
    torch.manual_seed(0)
    shape = (3, 32, 32) if name.startswith("squeeze") else (1, 8, 8)
    arch = Architecture(build_network(name, shape, 10))
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        states.append(Architecture(build_network(name, shape, 10)).initial_state())
    stacked = {n: torch.stack([s[n] for s in states]) for n in states[0]}
    x = torch.randn(2, 4, *shape)
    logits, buffers = vmap(arch.forward_train, randomness="different")(stacked, x)
    for c in range(2):
        one, one_buffers = arch.forward_train(states[c], x[c])
        torch.testing.assert_close(logits[c], one, rtol=1e-4, atol=1e-5)
        for n in one_buffers:
            torch.testing.assert_close(buffers[n][c], one_buffers[n], rtol=1e-4, atol=1e-5)
        evaluated = vmap(arch)(stacked, x)[c]
        torch.testing.assert_close(evaluated, arch(states[c], x[c]), rtol=1e-4, atol=1e-5)
    assert arch.stateful == name.startswith("resnet")
