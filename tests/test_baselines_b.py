"""PFedMe, PerFedAvg, FedBN, FedRoD and MOON: their math, vmap == loop, exact resume."""

import math
from pathlib import Path

import pytest
import torch

from lightning_pfl.errors import ConfigError
from lightning_pfl.losses import balanced_softmax_cross_entropy
from lightning_pfl.methods import MOON, FedBN, FedRoD
from lightning_pfl.methods.moon import model_contrastive_loss
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    capture_local_training,
)

BN = {"net_args": {"batch_norm": True}}


# ----------------------------------------------------------------------------- FedBN
def test_fedbn_keeps_batch_norms_per_client_and_averages_the_rest() -> None:
    dm = digits_data(6)
    method = build(FedBN, dm, clients_per_round=3, **BN)
    personal = set(method.personal_names())
    assert personal == {
        f"bn{i}.{t}" for i in (1, 2, 3) for t in ("weight", "bias", "running_mean", "running_var")
    }
    initial = {n: t.clone() for n, t in method.global_state().items()}
    trained = capture_local_training(method)
    clients = torch.tensor([0, 2, 5])
    method.run_round(0, clients)
    method.configure_server_optimizer().step()
    params = trained[0].params
    weights = method.client_weights(clients).float()
    state = method.global_state()
    for name in initial:
        if name in personal:  # never uploaded: the server's copy never moves
            assert torch.equal(state[name], initial[name]), name
            assert not torch.allclose(params[name][0], params[name][1]), name
            kept = method.store.fields["personal"][name][clients]
            assert torch.equal(kept, params[name]), name
        else:
            mean = (weights.view(-1, *[1] * (params[name].dim() - 1)) * params[name]).sum(0)
            torch.testing.assert_close(state[name], mean, msg=name)
    assert "bn1.weight" not in method.payload(clients)


def test_fedbn_refuses_a_network_without_batch_norm() -> None:
    with pytest.raises(ConfigError, match="batch_norm"):
        build(FedBN, digits_data(4))


def test_fedbn_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedBN, **BN)


def test_fedbn_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "fedbn.yaml", tmp_path)


# ----------------------------------------------------------------------------- FedRoD
def test_balanced_softmax_on_a_hand_example() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0], [1.0, 0.0, -1.0]])
    counts = torch.tensor([3.0, 1.0, 0.0])  # class 2 absent: log n_2 = log 1e-12
    # adjusted logits: [1 + log 3, 0, -1 + log 1e-12]; exp: [3e, 1, 1e-12 / e]
    denominator = 3 * math.e + 1 + 1e-12 / math.e
    first = math.log(denominator / (3 * math.e))  # y = 0
    second = math.log(denominator / 1.0)  # y = 1
    loss = balanced_softmax_cross_entropy(logits, torch.tensor([0, 1]), counts, torch.ones(2))
    torch.testing.assert_close(loss, torch.tensor((first + second) / 2))
    only_first = balanced_softmax_cross_entropy(
        logits, torch.tensor([0, 1]), counts, torch.tensor([1.0, 0.0])
    )
    torch.testing.assert_close(only_first, torch.tensor(first))


