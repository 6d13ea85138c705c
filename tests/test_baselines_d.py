"""FML, FedPHP, HypCluster, MAPPER, PartialFed and kNN-Per: their math on hand examples."""

from __future__ import annotations

import math

import torch
from torch.func import grad

from lightning_pfl.losses import interpolate_with_knn, knn_probabilities
from lightning_pfl.methods import FML, MAPPER, FedPHP, HypCluster, KNNPer, PartialFed
from lightning_pfl.methods.fedphp import history_weight, moving_average
from lightning_pfl.methods.partialfed import mix_layers
from tests.conftest import build, digits_data
from tests.helpers import (
    assert_vectorized_equals_sequential,
    bias_only,
    capture_local_training,
)


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def softmax(z: list[float]) -> list[float]:
    e = [math.exp(v) for v in z]
    return [v / sum(e) for v in e]


# ----------------------------------------------------------------------------- FML
def test_fml_losses_on_a_hand_example() -> None:
    dm = digits_data(4)
    method = build(FML, dm, alpha=0.3, beta=0.8)
    meme_bias = [1.0, 0.0] + [-30.0] * 8  # classes 2..9 have probability ~0
    private_bias = [0.0, 2.0] + [-30.0] * 8
    meme, private = bias_only(method, meme_bias), bias_only(method, private_bias)
    x, _ = dm.fetch(dm.index["train"].flat[:2])
    y = torch.tensor([0, 1])
    pm, pp = softmax(meme_bias), softmax(private_bias)
    ce_meme = -(math.log(pm[0]) + math.log(pm[1])) / 2
    ce_private = -(math.log(pp[0]) + math.log(pp[1])) / 2
    l_local = 0.3 * ce_private + 0.7 * kl(pm, pp)  # KL(p_meme || p_local)
    l_meme = 0.8 * ce_meme + 0.2 * kl(pp, pm)  # KL(p_local || p_meme)
    params = {f"meme.{n}": t for n, t in meme.items()} | {
        f"private.{n}": t for n, t in private.items()
    }
    w = torch.ones(2)
    loss = method.mutual_loss(params, {}, x, y, w)
    assert abs(float(loss) - (l_local + l_meme)) < 1e-4
    # each model learns from its own loss only: the other model's prediction is a fixed target
    g = grad(method.mutual_loss)(params, {}, x, y, w)
    p_local = torch.tensor(pp)
    onehot = torch.nn.functional.one_hot(y, 10).float()
    expected = 0.3 * (p_local - onehot).mean(0) + 0.7 * (p_local - torch.tensor(pm))
    torch.testing.assert_close(g["private.fc2.bias"], expected, atol=1e-5, rtol=1e-4)


def test_fml_evaluates_the_private_model_and_uploads_the_meme() -> None:
    dm = digits_data(4)
    method = build(FML, dm, clients_per_round=2)
    before = {n: t.clone() for n, t in method.store.fields["private"].items()}
    trained = capture_local_training(method)
    clients = torch.tensor([1, 3])
    method.run_round(0, clients)
    private = method.personalized_params(torch.tensor([0, 1, 3]))
    n = dm.num_samples("train")[clients].double()
    p = (n / n.sum()).view(-1, 1)
    for name, t in private.items():
        assert torch.equal(t[0], before[name][0]), name  # not sampled: unchanged
        torch.testing.assert_close(t[1:], trained[0].params[f"private.{name}"])
        meme = trained[0].params[f"meme.{name}"].double()
        new_global = method.net.get_parameter(name).detach() - method.net.get_parameter(name).grad
        torch.testing.assert_close(new_global, (p * meme.flatten(1)).sum(0).view_as(t[0]).float())


def test_fml_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FML)


