"""MH-pFedHN: the model zoo, the multi-head hypernetwork and the three methods."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.func import vmap

from lightning_pfl.engine import (
    Architecture,
    cross_entropy_loss,
    derive_seed,
    weighted_cross_entropy,
)
from lightning_pfl.errors import ConfigError
from lightning_pfl.losses import distillation_loss
from lightning_pfl.methods.mh_pfedhn import HOLDS, MHPFedHN
from lightning_pfl.methods.mh_pfedhng import MHPFedHNG
from lightning_pfl.methods.mh_pfedhngd import MHPFedHNGD
from lightning_pfl.models import build_network
from lightning_pfl.models.multihead_hypernetwork import (
    FlatCodec,
    MultiHeadHyperNetwork,
    slots_needed,
)
from lightning_pfl.models.zoo import ZOO_NETWORKS
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_vectorized_equals_sequential,
    capture_local_training,
    cli,
)

ZOO = list(ZOO_NETWORKS)
ROOT = Path(__file__).parents[1]
PAPER_GD = "configs/mh_pfedhn/main_cifar100_50clients_noniid1_mh_pfedhngd.yaml"
SHAPES = [((1, 8, 8), 10), ((1, 28, 28), 62), ((3, 32, 32), 100), ((3, 64, 64), 200)]


@pytest.mark.parametrize("name", ZOO)
def test_zoo_networks_build_for_every_input_shape(name: str) -> None:
    for shape, classes in SHAPES:
        net = build_network(name, shape, classes)
        assert net(torch.randn(2, *shape)).shape == (2, classes)
        assert net(torch.randn(2, *shape), features_only=True).dim() == 2


@pytest.mark.parametrize("name", ZOO)
def test_zoo_networks_logits_depend_on_the_input_at_init(name: str) -> None:
    # With PyTorch's default layer init VGG-8's logits vary over inputs by ~1e-4 and
    # SqueezeNet's by ~1e-8 of the inputs' spread (a constant prediction); see he_init.
    for seed in range(3):
        torch.manual_seed(seed)
        net = build_network(name, (3, 32, 32), 10)
        with torch.no_grad():
            spread = net(torch.randn(128, 3, 32, 32)).std(0).mean()
        assert spread > 1e-3, (name, seed, float(spread))


def test_zoo_sizes_follow_the_paper_on_cifar100() -> None:
    # LeNet-style: conv 3->16, conv 16->32, fc 2048->108->64->100
    cnn = build_network("zoo_cnn", (3, 32, 32), 100)
    assert cnn.fc1.in_features == 2048  # type: ignore[union-attr]
    vgg = build_network("vgg8", (3, 32, 32), 100)
    assert vgg.fc1.in_features == 1024  # type: ignore[union-attr]
    mlp = build_network("zoo_mlp", (3, 32, 32), 100)
    assert sum(p.numel() for p in mlp.parameters()) == 3072 * 128 + 128 + 128 * 64 + 64 + 6500


# Appendix Table 19: residual blocks per stage of 16, 32 and 64 channels
TABLE_19 = {"resnet10": (3, 3, 4), "resnet12": (1, 5, 6), "resnet18": (6, 6, 6)}


@pytest.mark.parametrize("name", list(TABLE_19))
def test_resnets_have_table_19s_blocks_and_channel_plan(name: str) -> None:
    net = build_network(name, (3, 32, 32), 100)
    stem = net.stem
    assert isinstance(stem, torch.nn.Conv2d)
    assert (stem.out_channels, stem.kernel_size, stem.stride) == (16, (3, 3), (1, 1))
    blocks: list[Any] = list(net.layers)  # type: ignore[arg-type]
    widths = [block.conv2.out_channels for block in blocks]
    stages = [widths.count(w) for w in (16, 32, 64)]
    assert tuple(stages) == TABLE_19[name] and len(widths) == sum(stages)
    assert widths == sorted(widths)  # stage after stage
    for block in blocks:  # basic blocks: two 3x3 convs
        assert block.conv1.kernel_size == block.conv2.kernel_size == (3, 3)
    seen: list[torch.Size] = []
    blocks[-1].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    assert seen == [torch.Size([2, 64, 8, 8])]  # the 8x8 map the average pool reduces
    assert net.fc.in_features == 64  # type: ignore[union-attr]


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


def test_batch_statistics_are_each_batch_norms_batch_mean_and_unbiased_variance() -> None:
    torch.manual_seed(0)
    net = build_network("resnet10", (1, 8, 8), 10, widths=(4, 4, 8), blocks=(1, 1, 1))
    arch = Architecture(copy.deepcopy(net))
    x = torch.randn(12, 1, 8, 8)
    for module in net.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.momentum = 1.0  # running statistics := this batch's
    net.train()(x)
    expected = dict(net.named_buffers())
    state = arch.initial_state()  # the buffers' values must not matter
    state = {n: t + 5.0 if n in arch.buffer_shapes else t for n, t in state.items()}
    got = arch.batch_statistics(state, x)
    norms = sum(isinstance(m, torch.nn.BatchNorm2d) for m in net.modules())
    assert set(got) == set(arch.buffer_shapes) and len(got) == 2 * norms
    for n, value in got.items():
        torch.testing.assert_close(value, expected[n], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- multi-head hypernetwork
def test_slots_and_head_sharing() -> None:
    counts = [5000, 3072, 6144, 3073, 100]  # tau = 2, 1, 2, 2, 1
    hnet = MultiHeadHyperNetwork(counts, output_size=3072, hidden_dim=16)
    assert hnet.tau == [2, 1, 2, 2, 1]
    assert [slots_needed(k, 3072) for k in (1, 3072, 3073)] == [1, 1, 2]
    assert hnet.embeddings.shape == (8, 64)
    for row, count in enumerate(counts):
        assert hnet([row]).shape == (1, count)  # exactly K values
    assert hnet.head_keys() == ["tau1", "tau2"]
    assert hnet.head_of == ["tau2", "tau1", "tau2", "tau2", "tau1"]
    assert hnet.heads["tau2_weight"].shape == (2, 3072, 16)
    # equal tau share a head, different tau do not: row 0's output reads tau2 only
    out = hnet([0]).sum()
    grads = torch.autograd.grad(out, list(hnet.heads.values()), allow_unused=True)
    by_name = dict(zip(hnet.heads.keys(), grads, strict=True))
    assert by_name["tau2_weight"] is not None and by_name["tau1_weight"] is None
    # rows 0 and 2 (both tau 2) read the same head weights with their own embeddings
    e0 = torch.autograd.grad(hnet([0]).sum(), hnet.embeddings)[0]
    assert e0[:2].abs().sum() > 0 and e0[2:].abs().sum() == 0
    with pytest.raises(ValueError, match="one parameter count"):
        hnet([0, 2])


def test_head_sharing_options() -> None:
    counts = [10, 10, 30]  # N = 8: tau = 2, 2, 4
    per_client = MultiHeadHyperNetwork(counts, output_size=8, hidden_dim=4, sharing="client")
    assert per_client.head_keys() == ["row0", "row1", "row2"]
    assert per_client([0, 1]).shape == (2, 10)
    single = MultiHeadHyperNetwork(counts, output_size=8, hidden_dim=4, sharing="none")
    assert single.head_keys() == ["shared"] and single.heads["shared_weight"].shape == (1, 8, 4)
    assert single([2]).shape == (1, 30)


def test_standardized_heads_and_codec_roundtrip() -> None:
    torch.manual_seed(0)
    net = build_network("resnet10", (1, 8, 8), 10, widths=(4, 4, 8), blocks=(1, 1, 1))
    arch = Architecture(net)
    codec = FlatCodec(arch.initial_params())
    assert codec.count == sum(p.numel() for p in net.parameters())
    codec = FlatCodec(arch.initial_params(), standardized=True)
    hnet = MultiHeadHyperNetwork([codec.count], output_size=512, hidden_dim=16, standardize=True)
    flat = hnet([0]).detach()
    assert abs(float(flat.mean())) < 0.2 and abs(float(flat.std()) - 1) < 0.2
    params = codec.to_params(flat)
    assert list(params) == list(arch.shapes)  # the client's fixed parameter order
    for name, shape in arch.shapes.items():
        assert params[name].shape == (1, *shape)
    torch.testing.assert_close(codec.to_flat(params), flat, rtol=1e-4, atol=1e-5)
    # each tensor starts at its own initialization scale
    init = arch.initial_params()
    ratio = params["layers.1.conv1.weight"].std() / init["layers.1.conv1.weight"].std()
    assert 0.7 < float(ratio) < 1.4
    raw = FlatCodec(init, standardized=False)
    torch.testing.assert_close(raw.to_params(flat)["fc.bias"][0], flat[0, -10:])


# ---------------------------------------------------------------- methods
TINY = {
    "cnn": {"net": "zoo_cnn", "net_args": {"channels": (4, 8), "hidden": (16, 16)}},
    "mlp": {"net": "zoo_mlp", "net_args": {"hidden": (32, 16)}},
    "res": {"net": "resnet10", "net_args": {"widths": (4, 4, 8), "blocks": (1, 1, 1)}},
}
SMALL: dict[str, Any] = {"output_size": 1024, "hidden_dim": 32, "local_epochs": 1, "batch_size": 16}


def build_mh(cls: type[MHPFedHN] = MHPFedHN, num_clients: int = 6, **kwargs: Any) -> MHPFedHN:
    dm = digits_data(num_clients)
    method = build(cls, dm, **{"architectures": TINY, **SMALL, **kwargs})
    assert isinstance(method, MHPFedHN)
    method.configure_optimizers()
    return method


def test_architectures_are_assigned_evenly_and_counts_are_all_the_server_gets() -> None:
    method = build_mh(num_clients=6)
    assert sorted(len(ids) for ids in method.client_groups().values()) == [2, 2, 2]
    assert set(method.client_groups()) == {"arch_cnn", "arch_mlp", "arch_res"}
    kinds = [method.zoo.names[g] for g in method.zoo.group_of.tolist()]
    assert method.hnet.counts == [method.codecs[k].count for k in kinds]
    # the server's modules are the MLP and nothing of a client network
    server_modules = {type(m).__name__ for m in method.hnet.modules()}
    assert server_modules == {
        "MultiHeadHyperNetwork",
        "Sequential",
        "Linear",
        "ReLU",
        "ParameterDict",
    }
    seen: list[Any] = []
    generate, update = method.hnet.forward, method.server_gradients

    def spy_generate(rows: Any) -> torch.Tensor:
        seen.append(("rows", rows))
        return generate(rows)

    def spy_update(generated: Any, deltas: Any, weights: Any) -> None:
        seen.append(("update", generated, deltas, weights))
        update(generated, deltas, weights)

    method.hnet.forward = spy_generate  # type: ignore[method-assign]
    method.server_gradients = spy_update  # type: ignore[method-assign]
    method.run_round(0, torch.tensor([0, 2, 3, 5]))
    rows = [s[1] for s in seen if s[0] == "rows"]
    assert all(isinstance(r, list) and all(isinstance(i, int) for i in r) for r in rows)
    updates = [s for s in seen if s[0] == "update"]
    assert len(updates) == 4  # hn_update: sequential, one per client
    for _, generated, deltas, _ in updates:
        for g, d in zip(generated, deltas, strict=True):
            assert isinstance(g, torch.Tensor) and g.dim() == 2 and g.shape == d.shape
            assert g.shape[1] in method.hnet.counts


def test_server_gradient_is_the_gradient_of_the_surrogate() -> None:
    method = build_mh(hn_max_grad_norm=None, hn_update="mean")
    before = copy.deepcopy(method.hnet)
    trained = capture_local_training(method)
    clients = torch.tensor([0, 1, 3, 4])
    method.run_round(0, clients)
    surrogate = torch.zeros(())
    for (kind, rows), result in zip(method.zoo.split(clients), trained, strict=True):
        codec = method.codecs[kind]
        flat = before(clients[rows].tolist())
        delta = flat.detach() - codec.to_flat(result.params)
        surrogate = surrogate + (flat * delta).sum() / len(clients)  # weights 1/C
    expected = torch.autograd.grad(surrogate, list(before.parameters()), allow_unused=True)
    for (name, p), g in zip(method.hnet.named_parameters(), expected, strict=True):
        if g is None:
            assert p.grad is None, name  # heads of absent sizes get no gradient
        else:
            torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-7, msg=name)
    assert method.hnet.embeddings.grad is not None
    touched = method.hnet.embeddings.grad.abs().sum(1) > 0
    slots = [
        s
        for c in clients.tolist()
        for s in range(method.hnet.slot_start[c], method.hnet.slot_start[c] + method.hnet.tau[c])
    ]
    assert touched.nonzero()[:, 0].tolist() == sorted(slots)


def drawn_order(seed: int, round_idx: int, count: int) -> list[int]:
    """The order of a round's per-client server steps: a permutation seeded by (seed, round,
    stream 14), positions among the round's clients."""
    generator = torch.Generator().manual_seed(derive_seed(seed, round_idx, 14))
    return torch.randperm(count, generator=generator).tolist()


