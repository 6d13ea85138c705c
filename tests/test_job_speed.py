"""What a job's lockstep costs besides the runs' own work (``lightning_pfl.lockstep``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from lightning_pfl.lockstep import Lockstep, get_rng


def test_passing_the_turn_wakes_only_the_run_that_takes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every run that waits for the turn is woken only when the turn is its own: a hand-off
    between two runs does not wake the others (each would take the lock and the GIL for
    nothing, N - 1 times a hand-off)."""
    runs, rounds = 4, 3
    lockstep = Lockstep(runs, [get_rng() for _ in range(runs)])

    def train_nothing() -> None:
        for pending in lockstep.pending.values():
            pending.result = "trained"  # type: ignore[assignment]

    monkeypatch.setattr(lockstep, "_train_pending", train_nothing)
    woken: list[tuple[int, int | None]] = []
    wait = threading.Condition.wait

    def recording_wait(self: threading.Condition, timeout: float | None = None) -> bool:
        result = wait(self, timeout)
        name = threading.current_thread().name
        if name.startswith("pfl-run-"):
            woken.append((int(name.rsplit("-", 1)[1]), lockstep.turn))
        return result

    monkeypatch.setattr(threading.Condition, "wait", recording_wait)

    def body(index: int) -> Any:
        return [lockstep.submit(index, None, None) for _ in range(rounds)]  # type: ignore[arg-type]

    targets: list[Callable[[], Any]] = [partial(body, i) for i in range(runs)]
    outcomes = lockstep.run(targets)
    assert outcomes == [["trained"] * rounds] * runs
    assert lockstep.submissions == runs * rounds
    assert woken, "the runs waited for their turns"
    assert all(turn == index for index, turn in woken), woken
