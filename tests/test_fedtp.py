"""FedTP (Li et al.): transformer backbones, the qkv hypernetwork and the variants."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import functional_call, vmap

from lightning_pfl.attention_maps import attention_pictures, embedding_figure, embedding_projection
from lightning_pfl.engine import Architecture
from lightning_pfl.errors import ConfigError
from lightning_pfl.losses import (
    balanced_softmax_cross_entropy,
    interpolate_with_knn,
    knn_probabilities,
)
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedtp import FedTP, FedTPKNN, FedTPPer, FedTPRoD
from lightning_pfl.methods.local import Local
from lightning_pfl.methods.vanilla_pt import VanillaPersonalizedT
from lightning_pfl.models import build_network
from lightning_pfl.models.transformers import CharTransformer, ViT, qkv_names
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_vectorized_equals_sequential,
    capture_local_training,
    cli,
    run_dir,
)


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


def test_char_transformer_without_mask_is_the_reference_codes() -> None:
    """``causal: false`` (FedTP's reference code): an earlier position reads later characters."""
    torch.manual_seed(0)
    net = CharTransformer(vocab_size=80, num_classes=80, dropout=0.0, causal=False).eval()
    x = torch.randint(0, 80, (3, 20))
    changed = x.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % 80
    with torch.no_grad():
        a, b = net.sequence_features(x), net.sequence_features(changed)
    assert not torch.allclose(a[:, :12], b[:, :12])
    default = build_network("char_transformer", (20,), 80)
    assert isinstance(default, CharTransformer)
    assert all(block.attn.causal for block in default.blocks)  # type: ignore[union-attr]


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


# ----------------------------------------------------------------- FedTP and its variants
SMALL_VIT = {"patch": 2, "dim": 16, "depth": 2, "heads": 2, "head_dim": 8, "mlp_dim": 32}
QKV = {"blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"}


def small(cls: type[FederatedMethod], num_clients: int = 6, **kwargs: Any) -> Any:
    dm = digits_data(num_clients)
    kwargs.setdefault("net_args", {**SMALL_VIT, "dropout": 0.0, "emb_dropout": 0.0})
    return build(cls, dm, net="vit", local_epochs=None, clients_per_round=3, **kwargs)


def capture_aggregate(method: Any) -> list[set[str]]:
    seen: list[set[str]] = []
    original = method.aggregate

    def wrapped(trained: dict[str, torch.Tensor], weights: torch.Tensor) -> None:
        seen.append(set(trained))
        original(trained, weights)

    method.aggregate = wrapped
    return seen


def test_hypernetwork_generates_exactly_the_qkv_tensors() -> None:
    method = small(FedTP)
    assert isinstance(method, FedTP)
    assert set(method.hnet.target_shapes) == QKV
    clients = torch.tensor([0, 3, 5])
    out = method.hnet(clients)
    assert set(out) == QKV
    assert all(out[n].shape == (3, 3 * 2 * 8, 16) for n in QKV)
    params = method.personalized_params(clients)
    assert set(params) == set(method.arch.shapes)
    for n in QKV:
        torch.testing.assert_close(params[n], out[n].detach())
        assert not torch.allclose(params[n][0], params[n][1])  # one W_i per client
    for n in set(params) - QKV:
        assert torch.equal(params[n][0], params[n][1])  # the rest is the global model
    with pytest.raises(ConfigError, match="qkv"):
        build(FedTP, digits_data(4), net="digits_cnn")


@pytest.mark.parametrize("cls", [FedTP, FedTPPer, VanillaPersonalizedT])
def test_personalized_tensors_never_enter_fedavg(cls: type[FederatedMethod]) -> None:
    method = small(cls)
    seen = capture_aggregate(method)
    before = {n: t.detach().clone() for n, t in method.net.state_dict().items()}
    trained = capture_local_training(method)
    method.run_round(0, torch.tensor([1, 2, 4]))
    personal = QKV | (set(method.arch.head_names) if cls is FedTPPer else set())
    assert seen == [set(method.arch.shapes) - personal]
    assert method.hp.clients_per_round == 3 and len(trained) == 1
    for n in personal:
        param = dict(method.net.named_parameters())[n]
        assert param.grad is None and torch.equal(param.detach(), before[n])
    if cls is not FedTP:  # what the clients keep is what they trained
        kept = method.store.gather("personal", torch.tensor([1, 2, 4]), torch.device("cpu"))
        assert set(kept) == (set(method.arch.head_names) if cls is FedTPPer else QKV)
        for n, t in kept.items():
            torch.testing.assert_close(t, trained[0].params[n])


def test_hypernetwork_update_is_the_gradient_of_its_surrogate() -> None:
    method = small(FedTP)  # defaults: no clipping of the HN gradient, as the paper and its code
    assert isinstance(method, FedTP)
    clients = torch.tensor([0, 2, 5])
    reference = copy.deepcopy(method.hnet)
    trained: list[Any] = []
    original = method.local_train

    def far(*args: Any, **kwargs: Any) -> Any:  # trained W~ far from W: a large HN gradient
        result = original(*args, **kwargs)
        for n in QKV:
            result.params[n] = result.params[n] - 10.0
        trained.append(result)
        return result

    method.local_train = far  # type: ignore[method-assign]
    method.run_round(0, clients)
    p = method.client_weights(clients)
    assert not torch.allclose(p, torch.full_like(p, 1 / 3))  # sample weights, not uniform
    generated = reference(clients)
    surrogate = sum(
        (p.view(-1, 1, 1) * 0.5 * (generated[n] - trained[0].params[n]) ** 2).sum() for n in QKV
    )
    expected = torch.autograd.grad(surrogate, list(reference.parameters()))
    assert float(torch.cat([g.flatten() for g in expected]).norm()) > 50  # old default clip
    for (name, param), g in zip(method.hnet.named_parameters(), expected, strict=True):
        assert param.grad is not None
        torch.testing.assert_close(param.grad, g, rtol=1e-4, atol=1e-5, msg=name)


def test_hypernetwork_starts_as_the_reference_code() -> None:
    """Default heads: PyTorch's Linear init reading unscaled features (the reference code);
    ``hn_feature_scale`` with ``hn_head_init: target`` starts generated qkv weights at the ViT's
    own init scale."""
    default = small(FedTP)
    assert float(default.hnet.feature_scale.scale) == 1.0
    bound = 1 / math.sqrt(default.hp.hidden_dim)
    for head in default.hnet.heads:
        assert float(head.weight.detach().abs().max()) <= bound
        assert float(head.bias.detach().abs().max()) <= bound
    clients = torch.arange(6)
    features = default.hnet.mlp(default.hnet.embeddings(clients))
    torch.testing.assert_close(default.hnet.features(clients), features)

    matched = small(FedTP, hn_feature_scale=True, hn_head_init="target")
    assert float(matched.hnet.feature_scale.scale) != 1.0
    own = matched.arch.initial_params()
    generated = matched.hnet(clients)
    for n in QKV:
        ratio = float(generated[n].detach().std()) / float(own[n].std())
        assert 0.9 < ratio < 1.1, (n, ratio)


def test_balanced_softmax_on_a_hand_example() -> None:
    # logits 0, counts (3, 1): softmax of (log 3, log 1) -> p(y=0) = 3/4, p(y=1) = 1/4
    logits = torch.zeros(2, 2)
    y = torch.tensor([0, 1])
    loss = balanced_softmax_cross_entropy(logits, y, torch.tensor([3.0, 1.0]), torch.ones(2))
    torch.testing.assert_close(loss, -(math.log(3 / 4) + math.log(1 / 4)) / 2 * torch.ones(()))


def test_rod_body_is_trained_by_the_balanced_loss_only() -> None:
    method = small(FedTPRoD)
    assert isinstance(method, FedTPRoD)
    clients = torch.tensor([1])
    params = {
        n: t[0].detach().clone().requires_grad_()
        for n, t in method.personalized_params(clients).items()
    }
    x, y = method.data.fetch(method.data.index["train"].lookup(clients, torch.arange(8)[None]))
    counts = torch.tensor([5.0, 0, 0, 3, 0, 0, 0, 0, 0, 0])
    context = {"class_counts": counts}
    w = torch.ones(8)
    total = method.rod_loss(params, context, x[0], y[0], w)
    grads = torch.autograd.grad(total, list(params.values()))
    generic, personal = method._logits(params, x[0], True)
    balanced = balanced_softmax_cross_entropy(generic, y[0], counts, w)
    body = [n for n in params if not n.startswith("rod_head")]
    expected = torch.autograd.grad(balanced, [params[n] for n in body])
    by_name = dict(zip(params, grads, strict=True))
    for n, g in zip(body, expected, strict=True):
        torch.testing.assert_close(by_name[n], g, msg=n)
    assert by_name["rod_head.weight"].abs().sum() > 0
    with torch.no_grad():
        torch.testing.assert_close(method.predict(params, x[0]), generic + personal)


def test_knn_interpolation_weights_on_a_hand_example() -> None:
    memory = torch.tensor([[1.0], [2.0], [10.0]])
    probs = knn_probabilities(
        torch.zeros(1, 1),
        memory,
        torch.tensor([0, 1, 0]),
        torch.ones(3, dtype=torch.bool),
        2,
        2,
        1.0,
    )
    near = torch.softmax(torch.tensor([-1.0, -4.0]), 0)  # squared distances 1 and 4
    torch.testing.assert_close(probs[0], near)
    mixed = interpolate_with_knn(torch.zeros(1, 2), probs, 0.25).exp()
    torch.testing.assert_close(mixed[0], 0.25 * near + 0.75 * torch.full((2,), 0.5))


@pytest.mark.parametrize("knn_weight", [0.0, 1.0])
def test_fedtp_knn_predicts_from_the_clients_own_memory(knn_weight: float) -> None:
    method = small(FedTPKNN, knn_weight=knn_weight, knn_k=1)
    clients = torch.tensor([0, 3])
    params = method.personalized_params(clients)
    counts = method.data.num_samples("train")[clients]
    assert params["knn.memory"].shape[:2] == (2, int(counts.max()))
    assert torch.equal(params["knn.mask"].sum(1), counts)
    index = method.data.index["train"].lookup(clients, torch.arange(5).expand(2, -1))
    x, y = method.data.fetch(index)
    out = vmap(method.predict)(params, x)
    if knn_weight == 1.0:  # a training sample's nearest neighbour is itself
        assert torch.equal(out.argmax(-1), y)
    else:
        logits = vmap(method.arch)(method.network_tensors(params), x)
        torch.testing.assert_close(out, torch.log_softmax(logits, -1))


def test_fedtp_knn_defaults_follow_the_reference_code() -> None:
    # lambda 0.6 on the kNN distribution, similarities exp(-d / D) with D the feature dimension
    method = small(FedTPKNN)
    clients = torch.tensor([1, 2])
    params = method.personalized_params(clients)
    index = method.data.index["train"].lookup(clients, torch.arange(4).expand(2, -1))
    x, _ = method.data.fetch(index)
    for c in range(2):
        one = {n: t[c] for n, t in params.items()}
        z = method.arch.features(method.network_tensors(one), x[c])
        memory = (one["knn.memory"], one["knn.labels"], one["knn.mask"])
        probs = knn_probabilities(z, *memory, method.hp.num_classes, 10, float(z.shape[-1]))
        expected = interpolate_with_knn(method.arch.classify(one, z), probs, 0.6)
        torch.testing.assert_close(method.predict(one, x[c]), expected)


@pytest.mark.parametrize("cls", [FedTP, FedTPRoD, VanillaPersonalizedT])
def test_vectorized_equals_sequential(cls: type[FederatedMethod]) -> None:
    assert_vectorized_equals_sequential(
        cls,
        rounds=2,
        net="vit",
        net_args={**SMALL_VIT, "dropout": 0.0, "emb_dropout": 0.0},
        local_epochs=None,
    )


# ----------------------------------------------------------------- noise feature imbalance
def test_noise_split_grows_with_the_client_index() -> None:
    from lightning_pfl.partition import IID

    clean = digits_data(5, partition=IID())
    noisy = digits_data(5, partition=IID(), noise_sigma=0.5)
    again = digits_data(5, partition=IID(), noise_sigma=0.5)
    spread = []
    for client in range(5):
        index = noisy.index["train"].lookup(torch.tensor([client]), torch.arange(40)[None])
        x0, y0 = clean.fetch(index)
        x1, y1 = noisy.fetch(index)
        assert torch.equal(y0, y1) and torch.equal(x1, again.fetch(index)[0])  # seeded
        torch.testing.assert_close(x1, noisy.fetch(index)[0])  # the same noise every fetch
        spread.append(float(((x1 - x0) * clean.std).std()))  # back to [0, 1] pixel units
    assert spread[0] == 0.0
    expected = [0.5 * i / 4 for i in range(1, 5)]
    for got, want in zip(spread[1:], expected, strict=True):
        assert abs(got - want) < 0.15 * want
    with pytest.raises(ConfigError, match="noise_sigma"):
        digits_data(5, noise_sigma=-1.0)


def test_attention_pictures_and_embedding_projection() -> None:
    method = small(FedTP)
    pictures = attention_pictures(method, torch.tensor([0, 4]), images=3)
    assert pictures.shape == (2, 3, 3, 8, 8)
    assert float(pictures.min()) >= 0 and float(pictures.max()) <= 1
    assert not torch.allclose(pictures[0], pictures[1])  # each client's own model and images
    points = embedding_projection(method.hnet.embeddings.weight)
    assert points.shape == (6, 2)
    torch.testing.assert_close(points.mean(0), torch.zeros(2), atol=1e-5, rtol=0)
    assert embedding_figure(points).axes


@pytest.mark.parametrize("cls", [Local, FedAvg, VanillaPersonalizedT])
def test_attention_pictures_of_the_other_t_methods(cls: type[FederatedMethod]) -> None:
    """Local-T, FedAvg-T and Vanilla Personalized-T have attention maps too (the paper's
    figures compare them with FedTP's)."""
    method = small(cls)
    method.run_round(0, torch.tensor([0, 2, 4]))  # Local and Vanilla-T: clients 0, 4 differ
    pictures = attention_pictures(method, torch.tensor([0, 4]), images=3)
    assert pictures.shape == (2, 3, 3, 8, 8)
    assert float(pictures.min()) >= 0 and float(pictures.max()) <= 1
    if cls is not FedAvg:  # each client's own model: different maps on the same images
        same = method.data.eval_blocks(torch.tensor([0]), "test", 3)
        x, _ = method.data.fetch(next(same)[0])
        params = method.personalized_params(torch.tensor([0, 4]))
        maps = []
        for c in range(2):
            net = build_network("vit", (1, 8, 8), 10, **SMALL_VIT).eval()
            assert isinstance(net, ViT)
            net.load_state_dict({n: t[c] for n, t in params.items()}, strict=False)
            maps.append(net.attention_rollout(x[0]))
        assert not torch.allclose(maps[0], maps[1])
    with pytest.raises(ConfigError, match="vit"):
        attention_pictures(build(Local, digits_data(4)), torch.tensor([0]))


@pytest.mark.parametrize("conf", ["fedtp_local_t", "fedtp_fedavg_t", "fedtp_vanilla_pt", "fedtp"])
def test_attention_maps_are_logged(conf: str, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = CONF / f"{conf}.yaml"
    cli(config, tmp_path, "--trainer.max_steps=2")
    logged = EventAccumulator(str(run_dir(tmp_path, config)), size_guidance={"images": 0})
    logged.Reload()
    for c in range(2):
        assert 2 in [e.step for e in logged.Images(f"attention_rollout/client_{c}")]
