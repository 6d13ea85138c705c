"""FedPHP's knowledge transfer and MAPPER's gate and schedule: the reference defaults on hand
examples, the other forms reachable, vectorized == client by client."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.func import grad

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import MAPPER, FedPHP
from lightning_pfl.methods.fedphp import gaussian_mmd
from tests.conftest import build, digits_data, fit
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    bias_only,
    capture_local_training,
)


def softmax(z: list[float]) -> list[float]:
    e = [math.exp(v) for v in z]
    return [v / sum(e) for v in e]


# ----------------------------------------------------------------------------- FedPHP
def test_fedphp_default_distillation_tempers_only_the_teacher() -> None:
    dm = digits_data(4)
    method = build(FedPHP, dm, lam=0.2, temperature=2.0)
    assert method.hp.distillation == "tempered_teacher"
    student_bias = [1.0, 0.0] + [-30.0] * 8
    teacher_bias = [0.0, 3.0] + [-30.0] * 8
    student = bias_only(method, student_bias)
    context = {f"hpm.{n}": t for n, t in bias_only(method, teacher_bias).items()}
    x, _ = dm.fetch(dm.index["train"].flat[:2])
    y = torch.tensor([0, 0])
    p_student = softmax(student_bias)
    ce = -math.log(p_student[0])
    # -sum_c softmax(v(x) / T)_c log softmax(w(x))_c: the student at T = 1, no T^2 factor
    target = softmax([b / 2 for b in teacher_bias])
    soft = -sum(q * math.log(p) for q, p in zip(target, p_student, strict=True))
    expected = 0.8 * ce + 0.2 * soft
    loss = float(method.php_loss(student, context, x, y, torch.ones(2)))
    assert abs(loss - expected) < 1e-4
    hinton = build(FedPHP, dm, lam=0.2, temperature=2.0, distillation="hinton")
    assert abs(float(hinton.php_loss(student, context, x, y, torch.ones(2))) - expected) > 0.1


def test_gaussian_mmd_on_hand_numbers_and_padding() -> None:
    a = torch.tensor([[0.0, 0.0], [1.0, 0.0]])
    b = torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    joint = a.tolist() + b.tolist()
    d = [[sum((u - v) ** 2 for u, v in zip(p, q, strict=True)) for q in joint] for p in joint]
    s = sum(map(sum, d)) / (4 * 4 - 4)
    k = [[sum(math.exp(-e / (s * 2.0 ** (i - 2))) for i in range(5)) for e in row] for row in d]
    sign = [1, 1, -1, -1]
    expected = sum(sign[i] * sign[j] * k[i][j] for i in range(4) for j in range(4)) / 4
    torch.testing.assert_close(gaussian_mmd(a, b, torch.ones(2)), torch.tensor(expected))
    # a padding sample (weight 0) takes no part, wherever it lies
    padded = gaussian_mmd(
        torch.cat([a, torch.tensor([[9.0, -9.0]])]),
        torch.cat([b, torch.tensor([[5.0, 5.0]])]),
        torch.tensor([1.0, 1.0, 0.0]),
    )
    torch.testing.assert_close(padded, torch.tensor(expected))
    assert float(gaussian_mmd(a, a, torch.ones(2))) == pytest.approx(0.0, abs=1e-6)


def test_fedphp_mmd_transfers_the_hpm_features() -> None:
    dm = digits_data(4)
    method = build(FedPHP, dm, lam=0.3, distillation="mmd")
    g = torch.Generator().manual_seed(0)
    init = method.arch.initial_params()
    student = {n: t + 0.2 * torch.randn(t.shape, generator=g) for n, t in init.items()}
    context = {f"hpm.{n}": t for n, t in init.items()}
    x, y = dm.fetch(dm.index["train"].flat[:6])
    w = torch.tensor([1.0] * 5 + [0.0])
    features = method.arch.features(student, x, train=True)
    ce = torch.nn.functional.cross_entropy(method.arch(student, x)[:5], y[:5])
    mmd = gaussian_mmd(features, method.arch.features(init, x), w)
    loss = method.php_loss(student, context, x, y, w)
    torch.testing.assert_close(loss, 0.7 * ce + 0.3 * mmd)
    assert float(mmd) > 1e-4
    same = {f"hpm.{n}": t for n, t in student.items()}
    torch.testing.assert_close(method.php_loss(student, same, x, y, w), 0.7 * ce)


def test_fedphp_mmd_refuses_batch_norm() -> None:
    with pytest.raises(ConfigError, match="distillation: mmd"):
        build(FedPHP, digits_data(4), distillation="mmd", net_args={"batch_norm": True})


@pytest.mark.parametrize("distillation", ["tempered_teacher", "mmd"])
def test_fedphp_vectorized_equals_sequential(distillation: str) -> None:
    assert_vectorized_equals_sequential(FedPHP, distillation=distillation)


# ----------------------------------------------------------------------------- MAPPER gate
def mapper_inputs(method: MAPPER, lam: float) -> tuple[dict[str, torch.Tensor], ...]:
    g = torch.Generator().manual_seed(0)
    init = method.arch.initial_params()
    glob = {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in init.items()}
    params = {f"global.{n}": t for n, t in glob.items()} | {
        f"local.{n}": t for n, t in init.items()
    }
    params["gate"] = torch.tensor(lam)
    return params, {f"anchor.{n}": t for n, t in glob.items()}, glob, init


@pytest.mark.parametrize("lam", [0.3, 0.0, 1.0])
def test_mapper_default_gate_is_lambda_by_projected_sgd(lam: float) -> None:
    dm = digits_data(4)
    method = build(MAPPER, dm, gate_lr=0.05, schedule="joint")  # joint: predicts the mixture
    assert method.hp.gate == "projected"
    params, received, glob, local = mapper_inputs(method, lam)
    x, y = dm.fetch(dm.index["train"].flat[:8])
    w = torch.tensor([1.0] * 6 + [0.0] * 2)  # two padding samples
    autograd = grad(method.mapper_loss)(params, received, x, y, w)["gate"]
    p_local = torch.softmax(method.arch(local, x), -1)[torch.arange(8), y]
    p_global = torch.softmax(method.arch(glob, x), -1)[torch.arange(8), y]
    mix = lam * p_local + (1 - lam) * p_global
    # d/dlambda -log(lambda p_l + (1 - lambda) p_g) = -(p_l - p_g) / mix, finite at the ends
    closed = (-(p_local - p_global) / mix * w).sum() / w.sum()
    assert abs(float(closed)) > 1e-3
    # one SGD step of size eta_lambda on this gradient lands on Proj_[0,1](lambda - eta g)
    landed = min(max(lam - 0.05 * float(closed), 0.0), 1.0)
    assert float(params["gate"] - 0.05 * autograd) == pytest.approx(landed, abs=1e-6)
    if 0.0 < lam - 0.05 * float(closed) < 1.0:
        torch.testing.assert_close(autograd, closed, rtol=1e-4, atol=1e-6)
    # the prediction mixes the probabilities with lambda itself
    predicted = method.predict(params | {f"global.{n}": t for n, t in glob.items()}, x).exp()
    expected = lam * torch.softmax(method.arch(local, x), -1) + (1 - lam) * torch.softmax(
        method.arch(glob, x), -1
    )
    torch.testing.assert_close(predicted, expected, rtol=1e-5, atol=1e-6)


def test_mapper_projected_gate_reaches_the_ends_and_stays_in_them() -> None:
    dm = digits_data(4)
    method = build(MAPPER, dm, clients_per_round=4, gate_lr=50.0)
    method.run_round(0, torch.arange(4))
    lam = method.mixture_weights()
    assert torch.equal(lam, method.store.fields["gate"]["gate"])
    assert bool(((lam >= 0) & (lam <= 1)).all())
    assert bool(((lam == 0) | (lam == 1)).any())  # a sigmoid never reaches an end
    sigmoid = build(MAPPER, dm, clients_per_round=4, gate_lr=50.0, gate="sigmoid")
    sigmoid.run_round(0, torch.arange(4))
    assert not torch.equal(sigmoid.mixture_weights(), sigmoid.store.fields["gate"]["gate"])


def test_mapper_sigmoid_gate_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(MAPPER, gate="sigmoid", gate_lr=0.5)


# ----------------------------------------------------------------------------- MAPPER schedule
def test_mapper_default_fits_after_fedavg_against_the_final_global_model() -> None:
    dm = digits_data(4)
    method = build(MAPPER, dm, clients_per_round=2, fedavg_rounds=1)
    assert method.hp.schedule == "after_fedavg"
    trained = capture_local_training(method)
    before = {f: {n: t.clone() for n, t in v.items()} for f, v in method.store.fields.items()}
    method.run_round(0, torch.tensor([0, 2]))  # FedAvg: CE of the global model only
    assert set(trained[0].params) == set(method.arch.shapes)
    for field in ("local", "gate"):
        for name, t in method.store.fields[field].items():
            assert torch.equal(t, before[field][name]), (field, name)
    with torch.no_grad():  # the server's SGD step (the base class's, after the round)
        for p in method.net.parameters():
            p -= p.grad
            p.grad = None
    final = {n: t.clone() for n, t in method.global_state().items()}
    method.run_round(1, torch.tensor([1, 2]))  # fitting: local model and lambda, nothing up
    assert set(trained[1].params) == {f"local.{n}" for n in method.arch.shapes} | {"gate"}
    assert method.record.round_bytes[1] == 0.0
    assert all(p.grad is None for p in method.net.parameters())
    for name, t in method.global_state().items():
        assert torch.equal(t, final[name]), name
    lam = method.store.fields["gate"]["gate"]
    assert lam[0] == 0.5 and lam[3] == 0.5 and lam[1] != 0.5 and lam[2] != 0.5
    local = method.store.fields["local"]
    assert all(torch.equal(t[0], before["local"][n][0]) for n, t in local.items())
    assert any(not torch.equal(t[1], before["local"][n][1]) for n, t in local.items())


def test_mapper_after_fedavg_evaluates_fedavg_until_the_fit_starts() -> None:
    dm = digits_data(4)
    method = build(MAPPER, dm, fedavg_rounds=2, initial_lambda=0.5)
    clients = torch.arange(2)
    params = method.personalized_params(clients)
    x, _ = dm.fetch(dm.index["train"].flat[:4])
    row = {n: t[0] for n, t in params.items()}
    glob = {n[7:]: t for n, t in row.items() if n.startswith("global.")}
    local = {n[6:]: t for n, t in row.items() if n.startswith("local.")}
    for done, expect_mixture in ((2, False), (3, True)):
        method.record.checkpoint_round = done  # rounds trained so far
        p_global = torch.softmax(method.arch(glob, x), -1)
        expected = p_global
        if expect_mixture:
            expected = 0.5 * torch.softmax(method.arch(local, x), -1) + 0.5 * p_global
        torch.testing.assert_close(method.predict(row, x).exp(), expected)


@pytest.mark.parametrize("schedule", ["after_fedavg", "joint"])
def test_mapper_schedule_vectorized_equals_sequential(schedule: str) -> None:
    assert_vectorized_equals_sequential(MAPPER, schedule=schedule, fedavg_rounds=1, gate_lr=0.5)


def test_mapper_local_start_global_copies_the_final_fedavg_model() -> None:
    dm = digits_data(4)
    method = build(MAPPER, dm, fedavg_rounds=1)
    assert method.hp.local_start == "global"
    method.run_round(0, torch.tensor([0, 1]))
    with torch.no_grad():
        for p in method.net.parameters():
            p -= p.grad
    method.start_local_models()
    state = method.global_state()
    for name, t in method.store.fields["local"].items():
        assert torch.equal(t, state[name].expand_as(t)), name


def test_mapper_local_start_initial_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "mapper.yaml", tmp_path, "--model.init_args.local_start=initial")


@pytest.mark.parametrize("local_start", ["global", "initial"])
def test_mapper_local_models_start_from_the_final_fedavg_model(local_start: str) -> None:
    dm = digits_data(6)
    method = build(MAPPER, dm, fedavg_rounds=2, clients_per_round=2, local_start=local_start)
    initial = method.arch.initial_params()
    fit(method, dm, rounds=3)  # rounds 0-1 FedAvg, round 2 fits its 2 clients
    final = method.global_state()
    fitted = set(method.sample_clients(2).tolist())
    for c in set(range(6)) - fitted:  # not sampled since: still the starting point
        start = final if local_start == "global" else initial
        for name, t in method.store.fields["local"].items():
            assert torch.equal(t[c], start[name]), (c, name)
