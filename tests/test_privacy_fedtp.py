"""Client-level DP for FedTP and its variants (issue 47).

Client i's release is the pair (Delta x_i, c_i): its shared tensors' update and its
contribution c_i = (dW_i / d phi)^T (W_i - W~_i) to the gradient of the shared hypernetwork
phi. Both are clipped by one factor f_i = min(1, S / ||[Delta x_i, c_i]||), both sums divide by
qN and carry N(0, z^2 S^2 I) / qN; the embeddings v_i are personal and take the unclipped
deltas with FedTP's sample weights."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from lightning_pfl.conditions import Conditions
from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.engine import TrainResult
from lightning_pfl.methods.fedtp import FedTP, FedTPKNN, FedTPPer, FedTPRoD
from lightning_pfl.models import HyperNetwork
from lightning_pfl.partition import IID
from lightning_pfl.privacy import ClientDP
from tests.conftest import build, digits_data, fit
from tests.helpers import CONF, assert_same_trained_state, capture_local_training
from tests.test_conditions import round_with_drops
from tests.test_privacy_scaffold_budgets import assert_resume_is_exact_with_dp

NO_DP = ClientDP(noise_multiplier=0.0, clip_norm=math.inf)
# no dropout: a round run outside fit draws it from the unseeded global generator, so that
# the probe round and its clipped twin would train differently
VIT_ARGS = {"patch": 2, "dim": 16, "depth": 2, "heads": 2, "head_dim": 8, "mlp_dim": 32} | {
    "dropout": 0.0,
    "emb_dropout": 0.0,
}


def fedtp(cls: type[FedTP] = FedTP, dm: FederatedDataModule | None = None, **kwargs: Any) -> FedTP:
    """``cls`` with a tiny ViT on 6 digits clients, 3 a round (unless ``kwargs`` say)."""
    dm = dm or digits_data(6)
    method = build(
        cls,
        dm,
        **{"net": "vit", "net_args": VIT_ARGS, "local_epochs": None, "clients_per_round": 3}
        | kwargs,
    )
    assert isinstance(method, FedTP)
    method.configure_optimizers()
    return method


def split_hnet(hnet: HyperNetwork) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """phi (every hypernetwork parameter but the embeddings) and the embeddings."""
    personal = list(hnet.personal_parameters())
    ids = {id(p) for p in personal}
    return [p for p in hnet.parameters() if id(p) not in ids], personal


class Release(NamedTuple):
    delta_x: dict[str, Tensor]  # x_i - x, [C, ...]
    c: Tensor  # c_i flattened over phi, [C, |phi|] (float64)
    v_grad: list[Tensor]  # sum_i p_i (dW_i / d v)^T (W_i - W~_i), without DP
    weights: Tensor  # p_i over the clients that reported back


def round_release(method: FedTP, round_idx: int, clients: Tensor) -> Release:
    """Run round ``round_idx``; return what each client releases, by hand from its training."""
    sent = {n: t.clone() for n, t in method.shared_payload(clients).items()}
    start = copy.deepcopy(method.hnet)  # phi and v at the round's start
    captured = capture_local_training(method)
    method.run_round(round_idx, clients)
    trained = captured[0].params
    generated = start(clients)
    deltas = {n: g.detach() - trained[n] for n, g in generated.items()}
    phi, embeddings = split_hnet(start)
    rows = []
    for i in range(len(clients)):  # J_i^T (W_i - W~_i), one client at a time
        surrogate = sum((generated[n][i] * deltas[n][i]).sum() for n in generated)
        grads = torch.autograd.grad(surrogate, phi, retain_graph=True)
        rows.append(torch.cat([g.flatten().double() for g in grads]))
    weights = method.client_weights(clients, round_idx)
    weighted = sum(
        (weights.to(g.dtype).view(-1, 1, 1) * g * deltas[n]).sum() for n, g in generated.items()
    )
    v_grad = list(torch.autograd.grad(weighted, embeddings))
    delta_x = {n: trained[n] - sent[n] for n in sent}
    return Release(delta_x, torch.stack(rows), v_grad, weights)


def norms_of(release: Release) -> tuple[Tensor, Tensor]:
    x = torch.cat([t.flatten(1).double() for t in release.delta_x.values()], 1).norm(dim=1)
    return x, release.c.norm(dim=1)


@pytest.mark.parametrize("drops", [False, True])
def test_one_clip_over_the_shared_update_and_the_hypernetwork_contribution(drops: bool) -> None:
    """f_i = min(1, S / sqrt(||Delta x_i||^2 + ||c_i||^2)); the shared tensors move by
    sum_i f_i Delta x_i / qN, phi's gradient is sum_i f_i c_i / qN, v's is FedTP's own; with
    dropped clients (which add nothing) the sums still divide by qN."""
    kwargs: dict[str, Any] = (
        {"clients_per_round": 4, "conditions": Conditions(drop_rate=0.5)} if drops else {}
    )
    probe = fedtp(client_dp=NO_DP, **kwargs)  # the same round without a clip, to pick S
    r = round_with_drops(probe) if drops else 0
    clients = probe.sample_clients(r)
    arrived = probe.arrived(clients, r)
    x_norm, c_norm = norms_of(round_release(probe, r, clients))
    joint = (x_norm.square() + c_norm.square()).sqrt()
    assert torch.equal(joint == 0, ~arrived), "a dropped client releases nothing"
    reported = joint[arrived].sort().values
    clip = float(reported[:2].mean())  # between the two smallest: some clipped, some not
    method = fedtp(client_dp=ClientDP(0.0, clip), **kwargs)
    release = round_release(method, r, clients)
    x_norm, c_norm = norms_of(release)
    joint = (x_norm.square() + c_norm.square()).sqrt()
    factors = (clip / joint).clamp(max=1.0)
    assert factors[arrived].min() < 1 and factors[arrived].max() == 1, "some clipped, some not"
    assert ((factors * joint) <= clip * (1 + 1e-6)).all()
    assert (x_norm[arrived] < 0.99 * joint[arrived]).all(), "c_i carries weight in the norm"
    assert (c_norm[arrived] < 0.99 * joint[arrived]).all(), "Delta x_i carries weight in it"
    expected = method.hp.clients_per_round
    params = dict(method.net.named_parameters())
    for name, delta in release.delta_x.items():  # grad = x - (x + sum_i f_i Delta x_i / qN)
        f = factors.view(-1, *[1] * (delta.dim() - 1))
        grad = params[name].grad
        assert grad is not None, name
        want = -(f * delta.double()).sum(0) / expected
        torch.testing.assert_close(grad.double(), want, rtol=1e-4, atol=1e-7, msg=name)
    phi, embeddings = split_hnet(method.hnet)
    got = torch.cat([p.grad.flatten().double() for p in phi])  # type: ignore[union-attr]
    parts = factors.view(-1, 1) * release.c / expected
    scale = float(parts.abs().max())  # float32 rounding of the backward
    torch.testing.assert_close(got, parts.sum(0), rtol=1e-5, atol=1e-5 * scale)
    for p, want in zip(embeddings, release.v_grad, strict=True):  # unclipped, weights p_i
        assert p.grad is not None
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-8)
    assert not torch.allclose(release.weights[arrived], release.weights[arrived][:1])


def no_training(method: FedTP) -> None:
    """Clients upload what they received: Delta x_i = 0 and W~_i = W_i, so c_i = 0."""

    def train_with_personal(round_idx: int, clients: Tensor, start: Any) -> TrainResult:
        zero = torch.zeros(len(clients))
        return TrainResult(start, {}, zero, zero, {})

    method.train_with_personal = train_with_personal  # type: ignore[method-assign]


def round_noise(method: FedTP) -> tuple[Tensor, Tensor, Tensor]:
    """The shared tensors', phi's and the embeddings' gradients of round 0 without training."""
    no_training(method)
    clients = method.sample_clients(0)
    shared = set(method.shared_payload(clients))
    method.run_round(0, clients)
    phi, embeddings = split_hnet(method.hnet)
    grads = [p.grad for n, p in method.net.named_parameters() if n in shared]
    assert all(g is not None for g in grads)
    return (
        torch.cat([g.flatten() for g in grads if g is not None]),
        torch.cat([p.grad.flatten() for p in phi]),  # type: ignore[union-attr]
        torch.cat([p.grad.flatten() for p in embeddings]),  # type: ignore[union-attr]
    )