# ----------------------------------------------------------------------------- FedPHP
def test_fedphp_moving_average_and_mixing_on_hand_numbers() -> None:
    history = {"w": torch.tensor([[1.0, 2.0], [0.0, 0.0]])}
    trained = {"w": torch.tensor([[3.0, 6.0], [4.0, -4.0]])}
    out = moving_average(history, trained, torch.tensor([0.25, 1.0]))
    torch.testing.assert_close(out["w"], torch.tensor([[2.5, 5.0], [0.0, 0.0]]))
    mu = history_weight(torch.tensor([0.0, 2.0, 100.0]), 0.9, 0.5, 20)  # q T = 10
    torch.testing.assert_close(mu, torch.tensor([0.0, 0.18, 0.9], dtype=torch.float64))
    dm = digits_data(4)
    method = build(FedPHP, dm, inherit=0.25)
    start = {"w": torch.tensor([[4.0, 8.0]])}
    hpm = {"w": torch.tensor([[0.0, 4.0]])}
    torch.testing.assert_close(method.starting_point(start, hpm)["w"], torch.tensor([[3.0, 7.0]]))


def test_fedphp_loss_on_a_hand_example() -> None:
    dm = digits_data(4)
    method = build(FedPHP, dm, lam=0.2, temperature=2.0, distillation="hinton")
    student_bias = [1.0, 0.0] + [-30.0] * 8
    teacher_bias = [0.0, 3.0] + [-30.0] * 8
    student = bias_only(method, student_bias)
    context = {f"hpm.{n}": t for n, t in bias_only(method, teacher_bias).items()}
    x, _ = dm.fetch(dm.index["train"].flat[:2])
    y = torch.tensor([0, 0])
    ce = -math.log(softmax(student_bias)[0])
    tempered = softmax([b / 2 for b in teacher_bias]), softmax([b / 2 for b in student_bias])
    expected = 0.8 * ce + 0.2 * 4 * kl(*tempered)  # T^2 KL(p_hpm^T || p_local^T)
    assert abs(float(method.php_loss(student, context, x, y, torch.ones(2))) - expected) < 1e-4


def test_fedphp_round_updates_the_history_model() -> None:
    dm = digits_data(4)
    method = build(FedPHP, dm, clients_per_round=2, total_rounds=4, lam=0.5)  # q T = 2
    trained = capture_local_training(method)
    clients = torch.tensor([0, 2])
    method.run_round(0, clients)
    for n, t in method.personalized_params(clients).items():  # z = 0: mu = 0, v = w
        torch.testing.assert_close(t, trained[0].params[n])
    before = method.personalized_params(clients)
    method.run_round(1, clients)
    for n, t in method.personalized_params(clients).items():  # z = 1: mu = 0.45
        torch.testing.assert_close(t, 0.45 * before[n] + 0.55 * trained[1].params[n])
    counts = method.store.fields["count"]["participations"]
    assert counts.tolist() == [2.0, 0.0, 2.0, 0.0]


def test_fedphp_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedPHP, inherit=0.5)


# ----------------------------------------------------------------------------- HypCluster
def set_cluster_biases(method: HypCluster, biases: list[list[float]]) -> None:
    """Cluster j predicts ``biases[j]`` for every input (all weights zero)."""
    with torch.no_grad():
        for p in method.clusters.values():
            p.zero_()
        method.clusters["fc2__bias"].copy_(torch.tensor(biases))


def favouring(classes: set[int], strength: float = 5.0) -> list[float]:
    return [strength if c in classes else 0.0 for c in range(10)]


def test_hypcluster_assigns_each_client_its_lowest_loss_model() -> None:
    dm = digits_data(6)
    method = build(HypCluster, dm, num_hypotheses=3)
    counts = dm.partition_counts()["train"]
    classes = [set(counts[i].nonzero()[0].tolist()) for i in range(6)]
    biases = [favouring(classes[0]), favouring(classes[1] - classes[0]), [0.0] * 10]
    set_cluster_biases(method, biases)
    clients = torch.arange(6)
    expected = torch.zeros(6, 3, dtype=torch.float64)
    for i in range(6):
        for j, b in enumerate(biases):
            p = softmax(b)
            expected[i, j] = -sum(n * math.log(p[c]) for c, n in enumerate(counts[i])) / sum(
                counts[i]
            )
    losses = method.cluster_losses(clients)
    torch.testing.assert_close(losses.double(), expected, rtol=1e-5, atol=1e-5)
    assert method.assign(clients).tolist() == expected.argmin(1).tolist()
    assert method.assign(clients)[:2].tolist() == [0, 1]  # each favoured client takes its model