def steps_by_hand(
    method: MHPFedHN,
    before: MultiHeadHyperNetwork,
    clients: torch.Tensor,
    seen: list[tuple[Any, ...]],
    order: list[int],
    regenerate: bool,
) -> MultiHeadHyperNetwork:
    """The server loop written out: for each client in ``order``, g_i generated from phi as the
    previous step left it (``regenerate``, the authors' code) or at the round's start, its
    gradient (d g_i / d(phi, v))^T (g_i - g~_i) clipped to ``hn_max_grad_norm``, one Adam step.
    Checks on the way that each client received that g_i. A client is generated in the batch
    of clients it trained with (``seen``: ``spy_client_updates``), as rounding then agrees."""
    received, trained, batch = {}, {}, {}
    for members, flat, _, params in seen:
        kind = method.zoo.names[int(method.zoo.group_of[int(members[0])])]
        for r, client in enumerate(members.tolist()):
            received[client] = flat[r : r + 1]
            trained[client] = method.codecs[kind].to_flat(params)[r : r + 1].detach()
            batch[client] = (members.tolist(), r)
    start, ref = copy.deepcopy(before), copy.deepcopy(before)
    adam = torch.optim.Adam(ref.parameters(), lr=method.hp.hn_lr)
    for position in order:
        client = int(clients[position])
        source = ref if regenerate else start
        members, r = batch[client]
        g = source(members)[r : r + 1]
        torch.testing.assert_close(received[client], g.detach(), rtol=0, atol=0)
        delta = g.detach() - trained[client]
        grads = torch.autograd.grad((g * delta).sum(), list(source.parameters()), allow_unused=True)
        for p, grad in zip(ref.parameters(), grads, strict=True):
            p.grad = grad
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), method.hp.hn_max_grad_norm)
        adam.step()
        adam.zero_grad()
    return ref


