"""Unreliable clients (drops, stragglers, availability) and what a round costs."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

import lightning_pfl.methods as methods
from lightning_pfl.conditions import Conditions, Stragglers, straggler_steps
from lightning_pfl.costs import RoundCosts
from lightning_pfl.engine import TrainResult
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import FedAvg, FederatedMethod, Local, PFedHN, method_classes
from lightning_pfl.methods.ditto import Ditto
from lightning_pfl.methods.power_of_choice import FedAvgPoC
from tests.conftest import build, digits_data, fit
from tests.helpers import CONF, assert_resume_is_exact, capture_local_training, run_dir
from tests.test_bad_inputs import run_cli

DROP: dict[str, Any] = {"drop_rate": 0.5}
STRAGGLE: dict[str, Any] = {"stragglers": {"rate": 0.5, "fraction": 0.6, "min_fraction": 0.2}}


def trained(cls: type[FederatedMethod], rounds: int = 3, **kwargs: Any) -> FederatedMethod:
    dm = digits_data(6)
    method = build(cls, dm, clients_per_round=3, **kwargs)
    fit(method, dm, rounds=rounds)
    return method


def state(method: FederatedMethod) -> dict[str, torch.Tensor]:
    tensors = dict(method.state_dict())
    for field, values in method.store.state_dict().items():
        tensors |= {f"store.{field}.{n}": t for n, t in values.items()}
    return tensors


@pytest.mark.parametrize("cls", [FedAvg, Ditto, PFedHN])
def test_reliable_conditions_equal_a_run_without_them_bit_for_bit(
    cls: type[FederatedMethod],
) -> None:
    """Drop 0 and stragglers that never straggle go through every mask and change no bit."""
    today = state(trained(cls))
    masked = trained(cls, conditions=Conditions(stragglers=Stragglers(rate=0.0)))
    for name, tensor in state(masked).items():
        assert torch.equal(tensor, today[name]), name


def one_round(method: FederatedMethod, round_idx: int) -> tuple[torch.Tensor, list[Any]]:
    clients = method.sample_clients(round_idx)
    captured = capture_local_training(method)
    method.configure_optimizers()
    method.run_round(round_idx, clients)
    return clients, captured


def round_with_drops(method: FederatedMethod) -> int:
    """A round in which some but not all sampled clients report back."""
    for r in range(50):
        arrived = method.arrived(method.sample_clients(r), r)
        if 0 < int(arrived.sum()) < len(arrived):
            return r
    raise AssertionError("no round with a partial drop")


def arrivals(method: FederatedMethod, round_idx: int) -> torch.Tensor:
    return method.arrived(method.sample_clients(round_idx), round_idx)


def store_copy(method: FederatedMethod) -> dict[str, dict[str, torch.Tensor]]:
    return {f: {n: t.clone() for n, t in v.items()} for f, v in method.store.fields.items()}


def server_state(method: FederatedMethod, store: bool = False) -> dict[str, torch.Tensor]:
    """Every module tensor, every gradient the round set and (``store``: for a server that
    keeps every client's model in the client store) the store."""
    grads = {f"{n}.grad": p.grad for n, p in method.named_parameters() if p.grad is not None}
    stored = {f"store.{f}.{n}": t for f, v in store_copy(method).items() for n, t in v.items()}
    return (
        {n: t.clone() for n, t in method.state_dict().items()} | grads | (stored if store else {})
    )


def assert_store_unchanged(
    method: FederatedMethod, stored: dict[str, dict[str, torch.Tensor]]
) -> None:
    for field, tensors in method.store.fields.items():
        for key, tensor in tensors.items():
            assert torch.equal(tensor, stored[field][key]), (field, key)


def assert_every_row_honours_the_conditions(classes: Any) -> None:
    for cls in classes:
        assert vars(cls).get("honours_conditions") is True, cls.__name__


def garbled_dropped_uploads(method: FederatedMethod, round_idx: int) -> None:
    """Make every local-training result of the clients that did not arrive nonsense (their
    trained tensors + 1): a server that reads only what arrived cannot tell."""
    original = method.local_train

    def wrapped(params: Any, clients: torch.Tensor, *args: Any, **kwargs: Any) -> TrainResult:
        result = original(params, clients, *args, **kwargs)
        arrived = method.arrived(clients, round_idx)
        garbled = {
            n: torch.where(arrived.view(-1, *[1] * (t.dim() - 1)), t, t + 1)
            for n, t in result.params.items()
        }
        return TrainResult(garbled, result.momentum, result.loss, result.steps, result.state)

    method.local_train = wrapped  # type: ignore[method-assign]


@pytest.mark.parametrize("cls", [Local, Ditto])
def test_a_dropped_clients_state_is_untouched(cls: type[FederatedMethod]) -> None:
    dm = digits_data(6)
    method = build(cls, dm, clients_per_round=4, conditions=Conditions(**DROP))
    r = round_with_drops(method)
    before = {f: {n: t.clone() for n, t in v.items()} for f, v in method.store.fields.items()}
    clients, _ = one_round(method, r)
    arrived = method.arrived(clients, r)
    for field, tensors in method.store.fields.items():
        for name, tensor in tensors.items():
            if name.endswith("num_batches_tracked"):
                continue
            old = before[field][name]
            for client, came in zip(clients.tolist(), arrived.tolist(), strict=True):
                assert torch.equal(tensor[client], old[client]) != came, (field, name, client)


def test_fedavg_averages_only_the_uploads_that_arrived() -> None:
    dm = digits_data(6)
    method = build(FedAvg, dm, clients_per_round=4, conditions=Conditions(**DROP))
    assert isinstance(method, FedAvg)
    r = round_with_drops(method)
    clients, captured = one_round(method, r)
    arrived = method.arrived(clients, r)
    n = dm.num_samples("train")[clients].double() * arrived
    for name, p in method.net.named_parameters():
        uploads = captured[0].params[name].double()
        expected = torch.einsum("c,c...->...", n / n.sum(), uploads)
        assert p.grad is not None
        torch.testing.assert_close(p.detach().double() - p.grad.double(), expected)


def test_a_round_where_nothing_arrives_leaves_the_server_alone() -> None:
    for cls in (FedAvg, PFedHN):
        method = build(cls, digits_data(6), clients_per_round=1, conditions=Conditions(**DROP))
        r = next(r for r in range(50) if not method.arrived(method.sample_clients(r), r).any())
        one_round(method, r)
        assert all(p.grad is None for p in method.parameters()), cls.__name__


def test_pfedhn_steps_only_from_the_clients_that_arrived() -> None:
    """hn_update per_client takes one optimizer step per client that reported back."""
    method = build(
        PFedHN, digits_data(6), clients_per_round=4, hn_update="per_client", conditions=DROP
    )
    r = round_with_drops(method)
    steps: list[int] = []
    clients = method.sample_clients(r)
    method.configure_optimizers()
    optimizer = method.server_optimizer
    assert optimizer is not None
    original = optimizer.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        steps.append(1)
        return original(*args, **kwargs)

    optimizer.step = counted  # type: ignore[method-assign]
    method.run_round(r, clients)
    assert len(steps) == int(method.arrived(clients, r).sum()) - 1  # the base takes the last


@pytest.mark.parametrize("epochs", [None, 2])
def test_a_straggler_takes_exactly_its_drawn_steps(epochs: int | None) -> None:
    dm = digits_data(6)
    conditions = Conditions(stragglers=Stragglers(rate=0.7, fraction=0.9, min_fraction=0.1))
    method = build(
        Local, dm, clients_per_round=5, local_steps=7, local_epochs=epochs, conditions=conditions
    )
    fractions = []
    for r in range(3):
        clients, captured = one_round(method, r)
        fraction = method.unreliable.draws(r).fraction[clients]  # type: ignore[union-attr]
        fractions.append(fraction)
        full = method.data.client_batches(
            clients.cpu(), 8, torch.Generator(), steps=None if epochs else 7, epochs=epochs
        ).active.sum(1)
        expected = [straggler_steps(float(f), int(s)) for f, s in zip(fraction, full, strict=True)]
        assert captured[0].steps.tolist() == expected
    drawn = torch.cat(fractions)
    assert (drawn < 1).any() and (drawn == 1).any()  # stragglers and clients that finish


def test_availability_samples_available_clients_first(tmp_path: Path) -> None:
    trace = np.zeros((3, 6), dtype=int)
    trace[0, [1, 4]] = 1  # round 0: two available of the three slots
    trace[1, :] = 1
    trace[2, [0, 2, 3, 5]] = 1
    path = tmp_path / "trace.npy"
    np.save(path, trace)
    method = build(
        Local, digits_data(6), clients_per_round=3, conditions={"availability": str(path)}
    )
    for r in range(6):
        clients = method.sample_clients(r)
        available = torch.from_numpy(trace[r % 3].astype(bool))[clients]
        assert int(available.sum()) == min(3, int(trace[r % 3].sum()))
        assert torch.equal(method.arrived(clients, r), available)


@pytest.mark.parametrize(
    ("conditions", "named"),
    [
        ({"drop_rate": 1.0}, "conditions.drop_rate"),
        ({"drop_rate": -0.1}, "conditions.drop_rate"),
        ({"stragglers": {"fraction": 0.0}}, "conditions.stragglers.fraction"),
        ({"stragglers": {"fraction": 1.5}}, "conditions.stragglers.fraction"),
        ({"stragglers": {"min_fraction": 0.0}}, "conditions.stragglers.min_fraction"),
        ({"stragglers": {"fraction": 0.3, "min_fraction": 0.5}}, "stragglers.min_fraction"),
        ({"stragglers": {"rate": 1.5}}, "conditions.stragglers.rate"),
        ({"availability": 0.0}, "conditions.availability"),
        ({"availability": [0.5, 0.5]}, "conditions.availability"),
        ({"availability": "missing.csv"}, "missing.csv"),
        ({"availability": "wrong_width.csv"}, "[rounds or period, 4]"),
        ({"availability": "not_binary.csv"}, "other than 0 and 1"),
    ],
)
def test_bad_conditions_are_refused_before_any_folder_exists(
    conditions: dict[str, Any], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.savetxt(tmp_path / "wrong_width.csv", np.ones((5, 3)), delimiter=",")
    np.savetxt(tmp_path / "not_binary.csv", np.full((5, 4), 0.5), delimiter=",")
    if isinstance(conditions.get("availability"), str):
        conditions = {"availability": str(tmp_path / conditions["availability"])}
    logs = tmp_path / "logs"
    args = [
        "fit",
        f"--config={CONF / 'fedavg.yaml'}",
        f"--trainer.logger.init_args.save_dir={logs}",
    ]
    code, err = run_cli([*args, f"--model.init_args.conditions={conditions}"], capsys)
    assert code == 2, err
    assert named in err, err
    assert not list(tmp_path.rglob("version_*")), "a run folder was created"


def test_methods_that_cannot_honour_the_conditions_refuse_them() -> None:
    dm = digits_data(4)

    with pytest.raises(ConfigError, match="FedAvgPoC does not weigh its aggregation"):
        build(FedAvgPoC, dm, clients_per_round=2, conditions=DROP)
    build(FedAvgPoC, dm, clients_per_round=2, conditions={})  # reliable: accepted


def test_resume_with_conditions_is_exact(tmp_path: Path) -> None:
    config = CONF / "fedavg.yaml"
    extra = (
        "--model.init_args.conditions.drop_rate=0.5",
        "--model.init_args.conditions.stragglers.min_fraction=0.2",
    )
    assert_resume_is_exact(config, tmp_path, *extra)
    straight, resumed = (
        json.loads((run_dir(tmp_path / folder, config) / "results.json").read_text())
        for folder in ("straight", "resumed")
    )
    costs = straight["costs"]
    assert resumed["costs"] == costs
    assert 0 < costs["clients_reported_total"] < 6 * 2  # 6 rounds of 2 clients, some dropped
    assert costs["flops_local_total"] == costs["flops_per_local_step"] * costs["local_steps_total"]


# ----------------------------------------------------------------- what a round costs
NO_COMMUNICATION = {"Local", "HeterogeneousLocal"}  # every client trains alone


def concrete_methods() -> list[str]:
    return sorted(n for n, cls in method_classes().items() if not inspect.isabstract(cls))


def conf_of(name: str) -> dict[str, Any]:
    """The model arguments of the first tests/conf config of method ``name`` (on digits)."""
    for path in sorted(CONF.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        if config["model"]["class_path"] == name and config["data"]["init_args"]["dataset"] == (
            "digits"
        ):
            return dict(config["model"].get("init_args") or {})
    raise AssertionError(f"no digits config of {name} in tests/conf")


@pytest.mark.parametrize("name", concrete_methods())
def test_every_method_counts_what_a_round_sends(name: str) -> None:
    dm = digits_data(4)
    method = build(getattr(methods, name), dm, **conf_of(name))
    costs = RoundCosts()
    fit(method, dm, rounds=1, callbacks=[costs])
    down, up = method.record.round_bytes
    if name in NO_COMMUNICATION:
        assert down == up == 0
    else:
        assert down > 0 and up > 0
    assert costs.totals["local_steps"] > 0
    summary = method.record.extra_results["costs"]
    if method.network_groups() is None:
        step = method.executor.step_flops(method.arch)
        assert summary["flops_local_total"] == step * costs.totals["local_steps"]


def test_round_costs_follow_the_steps_taken() -> None:
    """Local FLOPs = step FLOPs x steps actually taken: stragglers cut them, drops remove them."""
    dm = digits_data(6)
    full, cut = RoundCosts(), RoundCosts()
    for costs, conditions in ((full, None), (cut, {**DROP, **STRAGGLE})):
        method = build(PFedHN, dm, clients_per_round=3, local_steps=5, conditions=conditions)
        fit(method, dm, rounds=4, callbacks=[costs])
    assert full.totals["local_steps"] == 4 * 3 * 5
    assert 0 < cut.totals["local_steps"] < full.totals["local_steps"]
    assert full.totals["flops_server"] > 0
    assert cut.totals["flops_server"] == full.totals["flops_server"]  # same clients per round
    step = method.executor.step_flops(method.arch)
    assert cut.totals["flops_local"] == step * cut.totals["local_steps"]


def test_train_loss_averages_the_clients_that_reported_back() -> None:
    dm = digits_data(6)
    method = build(FedAvg, dm, clients_per_round=4, conditions=Conditions(**DROP))
    rounds = round_with_drops(method) + 1
    logged: list[float] = []
    expected: list[float] = []
    log_at_round, run_round = method._log_at_round, method.run_round

    def log(metrics: dict[str, float], rounds: int | None = None) -> None:
        if "train/loss" in metrics:
            logged.append(metrics["train/loss"])
        log_at_round(metrics, rounds)

    def round_losses(round_idx: int, clients: torch.Tensor) -> torch.Tensor:
        losses = run_round(round_idx, clients)
        arrived = method.arrived(clients, round_idx)
        expected.append(float(losses[arrived].mean()) if arrived.any() else 0.0)
        return losses

    method._log_at_round = log  # type: ignore[method-assign]
    method.run_round = round_losses  # type: ignore[method-assign]
    fit(method, dm, rounds=rounds)
    assert logged == pytest.approx(expected) and len(logged) == rounds