def test_noise_std_is_z_s_over_qn_on_the_shared_tensors_and_on_phi() -> None:
    z, clip = 2.0, 0.1
    method = fedtp(client_dp=ClientDP(z, clip))
    shared, phi, embeddings = round_noise(method)
    std = z * clip / method.hp.clients_per_round
    assert len(shared) > 3000 and len(phi) > 3000
    for noise in (shared, phi):
        assert noise.std().item() == pytest.approx(std, rel=0.05)
        assert abs(noise.mean().item()) < 4 * std / math.sqrt(len(noise))
    assert torch.equal(embeddings, torch.zeros_like(embeddings)), "no noise on the embeddings"
    n = min(len(shared), len(phi))
    correlation = torch.corrcoef(torch.stack([shared[:n], phi[:n]]))[0, 1]
    assert abs(float(correlation)) < 4 / math.sqrt(n), "two independent draws"
    again = round_noise(fedtp(client_dp=ClientDP(z, clip)))  # seeded by round: the same
    assert torch.equal(shared, again[0]) and torch.equal(phi, again[1])


@pytest.mark.parametrize("cls", [FedTP, FedTPPer, FedTPRoD, FedTPKNN])
def test_no_noise_and_no_clip_is_the_run_without_dp_bit_for_bit(cls: type[FedTP]) -> None:
    def trained(**kwargs: Any) -> FedTP:
        # equal client sizes: FedTP's sample weights are then DP-FedAvg's 1 / qN
        dm = digits_data(6, partition=IID(), val_fraction=0.15)
        assert len(set(dm.num_samples("train").tolist())) == 1
        method = fedtp(cls, dm, **kwargs)
        fit(method, dm, rounds=3)
        return method

    plain, private = trained(), trained(client_dp=NO_DP)
    assert private.record.extra_results["privacy"]["epsilon"] == math.inf
    assert_same_trained_state(plain, private)
    noisy = trained(client_dp=ClientDP(1e-3, 10.0))  # the check sees a changed run
    for key in ("net.embed.weight", "hnet.mlp.0.weight"):  # a shared tensor and phi
        assert not torch.equal(noisy.state_dict()[key], plain.state_dict()[key]), key


def test_fedtp_resume_is_exact_with_dp(tmp_path: Path) -> None:
    assert_resume_is_exact_with_dp(CONF / "fedtp.yaml", tmp_path, 4, 2)