@pytest.mark.parametrize("update", ["sequential", "per_client"])
def test_per_client_updates_step_once_per_client_in_the_drawn_order(update: str) -> None:
    # a clip small enough to bind at every step: clipping is per step, not of a sum
    option: dict[str, Any] = {} if update == "sequential" else {"hn_update": update}
    method = build_mh(hn_lr=1e-2, hn_max_grad_norm=1e-2, **option)
    assert method.hp.hn_update == update  # sequential, the authors' code, is the default
    clients, round_idx = torch.tensor([0, 1, 2, 3, 5]), 3
    order = drawn_order(method.hp.seed, round_idx, len(clients))
    assert order != sorted(order) and order != drawn_order(method.hp.seed, 4, len(clients))
    before = copy.deepcopy(method.hnet)
    seen = spy_client_updates(method)
    assert method.server_optimizer is not None
    steps: list[int] = []
    step = method.server_optimizer.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(len(seen))
        return step(*args, **kwargs)

    setattr(method.server_optimizer, "step", counted)  # noqa: B010
    method.run_round(round_idx, clients)
    if update == "sequential":  # one client at a time, in the drawn order, a step after each
        assert [s[0].tolist() for s in seen] == [[int(clients[p])] for p in order]
        assert steps == [1, 2, 3, 4]
    else:  # one vmapped group per architecture, then the steps
        assert len(seen) == len(list(method.zoo.split(clients))) and steps == [3] * 4
    method.server_optimizer.step()  # the last client's step, which the base class takes
    expected = steps_by_hand(method, before, clients, seen, order, update == "sequential")
    for (name, p), q in zip(method.hnet.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)


