"""FedTP (Li et al.): transformer backbones, the qkv hypernetwork and the variants."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, vmap

from lightning_pfl.engine import Architecture
from lightning_pfl.models import build_network
from lightning_pfl.models.transformers import CharTransformer, ViT, qkv_names


def test_vit_shapes_and_qkv_names() -> None:
    net = build_network("vit", (3, 32, 32), 10, depth=3)
    assert isinstance(net, ViT)
    x = torch.randn(5, 3, 32, 32)
    assert net(x).shape == (5, 10)
    assert net(x, features_only=True).shape == (5, 128)
    names = [n for n, _ in net.named_parameters()]
    assert qkv_names(names) == tuple(f"blocks.{i}.attn.qkv.weight" for i in range(3))
    assert dict(net.named_parameters())["blocks.0.attn.qkv.weight"].shape == (3 * 8 * 64, 128)
    assert not any(n.endswith("qkv.bias") for n in names)
    assert net.position.shape == (65, 128)  # 64 patches + CLS
    assert len(list(net.buffers())) == 0
    assert ViT().blocks.__len__() == 8  # the paper's depth is the default


def test_vit_patches_are_the_images_blocks() -> None:
    net = ViT(in_channels=2, input_size=4, patch=2, dim=8, depth=1, heads=1, head_dim=4)
    net.eval()
    x = torch.arange(2 * 4 * 4, dtype=torch.float32).view(1, 2, 4, 4)
    with torch.no_grad():
        net.embed.weight.copy_(torch.eye(8))
        net.embed.bias.zero_()
        net.position.zero_()
        tokens = net.tokens(x)
    # token 1 is the top-left 2x2 patch: pixels (0,0),(0,1),(1,0),(1,1) of both channels
    expected = torch.stack([x[0, :, i, j] for i in (0, 1) for j in (0, 1)]).flatten()
    torch.testing.assert_close(tokens[0, 1], expected)


def test_char_transformer_is_causal() -> None:
    torch.manual_seed(0)
    net = CharTransformer(vocab_size=80, num_classes=80, dropout=0.0).eval()
    x = torch.randint(0, 80, (3, 20))
    changed = x.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % 80
    with torch.no_grad():
        a, b = net.sequence_features(x), net.sequence_features(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])
    assert net(x).shape == (3, 80)
    assert qkv_names([n for n, _ in net.named_parameters()]) == (
        "blocks.0.attn.qkv.weight",
        "blocks.1.attn.qkv.weight",
    )
    assert dict(net.named_parameters())["blocks.0.attn.qkv.weight"].shape == (384, 128)


@pytest.mark.parametrize(
    ("name", "shape", "x"),
    [
        ("vit", (1, 8, 8), lambda: torch.randn(3, 4, 1, 8, 8)),
        ("char_transformer", (12,), lambda: torch.randint(0, 10, (3, 4, 12))),
    ],
)
def test_transformers_vmap_equals_loop(name: str, shape: tuple[int, ...], x) -> None:
    torch.manual_seed(0)
    kwargs = {"patch": 2, "dim": 16, "depth": 2, "heads": 2, "head_dim": 8} if name == "vit" else {}
    net = build_network(name, shape, 10, dropout=0.0, **kwargs)
    arch = Architecture(net)
    net.eval()
    stacked = {
        n: torch.stack([p + 0.01 * torch.randn_like(p) for _ in range(3)])
        for n, p in net.named_parameters()
    }
    inputs = x()
    batched = vmap(lambda p, xi: functional_call(net, p, (xi,)))(stacked, inputs)
    looped = torch.stack([arch({n: t[c] for n, t in stacked.items()}, inputs[c]) for c in range(3)])
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-5)


def test_attention_rollout_is_a_map_per_image() -> None:
    net = ViT(in_channels=1, input_size=8, patch=2, dim=16, depth=2, heads=2, head_dim=8).eval()
    maps = net.attention_rollout(torch.randn(4, 1, 8, 8))
    assert maps.shape == (4, 4, 4)
    assert torch.all(maps >= 0) and torch.allclose(maps.amax((1, 2)), torch.ones(4))
