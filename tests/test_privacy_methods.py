"""Client-level DP over every method: each one either runs a DP round or refuses it, naming
itself, what its clients upload and why that has no DP round; the methods whose uploads are
FedAvg's (FedDyn, FedCP, FedAKT) or pFedHN's (pFedHN-PC) privatize them with the same
mechanism, and with z = 0 and S = inf equal their runs without DP bit for bit."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from lightning_pfl import methods
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.partition import IID
from lightning_pfl.privacy import REFUSED, ClientDP, privatizing_methods
from tests.conftest import build, digits_data, fit
from tests.helpers import assert_same_trained_state, round_updates_beyond
from tests.test_conditions import concrete_methods, conf_of

NO_DP = ClientDP(noise_multiplier=0.0, clip_norm=math.inf)
# what a method's DP round needs beyond its tests/conf config (its own refusal otherwise)
JOINT: dict[str, Any] = {"hn_update": "mean", "global_step": "joint"}
DP_SETTINGS: dict[str, dict[str, Any]] = {
    "MHPFedHN": {"hn_update": "mean"},
    "MHPFedHNG": JOINT,
    "MHPFedHNGD": JOINT,
    "PeFLL": {"standardize_descriptors": False},  # fixed from every client's data, unnoised
}


def privatized(name: str) -> bool:
    return name in privatizing_methods()


def test_every_method_is_privatized_or_has_a_reason_to_refuse() -> None:
    names = set(concrete_methods())
    refused = {name for name in names if not privatized(name)}
    assert refused == set(REFUSED), "a refusal without its reason, or a reason for no refusal"


@pytest.mark.parametrize("name", concrete_methods())
def test_every_method_runs_a_dp_round_or_refuses_by_name_and_reason(name: str) -> None:
    cls: type[FederatedMethod] = getattr(methods, name)
    dm = digits_data(4)
    kwargs = conf_of(name) | DP_SETTINGS.get(name, {})
    dp = ClientDP(1.0, 0.5)
    if not privatized(name):
        with pytest.raises(ConfigError) as refusal:
            build(cls, dm, client_dp=dp, **kwargs)
        uploads, why = REFUSED[name]
        assert f"{name} does not support client-level DP. Each client uploads {uploads}; {why}" in (
            str(refusal.value)
        )
        return
    method = build(cls, dm, client_dp=dp, **kwargs)
    fit(method, dm, rounds=1)
    spent = method.record.extra_results["privacy"]
    assert spent["rounds"] == 1 and 0 < spent["epsilon"] < math.inf


def tiny(cls: type[FederatedMethod], rounds: int = 0, **kwargs: Any) -> FederatedMethod:
    """``cls`` on 6 equal-sized clients (FedCP's sample weights are then DP's 1 / qN), 3 a
    round, trained for ``rounds`` rounds."""
    dm = digits_data(6, partition=IID(), val_fraction=0.15)
    assert len(set(dm.num_samples("train").tolist())) == 1
    method = build(cls, dm, **{**conf_of(cls.__name__), "clients_per_round": 3, **kwargs})
    if rounds:
        fit(method, dm, rounds=rounds)
    return method


@pytest.mark.parametrize("name", ["FedDyn", "FedCP", "FedAKT", "PFedHNPC"])
def test_no_noise_and_no_clip_is_the_run_without_dp_bit_for_bit(name: str) -> None:
    cls = getattr(methods, name)
    plain, private = tiny(cls, 3), tiny(cls, 3, client_dp=NO_DP)
    assert private.record.extra_results["privacy"]["epsilon"] == math.inf
    assert_same_trained_state(plain, private)
    noisy = tiny(cls, 3, client_dp=ClientDP(1e-3, 10.0))  # the check sees a changed run
    assert any(not torch.equal(t, noisy.state_dict()[k]) for k, t in plain.state_dict().items())


def test_feddyn_h_moves_by_the_clipped_sum() -> None:
    """h^1 = -alpha / m sum_k clip(theta_k - theta^0) and theta^1 = mean clip - h^1 / alpha."""
    clip = 0.05
    method = tiny(methods.FedDyn, client_dp=ClientDP(0.0, clip))
    deltas, norms = round_updates_beyond(method, clip)
    alpha, m = method.hp.alpha, method.num_training_clients
    for n, p in method.net.named_parameters():
        clipped = deltas[n] * (clip / norms).view(-1, *[1] * (deltas[n].dim() - 1))
        h = -alpha * clipped.sum(0) / m
        torch.testing.assert_close(method.h[n], h, rtol=1e-4, atol=1e-9)
        # the unit server step lands on mean theta_k - h / alpha: grad = theta - that
        torch.testing.assert_close(p.grad, -clipped.mean(0) + h / alpha, rtol=1e-4, atol=1e-7)
