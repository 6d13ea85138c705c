"""Unreliable clients for MH-pFedHN, MH-pFedHNG and MH-pFedHNGD (docs/conditions.md): reliable
conditions change no bit, a dropped client's batch-norm statistics, local layers and copy of
the global model's statistics end the round as they began, the hypernetwork's update (every
``hn_update``) and the global model's step read only the clients that arrived, a round where
none arrived moves nothing and stragglers take exactly their drawn steps. Resume with drops and
stragglers is exact: tests/test_privacy_mh_global.py (MH-pFedHNGD with DP as well, one run of
the CLI's three for both)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from lightning_pfl.conditions import Conditions, Stragglers, straggler_steps
from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.engine import TrainResult
from lightning_pfl.methods.mh_pfedhn import MHPFedHN
from lightning_pfl.methods.mh_pfedhng import MHPFedHNG
from lightning_pfl.methods.mh_pfedhngd import MHPFedHNGD
from tests.conftest import build, digits_data, fit
from tests.test_conditions import (
    DROP,
    arrivals,
    assert_store_unchanged,
    garbled_dropped_uploads,
    one_round,
    round_with_drops,
    server_state,
    state,
    store_copy,
)
from tests.test_mh_pfedhn import SMALL, TINY

# row -> (class, arguments beyond TINY's zoo and SMALL's sizes); together every hn_update,
# Table 13's local layers, a partial set of holders and a global model with batch norm
ROWS: dict[str, tuple[type[MHPFedHN], dict[str, Any]]] = {
    "MHPFedHN": (MHPFedHN, {}),  # hn_update: sequential, the default
    "MHPFedHN-mean": (MHPFedHN, {"hn_update": "mean", "local_layers": 1}),
    "MHPFedHN-per_client": (MHPFedHN, {"hn_update": "per_client"}),
    "MHPFedHNG": (MHPFedHNG, {"hn_update": "mean", "global_clients": 0.5}),
    "MHPFedHNGD": (MHPFedHNGD, {"global_net": "res", "distill_weight": 0.5}),
}
TRAINED = 2  # rounds before the one under test
# a row of each way the round's server steps (sequential, the global step, mean), for the
# reliable run, and of each client-store field (batch norm, Table 13's local layers, the global
# ResNet's batch norm), for the dropped client's state
STEPPING = ["MHPFedHN", "MHPFedHNG", "MHPFedHNGD"]
STORING = ["MHPFedHN-mean", "MHPFedHNG", "MHPFedHNGD"]
STEPS = {"local_epochs": None, "local_steps": 3}  # a few local steps (SMALL trains an epoch)


def options(name: str, **kwargs: Any) -> tuple[type[MHPFedHN], dict[str, Any]]:
    cls, arguments = ROWS[name]
    return cls, {"architectures": TINY, **SMALL, **STEPS, **arguments, **kwargs}


@cache
def data() -> FederatedDataModule:
    """6 digits clients, split once for the module (loading them costs more than a round)."""
    return digits_data(6)


def built(name: str, clients_per_round: int, rounds: int = 0, **kwargs: Any) -> MHPFedHN:
    """Row ``name``, trained for ``rounds`` rounds."""
    cls, arguments = options(name, **kwargs)
    method = build(cls, data(), clients_per_round=clients_per_round, **arguments)
    assert isinstance(method, MHPFedHN)
    if rounds:
        fit(method, data(), rounds=rounds)
    return method


@pytest.mark.parametrize("name", STEPPING)
def test_reliable_conditions_equal_a_run_without_them_bit_for_bit(name: str) -> None:
    today = state(built(name, 3, TRAINED))
    masked = built(name, 3, TRAINED, conditions=Conditions(stragglers=Stragglers(rate=0.0)))
    for key, tensor in state(masked).items():
        assert torch.equal(tensor, today[key]), key


def client_row(method: MHPFedHN, field: str, client: int) -> int | None:
    """The row of ``client`` in client-store ``field`` (None: the field has none of it)."""
    if field == "global_buffers":  # one row per client; only holders ever train it
        assert isinstance(method, MHPFedHNG)
        return client if bool(method.holds_global[client]) else None
    kind = field.split(".", 1)[1]  # buffers.<kind> and local.<kind>: a row per member
    if method.zoo.names[int(method.zoo.group_of[client])] != kind:
        return None
    return int(method.zoo.row_of[client])


@pytest.mark.parametrize("name", STORING)
def test_a_dropped_clients_state_is_untouched(name: str) -> None:
    """Every per-client tensor of a dropped client ends the round as it began; every one of
    a client that arrived changed."""
    method = built(name, 4, TRAINED, conditions=Conditions(**DROP))  # kept states differ
    r = next(r for r in range(TRAINED, 50) if 0 < int(arrivals(method, r).sum()) < 4)
    before = store_copy(method)
    clients, _ = one_round(method, r)
    arrived = method.arrived(clients, r)
    checked = set()
    for field, tensors in method.store.fields.items():
        for client, came in zip(clients.tolist(), arrived.tolist(), strict=True):
            row = client_row(method, field, client)
            if row is None:
                continue
            for key, tensor in tensors.items():
                same = torch.equal(tensor[row], before[field][key][row])
                assert same != came, (field, key, client, came)
                checked.add((field, came))
    assert {came for _, came in checked} == {True, False}, checked


@pytest.mark.parametrize("name", ROWS)
def test_the_server_reads_only_the_uploads_that_arrived(name: str) -> None:
    """The same round, once with the dropped clients' results garbled (every hn_update, and
    the global model's step): the server's steps and gradients are the same, and not empty."""
    honest, garbled = (built(name, 4, conditions=Conditions(**DROP)) for _ in range(2))
    r = round_with_drops(honest)
    if isinstance(honest, MHPFedHNG):  # also some holders of the global model dropped
        holds = honest.holds_global
        r = next(
            r
            for r in range(50)
            if 0
            < int(arrivals(honest, r)[holds[honest.sample_clients(r)]].sum())
            < int(holds[honest.sample_clients(r)].sum())
        )
    garbled_dropped_uploads(garbled, r)
    start = {n: t.clone() for n, t in honest.state_dict().items()}
    for method in (honest, garbled):
        one_round(method, r)
    expected, got = server_state(honest), server_state(garbled)
    assert any(k.endswith(".grad") for k in expected)
    assert expected.keys() == got.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=key)
    if name in ("MHPFedHN", "MHPFedHNGD", "MHPFedHN-per_client", "MHPFedHNG"):
        # steps inside the round (sequential, per_client, the global step) moved phi
        assert not torch.equal(honest.state_dict()["hnet.mlp.0.weight"], start["hnet.mlp.0.weight"])


@pytest.mark.parametrize("name", ROWS)
def test_a_round_where_nothing_arrives_leaves_the_server_alone(name: str) -> None:
    """No gradient, no step (Adam's state stays empty), no client state changed; with the
    global model, the one sampled client holds it."""
    method = built(name, 1, conditions=Conditions(**DROP))
    holds = getattr(method, "holds_global", torch.ones(6, dtype=torch.bool))
    r = next(
        r
        for r in range(50)
        if not arrivals(method, r).any() and bool(holds[method.sample_clients(r)].all())
    )
    before = {n: t.clone() for n, t in method.state_dict().items()}
    stored = store_copy(method)
    one_round(method, r)
    assert all(p.grad is None for p in method.parameters())
    assert method.server_optimizer is not None and not method.server_optimizer.state
    for key, tensor in method.state_dict().items():
        assert torch.equal(tensor, before[key]), key
    assert_store_unchanged(method, stored)


@pytest.mark.parametrize("name", ROWS)
def test_a_straggler_takes_exactly_its_drawn_steps(name: str) -> None:
    """Every local training of the round (the global model's, each architecture's or each
    client's) takes ceil(f S) of its S local steps for each of its clients."""
    conditions = Conditions(stragglers=Stragglers(rate=0.7, fraction=0.9, min_fraction=0.1))
    method = built(name, 5, conditions=conditions)
    assert method.unreliable is not None
    calls: list[tuple[torch.Tensor, TrainResult]] = []
    original = method.local_train

    def spy(params: Any, clients: torch.Tensor, *args: Any, **kwargs: Any) -> TrainResult:
        calls.append((clients, original(params, clients, *args, **kwargs)))
        return calls[-1][1]

    method.local_train = spy  # type: ignore[method-assign]
    one_round(method, 0)
    fraction = method.unreliable.draws(0).fraction
    assert (fraction[method.sample_clients(0)] < 1).any()
    assert sum(len(c) for c, _ in calls) >= 5
    for clients, result in calls:
        expected = [straggler_steps(float(fraction[c]), STEPS["local_steps"]) for c in clients]
        assert result.steps.tolist() == expected, (name, clients.tolist())
