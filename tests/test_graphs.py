"""Recorded rounds: static buffers, replay bookkeeping and fallbacks (eager replay on CPU, the
real CUDA graphs where a GPU is present)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import lightning_pfl.execution as execution
from lightning_pfl.graphs import CudaGraphRecorder, EagerRecorder, Leaves, RoundGraphs
from lightning_pfl.methods import (
    FedAvg,
    FederatedMethod,
    FedSimSup,
    Local,
    PFedHN,
    PFedHNPC,
    PFedKT,
    feddyn,
    fednova,
    fedopt,
    qffl,
    scaffold,
)
from lightning_pfl.methods.apple import APPLE
from lightning_pfl.methods.ccvr import CCVR
from lightning_pfl.methods.cfl import CFL
from lightning_pfl.methods.fedala import FedALA
from lightning_pfl.methods.fedamp import FedAMP
from lightning_pfl.methods.fedas import FedAS
from lightning_pfl.methods.fedbabu import FedBABU
from lightning_pfl.methods.fedcp import FedCP
from lightning_pfl.methods.fedlc import FedLC
from lightning_pfl.methods.fedmgda_plus import FedMGDAPlus
from lightning_pfl.methods.gpfl import GPFL
from lightning_pfl.methods.power_of_choice import FedAvgPoC
from tests.conftest import build, digits_data, fit


def affine(
    w: dict[str, torch.Tensor], x: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return {"w": w["w"] * 2}, (x * w["w"]).sum()


def test_a_call_is_recorded_once_per_shape_and_replayed_with_new_inputs() -> None:
    graphs = RoundGraphs(EagerRecorder())
    for scale in (1.0, 2.0, 3.0):
        out, total = graphs(affine, "affine", None, {"w": torch.full((3,), scale)}, torch.ones(3))
        assert torch.equal(out["w"], torch.full((3,), 2 * scale)) and float(total) == 3 * scale
    assert (graphs.recorded, graphs.replayed) == (1, 3)
    graphs(affine, "affine", None, {"w": torch.ones(4)}, torch.ones(4))  # a new shape
    graphs(affine, "other code", None, {"w": torch.ones(3)}, torch.ones(3))  # new code
    assert graphs.recorded == 3 and len(graphs.entries) == 3


def test_returned_tensors_are_not_the_static_buffers() -> None:
    graphs = RoundGraphs(EagerRecorder())
    first, _ = graphs(affine, "k", None, {"w": torch.ones(2)}, torch.ones(2))
    graphs(affine, "k", None, {"w": torch.zeros(2)}, torch.ones(2))
    assert torch.equal(first["w"], torch.full((2,), 2.0))  # not overwritten by the replay


def test_least_recently_used_recordings_are_dropped() -> None:
    graphs = RoundGraphs(EagerRecorder(), capacity=2)
    for n in (1, 2, 3):
        graphs(affine, "k", None, {"w": torch.ones(n)}, torch.ones(n))
    assert [key[2][0][0] for key in graphs.entries] == [(2,), (3,)]


def test_a_call_that_cannot_be_recorded_runs_eagerly_with_a_warning() -> None:
    class Refusing:
        def record(self, fn: Callable[[Leaves], Leaves], inputs: Leaves) -> Any:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")

    graphs = RoundGraphs(Refusing())
    with pytest.warns(UserWarning, match="could not be recorded \\(operation not permitted"):
        out, _ = graphs(affine, "k", None, {"w": torch.ones(2)}, torch.ones(2))
    assert torch.equal(out["w"], torch.full((2,), 2.0))
    out, _ = graphs(affine, "k", None, {"w": torch.ones(2)}, torch.ones(2))  # no new attempt
    assert graphs.recorded == 0 and len(graphs.failed) == 1


def test_shapes_that_change_every_round_turn_recording_off() -> None:
    graphs = RoundGraphs(EagerRecorder(), max_new_keys=3)
    with pytest.warns(UserWarning, match="new shapes"):
        for n in range(1, 6):
            graphs(affine, "k", None, {"w": torch.ones(n)}, torch.ones(n))
    assert graphs.disabled is not None and graphs.recorded == 3


def _final_state(cls: type[FederatedMethod], recorder: Any, **kwargs: Any) -> tuple[Any, ...]:
    dm = digits_data(6, **kwargs.pop("data", {}))
    kwargs.setdefault("clients_per_round", 3)
    method = build(cls, dm, **kwargs)
    original = execution.make_round_graphs
    made: list[RoundGraphs | None] = []

    def with_recorder(settings: Any, device: torch.device) -> RoundGraphs | None:
        made.append(RoundGraphs(recorder) if recorder is not None else original(settings, device))
        return made[-1]

    execution.make_round_graphs = with_recorder  # type: ignore[assignment]
    try:
        fit(method, dm, rounds=3, accelerator="gpu" if torch.cuda.is_available() else "cpu")
    finally:
        execution.make_round_graphs = original
    # the recorder training used: after fit the model is back on the CPU, where reading
    # method.executor would choose a new executor for that device
    assert len(made) == 1, f"{len(made)} executors were chosen during one fit"
    return method.state_dict(), method.store.state_dict(), made[0]


METHODS: list[tuple[type[FederatedMethod], dict[str, Any]]] = [
    (Local, {}),
    (FedAvg, {"local_epochs": 1}),
    (PFedHN, {}),
    (PFedHNPC, {}),
    (PFedKT, {"local_epochs": 1}),
    (
        FedSimSup,
        {
            "supervisors": {"cnn": {"net": "digits_cnn", "net_args": {"width": 4}}},
            "supervisor_epochs": 1,
            "model_epochs": 1,
            "batch_size": 32,
        },
    ),
    (CFL, {"eps_1": 1e6, "eps_2": 0.0, "split_from_round": 1}),
    (CCVR, {}),
    (FedAS, {}),
    (GPFL, {}),
    (FedCP, {"gumbel_noise": False}),
    (scaffold.SCAFFOLD, {}),
    (feddyn.FedDyn, {}),
    (fednova.FedNova, {"local_epochs": 1}),
    (qffl.QFFL, {}),
    (fedopt.FedOpt, {"adaptivity": "yogi"}),
    (FedBABU, {}),
    (FedLC, {}),
    (FedALA, {"ala_max_epochs": 2, "batch_size": 64}),
    (FedAMP, {}),
    (APPLE, {}),
    (FedMGDAPlus, {}),
    (FedAvgPoC, {"candidates": 4}),
]


def _assert_same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    for name, tensor in a[0].items():
        torch.testing.assert_close(b[0][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    for field, tensors in a[1].items():
        for name, tensor in tensors.items():
            torch.testing.assert_close(b[1][field][name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("cls", "kwargs"), METHODS, ids=[c.__name__ for c, _ in METHODS])
def test_recorded_rounds_give_the_eager_result(
    cls: type[FederatedMethod], kwargs: dict[str, Any]
) -> None:
    eager = _final_state(cls, None, cuda_graphs=False, **kwargs)
    recorded = _final_state(cls, EagerRecorder(), **kwargs)
    _assert_same(eager, recorded)
    graphs = recorded[2]
    # later rounds replay the first round's recordings
    assert graphs is not None and graphs.replayed >= 3 and graphs.recorded < graphs.replayed


def test_epochs_over_unequal_clients_share_one_recording() -> None:
    """Rounds whose largest client differs are padded to the largest client overall."""
    _, _, graphs = _final_state(
        FedAvg,
        EagerRecorder(),
        local_epochs=1,
        clients_per_round=2,
        data={"partition": __import__("lightning_pfl").Dirichlet(0.3, min_samples=5)},
    )
    assert graphs.recorded == 1 and graphs.replayed == 3


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize(("cls", "kwargs"), METHODS, ids=[c.__name__ for c, _ in METHODS])
def test_cuda_graphs_give_the_eager_result(
    cls: type[FederatedMethod], kwargs: dict[str, Any]
) -> None:
    eager = _final_state(cls, None, cuda_graphs=False, **kwargs)
    graphed = _final_state(cls, CudaGraphRecorder(), **kwargs)
    _assert_same(eager, graphed)
    assert graphed[2] is not None and graphed[2].recorded >= 1 and not graphed[2].failed


@needs_cuda
def test_cuda_graphs_are_on_by_default_on_a_gpu() -> None:
    _, _, graphs = _final_state(FedAvg, None)
    assert isinstance(graphs, RoundGraphs) and isinstance(graphs.recorder, CudaGraphRecorder)


@needs_cuda
@pytest.mark.parametrize("cls", [FedAvg, PFedHN])
def test_a_recorded_round_is_queued_without_waiting_for_the_device(
    cls: type[FederatedMethod],
) -> None:
    """After the first (recording) round, sampling the clients and the whole round (local
    training, server step) queue work without a host synchronization: the host waits only
    where it reads the previous round's loss (``run_record.PendingLoss``)."""
    dm = digits_data(6)
    method = build(cls, dm, clients_per_round=3)
    strict_calls: list[str] = []

    def without_syncs(name: str) -> None:
        original = getattr(method, name)

        def strict(round_idx: int, *args: Any) -> Any:
            if round_idx == 0:
                return original(round_idx, *args)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return original(round_idx, *args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                strict_calls.append(name)

        setattr(method, name, strict)

    without_syncs("sample_clients")
    without_syncs("run_round")
    fit(method, dm, rounds=3, accelerator="gpu")
    assert strict_calls == ["sample_clients", "run_round"] * 2
