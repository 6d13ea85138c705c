"""Unreliable clients for FedSimSup and PeFLL (docs/conditions.md): reliable conditions change
no bit, a dropped client's state is untouched (FedSimSup's theta_i and s_i; PeFLL keeps none),
the server reads only the uploads that arrived, a round where none did moves nothing (the
server optimizer's state included) and stragglers take exactly their drawn steps."""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pfl.conditions import Conditions, Stragglers, straggler_steps
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.methods.fedsimsup import FedSimSup
from lightning_pfl.methods.pefll import PeFLL
from tests.conftest import build, digits_data, fit
from tests.helpers import CONF, assert_resume_is_exact
from tests.test_conditions import (
    DROP,
    arrivals,
    assert_every_row_honours_the_conditions,
    assert_store_unchanged,
    garbled_dropped_uploads,
    one_round,
    round_with_drops,
    server_state,
    state,
    store_copy,
    trained,
)

SUPERVISOR = {"cnn": {"net": "digits_cnn", "net_args": {"width": 2, "hidden": 16}}}
# method -> (class, arguments beyond tests.conftest.build's); FedSimSup trains one epoch per
# phase (its local work is epochs), in batches of 64 (5 steps a phase on these clients)
ROWS: dict[str, tuple[type[FederatedMethod], dict[str, Any]]] = {
    "FedSimSup": (
        FedSimSup,
        {"supervisors": SUPERVISOR, "supervisor_epochs": 1, "model_epochs": 1, "batch_size": 64},
    ),
    "PeFLL": (PeFLL, {"hidden_dim": 16, "n_hidden": 1, "embedding_hidden": 16}),
}
TRAINED = 2  # reliable rounds before the one under test: every client's state its own


def built(name: str, clients_per_round: int, **kwargs: Any) -> FederatedMethod:
    cls, arguments = ROWS[name]
    return build(cls, digits_data(6), clients_per_round=clients_per_round, **arguments, **kwargs)


@cache
def pretrained(name: str, clients_per_round: int) -> FederatedMethod:
    """``name`` with drop rate 0.5, after ``TRAINED`` rounds without drops (shared: copy it)."""
    method = built(name, clients_per_round, conditions=Conditions(**DROP))
    unreliable, method.unreliable = method.unreliable, None
    fit(method, method.data, rounds=TRAINED)
    method.unreliable = unreliable
    method.zero_grad()  # the last fitted round's gradients
    return method


def test_every_row_honours_the_conditions() -> None:
    assert_every_row_honours_the_conditions(cls for cls, _ in ROWS.values())


@pytest.mark.parametrize("name", ROWS)
def test_reliable_conditions_equal_a_run_without_them_bit_for_bit(name: str) -> None:
    cls, arguments = ROWS[name]
    reliable = Conditions(stragglers=Stragglers(rate=0.0))
    today = state(trained(cls, rounds=2, **arguments))
    masked = trained(cls, rounds=2, conditions=reliable, **arguments)
    got = state(masked)
    assert got.keys() == today.keys()
    for key, tensor in got.items():
        assert torch.equal(tensor, today[key]), key


def test_a_dropped_fedsimsup_client_keeps_its_model_and_supervisor() -> None:
    """A sampled client that did not report back keeps every tensor of theta_i and s_i (it is
    not mixed either); one that did changed both."""
    method = copy.deepcopy(pretrained("FedSimSup", 4))
    assert isinstance(method, FedSimSup)
    r = next(r for r in range(TRAINED, 50) if 0 < int(arrivals(method, r).sum()) < 4)
    before = store_copy(method)
    clients, _ = one_round(method, r)
    arrived = method.arrived(clients, r)
    assert set(method.store.fields) == {"theta", "supervisor.cnn"}
    for field, tensors in method.store.fields.items():
        for client, came in zip(clients.tolist(), arrived.tolist(), strict=True):
            row = client if field == "theta" else int(method.supervisors.row_of[client])
            for key, tensor in tensors.items():
                same = torch.equal(tensor[row], before[field][key][row])
                assert same != came, (field, key, client, came)


def test_pefll_keeps_nothing_per_client() -> None:
    """PeFLL's model of a client is h(e(S_i)): no client state that a drop could touch."""
    assert not pretrained("PeFLL", 4).store.fields