def test_hypcluster_averages_each_cluster_over_its_members_only() -> None:
    dm = digits_data(6)
    method = build(HypCluster, dm, num_hypotheses=3)
    counts = dm.partition_counts()["train"]
    classes = [set(counts[i].nonzero()[0].tolist()) for i in range(6)]
    first, second = classes[0] | classes[1], classes[3] | classes[4]
    disfavoured = favouring(first | second, -5.0)
    set_cluster_biases(method, [favouring(first), favouring(second), disfavoured])
    clients = torch.tensor([0, 1, 3, 4])
    cluster = method.assign(clients)
    assert 0 in cluster.tolist() and 1 in cluster.tolist() and 2 not in cluster.tolist()
    before = {n: t.clone() for n, t in method.models().items()}
    trained = capture_local_training(method)
    method.run_round(0, clients)
    for p in method.clusters.values():  # the server step: lr 1, no momentum
        p.data -= p.grad
    n = dm.num_samples("train")[clients].double()
    after = method.models()
    for name, t in after.items():
        for j in range(2):
            w = n * (cluster == j)
            mean = (w.view(-1, *[1] * (t.dim() - 1)) * trained[0].params[name].double()).sum(0)
            torch.testing.assert_close(t[j], (mean / w.sum()).float(), msg=name)
        assert torch.equal(t[2], before[name][2]), name  # no members: unchanged


def test_hypcluster_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(HypCluster, num_hypotheses=3)


# ----------------------------------------------------------------------------- MAPPER
def test_mapper_gate_gradient_matches_the_closed_form() -> None:
    dm = digits_data(4)
    method = build(MAPPER, dm, gate="sigmoid", schedule="joint")
    g = torch.Generator().manual_seed(0)
    glob = {
        n: t + 0.1 * torch.randn(t.shape, generator=g)
        for n, t in method.arch.initial_params().items()
    }
    local = method.arch.initial_params()
    x, y = dm.fetch(dm.index["train"].flat[:8])
    w = torch.tensor([1.0] * 6 + [0.0] * 2)  # two padding samples
    a = torch.tensor(0.7)
    # the copy of the global model being trained differs from the received one: the mixture
    # must use the received model (fixed for the round, the one evaluation mixes with)
    trained_copy = {n: t + 0.3 for n, t in glob.items()}
    params = {f"global.{n}": t for n, t in trained_copy.items()} | {
        f"local.{n}": t for n, t in local.items()
    }
    params["gate"] = a
    received = {f"anchor.{n}": t for n, t in glob.items()}
    autograd = grad(method.mapper_loss)(params, received, x, y, w)["gate"]
    lam = torch.sigmoid(a)
    p_local = torch.softmax(method.arch(local, x), -1)[torch.arange(8), y]
    p_global = torch.softmax(method.arch(glob, x), -1)[torch.arange(8), y]
    mix = lam * p_local + (1 - lam) * p_global
    # d/da -log(sigmoid(a) p_l + (1 - sigmoid(a)) p_g) = -lambda (1 - lambda) (p_l - p_g) / mix
    closed = (-(lam * (1 - lam)) * (p_local - p_global) / mix * w).sum() / w.sum()
    torch.testing.assert_close(autograd, closed, rtol=1e-4, atol=1e-6)
    assert abs(float(closed)) > 1e-4
    # the prediction is the mixture of probabilities
    params |= {f"global.{n}": t for n, t in glob.items()}
    predicted = method.predict(params, x).exp()
    expected = lam * torch.softmax(method.arch(local, x), -1) + (1 - lam) * torch.softmax(
        method.arch(glob, x), -1
    )
    torch.testing.assert_close(predicted, expected, rtol=1e-5, atol=1e-6)