def test_sparsified_upload_keeps_the_largest_entries_and_counts_fewer_bytes() -> None:
    method = build_mh(upload_fraction=0.3)
    delta = torch.tensor([[0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 0.05, 1.0, -0.01, 0.02]])
    kept = method.sparsify(delta)
    assert kept.tolist() == [[0.0, -5.0, 0.0, 3.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]
    dense = build_mh()
    for m in (method, dense):
        m.run_round(0, torch.tensor([0, 1]))
    assert method.record.round_bytes[1] < 0.7 * dense.record.round_bytes[1]
    assert method.record.round_bytes[0] == dense.record.round_bytes[0]


@pytest.mark.parametrize("teacher", ["received", "trained"])
def test_gd_trains_the_global_model_first_then_personal_models_with_it_as_teacher(
    teacher: str,
) -> None:
    options: dict[str, Any] = {} if teacher == "received" else {"distill_teacher": teacher}
    options["hn_update"] = "mean"  # one vmapped group per architecture
    method = build_mh(MHPFedHNGD, distill_temperature=2.0, distill_weight=0.5, **options)
    assert isinstance(method, MHPFedHNGD)
    received = method.global_codec.to_params(method.hnet([method.hp.num_clients]).detach())
    assert method.global_codec.count == min(c.count for c in method.codecs.values())
    assert method.hnet.counts[-1] == method.global_codec.count  # the global row
    calls: list[tuple[Any, Any, Any]] = []
    original = method.local_train

    def spy(params: Any, clients: Any, round_idx: int, **kwargs: Any) -> Any:
        result = original(params, clients, round_idx, **kwargs)
        calls.append((kwargs["arch"], kwargs.get("context"), result))
        return result

    setattr(method, "local_train", spy)  # noqa: B010
    steps: list[int] = []
    assert method.server_optimizer is not None
    step = method.server_optimizer.step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        steps.append(len(calls))
        return step(*args, **kwargs)

    setattr(method.server_optimizer, "step", counted_step)  # noqa: B010
    clients = torch.tensor([0, 2, 3, 5])
    method.run_round(0, clients)
    assert calls[0][0] is method.global_arch and calls[0][1] is None
    assert steps == [1]  # the server's global update comes before any personal training
    global_trained = calls[0][2].params
    kinds = [kind for kind, _ in method.zoo.split(clients)]
    assert [c[0] for c in calls[1:]] == [method.zoo.archs[k] for k in kinds]
    for (_, rows), (_, context, _) in zip(method.zoo.split(clients), calls[1:], strict=True):
        for name, tensor in global_trained.items():
            if teacher == "trained":  # each client's copy after its global training
                torch.testing.assert_close(context[f"teacher.{name}"], tensor[rows])
        for name, value in received.items():
            if teacher == "received":  # the global model as generated before the round's steps
                want = value.expand(len(rows), *value.shape[1:])
                torch.testing.assert_close(context[f"teacher.{name}"], want)
                assert not torch.equal(context[f"teacher.{name}"], global_trained[name][rows])
    plain = build_mh(MHPFedHNG)
    assert isinstance(plain, MHPFedHNG)
    assert not plain.distills() and plain.personal_loss("cnn") is plain.losses["cnn"]


def test_distillation_loss_on_a_hand_example() -> None:
    # teacher p = (3/4, 1/4), student p = (1/2, 1/2) at T = 1:
    # KL = 3/4 ln(3/2) + 1/4 ln(1/2)
    student = torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[math.log(3.0), 0.0]])
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    value = distillation_loss(student, teacher, 1.0, torch.ones(1))
    torch.testing.assert_close(value, torch.tensor(kl))
    # T = 2 on logits doubled is the same distributions, times T^2 = 4
    value = distillation_loss(2 * student, 2 * teacher, 2.0, torch.ones(1))
    torch.testing.assert_close(value, torch.tensor(4 * kl))


@pytest.mark.parametrize("t_squared", [False, True])
def test_gd_personal_loss_mixes_cross_entropy_and_distillation(t_squared: bool) -> None:
    # the paper: (1 - lambda) CE + lambda KL; distill_t_squared: lambda T^2 KL (Hinton et al.)
    options = {"distill_t_squared": True} if t_squared else {}
    method = build_mh(MHPFedHNGD, distill_temperature=3.0, distill_weight=0.25, **options)
    assert isinstance(method, MHPFedHNGD)
    kind = "cnn"
    arch = method.zoo.archs[kind]
    student = arch.initial_params()
    torch.manual_seed(1)
    teacher = {n: torch.randn_like(t) * 0.3 for n, t in method.global_arch.initial_params().items()}
    x, y, w = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4]), torch.ones(5)
    w[-1] = 0.0
    context = {f"teacher.{n}": t for n, t in teacher.items()}
    value = method.distill_losses[kind](student, context, x, y, w)
    logits, target = arch(student, x, train=True), method.global_arch(teacher, x)
    ce = F.cross_entropy(logits[:4], y[:4])
    p_t = F.softmax(target[:4] / 3, -1)
    kl = (p_t * (p_t.log() - F.log_softmax(logits[:4] / 3, -1))).sum(-1).mean()
    torch.testing.assert_close(value, 0.75 * ce + 0.25 * (9 if t_squared else 1) * kl)


@pytest.mark.parametrize(
    ("cls", "update"),
    [(MHPFedHN, "sequential"), (MHPFedHNGD, "sequential"), (MHPFedHN, "per_client")],
)
def test_vectorized_equals_sequential(cls: type[MHPFedHN], update: str) -> None:
    assert_vectorized_equals_sequential(
        cls,
        rounds=2,
        num_clients=6,
        architectures=TINY,
        # hn_lr 1e-3, as below: at 1e-2 Adam's steps of sign(rounding) at near-zero gradient
        # entries moved embeddings by up to 5e-3 between vmap and the loop on an AMD EPYC
        # (2026-12-02; within tolerance on the Intel Xeon before)
        **{**SMALL, "hn_lr": 1e-3, "hn_update": update},
    )


