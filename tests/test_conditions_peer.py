"""Unreliable clients for more methods: each row's round honours drops, stragglers and
availability (docs/conditions.md, "Which methods honour them")."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_pfl.conditions import Conditions, Stragglers
from lightning_pfl.engine import TrainResult
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.methods.apfl import APFL
from lightning_pfl.methods.fedala import FedALA
from lightning_pfl.methods.fedas import FedAS
from lightning_pfl.methods.fedavg_ft import FedAvgFT
from lightning_pfl.methods.fedbabu import FedBABU
from lightning_pfl.methods.feddyn import FedDyn
from lightning_pfl.methods.fedlc import FedLC
from lightning_pfl.methods.fednova import FedNova, momentum_norm
from lightning_pfl.methods.fedopt import FedOpt
from lightning_pfl.methods.fedrod import FedRoD
from lightning_pfl.methods.fml import FML
from lightning_pfl.methods.gpfl import GPFL
from lightning_pfl.methods.per_fedavg import PerFedAvg
from lightning_pfl.methods.pfedme import PFedMe
from lightning_pfl.methods.qffl import QFFL
from lightning_pfl.params import client_mean
from tests.conftest import build, digits_data, fit
from tests.helpers import CONF, assert_resume_is_exact
from tests.test_conditions import (
    DROP,
    STRAGGLE,
    assert_every_row_honours_the_conditions,
    one_round,
    round_with_drops,
    state,
    trained,
)

# one row per method: (class, arguments beyond tests.conftest.build's)
ROWS: list[tuple[type[FederatedMethod], dict[str, Any]]] = [
    (FedDyn, {}),
    (FedOpt, {"adaptivity": "yogi", "server_lr": 0.05}),
    (FedNova, {"local_epochs": 1, "batch_size": 32}),
    (FedLC, {}),
    (FedRoD, {}),
    (FedAvgFT, {}),
    (FedBABU, {"finetune_epochs": 1}),
    (APFL, {}),
    (PerFedAvg, {"variant": "hf"}),
    (PFedMe, {"inner_steps": 2}),
    (PFedMe, {"inner_steps": 2, "local_updates": "sampled", "aggregation": "weighted"}),
    (FML, {}),
    (QFFL, {}),
    (FedALA, {"ala_max_epochs": 4, "convergence_window": 2}),
    (GPFL, {}),
    (FedAS, {}),
]
IDS = [f"{cls.__name__}-{i}" for i, (cls, _) in enumerate(ROWS)]
# the rows whose clients keep state between rounds (in the client store)
STATEFUL = [
    (c, k) for c, k in ROWS if c in (FedDyn, FedRoD, APFL, PFedMe, FML, FedALA, GPFL, FedAS)
]
STATEFUL_IDS = [f"{cls.__name__}-{i}" for i, (cls, _) in enumerate(STATEFUL)]
# the methods that compute more per-client uploads than local_train's result
EXTRA_UPLOADS: dict[type[FederatedMethod], tuple[str, ...]] = {FedAS: ("fisher_trace",)}


def test_every_row_honours_the_conditions() -> None:
    """Each class of the table declares it in its own body (the refusal reads that)."""
    assert_every_row_honours_the_conditions(cls for cls, _ in ROWS)


@pytest.mark.parametrize(("cls", "kwargs"), ROWS, ids=IDS)
def test_reliable_conditions_equal_a_run_without_them_bit_for_bit(
    cls: type[FederatedMethod], kwargs: dict[str, Any]
) -> None:
    today = state(trained(cls, **kwargs))
    masked = state(trained(cls, conditions=Conditions(stragglers=Stragglers(rate=0.0)), **kwargs))
    assert masked.keys() == today.keys()
    for name, tensor in masked.items():
        assert torch.equal(tensor, today[name]), name


def client_state(method: FederatedMethod) -> dict[str, Tensor]:
    """Every per-client tensor ``[num_clients, ...]``: the store and FedALA's participations."""
    tensors = {
        f"{field}.{n}": t.clone()
        for field, values in method.store.fields.items()
        for n, t in values.items()
    }
    visits = getattr(method, "visits", None)
    return tensors | ({"visits": visits.clone()} if isinstance(visits, Tensor) else {})