def test_mapper_global_model_ignores_the_mixture() -> None:
    dm = digits_data(4)
    method = build(MAPPER, dm)
    params = {f"global.{n}": t for n, t in method.arch.initial_params().items()}
    params |= {f"local.{n}": t * 0.5 for n, t in method.arch.initial_params().items()}
    params["gate"] = torch.tensor(0.3)
    x, y = dm.fetch(dm.index["train"].flat[:8])
    w = torch.ones(8)
    received = {f"anchor.{n}": t * 0.8 for n, t in method.arch.initial_params().items()}
    g = grad(method.mapper_loss)(params, received, x, y, w)
    glob = {n[7:]: t for n, t in params.items() if n.startswith("global.")}
    ce = grad(lambda p: torch.nn.functional.cross_entropy(method.arch(p, x), y))(glob)
    for n, t in ce.items():
        torch.testing.assert_close(g[f"global.{n}"], t, rtol=1e-4, atol=1e-6)


def test_mapper_mixture_does_not_depend_on_the_trained_global_copy() -> None:
    dm = digits_data(4)
    method = build(MAPPER, dm)
    init = method.arch.initial_params()
    received = {f"anchor.{n}": t for n, t in init.items()}
    params = {f"local.{n}": t * 0.5 for n, t in init.items()} | {"gate": torch.tensor(0.3)}
    x, y = dm.fetch(dm.index["train"].flat[:8])
    w = torch.ones(8)
    grads = [
        grad(method.mapper_loss)(
            params | {f"global.{n}": t + shift for n, t in init.items()}, received, x, y, w
        )
        for shift in (0.0, 0.5)
    ]
    for name in [n for n in params if not n.startswith("global.")]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=0, atol=0)
    assert any(
        not torch.equal(grads[0][n], grads[1][n]) for n in grads[0] if n.startswith("global.")
    )


def test_mapper_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(MAPPER, gate_lr=0.5)


# ----------------------------------------------------------------------------- PartialFed
def shifted_global(method: PartialFed, by: float) -> None:
    with torch.no_grad():
        for p in method.net.parameters():
            p.add_(by)


def test_partialfed_global_choice_starts_from_the_global_model() -> None:
    dm = digits_data(4)
    method = build(PartialFed, dm, choice="global", local_lr=1e-30, local_weight_decay=0.0)
    clients = torch.tensor([0, 1])
    method.run_round(0, clients)  # lr 1e-30 changes no float32 value: kept = start
    shifted_global(method, 1.0)  # now the global model differs from the kept local models
    method.run_round(1, clients)
    for name, p in method.net.named_parameters():
        assert torch.equal(method.store.fields["local"][name][1], p.detach()), name


def test_partialfed_local_choice_keeps_the_local_model() -> None:
    dm = digits_data(4)
    method = build(PartialFed, dm, choice="local", local_lr=1e-30, local_weight_decay=0.0)
    clients = torch.tensor([0, 1])
    first = {n: t.detach().clone() for n, t in method.net.named_parameters()}
    method.run_round(0, clients)  # first round: no local model yet, the global one is loaded
    shifted_global(method, 1.0)
    method.run_round(1, clients)
    for name, t in first.items():
        assert torch.equal(method.store.fields["local"][name][1], t), name
    never = method.personalized_params(torch.tensor([3]))  # never sampled: the global model
    for name, p in method.net.named_parameters():
        assert torch.equal(never[name][0], p.detach()), name


