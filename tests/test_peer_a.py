"""SCAFFOLD, FedOpt, FedDyn, FedNova and q-FFL (issue 46): each method's math against a
hand-computed case, vectorized == one by one (exact resume with its server and client state:
tests/test_cli.py, RESUMED)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import grad

from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.engine import Params
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import FedAvg, FederatedMethod
from lightning_pfl.methods.feddyn import LINEAR, FedDyn
from lightning_pfl.methods.fednova import FedNova, momentum_norm
from lightning_pfl.methods.fedopt import AdaptiveServerOptimizer, FedOpt
from lightning_pfl.methods.fedprox import anchor
from lightning_pfl.methods.qffl import QFFL
from lightning_pfl.methods.scaffold import SCAFFOLD
from lightning_pfl.params import prefixed
from lightning_pfl.partition import ClassesPerClient
from tests.conftest import build, digits_data
from tests.helpers import (
    assert_vectorized_equals_sequential,
    capture_local_training,
)


def minibatch_gradients(method: FederatedMethod, params: Params, clients: Tensor) -> Params:
    """Gradient of each client's cross-entropy at ``params`` (stacked) on its first batch of
    round 0."""
    batches = method.draw_batches(clients, 0)
    out: list[Params] = []
    for c in range(len(clients)):
        x, y = method.data.fetch(batches.index[c, 0])
        one = {n: t[c] for n, t in params.items()}
        out.append(grad(method.cross_entropy)(one, {}, x, y, batches.weight[c, 0]))
    return {n: torch.stack([g[n] for g in out]) for n in out[0]}


def randomized(tensors: Params, seed: int, scale: float = 0.05) -> Params:
    g = torch.Generator().manual_seed(seed)
    return {n: scale * torch.randn(t.shape, generator=g) for n, t in tensors.items()}


# ----------------------------------------------------------------- SCAFFOLD
def test_scaffold_one_step_round_sets_c_i_to_the_gradient_and_corrects_the_step() -> None:
    """With K = 1, option II gives c_i+ = c_i - c + (g - c_i + c) = g_i(x); the step is
    x - eta_l (g_i - c_i + c); c moves by sum_i (c_i+ - c_i) / N."""
    dm = digits_data(6)
    lr, n = 0.1, 6
    method = build(SCAFFOLD, dm, local_steps=1, local_lr=lr, clients_per_round=3)
    assert isinstance(method, SCAFFOLD)
    clients = torch.tensor([0, 2, 5])
    c = randomized(method.control.tensors(), 1)
    c_all = {k: torch.stack([v * (i + 1) for i in range(n)]) for k, v in randomized(c, 2).items()}
    for k in c:
        method.control[k].copy_(c[k])
    method.store.fields["control"] = {k: v.clone() for k, v in c_all.items()}
    x = method.global_state()
    g = minibatch_gradients(method, {k: x[k].expand(3, *x[k].shape) for k in c}, clients)
    method.run_round(0, clients)
    new_c_i = method.store.gather("control", clients, method.device)
    for k in c:
        c_i = c_all[k][clients]
        torch.testing.assert_close(new_c_i[k], g[k], rtol=1e-4, atol=1e-6, msg=k)
        step = lr * (g[k] - c_i + c[k]).mean(0)  # x - mean(y_i) with uniform weights
        param = dict(method.net.named_parameters())[k]
        torch.testing.assert_close(param.grad, step, rtol=1e-4, atol=1e-7, msg=k)
        expected_c = c[k] + (g[k] - c_i).sum(0) / n
        torch.testing.assert_close(method.control[k], expected_c, rtol=1e-4, atol=1e-6, msg=k)
        # clients not sampled keep their control variates
        untouched = torch.tensor([1, 3, 4])
        assert torch.equal(method.store.fields["control"][k][untouched], c_all[k][untouched])
        assert (c[k] - c_i).abs().max() > 1e-3  # the correction matters here


def test_scaffold_sends_and_receives_two_models_per_client() -> None:
    dm = digits_data(6)
    method = build(SCAFFOLD, dm, clients_per_round=3)
    assert isinstance(method, SCAFFOLD)
    method.run_round(0, torch.tensor([0, 1, 2]))
    model = sum(t.numel() * t.element_size() for t in method.global_state().values())
    assert method.record.round_bytes == [3 * 2 * model, 3 * 2 * model]


def test_scaffold_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(SCAFFOLD)


# ----------------------------------------------------------------- FedOpt
@pytest.mark.parametrize("adaptivity", ["adagrad", "adam", "yogi"])
def test_fedopt_server_step_matches_algorithm_2_by_hand(adaptivity: str) -> None:
    """Two server steps on one coordinate, written out: Delta = -grad, m and v from
    m_{-1} = 0, v_{-1} = tau^2, x += eta m / (sqrt(v) + tau), no bias correction."""
    eta, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    x = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = AdaptiveServerOptimizer([x], adaptivity, eta, b1, b2, tau)  # type: ignore[arg-type]
    expected = [1.0, -2.0]
    m, v = [0.0, 0.0], [tau**2, tau**2]
    for deltas in ([0.5, 0.01], [-0.2, 0.001]):  # yogi: v < Delta^2, then v > Delta^2
        x.grad = -torch.tensor(deltas, dtype=torch.float64)
        opt.step()
        for j, d in enumerate(deltas):
            m[j] = b1 * m[j] + (1 - b1) * d
            if adaptivity == "adagrad":
                v[j] = v[j] + d * d
            elif adaptivity == "adam":
                v[j] = b2 * v[j] + (1 - b2) * d * d
            else:
                v[j] = v[j] - (1 - b2) * d * d * (1.0 if v[j] > d * d else -1.0)
            expected[j] += eta * m[j] / (v[j] ** 0.5 + tau)
        torch.testing.assert_close(x.detach(), torch.tensor(expected, dtype=torch.float64))


def test_fedopt_averages_updates_uniformly() -> None:
    dm = digits_data(6)
    method = build(FedOpt, dm, clients_per_round=3)
    assert isinstance(method, FedOpt)
    trained = capture_local_training(method)
    clients = torch.tensor([0, 2, 5])
    x = {n: t.clone() for n, t in method.global_state().items()}
    method.run_round(0, clients)
    sizes = dm.num_samples("train")[clients]
    assert sizes.unique().numel() > 1  # sample weights would differ
    for name, p in method.net.named_parameters():
        expected = x[name] - trained[0].params[name].mean(0)
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-7, msg=name)


def test_fedopt_refuses_server_momentum() -> None:
    with pytest.raises(ConfigError, match="beta1"):
        build(FedOpt, digits_data(6), server_momentum=0.9)


def test_fedopt_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedOpt, adaptivity="yogi")


# ----------------------------------------------------------------- FedDyn
def test_feddyn_local_gradient_is_ce_minus_state_plus_alpha_times_drift() -> None:
    dm = digits_data(4)
    alpha = 0.3
    method = build(FedDyn, dm, alpha=alpha)
    assert isinstance(method, FedDyn)
    names = method.trainable
    start = method.arch.initial_params()
    theta = randomized(start, 3, scale=1.0)
    theta = {n: start[n] + theta[n] for n in names}
    state = randomized(start, 4)
    context = anchor(start, names) | prefixed(LINEAR, {n: -state[n] for n in names})
    index = torch.arange(16)
    x, y = dm.fetch(index)
    w = torch.ones(16)
    actual = grad(method.dynamic_loss)(theta, context, x, y, w)
    ce = grad(method.cross_entropy)(theta, {}, x, y, w)
    for n in names:
        expected = ce[n] - state[n] + alpha * (theta[n] - start[n])
        torch.testing.assert_close(actual[n], expected, rtol=1e-4, atol=1e-6, msg=n)


def test_feddyn_round_updates_client_state_h_and_the_server_model_by_hand() -> None:
    """One local step of plain SGD from theta: theta_k = theta - lr (g_k - s_k) (the proximal
    term is zero at the start); s_k+ = s_k - alpha (theta_k - theta);
    h+ = h - alpha/m sum (theta_k - theta); theta+ = mean theta_k - h+ / alpha."""
    dm = digits_data(6)
    lr, alpha, m = 0.1, 0.5, 6
    method = build(
        FedDyn,
        dm,
        alpha=alpha,
        local_lr=lr,
        local_steps=1,
        local_weight_decay=0.0,
        local_max_grad_norm=None,
        clients_per_round=3,
    )
    assert isinstance(method, FedDyn)
    clients = torch.tensor([1, 3, 4])
    names = method.trainable
    s_all = {
        n: torch.stack([v * (i + 1) for i in range(m)])
        for n, v in randomized(method.arch.initial_params(), 5).items()
    }
    method.store.fields["gradient"] = {n: v.clone() for n, v in s_all.items()}
    h = randomized(method.arch.initial_params(), 6)
    for n in names:
        method.h[n].copy_(h[n])
    theta = method.global_state()
    g = minibatch_gradients(
        method, {n: theta[n].expand(3, *theta[n].shape) for n in names}, clients
    )
    trained = capture_local_training(method)
    method.run_round(0, clients)
    new_state = method.store.gather("gradient", clients, method.device)
    params = dict(method.net.named_parameters())
    for n in names:
        s_k = s_all[n][clients]
        theta_k = theta[n] - lr * (g[n] - s_k)
        torch.testing.assert_close(trained[0].params[n], theta_k, rtol=1e-4, atol=1e-6, msg=n)
        drift = theta_k - theta[n]
        torch.testing.assert_close(new_state[n], s_k - alpha * drift, rtol=1e-4, atol=1e-6)
        h_new = h[n] - alpha * drift.sum(0) / m
        torch.testing.assert_close(method.h[n], h_new, rtol=1e-4, atol=1e-6, msg=n)
        target = theta_k.mean(0) - h_new / alpha
        torch.testing.assert_close(params[n].grad, theta[n] - target, rtol=1e-4, atol=1e-6)
        assert (h_new / alpha).abs().max() > 1e-2  # h matters here


def test_feddyn_refuses_a_server_learning_rate() -> None:
    with pytest.raises(ConfigError, match="server_lr"):
        build(FedDyn, digits_data(6), server_lr=0.5)


def test_feddyn_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedDyn)


# ----------------------------------------------------------------- FedNova
def test_fednova_momentum_norm_is_the_sum_of_a_i() -> None:
    """a_i = [sum_{j<tau-k} rho^j for k = 0..tau-1] (momentum SGD without dampening)."""
    for rho in (0.0, 0.5, 0.9):
        for tau in range(1, 7):
            a = [sum(rho**j for j in range(tau - k)) for k in range(tau)]
            actual = float(momentum_norm(torch.tensor([tau]), rho)[0])
            assert abs(actual - sum(a)) < 1e-9, (rho, tau)


def unequal_digits() -> FederatedDataModule:
    return digits_data(6, partition=ClassesPerClient(2, low=0.15, high=0.85))


def test_fednova_normalizes_unequal_local_work_by_hand() -> None:
    """x - x+ = tau_eff sum_i p_i (x - x_i) / ||a_i||_1, tau_eff = sum_i p_i ||a_i||_1."""
    dm = unequal_digits()
    rho = 0.5
    method = build(FedNova, dm, local_epochs=1, local_momentum=rho, clients_per_round=3)
    assert isinstance(method, FedNova)
    trained = capture_local_training(method)
    clients = torch.tensor([0, 2, 5])
    x = {n: t.clone() for n, t in method.global_state().items()}
    method.run_round(0, clients)
    steps = [int(s) for s in trained[0].steps]
    assert len(set(steps)) > 1, steps  # unequal local work
    n = dm.num_samples("train")[clients].double()
    p = n / n.sum()
    norms = [sum(sum(rho**j for j in range(t - k)) for k in range(t)) for t in steps]
    tau_eff = sum(float(p[i]) * norms[i] for i in range(3))
    for name, param in method.net.named_parameters():
        updates = [x[name] - trained[0].params[name][i] for i in range(3)]
        expected = tau_eff * torch.stack([float(p[i]) * updates[i] / norms[i] for i in range(3)])
        torch.testing.assert_close(param.grad, expected.sum(0), rtol=1e-5, atol=1e-7, msg=name)
        fedavg = torch.stack([float(p[i]) * updates[i] for i in range(3)]).sum(0)
        assert (expected.sum(0) - fedavg).abs().max() > 1e-4  # the normalization matters here


def test_fednova_with_equal_steps_and_plain_sgd_is_fedavg() -> None:
    dm = unequal_digits()
    grads = []
    for cls in (FedAvg, FedNova):
        plain_sgd = {"local_momentum": 0.0, "local_weight_decay": 0.0, "local_max_grad_norm": None}
        method = build(cls, dm, clients_per_round=3, **plain_sgd)
        assert isinstance(method, FedAvg)
        method.run_round(0, torch.tensor([0, 2, 5]))
        grads.append({n: p.grad for n, p in method.net.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_fednova_vectorized_equals_sequential() -> None:
    # vanilla SGD: at rho = 0.9 and batch 8 the two paths' 1e-6 rounding differences grew to
    # 4e-2 in three rounds (FedNova scales short clients' updates up), past the tolerance
    assert_vectorized_equals_sequential(
        FedNova,
        local_epochs=1,
        local_momentum=0.0,
        data_kwargs={"partition": ClassesPerClient(2, 0.15, 0.85)},
    )


# ----------------------------------------------------------------- q-FFL
def test_qffl_step_is_sum_delta_over_sum_h_by_hand() -> None:
    """F_k = mean training CE of w^t over all of client k's samples; Delta w_k = L (w - wbar_k);
    w - w+ = sum_k F_k^q Delta w_k / sum_k (q F_k^{q-1} ||Delta w_k||^2 + L F_k^q)."""
    dm = digits_data(6)
    q, lr = 2.0, 0.1
    method = build(QFFL, dm, q=q, local_lr=lr, clients_per_round=3)
    assert isinstance(method, QFFL)
    lip = 1 / lr
    trained = capture_local_training(method)
    clients = torch.tensor([0, 3, 4])
    w = {n: t.clone() for n, t in method.global_state().items()}
    method.run_round(0, clients)
    losses = []
    for c in clients:
        index = next(dm.eval_blocks(c.view(1), "train", 10**6))[0][0]
        x, y = dm.fetch(index)
        losses.append(float(F.cross_entropy(method.arch(w, x), y)))
    names = list(method.arch.shapes)
    delta = [{n: lip * (w[n] - trained[0].params[n][i]) for n in names} for i in range(3)]
    norms = [sum(float((d[n] ** 2).sum()) for n in names) for d in delta]
    hs = [q * f ** (q - 1) * s + lip * f**q for f, s in zip(losses, norms, strict=True)]
    assert max(losses) - min(losses) > 1e-3  # the clients weigh differently
    for name, param in method.net.named_parameters():
        expected = sum(f**q * d[name] for f, d in zip(losses, delta, strict=True)) / sum(hs)
        torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-8, msg=name)


def test_qffl_with_q_zero_is_the_uniform_mean_update() -> None:
    dm = digits_data(6)
    method = build(QFFL, dm, q=0.0, lipschitz=3.0, clients_per_round=3)
    assert isinstance(method, QFFL)
    trained = capture_local_training(method)
    w = {n: t.clone() for n, t in method.global_state().items()}
    method.run_round(0, torch.tensor([1, 2, 5]))
    for name, param in method.net.named_parameters():
        expected = (w[name] - trained[0].params[name]).mean(0)
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-8, msg=name)


def test_qffl_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(QFFL)