def test_per_architecture_accuracy_is_logged(tmp_path: Path) -> None:
    result = cli(CONF / "mh_pfedhn.yaml", tmp_path, "--trainer.max_steps=2")
    for name in ("cnn", "mlp", "resnet"):
        assert f"arch_{name}/acc" in result["test_at_best_val"]
    assert set(result["client_parameters"]) == {"cnn", "mlp", "resnet"}


def test_evaluation_re_estimates_batch_norm_statistics_on_each_clients_own_data() -> None:
    # one batch covers a client's training data, so the statistics are that data's exactly
    method = build_mh(num_clients=6, batch_size=1000)
    method.run_round(0, torch.tensor([0, 1, 2, 3, 4, 5]))  # the store's statistics move
    clients = method.client_groups()["arch_res"]
    stored = method.store.gather("buffers.res", method.zoo.row_of[clients], method.device)
    arch, codec = method.zoo.archs["res"], method.codecs["res"]
    generated = codec.to_params(method.hnet(clients.tolist()).detach())
    got = method.personalized_params(clients)
    sizes = [len(method.data._parts["train"][client]) for client in clients.tolist()]
    for c, client in enumerate(clients.tolist()):
        x, _ = method.data.fetch(method.data._parts["train"][client])
        one = {n: t[c] for n, t in generated.items()}
        zeros = {n: torch.zeros(shape) for n, shape in arch.buffer_shapes.items()}
        expected = arch.batch_statistics(one | zeros, x)
        alone = method.personalized_params(clients[c : c + 1])
        # together, a smaller client's batch is padded with repeats of its own samples
        together = sizes[c] == max(sizes)
        for n, value in expected.items():
            torch.testing.assert_close(alone[f"res/{n}"][0], value, rtol=1e-4, atol=1e-5)
            if together:
                torch.testing.assert_close(got[f"res/{n}"][c], value, rtol=1e-4, atol=1e-5)
    # evaluation stores nothing; without recalibration the client's stored statistics are used
    after = method.store.gather("buffers.res", method.zoo.row_of[clients], method.device)
    assert all(torch.equal(stored[n], after[n]) for n in stored)
    assert not torch.allclose(got["res/bn.running_var"], stored["bn.running_var"])
    method.hparams.recalibrate_batch_norm = False
    kept = method.personalized_params(clients)
    assert all(torch.equal(kept[f"res/{n}"], stored[n]) for n in stored)


# ---------------------------------------------------------------- Tables 13-15
def spy_client_updates(method: MHPFedHN) -> list[tuple[Any, ...]]:
    """Record (clients, flat, delta, trained) of every ``client_update`` of ``method``."""
    seen: list[tuple[Any, ...]] = []
    original = method.client_update

    def spy(codec: Any, arch: Any, clients: Any, flat: Any, *args: Any, **kwargs: Any) -> Any:
        delta, trained, loss = original(codec, arch, clients, flat, *args, **kwargs)
        seen.append((clients, flat, delta, trained))
        return delta, trained, loss

    method.client_update = spy  # type: ignore[method-assign]
    return seen