@pytest.mark.parametrize("name", ROWS)
def test_the_server_reads_only_the_uploads_that_arrived(name: str) -> None:
    """The same round, once with the dropped clients' results garbled: the server (and the
    store) ends it the same, and not as it began."""
    honest, garbled = (copy.deepcopy(pretrained(name, 4)) for _ in range(2))
    r = next(r for r in range(TRAINED, 50) if 0 < int(arrivals(honest, r).sum()) < 4)
    initial = server_state(honest, store=True)
    garbled_dropped_uploads(garbled, r)
    for method in (honest, garbled):
        one_round(method, r)
    expected, got = server_state(honest, store=True), server_state(garbled, store=True)
    assert expected.keys() == got.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=key)
    assert expected.keys() != initial.keys() or any(
        not torch.equal(t, initial[k]) for k, t in expected.items()
    )


@pytest.mark.parametrize("name", ROWS)
def test_a_round_where_nothing_arrives_moves_nothing(name: str) -> None:
    """No gradient, no store change, and the server optimizer's step changes neither the
    parameters nor its own state (Adam's moments and step counts for PeFLL)."""
    method = copy.deepcopy(pretrained(name, 1))
    r = next(r for r in range(TRAINED, 80) if not arrivals(method, r).any())
    optimizer = method.server_optimizer
    assert optimizer is not None
    kept = copy.deepcopy(optimizer.state_dict())
    assert name != "PeFLL" or kept["state"], "PeFLL's Adam has state to keep"
    before, stored = server_state(method, store=True), store_copy(method)
    method.run_round(r, method.sample_clients(r))
    optimizer.step()
    assert all(p.grad is None for p in method.parameters())
    after = server_state(method, store=True)
    assert after.keys() == before.keys()
    for key, tensor in after.items():
        assert torch.equal(tensor, before[key]), key
    assert_store_unchanged(method, stored)
    assert str(optimizer.state_dict()) == str(kept)


@pytest.mark.parametrize("name", ROWS)
def test_a_straggler_takes_exactly_its_drawn_steps(name: str) -> None:
    """Every local training of the round takes ceil(f * S) of its S steps (FedSimSup: each
    phase, S = one epoch of the client's batches)."""
    conditions = Conditions(stragglers=Stragglers(rate=0.7, fraction=0.9, min_fraction=0.1))
    method = built(name, 5, local_steps=7, conditions=conditions)
    assert method.unreliable is not None
    clients, captured = one_round(method, 0)
    fraction = method.unreliable.draws(0).fraction[clients]
    assert (fraction < 1).any() and captured
    if name == "FedSimSup":
        full = method.data.client_batches(
            clients.cpu(), method.hp.batch_size, torch.Generator(), epochs=1
        ).active.sum(1)
        assert len(captured) == 2, "the supervisor's phase and the model's"
    else:
        full = torch.full((len(clients),), 7)
        assert len(captured) == 1
    expected = [straggler_steps(float(f), int(s)) for f, s in zip(fraction, full, strict=True)]
    assert len(set(expected)) > 1
    for result in captured:
        assert result.steps.tolist() == expected, name


def test_fedsimsup_resume_with_conditions_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / "fedsimsup.yaml",
        tmp_path,
        "--model.init_args.conditions.drop_rate=0.5",
        "--model.init_args.conditions.stragglers.min_fraction=0.2",
    )


def test_pefll_round_with_drops_weighs_only_the_arrived() -> None:
    """hn_update mean: the server gradient equals the one of a round over the arrived
    clients alone (weights 1/|arrived|), computed without conditions."""
    method = built("PeFLL", 4, conditions=Conditions(**DROP), hn_max_grad_norm=None)
    r = round_with_drops(method)
    clients, captured = one_round(method, r)
    got = {n: p.grad for n, p in method.named_parameters() if p.grad is not None}
    assert got
    arrived = method.arrived(clients, r)
    reference = built("PeFLL", 4, hn_max_grad_norm=None)
    assert isinstance(reference, PeFLL)
    kept = clients[arrived]  # the clients whose uploads the server may read
    x, y, weight = reference.descriptor_batches(clients, r)
    generated = reference.network(x[arrived], y[arrived], weight[arrived])
    trained_params = {n: t[arrived] for n, t in captured[0].params.items()}
    delta = {n: generated[n].detach() - trained_params[n] for n in generated}
    reference.set_hypernetwork_gradients(generated, delta)
    assert 0 < len(kept) < len(clients)
    assert got.keys() == {n for n, p in reference.named_parameters() if p.grad is not None}
    for n, p in reference.named_parameters():
        if p.grad is not None:  # float32 sums in another order: relative to the scale
            atol = 1e-5 * float(p.grad.abs().max())
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=atol, msg=n)