def test_fedrod_predicts_the_sum_of_both_heads_and_trains_them_apart() -> None:
    dm = digits_data(4)
    method = build(FedRoD, dm)
    g = torch.Generator().manual_seed(0)
    net = method.arch.initial_params()
    params = dict(net)
    params["personal_head.weight"] = torch.randn(10, 64, generator=g)
    params["personal_head.bias"] = torch.randn(10, generator=g)
    x, y = dm.fetch(dm.index["train"].flat[:6])
    z = method.arch.features(net, x)
    personal = z @ params["personal_head.weight"].T + params["personal_head.bias"]
    torch.testing.assert_close(method.predict(params, x), method.arch(net, x) + personal)
    # the body and generic head follow the balanced softmax alone; the personal head the CE
    counts = torch.tensor([5.0, 0, 7, 0, 0, 0, 0, 0, 0, 1])
    w = torch.ones(6)
    grads = torch.func.grad(method.rod_loss)(params, {"class_counts": counts}, x, y, w)

    def balanced(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return balanced_softmax_cross_entropy(method.arch(p, x), y, counts, w)

    expected = torch.func.grad(balanced)(net)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, msg=name)

    def personal_ce(head: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = method.arch(net, x) + z @ head["weight"].T + head["bias"]
        return torch.nn.functional.cross_entropy(logits, y)

    head = {"weight": params["personal_head.weight"], "bias": params["personal_head.bias"]}
    expected_head = torch.func.grad(personal_ce)(head)
    torch.testing.assert_close(grads["personal_head.weight"], expected_head["weight"])
    torch.testing.assert_close(grads["personal_head.bias"], expected_head["bias"])


def test_fedrod_personal_heads_stay_in_the_store() -> None:
    dm = digits_data(6)
    method = build(FedRoD, dm, clients_per_round=2)
    method.run_round(0, torch.tensor([1, 3]))
    heads = method.store.fields["personal_head"]["personal_head.weight"]
    assert heads[[0, 2, 4, 5]].abs().sum() == 0 and heads[1].abs().sum() > 0
    assert not torch.equal(heads[1], heads[3])
    assert "personal_head.weight" not in method.payload(torch.tensor([1]))


def test_fedrod_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedRoD)


def test_fedrod_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "fedrod.yaml", tmp_path)


# ----------------------------------------------------------------------------- MOON
def test_model_contrastive_loss_on_a_hand_example() -> None:
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    positive = torch.tensor([[1.0, 1.0], [0.0, 1.0]])  # cosines 1/sqrt(2) and 1
    negative = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])  # cosines 0 and 0
    tau = 0.5
    first = -math.log(math.exp(2**-0.5 / tau) / (math.exp(2**-0.5 / tau) + math.exp(0.0)))
    second = -math.log(math.exp(1 / tau) / (math.exp(1 / tau) + 1.0))
    loss = model_contrastive_loss(z, positive, negative, tau, torch.ones(2))
    torch.testing.assert_close(loss, torch.tensor((first + second) / 2))
    torch.testing.assert_close(
        model_contrastive_loss(z, positive, negative, tau, torch.tensor([0.0, 1.0])),
        torch.tensor(second),
    )


def test_moon_loss_is_cross_entropy_plus_mu_times_contrastive() -> None:
    dm = digits_data(4)
    method = build(MOON, dm, mu=2.5, temperature=0.7)
    params = method.global_state()
    other = {n: t + 0.01 * torch.randn_like(t) for n, t in params.items()}
    prev = {n: t - 0.02 for n, t in params.items()}
    x, y = dm.fetch(dm.index["train"].flat[:6])
    frozen = {f"global.{n}": t for n, t in other.items()}
    frozen |= {f"previous.{n}": t for n, t in prev.items()}
    w = torch.ones(6)
    z, logits = method.represent(params, x)
    expected = torch.nn.functional.cross_entropy(logits, y) + 2.5 * model_contrastive_loss(
        z, method.represent(other, x)[0], method.represent(prev, x)[0], 0.7, w
    )
    torch.testing.assert_close(method.moon_loss(params, frozen, x, y, w), expected)
    assert z.shape == (6, 256)


def test_moon_keeps_previous_models_and_averages_the_projection() -> None:
    dm = digits_data(6)
    method = build(MOON, dm, clients_per_round=2)
    before = {n: t.clone() for n, t in method.global_state().items()}
    trained = capture_local_training(method)
    clients = torch.tensor([0, 4])
    method.run_round(0, clients)
    method.configure_server_optimizer().step()
    weights = method.client_weights(clients).float()
    for name, t in trained[0].params.items():
        assert torch.equal(method.store.fields["previous"][name][clients], t), name
        mean = (weights.view(-1, *[1] * (t.dim() - 1)) * t).sum(0)
        torch.testing.assert_close(method.global_state()[name], mean, msg=name)
        assert torch.equal(method.store.fields["previous"][name][1], before[name]), name
    assert any(n.startswith("projection.") for n in trained[0].params)


def test_moon_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(MOON, projection_dim=16)


def test_moon_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "moon.yaml", tmp_path)
