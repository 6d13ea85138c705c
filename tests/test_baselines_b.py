"""PFedMe, PerFedAvg, FedBN, FedRoD and MOON: their math, vmap == loop (exact resume:
tests/test_cli.py, RESUMED)."""

import math

import pytest
import torch

from lightning_pfl.errors import ConfigError
from lightning_pfl.losses import balanced_softmax_cross_entropy
from lightning_pfl.methods import MOON, FedBN, FedRoD, PerFedAvg, PFedMe
from lightning_pfl.methods.moon import model_contrastive_loss
from lightning_pfl.methods.per_fedavg import hessian_vector_product
from lightning_pfl.methods.pfedme import moreau_solve
from tests.conftest import build, digits_data
from tests.helpers import (
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
    # momentum: with FedAvg's plain SGD the 3-round models sit near ties (accuracy near chance)
    # and float rounding between the paths flips argmaxes
    # local_epochs None: the conftest's 3 steps, not the paper's whole epoch at batch 8
    assert_vectorized_equals_sequential(FedBN, local_momentum=0.9, local_epochs=None, **BN)


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
    context = {f"global.{n}": t for n, t in other.items()}
    context |= {f"previous.{n}": t for n, t in prev.items()}
    w = torch.ones(6)
    z, logits = method.represent(params, x)
    expected = torch.nn.functional.cross_entropy(logits, y) + 2.5 * model_contrastive_loss(
        z, method.represent(other, x)[0], method.represent(prev, x)[0], 0.7, w
    )
    torch.testing.assert_close(method.moon_loss(params, context, x, y, w), expected)
    assert z.shape == (6, 256)


def test_moon_keeps_previous_models_and_averages_the_projection() -> None:
    dm = digits_data(6)
    # local_epochs None: the conftest's 3 steps, not the paper's 10 epochs at batch 8
    method = build(MOON, dm, clients_per_round=2, local_epochs=None)
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
    # local_epochs None: the conftest's 3 steps, not the paper's 10 epochs at batch 8
    assert_vectorized_equals_sequential(MOON, projection_dim=16, local_epochs=None)


# ----------------------------------------------------------------------------- pFedMe
def _softmax_regression() -> tuple[dict[str, torch.Tensor], object]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 5, generator=g, dtype=torch.float64), torch.arange(32) % 3

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(x @ p["weight"].T + p["bias"], y)

    w = {
        "weight": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "bias": torch.randn(3, generator=g, dtype=torch.float64),
    }
    return w, f


@pytest.mark.parametrize("steps", [1, 300])
def test_moreau_solve_reaches_the_optimality_condition(steps: int) -> None:
    w, f = _softmax_regression()
    lam = 2.0
    theta, _ = moreau_solve(f, w, w, lam, 0.2, steps)  # type: ignore[arg-type]
    grads = torch.func.grad(f)(theta)  # type: ignore[arg-type]
    residual = torch.cat([(grads[n] + lam * (theta[n] - w[n])).flatten() for n in w]).norm()
    if steps == 1:
        assert residual > 1e-2  # one step is far from the solution: the check can fail
    else:
        assert residual < 1e-8


def test_pfedme_step_moves_w_along_the_moreau_gradient_and_keeps_theta() -> None:
    dm = digits_data(4)
    method = build(PFedMe, dm, lam=3.0, personal_lr=0.05, inner_steps=4)
    w = method.arch.initial_params()
    theta_old = {n: t + 0.01 for n, t in w.items()}
    params = {**w, **{f"theta.{n}": t for n, t in theta_old.items()}}
    x, y = dm.fetch(dm.index["train"].flat[:8])
    weight = torch.ones(8)

    def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(method.arch(p, x), y)

    theta, value = moreau_solve(f, theta_old, w, 3.0, 0.05, 4)
    grads, loss = torch.func.grad_and_value(method.pfedme_loss)(params, {}, x, y, weight)
    torch.testing.assert_close(loss, value)
    for n in w:
        torch.testing.assert_close(grads[n], 3.0 * (w[n] - theta[n]), msg=n)
        torch.testing.assert_close(grads[f"theta.{n}"], theta_old[n] - theta[n], msg=n)


def test_pfedme_mixes_with_beta_and_evaluates_theta() -> None:
    dm = digits_data(6)
    method = build(
        PFedMe,
        dm,
        clients_per_round=2,
        beta=0.5,
        local_lr=0.05,
        local_updates="sampled",
        aggregation="weighted",
    )
    before = {n: t.clone() for n, t in method.global_state().items()}
    trained = capture_local_training(method)
    clients = torch.tensor([2, 3])
    method.run_round(0, clients)
    method.configure_server_optimizer().step()
    weights = method.client_weights(clients).float()
    params = trained[0].params
    for name, old in before.items():
        mean = (weights.view(-1, *[1] * old.dim()) * params[name]).sum(0)
        torch.testing.assert_close(method.global_state()[name], 0.5 * old + 0.5 * mean)
    personalized = method.personalized_params(clients)
    for name in before:
        assert torch.equal(personalized[name], params[f"theta.{name}"]), name
        assert not torch.equal(personalized[name], params[name]), name
    with pytest.raises(ConfigError, match="beta"):
        build(PFedMe, dm, server_lr=0.5)


def test_pfedme_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(PFedMe, local_lr=0.05)