def test_frozen_clients_keep_their_last_layers_at_the_generated_values() -> None:
    # hn_update mean: the clients of an architecture train in one vmapped group
    options: dict[str, Any] = {"hn_max_grad_norm": None, "local_weight_decay": 0.01}
    options["hn_update"] = "mean"
    plain = build_mh(**options)
    cnn = plain.zoo.members("cnn").tolist()
    method = build_mh(frozen_clients=[cnn[0]], frozen_layers=2, **options)
    names = ("fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias")  # Table 14: the last layers
    assert (
        method.fixed_names["cnn"] == names
        and method.constrained.nonzero()[:, 0].tolist() == cnn[:1]
    )
    clients = torch.tensor(sorted([*cnn, *plain.zoo.members("mlp").tolist()]))
    seen, reference = spy_client_updates(method), spy_client_updates(plain)
    method.run_round(0, clients)
    plain.run_round(0, clients)
    kinds = [kind for kind, _ in method.zoo.split(clients)]
    (members, flat, delta, trained), (_, _, plain_delta, plain_trained) = [
        (s, r) for kind, s, r in zip(kinds, seen, reference, strict=True) if kind == "cnn"
    ][0]
    assert members.tolist() == cnn  # the frozen and the free client train in one vmapped group
    codec = method.codecs["cnn"]
    generated = codec.to_params(flat)
    entries = torch.cat(
        [torch.full((k,), n in names) for n, k in zip(codec.names, codec.sizes, strict=True)]
    )
    for n in names:  # frozen: exactly the generated values, delta exactly 0
        assert torch.equal(trained[n][0], generated[n][0]), n
    assert torch.equal(delta[0, entries], torch.zeros(int(entries.sum())))
    assert (delta[0, ~entries] != 0).any() and (delta[1, entries] != 0).any()
    for n in codec.names:  # the free client trains exactly as without frozen clients
        torch.testing.assert_close(trained[n][1], plain_trained[n][1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(delta[1], plain_delta[1], rtol=1e-5, atol=1e-7)
    # the frozen client's other tensors: as if its last layers were not trainable at all
    arch = method.zoo.archs["cnn"]
    position = torch.tensor([clients.tolist().index(cnn[0])])
    alone = method.local_train(
        {n: generated[n][:1] for n in codec.names if n not in names},
        torch.tensor(cnn[:1]),
        0,
        loss_fn=cross_entropy_loss(arch),
        context={n: generated[n][:1] for n in names},
        batches=method.draw_batches(clients, 0).select(position),
        arch=arch,
    )
    for n, t in alone.params.items():
        torch.testing.assert_close(trained[n][:1], t, rtol=1e-4, atol=1e-6, msg=n)


def test_a_registry_global_net_gets_its_own_size_and_trains_in_a_round() -> None:
    method = build_mh(MHPFedHNG, global_net="zoo_mlp", global_net_args={"hidden": (8, 8)})
    assert isinstance(method, MHPFedHNG)
    count = sum(
        p.numel() for p in build_network("zoo_mlp", (1, 8, 8), 10, hidden=(8, 8)).parameters()
    )
    assert method.global_codec.count == count
    assert count not in [c.count for c in method.codecs.values()]
    assert method.hnet.counts[-1] == count
    before = method.hnet([method.hp.num_clients]).detach()
    method.run_round(0, torch.tensor([0, 3]))
    assert not torch.equal(method.hnet([method.hp.num_clients]).detach(), before)


def test_frozen_and_global_client_options_are_seeded_and_validated() -> None:
    a, b = build_mh(MHPFedHNG, frozen_clients=0.5, global_clients=0.5), build_mh(frozen_clients=0.5)
    assert isinstance(a, MHPFedHNG)
    assert int(a.constrained.sum()) == 3 and torch.equal(a.constrained, b.constrained)
    assert int(a.holds_global.sum()) == 3 and not torch.equal(a.constrained, a.holds_global)
    assert a.results()["global_clients"] == a.holds_global.nonzero()[:, 0].tolist()
    assert not build_mh().any_constrained and build_mh(MHPFedHNG).holds_global.all()
    bad: list[tuple[dict[str, Any], str]] = [
        ({"frozen_clients": 1.5}, "model.init_args.frozen_clients"),
        ({"frozen_clients": [0, 6]}, "model.init_args.frozen_clients"),
        ({"frozen_clients": [1, 1]}, "model.init_args.frozen_clients"),
        ({"frozen_clients": [-1]}, "model.init_args.frozen_clients"),
        ({"frozen_layers": 5}, "model.init_args.frozen_layers"),  # the MLP has 3 layers
        ({"frozen_layers": 0}, "model.init_args.frozen_layers"),
        ({"global_clients": 0.0}, "model.init_args.global_clients"),
        ({"global_clients": 0.05}, "model.init_args.global_clients"),  # 0 of 6 clients
        ({"global_clients": []}, "model.init_args.global_clients"),
        ({"global_clients": [6]}, "model.init_args.global_clients"),
        ({"global_net": "res", "global_net_args": {}}, "model.init_args.global_net_args"),
    ]
    for options, key in bad:
        with pytest.raises(ConfigError, match=key):
            build_mh(MHPFedHNG, **options)


@pytest.mark.parametrize("update", ["mean", "sequential"])
def test_only_holders_train_the_global_model_and_set_its_gradient(update: str) -> None:
    method = build_mh(
        MHPFedHNGD,
        global_clients=[0, 2],
        hn_max_grad_norm=None,
        distill_teacher="trained",
        hn_update=update,
    )
    before = copy.deepcopy(method.hnet)
    calls: list[tuple[Any, ...]] = []
    original = method.local_train

    def spy(params: Any, clients: Any, round_idx: int, **kwargs: Any) -> Any:
        result = original(params, clients, round_idx, **kwargs)
        calls.append((clients, kwargs.get("context"), result))
        return result

    setattr(method, "local_train", spy)  # noqa: B010
    grads: list[list[Any]] = []
    assert method.server_optimizer is not None
    step = method.server_optimizer.step

    def snapshot(*args: Any, **kwargs: Any) -> Any:
        grads.append([None if p.grad is None else p.grad.clone() for p in method.hnet.parameters()])
        return step(*args, **kwargs)

    setattr(method.server_optimizer, "step", snapshot)  # noqa: B010
    clients = torch.tensor([0, 1, 2, 3])
    method.run_round(0, clients)
    holders, _, global_result = calls[0]
    # the global step, then (sequential) every personal step but the last (training_step's)
    assert holders.tolist() == [0, 2] and len(grads) == (1 if update == "mean" else len(clients))
    # the global step: autograd of the holders' sample-weighted surrogate, nothing of the others
    flat = before([method.hp.num_clients])
    deltas = flat.detach() - method.global_codec.to_flat(global_result.params)
    weights = method.client_weights(holders)
    surrogate = (flat * (weights[:, None] * deltas).sum(0, keepdim=True)).sum()
    expected = torch.autograd.grad(surrogate, list(before.parameters()), allow_unused=True)
    for got, want in zip(grads[0], expected, strict=True):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    # personal training: holders distil from their own trained copy, the others get no teacher
    position = {0: 0, 2: 1}
    for members, context, _ in calls[1:]:
        assert context[HOLDS].tolist() == [c in position for c in members.tolist()]
        for i, c in enumerate(members.tolist()):
            for name, tensor in global_result.params.items():
                teacher = context[f"teacher.{name}"][i]
                if c in position:
                    assert torch.equal(teacher, tensor[position[c]])
                else:
                    assert not teacher.any()


def test_clients_without_the_global_model_use_plain_cross_entropy() -> None:
    method = build_mh(MHPFedHNGD, global_clients=[0], distill_temperature=3.0, distill_weight=0.25)
    assert isinstance(method, MHPFedHNGD)
    arch = method.zoo.archs["cnn"]
    student = {n: t.requires_grad_() for n, t in arch.initial_params().items()}
    torch.manual_seed(1)
    teacher = {n: torch.randn_like(t) for n, t in method.global_arch.initial_params().items()}
    x, y, w = torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4]), torch.ones(5)
    w[-1] = 0.0
    context = {f"teacher.{n}": t for n, t in teacher.items()}
    loss = method.distill_losses["cnn"]
    without = loss(student, {**context, HOLDS: torch.tensor(False)}, x, y, w)
    ce = weighted_cross_entropy(arch(student, x, train=True), y, w)
    assert isinstance(without, torch.Tensor) and torch.equal(without, ce)
    for g, h in zip(
        torch.autograd.grad(without, list(student.values())),
        torch.autograd.grad(ce, list(student.values())),
        strict=True,
    ):
        assert torch.equal(g, h)
    holding = loss(student, {**context, HOLDS: torch.tensor(True)}, x, y, w)
    torch.testing.assert_close(holding, loss(student, context, x, y, w))  # (1 - lambda) CE + ...