def test_partialfed_selection_gradient_and_layer_mixing() -> None:
    dm = digits_data(4)
    method = build(PartialFed, dm)
    glob = method.arch.initial_params()
    local = {n: t + 0.2 * torch.randn_like(t) for n, t in glob.items()}
    load = {layer: torch.tensor([0.25]) for layer in method.layers}
    load["fc2"] = torch.tensor([1.0])
    mixed = mix_layers(
        {n: t[None] for n, t in glob.items()}, {n: t[None] for n, t in local.items()}, load
    )
    torch.testing.assert_close(mixed["fc2.weight"][0], glob["fc2.weight"])
    torch.testing.assert_close(
        mixed["conv1.bias"][0], 0.25 * glob["conv1.bias"] + 0.75 * local["conv1.bias"]
    )
    x, y = dm.fetch(dm.index["train"].flat[:8])
    w = torch.ones(8)
    beta = {layer: torch.tensor(0.4) for layer in method.layers}
    context = {f"global.{n}": t for n, t in glob.items()} | {
        f"local.{n}": t for n, t in local.items()
    }
    g_beta = grad(method.relaxed_loss)(beta, context, x, y, w)
    s = torch.sigmoid(torch.tensor(0.4))
    theta = {n: s * glob[n] + (1 - s) * local[n] for n in glob}
    g_theta = grad(lambda p: torch.nn.functional.cross_entropy(method.arch(p, x), y))(theta)
    for layer in method.layers:  # dL/dbeta_l = s (1 - s) sum_n <dL/dtheta_n, g_n - o_n>
        names = [n for n in glob if n.rsplit(".", 1)[0] == layer]
        closed = s * (1 - s) * sum((g_theta[n] * (glob[n] - local[n])).sum() for n in names)
        torch.testing.assert_close(g_beta[layer], closed, rtol=1e-4, atol=1e-7)


def test_partialfed_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(PartialFed, select_lr=1.0)


# ----------------------------------------------------------------------------- kNN-Per
def test_knn_probabilities_and_interpolation_on_a_hand_example() -> None:
    memory = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 3.0], [0.0, 0.1]])
    labels = torch.tensor([0, 1, 1, 2])
    mask = torch.tensor([True, True, True, False])  # the last entry is padding
    queries = torch.tensor([[0.5, 0.0], [0.0, 0.0]])
    p = knn_probabilities(queries, memory, labels, mask, 3, k=2, temperature=1.0)
    # query 0: d^2 = 0.25, 0.25 (labels 0, 1); query 1: d^2 = 0, 1 (labels 0, 1)
    near = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.5, 0.0], [near, 1 - near, 0.0]]))
    logits = torch.tensor([[0.0, 0.0, math.log(2.0)]] * 2)  # softmax = (1/4, 1/4, 1/2)
    mixed = interpolate_with_knn(logits, p, 0.25).exp()
    expected = torch.tensor(
        [
            [0.25 * 0.5 + 0.75 * 0.25, 0.25 * 0.5 + 0.75 * 0.25, 0.75 * 0.5],
            [0.25 * near + 0.75 * 0.25, 0.25 * (1 - near) + 0.75 * 0.25, 0.75 * 0.5],
        ]
    )
    torch.testing.assert_close(mixed, expected)


def test_knn_per_interpolates_the_global_model_and_the_client_memory() -> None:
    dm = digits_data(4)
    clients = torch.tensor([0, 2])
    x, y = dm.fetch(dm.index["train"].lookup(clients, torch.arange(20).expand(2, -1)))
    model_only = build(KNNPer, dm, knn_weight=0.0)
    params = model_only.personalized_params(clients)
    assert params["memory.features"].shape[:2] == params["memory.mask"].shape
    predicted = torch.vmap(model_only.predict)(params, x)
    glob = model_only.global_state()
    torch.testing.assert_close(
        predicted, torch.log_softmax(model_only.arch(glob, x.flatten(0, 1)), -1).view(2, 20, -1)
    )
    memory_only = build(KNNPer, dm, knn_weight=1.0, neighbours=1)
    params = memory_only.personalized_params(clients)
    predicted = torch.vmap(memory_only.predict)(params, x)  # a stored sample is its own neighbour
    assert torch.equal(predicted.argmax(-1), y)
    other = torch.vmap(memory_only.predict)(
        params, x.flip(0)
    )  # client 2's memory has no class of 0
    assert not torch.equal(other.argmax(-1), y.flip(0))


def test_knn_per_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(KNNPer)
