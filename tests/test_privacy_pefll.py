"""Client-level DP for PeFLL: client i's contribution c_i = (d theta_i / d (phi, psi))^T
(delta_i + 2 lambda_theta theta_i) to the gradient of the hypernetwork phi and of the embedding
network psi (through its descriptor v_i = e(B_i; psi)) is clipped as one vector; the server's
gradient is (sum_i f_i c_i + N(0, z^2 S^2 I)) / qN, plus the regularizers of phi and psi."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_pfl.conditions import Conditions
from lightning_pfl.engine import TrainResult
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.pefll import PeFLL
from lightning_pfl.privacy import ClientDP, PrivacyAccountant
from tests.conftest import build, digits_data, fit
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_same_trained_state,
    capture_local_training,
    run_dir,
)
from tests.test_conditions import round_with_drops
from tests.test_privacy_scaffold_budgets import DP_FLAG

NO_DP = ClientDP(noise_multiplier=0.0, clip_norm=math.inf)
# a small network; the regularizers on, so that the checks see them
SMALL: dict[str, Any] = {
    "hidden_dim": 16,
    "n_hidden": 1,
    "embedding_hidden": 16,
    "standardize_descriptors": False,
    "lambda_h": 1e-3,
    "lambda_v": 1e-3,
    "lambda_theta": 1e-2,
}


def pefll(**kwargs: Any) -> PeFLL:
    method = build(PeFLL, digits_data(6), **{"clients_per_round": 3, **SMALL, **kwargs})
    assert isinstance(method, PeFLL)
    method.configure_optimizers()
    return method


def shared(method: PeFLL) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """phi (the hypernetwork without its frozen table) and psi (the embedding network)."""
    return method.network.body_parameters(), method.network.embedding_parameters()


def flat_grad(params: list[nn.Parameter]) -> Tensor:
    assert all(p.grad is not None for p in params), "every shared tensor gets a gradient"
    return torch.cat([p.grad.flatten().double() for p in params])  # type: ignore[union-attr]


def contributions(method: PeFLL, round_idx: int, clients: Tensor) -> tuple[Tensor, Tensor]:
    """Run round ``round_idx``; return each client's c_i over phi and over psi (flattened,
    float64 ``[C, |phi|]``, ``[C, |psi|]``), by autograd one client at a time from a copy of
    the networks at the round's start."""
    start = copy.deepcopy(method.network)
    x, y, weight = method.descriptor_batches(clients, round_idx)
    captured = capture_local_training(method)
    method.run_round(round_idx, clients)
    trained = captured[0].params
    lam = method.hp.lambda_theta
    phi, psi = start.body_parameters(), start.embedding_parameters()
    rows: tuple[list[Tensor], list[Tensor]] = ([], [])
    for i in range(len(clients)):
        theta = start(x[i : i + 1], y[i : i + 1], weight[i : i + 1])
        surrogate = sum(
            (t * (t.detach() - trained[n][i : i + 1] + 2 * lam * t.detach())).sum()
            for n, t in theta.items()
        )
        grads = torch.autograd.grad(surrogate, phi + psi)
        for part, gs in zip(rows, (grads[: len(phi)], grads[len(phi) :]), strict=True):
            part.append(torch.cat([g.flatten().double() for g in gs]))
    return torch.stack(rows[0]), torch.stack(rows[1])


def regularizers(method: PeFLL) -> tuple[Tensor, Tensor]:
    """2 lambda_h phi and 2 lambda_v psi (flattened, float64)."""
    phi, psi = shared(method)
    h = method.hp
    return (
        torch.cat([2 * h.lambda_h * p.detach().flatten().double() for p in phi]),
        torch.cat([2 * h.lambda_v * p.detach().flatten().double() for p in psi]),
    )


