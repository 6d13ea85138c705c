"""Client-level DP for MH-pFedHNG and MH-pFedHNGD (issue 47), ``global_step: joint``: the round
is one release. Client i's delta of the global model delta_g,i (zero without it) and its
contribution c_i = (d g_i / d phi_s)^T delta_i to the shared part's gradient are clipped by one
factor f_i = min(1, S / sqrt(||delta_g,i||^2 + ||c_i||^2)); the global mean delta is
(sum_i f_i delta_g,i + noise) / qN, phi_s's gradient (sum_i f_i c_i + noise) / qN."""

from __future__ import annotations

import copy
import json
import math
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor

from lightning_pfl.conditions import Conditions
from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.engine import TrainResult
from lightning_pfl.methods.mh_parts import shared_and_personal
from lightning_pfl.methods.mh_pfedhng import MHPFedHNG
from lightning_pfl.methods.mh_pfedhngd import MHPFedHNGD
from lightning_pfl.partition import IID
from lightning_pfl.privacy import ClientDP, PrivacyAccountant
from tests.conftest import build, digits_data, fit
from tests.helpers import CONF, assert_resume_is_exact, assert_same_trained_state, run_dir
from tests.test_conditions import garbled_dropped_uploads, round_with_drops
from tests.test_mh_pfedhn import SMALL, TINY
from tests.test_privacy_scaffold_budgets import DP_FLAG

NO_DP = ClientDP(noise_multiplier=0.0, clip_norm=math.inf)
OPTIONS: dict[str, Any] = {
    "architectures": TINY,
    **SMALL,
    "local_epochs": None,
    "local_steps": 3,
    "hn_update": "mean",
    "global_step": "joint",
}


@cache
def data(equal: bool = False) -> FederatedDataModule:
    """6 digits clients (``equal``: of one size, so that p_i is DP-FedAvg's 1 / qN)."""
    if not equal:
        return digits_data(6)
    dm = digits_data(6, partition=IID(), val_fraction=0.15)
    assert len(set(dm.num_samples("train").tolist())) == 1
    return dm


def built(cls: type[MHPFedHNG] = MHPFedHNG, equal: bool = False, **kwargs: Any) -> MHPFedHNG:
    method = build(cls, data(equal), **{**OPTIONS, "clients_per_round": 4, **kwargs})
    assert isinstance(method, MHPFedHNG)
    method.configure_optimizers()
    return method


def test_no_noise_and_no_clip_is_the_run_without_dp_bit_for_bit() -> None:
    """MH-pFedHNGD (MH-pFedHNG's round, and its distillation), ``global_step: joint`` both."""

    def trained(**kwargs: Any) -> MHPFedHNG:
        method = built(MHPFedHNGD, equal=True, clients_per_round=3, **kwargs)
        fit(method, data(True), rounds=3)
        return method

    plain, private = trained(), trained(client_dp=NO_DP)
    assert private.record.extra_results["privacy"]["epsilon"] == math.inf
    assert_same_trained_state(plain, private)
    noisy = trained(client_dp=ClientDP(1e-3, 10.0))  # the check sees a changed run
    assert not torch.equal(noisy.dp_shared[0], plain.dp_shared[0])  # mlp.0.weight


class Release(NamedTuple):
    c: Tensor  # c_i flattened over phi_s, [C, |phi_s|] (float64), in client order
    delta_g: Tensor  # delta_g,i, [C, K_g] (float64), zero for a client without the global model
    holders: Tensor  # [C] bool
    global_mean: Tensor  # the global model's mean delta the server stepped with, [K_g]


def round_release(method: MHPFedHNG, clients: Tensor, round_idx: int = 0) -> Release:
    """Run round ``round_idx`` of ``clients``; return each client's release, by hand (one
    client at a time, autograd of <g_i, delta_i> at the round's phi) from what its local
    training returned, and the global mean delta the server used."""
    start = copy.deepcopy(method.hnet)
    calls: list[tuple[Tensor, TrainResult]] = []
    local_train, server_gradients = method.local_train, method.server_gradients
    means: list[Tensor] = []

    def spy(params: Any, members: Tensor, *args: Any, **kwargs: Any) -> TrainResult:
        calls.append((members, local_train(params, members, *args, **kwargs)))
        return calls[-1][1]

    def stepped(generated: list[Tensor], deltas: list[Tensor], weights: Tensor) -> None:
        means.append(deltas[0][0].detach().clone())
        server_gradients(generated, deltas, weights)

    method.local_train = spy  # type: ignore[method-assign]
    method.server_gradients = stepped  # type: ignore[method-assign]
    method.run_round(round_idx, clients)
    shared, _ = shared_and_personal(start)
    row = method.hp.num_clients  # the global model's
    flat_g = start([row]).detach()
    delta_g = torch.zeros(len(clients), flat_g.shape[1], dtype=torch.float64)
    c = torch.zeros(len(clients), sum(p.numel() for p in shared), dtype=torch.float64)
    for call, (members, result) in enumerate(calls):  # the holders' global model first
        for k, client in enumerate(members.tolist()):
            i = clients.tolist().index(client)
            own = {n: t[k : k + 1] for n, t in result.params.items()}
            if call == 0:
                delta_g[i] = (flat_g - method.global_codec.to_flat(own))[0].double()
                continue
            generated = start([client])
            kind = method.zoo.names[int(method.zoo.group_of[client])]
            delta = generated.detach() - method.codecs[kind].to_flat(own)
            grads = torch.autograd.grad((generated * delta).sum(), shared, allow_unused=True)
            c[i] = torch.cat(
                [
                    (g if g is not None else torch.zeros_like(p)).flatten().double()
                    for g, p in zip(grads, shared, strict=True)
                ]
            )
    holders = method.holds_global[clients]
    assert len(means) == 1, "one global step"
    return Release(c, delta_g, holders, means[0])