def test_a_round_without_holders_takes_no_global_step() -> None:
    method = build_mh(MHPFedHNG, global_clients=[0], hn_update="mean")
    row = method.hp.num_clients  # the global model's row
    start, tau = method.hnet.slot_start[row], method.hnet.tau[row]
    v_g = method.hnet.embeddings[start : start + tau].detach().clone()
    calls = capture_local_training(method)
    steps: list[int] = []
    assert method.server_optimizer is not None
    step = method.server_optimizer.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return step(*args, **kwargs)

    setattr(method.server_optimizer, "step", counted)  # noqa: B010
    clients = torch.tensor([1, 2, 3])
    method.run_round(0, clients)
    assert not steps and len(calls) == len(list(method.zoo.split(clients)))  # personal only
    assert torch.equal(method.hnet.embeddings[start : start + tau], v_g)
    no_global = method.record.round_bytes[0]
    method.run_round(1, torch.tensor([0, 2, 3]))  # client 0 holds it: the global flat goes down
    assert len(steps) == 1 and method.record.round_bytes[0] > no_global


def test_vectorized_equals_sequential_with_frozen_clients_and_local_layers() -> None:
    assert_vectorized_equals_sequential(
        MHPFedHN,
        rounds=2,
        num_clients=6,
        architectures=TINY,
        # Adam turns float-rounding differences of near-zero gradients into steps of up to hn_lr:
        # 1e-3 keeps them inside the helper's tolerance with one or two threads (1e-2 not with one).
        **{**SMALL, "hn_lr": 1e-3, "frozen_clients": 0.5, "frozen_layers": 1, "local_layers": 1},
    )


def sent_and_kept(vectorize: bool, **options: Any) -> tuple[list[torch.Tensor], Any]:
    """Both server gradients of one MH-pFedHNGD round and the clients' store afterwards."""
    method = build_mh(MHPFedHNGD, vectorize=vectorize, hn_max_grad_norm=None, **options)
    grads: list[torch.Tensor] = []
    assert method.server_optimizer is not None
    step = method.server_optimizer.step

    def snapshot(*args: Any, **kwargs: Any) -> Any:
        grads.extend(p.grad.clone() for p in method.hnet.parameters() if p.grad is not None)
        return step(*args, **kwargs)

    setattr(method.server_optimizer, "step", snapshot)  # noqa: B010
    method.run_round(0, torch.tensor([0, 1, 2, 4, 5]))
    grads.extend(p.grad for p in method.hnet.parameters() if p.grad is not None)
    return grads, method.store.state_dict()


def test_vectorized_equals_sequential_with_a_partial_global_model() -> None:
    # Compared on what the clients send (both server gradients of a round) and keep (batch-norm
    # state), not after several Adam steps: Adam turns float noise in a near-zero gradient entry
    # into a full step of its sign, so multi-round parameters differ by up to lr at such entries.
    options: dict[str, Any] = {"frozen_clients": [1, 4], "global_clients": [0, 1, 4]}
    (fast, fast_store), (slow, slow_store) = (sent_and_kept(v, **options) for v in (True, False))
    assert len(fast) == len(slow) > 0
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for field, tensors in fast_store.items():
        for name, tensor in tensors.items():
            torch.testing.assert_close(tensor, slow_store[field][name], rtol=1e-4, atol=1e-6)


def test_extreme_personalization_gives_every_client_its_own_architecture(tmp_path: Path) -> None:
    result = cli(CONF / "mh_pfedhn_extreme.yaml", tmp_path, "--trainer.max_steps=2")
    counts = result["client_parameters"]
    assert len(counts) == 6 and len(set(counts.values())) == 6
    assert set(result["architecture_clients"].values()) == {1}
    assert len(result["slots"]) == 6


def test_the_shipped_extreme_personalization_config_gives_50_distinct_architectures() -> None:
    config = yaml.safe_load(
        (
            ROOT / "configs/mh_pfedhn/extra_cifar100_50clients_every_client_own_architecture.yaml"
        ).read_text()
    )
    small_hn = {"hidden_dim": 1, "n_layers": 1}  # about counts and heads, not the HN's size
    method = MHPFedHN(
        num_clients=50,
        num_classes=100,
        input_shape=(3, 32, 32),
        **(config["model"]["init_args"] | small_hn),
    )
    assert len(method.zoo.names) == 50
    assert sorted(method.zoo.group_of.tolist()) == list(range(50))  # one client per architecture
    assert len(set(method.hnet.counts)) == 50  # 50 distinct parameter counts
    assert len(method.hnet.head_keys()) > 1  # clients share heads only through equal tau


