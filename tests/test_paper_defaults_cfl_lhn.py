"""Issue 43 item 3 for CFL and pFedLHN: the client SGD of CFL's authors' code (kept momentum, lr
decayed before each of a client's rounds) and pFedLHN's own server optimizer, by default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import grad

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.cfl import CFL
from lightning_pfl.methods.pfedlhn import PFedLHN
from tests.conftest import build, digits_data
from tests.helpers import CONF, assert_resume_is_exact, capture_local_training, run_dir

PATHS: dict[str, dict[str, Any]] = {
    "vmap": {"vectorize": True},
    "loop": {"vectorize": False, "client_threads": 1},
    "threads": {"vectorize": False, "client_threads": 2},
}


@pytest.mark.parametrize("path", PATHS)
def test_cfl_clients_keep_their_momentum_and_decay_their_lr_per_round_they_train(
    path: str,
) -> None:
    """felisat/clustered-federated-learning ``fl_devices.py``: ``lr *= 0.99`` before each of a
    client's rounds on an optimizer the client keeps. One local step per round at lr eta:
    client 1 trains in rounds 0 and 1: w = w_1 - eta 0.99^2 (0.9 g(w_0; b_0) + g(w_1; b_1));
    client 2 first trains in round 1: w = w_1 - eta 0.99 g(w_1; b_1). Every training path."""
    dm = digits_data(4)
    lr, mu = 0.5, 0.9
    method = build(
        CFL, dm, local_steps=1, local_lr=lr, clients_per_round=2, split_from_round=99, **PATHS[path]
    )
    assert isinstance(method, CFL)
    trained = capture_local_training(method)
    first, second = torch.tensor([0, 1]), torch.tensor([1, 2])
    w0 = {n: method.models()[n][0].clone() for n in method.arch.shapes}
    b0 = method.draw_batches(first, 0)
    method.run_round(0, first)
    w1 = {n: method.models()[n][0].clone() for n in method.arch.shapes}
    b1 = method.draw_batches(second, 1)
    method.run_round(1, second)

    def gradient(w: dict[str, torch.Tensor], batches: object, row: int) -> dict:
        x, y = dm.fetch(batches.index[row, 0])  # type: ignore[attr-defined]
        return grad(method.cross_entropy)(w, {}, x, y, batches.weight[row, 0])  # type: ignore[attr-defined]

    g0, g1 = gradient(w0, b0, 1), gradient(w1, b1, 0)
    g2 = gradient(w1, b1, 1)
    for n in method.arch.shapes:
        expected_1 = w1[n] - lr * 0.99**2 * (mu * g0[n] + g1[n])
        expected_2 = w1[n] - lr * 0.99 * g2[n]
        got = trained[1].params[n]
        torch.testing.assert_close(got[0], expected_1, rtol=1e-4, atol=1e-6, msg=n)
        torch.testing.assert_close(got[1], expected_2, rtol=1e-4, atol=1e-6, msg=n)
    momentum = method.store.gather("momentum", torch.arange(4), method.device)
    for n in method.arch.shapes:
        torch.testing.assert_close(momentum[n][1], mu * g0[n] + g1[n], rtol=1e-4, atol=1e-6)
        assert not momentum[n][3].any(), n  # never trained
    rounds = method.store.gather("rounds", torch.arange(4), method.device)["trained"]
    assert rounds.tolist() == [1, 2, 1, 0]


def test_cfl_fresh_optimizer_at_a_constant_lr_stays_reachable() -> None:
    """``keep_client_optimizer: false``, ``lr_decay: 1.0``: round 1 is w_1 - eta g(w_1; b_1)."""
    dm = digits_data(4)
    lr = 0.5
    method = build(
        CFL,
        dm,
        local_steps=1,
        local_lr=lr,
        clients_per_round=2,
        split_from_round=99,
        keep_client_optimizer=False,
        lr_decay=1.0,
    )
    assert isinstance(method, CFL)
    assert set(method.store.fields) == {"update"}
    trained = capture_local_training(method)
    clients = torch.tensor([0, 1])
    method.run_round(0, clients)
    w1 = {n: method.models()[n][0].clone() for n in method.arch.shapes}
    b1 = method.draw_batches(clients, 1)
    method.run_round(1, clients)
    for row in range(2):
        x, y = dm.fetch(b1.index[row, 0])
        g = grad(method.cross_entropy)(w1, {}, x, y, b1.weight[row, 0])
        for n in method.arch.shapes:
            torch.testing.assert_close(
                trained[1].params[n][row], w1[n] - lr * g[n], rtol=1e-4, atol=1e-6, msg=n
            )


@pytest.mark.parametrize("value", [0.0, 1.5])
def test_cfl_lr_decay_outside_its_range_is_refused(value: float) -> None:
    with pytest.raises(ConfigError, match="lr_decay"):
        build(CFL, digits_data(4), lr_decay=value)


def test_cfl_resume_keeps_each_clients_momentum_and_round_count(tmp_path: Path) -> None:
    """tests/conf/cfl.yaml runs the defaults: the kept momentum and the rounds each client has
    trained are in the checkpoint and resume exactly."""
    assert_resume_is_exact(CONF / "cfl.yaml", tmp_path)
    ckpt = torch.load(
        run_dir(tmp_path / "straight", CONF / "cfl.yaml") / "checkpoints" / "last.ckpt"
    )
    state = ckpt["pfl"]["client_state"]
    assert state["rounds"]["trained"].sum() == 6 * 2  # 6 rounds of 2 clients
    assert any(t.any() for t in state["momentum"].values())


# ----------------------------------------------------------------------------- pFedLHN
def test_pfedlhn_server_optimizer_is_the_public_codes_adamw_by_default() -> None:
    """tianyuzeke/pFedLHN's README runs ``--optim adamw --lr 3e-4`` with ``--grad-clip`` 30:
    PyTorch's AdamW (weight decay 1e-2). Its first step from gradient g moves every parameter
    to p (1 - lr wd) - lr g / (|g| + eps) (bias-corrected moments m = g, v = g^2)."""
    method = build(PFedLHN, digits_data(4))
    assert isinstance(method, PFedLHN)
    assert method.hp.hn_max_grad_norm == 30.0
    optimizer = method.configure_server_optimizer()
    params = list(method.hnet.parameters())
    before = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g) for p in params]
    for p, grad_ in zip(params, grads, strict=True):
        p.grad = grad_
    optimizer.step()
    lr, wd = 3e-4, 1e-2
    for p, p0, grad_ in zip(params, before, grads, strict=True):
        expected = p0 * (1 - lr * wd) - lr * grad_ / (grad_.abs() + 1e-8)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7)


def test_pfedlhn_pfedhns_sgd_stays_reachable() -> None:
    """``hn_optimizer: sgd`` with pFedHN's numbers (the code's argparse default): one step is
    p - lr (g + wd p)."""
    method = build(PFedLHN, digits_data(4), hn_optimizer="sgd", hn_lr=1e-2, hn_weight_decay=1e-3)
    assert isinstance(method, PFedLHN)
    optimizer = method.configure_server_optimizer()
    assert isinstance(optimizer, torch.optim.SGD)
    params = list(method.hnet.parameters())
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    for p, p0 in zip(params, before, strict=True):
        torch.testing.assert_close(p.detach(), p0 - 1e-2 * (1 + 1e-3 * p0))


def test_pfedlhn_unknown_server_optimizer_is_refused() -> None:
    with pytest.raises(ConfigError, match="hn_optimizer"):
        build(PFedLHN, digits_data(4), hn_optimizer="rmsprop")