@pytest.mark.parametrize("drops", [False, True])
def test_one_clip_over_the_hypernetwork_and_the_embedding_network(drops: bool) -> None:
    """f_i = min(1, S / sqrt(||c_i(phi)||^2 + ||c_i(psi)||^2)); grad(phi, psi) =
    sum_i f_i c_i / qN + the regularizers; a dropped client adds nothing (its delta is zero,
    its lambda_theta term too) and the sum still divides by qN."""
    kwargs: dict[str, Any] = {"hn_max_grad_norm": None}
    if drops:
        kwargs |= {"clients_per_round": 4, "conditions": Conditions(drop_rate=0.5)}
    probe = pefll(client_dp=NO_DP, **kwargs)  # the same round without a clip, to pick S
    r = round_with_drops(probe) if drops else 0
    clients = probe.sample_clients(r)
    arrived = probe.arrived(clients, r)
    phi_c, psi_c = contributions(probe, r, clients)
    joint = (phi_c.square().sum(1) + psi_c.square().sum(1)).sqrt()
    clip = float(joint[arrived].sort().values[:2].mean())  # some clipped, some not
    method = pefll(client_dp=ClientDP(0.0, clip), **kwargs)
    phi_reg, psi_reg = regularizers(method)
    phi_c, psi_c = contributions(method, r, clients)
    phi_norm, psi_norm = phi_c.norm(dim=1), psi_c.norm(dim=1)
    joint = (phi_norm.square() + psi_norm.square()).sqrt()
    factors = (clip / joint).clamp(max=1.0) * arrived
    assert factors[arrived].min() < 1 and factors[arrived].max() == 1, "some clipped, some not"
    assert ((factors * joint) <= clip * (1 + 1e-6)).all(), "every clipped norm <= S"
    assert (phi_norm[arrived] < 0.99 * joint[arrived]).all(), "psi carries weight in the norm"
    assert (psi_norm[arrived] < 0.99 * joint[arrived]).all(), "phi carries weight in the norm"
    expected = method.hp.clients_per_round
    phi, psi = shared(method)
    for got, c, reg in ((flat_grad(phi), phi_c, phi_reg), (flat_grad(psi), psi_c, psi_reg)):
        parts = factors.view(-1, 1) * c / expected
        scale = float(parts.abs().max())  # float32 rounding of the backward
        torch.testing.assert_close(got, parts.sum(0) + reg, rtol=1e-5, atol=1e-5 * scale)


def no_training(method: PeFLL) -> None:
    """Clients return what they received: delta_i = 0 (with lambda_theta 0, c_i = 0)."""

    def local_train(params: Any, clients: Tensor, *args: Any, **kwargs: Any) -> TrainResult:
        zero = torch.zeros(len(clients))
        return TrainResult(params, {}, zero, zero, {})

    method.local_train = local_train  # type: ignore[method-assign]


def test_noise_std_is_z_s_over_qn_on_phi_and_on_psi() -> None:
    z, clip = 2.0, 0.1
    released = []
    for _ in range(2):  # seeded by round: twice the same draw
        method = pefll(
            client_dp=ClientDP(z, clip),
            hn_max_grad_norm=None,
            lambda_h=0.0,
            lambda_v=0.0,
            lambda_theta=0.0,
        )
        no_training(method)
        method.run_round(0, method.sample_clients(0))
        released.append([flat_grad(part) for part in shared(method)])
    std = z * clip / method.hp.clients_per_round
    for noise in released[0]:
        assert len(noise) > 1000
        assert noise.std().item() == pytest.approx(std, rel=0.05)
        assert abs(noise.mean().item()) < 4 * std / math.sqrt(len(noise))
    phi, psi = shared(method)
    for p in phi + psi:  # every released tensor, each of its own noise
        assert p.grad is not None and p.grad.std() > 0.5 * std, p.shape
    assert all(torch.equal(a, b) for a, b in zip(*released, strict=True))


def test_no_noise_and_no_clip_is_the_run_without_dp_bit_for_bit() -> None:
    """z = 0 and S = inf: every tensor and the optimizer's state as without DP, regularizers
    and the server's clip included."""

    def trained(**kwargs: Any) -> PeFLL:
        dm = digits_data(6)
        method = build(PeFLL, dm, **{"clients_per_round": 3, **SMALL, **kwargs})
        assert isinstance(method, PeFLL)
        fit(method, dm, rounds=3)
        return method

    plain, private = trained(), trained(client_dp=NO_DP)
    spent = private.record.extra_results["privacy"]
    assert spent["epsilon"] == math.inf and spent["rounds"] == 3, "the DP round ran"
    assert_same_trained_state(plain, private)
    a, b = (m.server_optimizer for m in (plain, private))
    assert a is not None and b is not None
    assert str(a.state_dict()) == str(b.state_dict())


def test_the_descriptor_standardization_is_refused_under_dp() -> None:
    with pytest.raises(ConfigError, match="standardize_descriptors: false"):
        pefll(client_dp=ClientDP(1.0, 1.0), standardize_descriptors=True)


def test_pefll_resume_is_exact_with_dp(tmp_path: Path) -> None:
    config = CONF / "pefll.yaml"
    assert_resume_is_exact(
        config, tmp_path, DP_FLAG, "--model.init_args.standardize_descriptors=false"
    )
    runs = [run_dir(tmp_path / name, config) for name in ("straight", "resumed")]
    straight, resumed = (json.loads((r / "results.json").read_text()) for r in runs)
    assert resumed["privacy"] == straight["privacy"]
    assert straight["privacy"]["epsilon"] == (
        PrivacyAccountant(ClientDP(1.0, 0.3, 1e-4), 4, 2).epsilon(6)
    )