# ---------------------------------------------------------------- paper defaults (issue 43)
def test_the_paper_parametrization_is_the_default() -> None:
    # theta = g: the generated flat vector is the model, heads keep PyTorch's default init
    method = build_mh()
    assert method.hp.parametrization == "raw"
    for kind, codec in method.codecs.items():
        assert torch.equal(codec.mean, torch.zeros(codec.count)), kind
        assert torch.equal(codec.scale, torch.ones(codec.count)), kind
    members = method.zoo.members("cnn").tolist()
    flat = method.hnet(members).detach()
    params = method.codecs["cnn"].to_params(flat)
    torch.testing.assert_close(params["fc3.bias"], flat[:, -10:])
    bound = 1 / math.sqrt(SMALL["hidden_dim"])  # nn.Linear's default init, not rescaled
    assert all(float(p.detach().abs().max()) <= bound for p in method.hnet.heads.values())
    standardized = build_mh(parametrization="standardized")
    assert not torch.equal(standardized.codecs["cnn"].scale, torch.ones(method.codecs["cnn"].count))


def test_the_paper_zoo_gives_the_lenet_as_global_model() -> None:
    # K_g = min_i K_i over the paper's zoo (LeNet-style CNN, VGG-8, ResNet-10/12/18) on CIFAR-100
    config = yaml.safe_load((ROOT / PAPER_GD).read_text())["model"]["init_args"]
    assert sorted(a["net"] for a in config["architectures"].values()) == sorted(
        ["zoo_cnn", "vgg8", "resnet10", "resnet12", "resnet18"]
    )
    small_hn = {"hidden_dim": 1, "n_layers": 1}  # the rule is about counts, not the HN's size
    method = MHPFedHNGD(
        num_clients=50, num_classes=100, input_shape=(3, 32, 32), **(config | small_hn)
    )
    counts = {kind: codec.count for kind, codec in method.codecs.items()}
    assert method.global_codec.count == min(counts.values())
    (smallest,) = [k for k, c in counts.items() if c == min(counts.values())]
    assert config["architectures"][smallest]["net"] == "zoo_cnn"
    assert method.global_arch is method.zoo.archs[smallest]


def test_table_10_separate_heads_give_the_global_model_a_head_of_its_own() -> None:
    shared = build_mh(MHPFedHNG)
    separate = build_mh(MHPFedHNG, global_head="separate")
    row = shared.hp.num_clients  # the global model's row
    kind = min(shared.codecs, key=lambda k: shared.codecs[k].count)
    first = int(shared.zoo.members(kind)[0])
    assert shared.hnet.head_of[row] == shared.hnet.head_of[first]  # the paper's main setting
    assert separate.hnet.head_of[row] == f"row{row}"
    assert separate.hnet.head_of[row] not in separate.hnet.head_of[:row]
    assert separate.hnet.head_of[:row] == shared.hnet.head_of[:row]
    head = [separate.hnet.heads[f"row{row}_weight"], separate.hnet.heads[f"row{row}_bias"]]
    before = [p.detach().clone() for p in head]
    members = separate.zoo.members(kind)
    clients = torch.tensor(sorted(members.tolist()))
    grads = torch.autograd.grad(separate.hnet(members.tolist()).sum(), head, allow_unused=True)
    assert all(g is None for g in grads)  # the clients of its tau never read it
    separate.run_round(0, clients)
    assert not torch.equal(head[0].detach(), before[0])  # the global step moved it


def test_table_13_local_layers_are_kept_trained_and_never_generated() -> None:
    whole, method = build_mh(), build_mh(local_layers=1)
    assert method.local_names["cnn"] == ("fc3.weight", "fc3.bias")
    assert method.local_names["res"] == ("fc.weight", "fc.bias")
    for kind, codec in method.codecs.items():
        kept = sum(
            method.store.fields[f"local.{kind}"][n][0].numel() for n in method.local_names[kind]
        )
        assert codec.count == whole.codecs[kind].count - kept
        assert not set(codec.names) & set(method.local_names[kind])
    kinds = [method.zoo.names[g] for g in method.zoo.group_of.tolist()]
    assert method.hnet.counts == [method.codecs[k].count for k in kinds]  # what the server sees
    seen = spy_client_updates(method)
    field = method.store.fields["local.cnn"]
    start = {n: t.clone() for n, t in field.items()}
    cnn = method.zoo.members("cnn")
    method.run_round(0, cnn[:1])
    ((clients, flat, delta, trained),) = seen
    assert delta.shape == flat.shape == (1, method.codecs["cnn"].count)
    rows = method.zoo.row_of[cnn]
    for n in method.local_names["cnn"]:
        assert torch.equal(field[n][rows[0]], trained[n][0])  # kept by the client
        assert not torch.equal(field[n][rows[0]], start[n][rows[0]])  # and trained
        assert torch.equal(field[n][rows[1]], start[n][rows[1]])  # not the other's
    evaluated = method.personalized_params(cnn[:1])
    for n in method.local_names["cnn"]:
        assert torch.equal(evaluated[f"cnn/{n}"][0], field[n][rows[0]])
    kept_now = {n: field[n][rows[0]].clone() for n in method.local_names["cnn"]}
    starts: list[dict[str, torch.Tensor]] = []
    train = method.local_train

    def spy(params: Any, *args: Any, **kwargs: Any) -> Any:
        starts.append({n: t.clone() for n, t in params.items()})
        return train(params, *args, **kwargs)

    setattr(method, "local_train", spy)  # noqa: B010
    method.run_round(1, cnn[:1])  # the next visit starts from what the client kept
    for n, value in kept_now.items():
        assert torch.equal(starts[0][n][0], value)
    with pytest.raises(ConfigError, match="model.init_args.local_layers"):
        build_mh(local_layers=3)  # the MLP has 3 layers
