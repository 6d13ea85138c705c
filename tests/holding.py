"""A callback that holds a run in a known round until a stop signal has reached it.

Kept apart from ``tests.helpers`` (which imports the test fixtures) because runs the tests start
in other processes load it through the CLI: ``--trainer.callbacks+=tests.holding.HoldForSignal``.
"""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType
from typing import Any

from lightning import Callback, LightningModule, Trainer

from lightning_pfl.callbacks import STOP_SIGNALS


class HoldForSignal(Callback):
    """Before round ``at_round + 1`` of a fresh run (not a resumed one), print ``holding at
    round <at_round>`` to stderr and wait until SIGINT or SIGTERM has been through the run's
    own handler (the checkpoint's), or ``timeout`` seconds passed. A test that signals once it
    reads that line knows the run is mid-way: neither finished nor still starting, however
    slow the machine. Waiting costs no CPU, unlike rounds enough to outlast another run's
    start."""

    def __init__(self, at_round: int = 3, timeout: float = 120.0) -> None:
        self.at_round, self.timeout = at_round, timeout

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step != self.at_round or trainer.ckpt_path:
            return
        previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        arrived: list[int] = []

        def handled_then_noted(signum: int, frame: FrameType | None) -> None:
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            arrived.append(signum)

        for signum in STOP_SIGNALS:
            signal.signal(signum, handled_then_noted)
        print(f"holding at round {self.at_round}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + self.timeout
        try:
            while not arrived and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