# ----------------------------------------------------------------------------- Per-FedAvg
def test_finite_difference_hessian_vector_product_matches_autograd() -> None:
    w, f = _softmax_regression()
    g = torch.Generator().manual_seed(1)
    v = {n: torch.randn(t.shape, generator=g, dtype=torch.float64) for n, t in w.items()}
    grad_f = torch.func.grad(f)  # type: ignore[arg-type]
    expected = torch.func.jvp(grad_f, (w,), (v,))[1]
    approx = hessian_vector_product(grad_f, w, v, 1e-3)
    for n in w:
        torch.testing.assert_close(approx[n], expected[n], rtol=1e-5, atol=1e-7)
    coarse = hessian_vector_product(grad_f, w, v, 10.0)  # a large delta is visibly wrong
    assert not torch.allclose(coarse["weight"], expected["weight"], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_per_fedavg_direction_is_the_maml_gradient(variant: str) -> None:
    dm = digits_data(4)
    # delta small enough that w +- delta g crosses no ReLU/max-pool kink of this batch
    method = build(PerFedAvg, dm, variant=variant, alpha=0.1, delta=1e-4)
    w = method.arch.initial_params()
    x, y = dm.fetch(dm.index["train"].flat[:12])
    weight = torch.ones(12)
    parts = 2 if variant == "fo" else 3
    size = 12 // parts

    def f(k: int):  # type: ignore[no-untyped-def]
        sl = slice(k * size, (k + 1) * size)
        return lambda p: torch.nn.functional.cross_entropy(method.arch(p, x[sl]), y[sl])

    def maml(p: dict[str, torch.Tensor]) -> torch.Tensor:  # F(w) = f(w - alpha grad f(w; D); D')
        inner = torch.func.grad(f(0))(p)
        return f(1)({n: t - 0.1 * inner[n] for n, t in p.items()})

    grads = torch.func.grad(method.maml_loss)(w, {}, x, y, weight)
    adapted = {n: t - 0.1 * torch.func.grad(f(0))(w)[n] for n, t in w.items()}
    first_order = torch.func.grad(f(1))(adapted)
    if variant == "fo":
        for n in w:
            torch.testing.assert_close(grads[n], first_order[n], msg=n)
    else:  # HF: g - alpha H(w; D'') g with the exact Hessian of D''
        hv = torch.func.jvp(torch.func.grad(f(2)), (w,), (first_order,))[1]
        for n in w:
            expected = first_order[n] - 0.1 * hv[n]
            assert (grads[n] - expected).norm() < 1e-3 * expected.norm(), n
            assert (first_order[n] - expected).norm() > 1e-2 * expected.norm(), n
    exact = torch.func.grad(maml)(w)  # with D'' = D, HF would be exact; FO drops the term
    assert not torch.allclose(first_order["fc2.weight"], exact["fc2.weight"], atol=1e-6)


def test_per_fedavg_evaluates_after_one_adaptation_step() -> None:
    dm = digits_data(6)
    method = build(PerFedAvg, dm, alpha=0.3)
    clients = torch.tensor([0, 3])
    adapted = method.personalized_params(clients)
    again = method.personalized_params(clients)
    for n, t in method.global_state().items():
        assert torch.equal(adapted[n], again[n]), n  # seeded: the same batch every call
        assert not torch.equal(adapted[n][0], t), n
    assert not torch.equal(adapted["fc2.weight"][0], adapted["fc2.weight"][1])


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_per_fedavg_vectorized_equals_sequential(variant: str) -> None:
    assert_vectorized_equals_sequential(PerFedAvg, variant=variant)


# ----------------------------------------------------------------------------- all five
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        # local_epochs None: the conftest's 3 steps, not the papers' whole epochs at batch 8
        (FedBN, {**BN, "local_epochs": None}),
        (FedRoD, {}),
        (MOON, {"projection_dim": 16, "local_epochs": None}),
        (PFedMe, {"local_lr": 0.05}),
        (PerFedAvg, {"variant": "hf"}),
    ],
    ids=["FedBN", "FedRoD", "MOON", "PFedMe", "PerFedAvg"],
)
def test_recorded_rounds_give_the_eager_result_with_one_recording(
    cls: type[FedBN], kwargs: dict[str, object]
) -> None:
    from tests.test_graphs import EagerRecorder, _assert_same, _final_state

    eager = _final_state(cls, None, cuda_graphs=False, **kwargs)
    recorded = _final_state(cls, EagerRecorder(), **kwargs)
    _assert_same(eager, recorded)
    graphs = recorded[2]
    assert graphs is not None and graphs.recorded == 1 and graphs.replayed >= 3


@pytest.mark.parametrize(
    ("cls", "kwargs", "named"),
    [
        (PFedMe, {"lam": -1.0}, "lam"),
        (PFedMe, {"inner_steps": 0}, "inner_steps"),
        (PerFedAvg, {"alpha": 0.0}, "alpha"),
        (MOON, {"temperature": 0.0}, "temperature"),
        (MOON, {"mu": -0.1}, "mu"),
    ],
)
def test_bad_values_are_refused_by_name(
    cls: type[FedBN], kwargs: dict[str, object], named: str
) -> None:
    with pytest.raises(ConfigError, match=f"model.init_args.{named} ="):
        build(cls, digits_data(4), **kwargs)