@pytest.mark.parametrize(("cls", "kwargs"), STATEFUL, ids=STATEFUL_IDS)
def test_a_dropped_clients_state_is_untouched(
    cls: type[FederatedMethod], kwargs: dict[str, Any]
) -> None:
    """After rounds with drops (so that clients hold state of their own: FedALA's local model
    and weights), a round with a partial drop: every client whose draw drops keeps every
    per-client tensor bit for bit, and each sampled client that arrived changed some."""
    dm = digits_data(6)
    method = build(cls, dm, clients_per_round=4, conditions=Conditions(**DROP), **kwargs)
    fit(method, dm, rounds=3)
    r = next(r for r in range(3, 60) if 0 < int(arrived_in(method, r).sum()) < 4)
    before = client_state(method)
    clients, _ = one_round(method, r)
    after = client_state(method)
    arrives = method.unreliable.draws(r).arrives  # type: ignore[union-attr]
    sampled = set(clients.tolist())
    for client in range(dm.num_clients):
        same = [torch.equal(after[k][client], before[k][client]) for k in before]
        if not arrives[client]:
            assert all(same), (client, [k for k, s in zip(before, same, strict=True) if not s])
        elif client in sampled:
            assert not all(same), client


def arrived_in(method: FederatedMethod, round_idx: int) -> Tensor:
    return method.arrived(method.sample_clients(round_idx), round_idx)


def replaying(method: FederatedMethod, recorded: dict[str, list[tuple[Tensor, Any]]]) -> None:
    """Make ``method``'s local training (and EXTRA_UPLOADS) return the rows, for its clients,
    of what another run ``recorded`` for the same call (``recording``)."""
    for name, calls in recorded.items():
        queue = iter(calls)

        def replay(*args: Any, queue: Any = queue, **kwargs: Any) -> Any:
            clients = next(a for a in args if isinstance(a, Tensor) and a.dtype == torch.long)
            seen, result = next(queue)
            rows = torch.tensor([seen.tolist().index(c) for c in clients.tolist()])
            if isinstance(result, Tensor):
                return result[rows]
            return TrainResult(
                {n: t[rows] for n, t in result.params.items()},
                {n: t[rows] for n, t in result.momentum.items()},
                result.loss[rows],
                result.steps[rows],
                {n: t[rows] for n, t in result.state.items()},
            )

        setattr(method, name, replay)


def recording(method: FederatedMethod, names: tuple[str, ...]) -> dict[str, list[Any]]:
    """Record the clients and the result of every call of ``method``'s ``names``."""
    recorded: dict[str, list[Any]] = {}
    for name in names:
        original: Callable[..., Any] = getattr(method, name)
        calls = recorded[name] = []

        def record(*args: Any, original: Any = original, calls: Any = calls, **kw: Any) -> Any:
            clients = next(a for a in args if isinstance(a, Tensor) and a.dtype == torch.long)
            calls.append((clients.clone(), original(*args, **kw)))
            return calls[-1][1]

        setattr(method, name, record)
    return recorded


def server_state(method: FederatedMethod) -> dict[str, Tensor]:
    tensors = {k: t.clone() for k, t in method.state_dict().items()}
    optimizer = method.server_optimizer
    assert optimizer is not None
    for i, values in enumerate(optimizer.state.values()):
        tensors |= {f"optimizer.{i}.{k}": v.clone() for k, v in values.items() if v is not None}
    return tensors


@pytest.mark.parametrize(("cls", "kwargs"), ROWS, ids=IDS)
def test_the_server_update_equals_a_round_of_only_the_clients_that_arrived(
    cls: type[FederatedMethod], kwargs: dict[str, Any]
) -> None:
    """A round with a partial drop ends with the server of the same round whose sample was
    only the clients that arrived, given the same uploads: the dropped ones weigh nothing."""
    dm = digits_data(6)
    kwargs = {**kwargs, "clients_per_round": 4}
    method = build(cls, dm, conditions={**DROP, **STRAGGLE}, **kwargs)
    r = round_with_drops(method)
    recorded = recording(method, ("local_train", *EXTRA_UPLOADS.get(cls, ())))
    clients, _ = one_round(method, r)
    arrived = method.arrived(clients, r)
    reference = build(cls, dm, **kwargs)  # same seed: the same initial server and clients
    replaying(reference, recorded)
    reference.configure_optimizers()
    initial = server_state(reference)
    reference.run_round(r, clients[arrived])
    for m in (method, reference):
        assert m.server_optimizer is not None
        m.server_optimizer.step()
    expected, got = server_state(reference), server_state(method)
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-6, atol=1e-7, msg=name)
    assert any(not torch.equal(t, initial[n]) for n, t in got.items() if n in initial)