@pytest.mark.parametrize("drops", [False, True])
def test_one_clip_over_the_global_delta_and_the_shared_contribution(drops: bool) -> None:
    """f_i from the joint norm bounds each client's whole release (some clipped, some not);
    the global mean is sum_i f_i delta_g,i / qN, phi_s's gradient sum_i f_i c_i / qN; a
    dropped client (its results garbled here) adds nothing to either, which still divide by
    qN."""
    options: dict[str, Any] = {"global_clients": [0, 2, 3, 5], "hn_max_grad_norm": None}
    if drops:
        options["conditions"] = Conditions(drop_rate=0.5)
    probe = built(client_dp=NO_DP, **options)  # the same round without a clip, to pick S
    r = round_with_drops(probe) if drops else 0
    clients = probe.sample_clients(r)
    arrived = probe.arrived(clients, r)
    if drops:
        garbled_dropped_uploads(probe, r)
    first = round_release(probe, clients, r)
    joint = (first.c.square().sum(1) + first.delta_g.square().sum(1)).sqrt()
    assert first.holders.any() and not first.holders.all(), clients
    clip = float(joint[arrived].sort().values[:2].mean())  # some clipped, some not
    method = built(client_dp=ClientDP(0.0, clip), **options)
    if drops:
        garbled_dropped_uploads(method, r)
    release = round_release(method, clients, r)
    torch.testing.assert_close(release.c, first.c)  # the same training
    c_norm, g_norm = release.c.norm(dim=1), release.delta_g.norm(dim=1)
    joint = (c_norm.square() + g_norm.square()).sqrt()
    factors = (clip / joint).clamp(max=1.0) * arrived
    assert factors[arrived].min() < 1 and factors[arrived].max() == 1, "some clipped, some not"
    assert ((factors * joint) <= clip * (1 + 1e-6)).all()
    assert (g_norm[~release.holders] == 0).all(), "no global delta without the global model"
    holders = release.holders & arrived
    assert (c_norm[holders] < 0.99 * joint[holders]).all(), "delta_g carries weight in the norm"
    assert (g_norm[holders] < 0.99 * joint[holders]).all(), "c_i carries weight in it"
    expected = method.hp.clients_per_round
    want = (factors[:, None] * release.delta_g).sum(0) / expected
    torch.testing.assert_close(release.global_mean.double(), want, rtol=1e-5, atol=1e-9)
    got = torch.cat([p.grad.flatten().double() for p in method.dp_shared])  # type: ignore[union-attr]
    parts = factors[:, None] * release.c / expected
    scale = float(parts.abs().max())  # float32 rounding of the backward
    torch.testing.assert_close(got, parts.sum(0), rtol=1e-5, atol=1e-5 * scale)


def test_noise_std_is_z_s_over_qn_on_the_global_mean_and_on_phi_s() -> None:
    """Clients that upload what they received: every released tensor is noise alone, of
    std z S / qN, from two independent draws; the personal part gets none."""
    z, clip = 2.0, 0.1
    method = built(client_dp=ClientDP(z, clip), hn_max_grad_norm=None)

    def no_training(params: Any, clients: Tensor, *args: Any, **kwargs: Any) -> TrainResult:
        zero = torch.zeros(len(clients))
        return TrainResult(params, {}, zero, zero, {})

    method.local_train = no_training  # type: ignore[method-assign]
    release = round_release(method, method.sample_clients(0))
    assert not release.delta_g.any() and release.c.abs().max() < 1e-6  # batched forward's rounding
    std = z * clip / method.hp.clients_per_round
    shared = torch.cat([p.grad.flatten() for p in method.dp_shared])  # type: ignore[union-attr]
    noise = release.global_mean
    assert len(noise) > 1000 and len(shared) > 10_000
    for values in (noise, shared):
        assert values.std().item() == pytest.approx(std, rel=0.1)
        assert abs(values.mean().item()) < 4 * std / math.sqrt(len(values))
    n = len(noise)
    correlation = torch.corrcoef(torch.stack([noise, shared[:n]]))[0, 1]
    assert abs(float(correlation)) < 4 / math.sqrt(n), "two independent draws"
    embeddings = method.dp_personal[0]
    assert embeddings.grad is not None and not embeddings.grad.any(), "no noise on them"


def test_resume_is_exact_with_dp_and_unreliable_clients(tmp_path: Path) -> None:
    """MH-pFedHNGD with DP, drops and stragglers (also the conditions' resume test of
    tests/test_conditions_mh.py's rows): 6 rounds == 3 resumed to 6, epsilon included."""
    config = CONF / "mh_pfedhngd.yaml"
    assert_resume_is_exact(
        config,
        tmp_path,
        DP_FLAG,
        "--model.init_args.hn_update=mean",
        "--model.init_args.global_step=joint",
        "--model.init_args.global_net=resnet",  # the global model's batch norm in the store
        "--model.init_args.local_epochs=null",
        "--model.init_args.local_steps=2",
        "--model.init_args.conditions.drop_rate=0.5",
        "--model.init_args.conditions.stragglers.min_fraction=0.2",
    )
    runs = [run_dir(tmp_path / name, config) for name in ("straight", "resumed")]
    straight, resumed = (json.loads((r / "results.json").read_text()) for r in runs)
    assert resumed["privacy"] == straight["privacy"] and straight["privacy"]["rounds"] == 6
    expected = PrivacyAccountant(ClientDP(1.0, 0.3, 1e-4), 4, 2).epsilon(6)
    assert straight["privacy"]["epsilon"] == expected
    assert 0 < straight["costs"]["clients_reported_total"] < 6 * 2  # some dropped