@pytest.mark.parametrize(("cls", "kwargs"), ROWS, ids=IDS)
def test_a_round_where_nothing_arrives_leaves_the_server_alone(
    cls: type[FederatedMethod], kwargs: dict[str, Any]
) -> None:
    dm = digits_data(6)
    method = build(cls, dm, clients_per_round=2, conditions=Conditions(**DROP), **kwargs)
    fit(method, dm, rounds=2)  # a server with state of its own (FedDyn's h, FedOpt's m and v)
    r = next(r for r in range(2, 80) if not arrived_in(method, r).any())
    before = server_state(method)
    method.zero_grad()  # the last fitted round's gradients
    method.run_round(r, method.sample_clients(r))  # the fitted server optimizer, m and v kept
    assert all(p.grad is None for p in method.parameters())
    assert method.server_optimizer is not None
    method.server_optimizer.step()
    after = server_state(method)
    assert after.keys() == before.keys()
    for name, tensor in after.items():
        assert torch.equal(tensor, before[name]), name


def test_fednova_normalizes_by_the_steps_actually_taken() -> None:
    """FedNova's a_i counts a straggler's cut steps: the server's step is
    tau_eff sum_i p_i (x - x_i) / ||a_i||_1 over the arrived clients, from TrainResult.steps."""
    dm = digits_data(6)
    conditions = Conditions(drop_rate=0.3, stragglers=Stragglers(0.8, 0.9, 0.1))
    method = build(FedNova, dm, clients_per_round=5, local_epochs=1, conditions=conditions)
    assert isinstance(method, FedNova)
    r = round_with_drops(method)
    clients, captured = one_round(method, r)
    arrived = method.arrived(clients, r)
    full = method.data.client_batches(clients.cpu(), 8, torch.Generator(), epochs=1).active.sum(1)
    steps = captured[0].steps
    assert (steps[arrived] < full[arrived]).any(), "no straggler among the arrived clients"
    n = dm.num_samples("train")[clients].double() * arrived
    p = n / n.sum()
    norm = momentum_norm(steps, method.hp.local_momentum).clamp_min(1)
    tau_eff = (p * norm).sum()
    for name, param in method.net.named_parameters():
        x = param.detach().double()
        shape = (-1, *[1] * x.dim())
        normalized = (x - captured[0].params[name].double()) / norm.view(shape)
        assert param.grad is not None
        torch.testing.assert_close(param.grad.double(), tau_eff * client_mean(normalized, p))


@pytest.mark.parametrize("cls", [FedAvgFT, FedBABU])
def test_fine_tuning_for_evaluation_is_not_cut_by_the_conditions(
    cls: type[FederatedMethod],
) -> None:
    """Evaluation fine-tunes every client fully, whether or not its draw drops or straggles
    in the current round (the conditions act on rounds only)."""
    dm = digits_data(6)
    clients = torch.arange(dm.num_clients)
    reliable = build(cls, dm).personalized_params(clients)
    method = build(cls, dm, conditions={**DROP, **STRAGGLE})
    draws = method.unreliable.draws(0)  # type: ignore[union-attr]
    assert not draws.arrives.all() and (draws.fraction < 1).any()
    for name, tensor in method.personalized_params(clients).items():
        assert torch.equal(tensor, reliable[name]), name


@pytest.mark.parametrize("config", ["feddyn", "fedala"])
def test_resume_with_conditions_is_exact(config: str, tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / f"{config}.yaml",
        tmp_path,
        "--model.init_args.conditions.drop_rate=0.4",
        "--model.init_args.conditions.stragglers.min_fraction=0.2",
    )
