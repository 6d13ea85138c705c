"""Checkpoints that survive crashes: periodic, timed, atomic, and on SIGINT/SIGTERM; the
novel-client protocol (:class:`~lightning_pfl.novel.NovelClients`) and the gradient-inversion
attack (:class:`~lightning_pfl.attacks.GradientInversion`), re-exported here."""

from __future__ import annotations

import os
import signal
import time
import warnings
from types import FrameType
from typing import Any

from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_pfl.attacks import GradientInversion
from lightning_pfl.errors import ConfigError, NonFiniteLossError, RunInterrupted
from lightning_pfl.novel import NovelClients
from lightning_pfl.validation import NonNegativeInt, PositiveFloat

__all__ = ["GradientInversion", "NovelClients", "RoundCheckpoint"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RoundCheckpoint(ModelCheckpoint):
    """``last.ckpt`` every ``every_n_rounds`` rounds, every ``every_minutes``, at the end, and on
    SIGINT/SIGTERM, written atomically (to a temporary file, then renamed over the old one).

    Checkpoints are taken at a round boundary, after that round's validation when it has one,
    so a resumed run repeats nothing and skips nothing: it reaches exactly the state of an
    uninterrupted run. The first SIGINT or SIGTERM finishes the current round (and
    its validation), saves ``last.ckpt`` and stops with exit status 130 / 143; a second SIGINT
    stops at once (then the previous checkpoint is the one to resume from). Under DDP the ranks
    agree on stopping at the same round. A crash while saving leaves the previous checkpoint
    intact. Every other option is Lightning's ``ModelCheckpoint`` (e.g. ``monitor: val/acc``
    with ``save_top_k`` for best-round checkpoints).

    Args:
        every_n_rounds: save ``last.ckpt`` every this many rounds (0: only by time and at the end).
        every_minutes: also save when this many minutes passed since the last save (None: off).
        **kwargs: ``ModelCheckpoint`` arguments (defaults here: ``save_last=True``,
            ``save_top_k=0``).
    """

    def __init__(
        self,
        every_n_rounds: NonNegativeInt = 100,
        every_minutes: PositiveFloat | None = 10.0,
        **kwargs: Any,
    ) -> None:
        if every_n_rounds < 0 or (every_minutes is not None and every_minutes <= 0):
            raise ConfigError(
                f"checkpoint.every_n_rounds = {every_n_rounds} must be >= 0 and "
                f"checkpoint.every_minutes = {every_minutes} must be > 0 or null."
            )
        for lightning_schedule in ("every_n_train_steps", "train_time_interval"):
            if kwargs.get(lightning_schedule) is not None:
                raise ConfigError(
                    f"checkpoint.{lightning_schedule} saves before the round's validation; use "
                    "checkpoint.every_n_rounds / checkpoint.every_minutes instead."
                )
        if kwargs.get("save_on_exception"):
            raise ConfigError(
                "checkpoint.save_on_exception would save a round half done; checkpoints are "
                "saved at round boundaries (also on SIGINT/SIGTERM): remove it."
            )
        kwargs.setdefault("save_last", True)
        kwargs.setdefault("save_top_k", 0)
        kwargs["enable_version_counter"] = False  # last.ckpt is replaced, never last-v1.ckpt
        super().__init__(**kwargs)
        self.every_n_rounds = every_n_rounds
        self.every_seconds = every_minutes * 60 if every_minutes is not None else None
        self._last_save_time = time.monotonic()
        self._signal: int | None = None
        self._save_after_validation = False
        self._previous_handlers: dict[int, Any] = {}
        self.resume_point = ("", 0)  # the newest intact checkpoint and its round

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.save_top_k != 0:
            super().load_state_dict(state_dict)
            return
        # A resumed or tested run writes into its own version folder; Lightning then warns that
        # the best-k bookkeeping of the old folder is dropped, which tracks nothing at top-k 0.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The dirpath has changed")
            super().load_state_dict(state_dict)

    # ------------------------------------------------------------------ signals
    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self._signal = signum

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_save_time = time.monotonic()
        if trainer.ckpt_path:
            self.resume_point = (str(trainer.ckpt_path), trainer.global_step)
        try:
            for signum in STOP_SIGNALS:
                self._previous_handlers[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread: signals cannot be caught here
            self._previous_handlers.clear()

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_handlers()

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._restore_handlers()
        if isinstance(exception, NonFiniteLossError):
            exception.resume_from = self.resume_point  # the failed round itself is not saved

    # ------------------------------------------------------------------ saving
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Save after round ``global_step`` when due, or after its validation if it has one."""
        stop = trainer.strategy.reduce_boolean_decision(self._signal is not None, all=False)
        if stop and self._signal is None:
            self._signal = signal.SIGTERM  # another rank received it
        rounds = trainer.global_step
        due = stop or (self.every_n_rounds > 0 and rounds % self.every_n_rounds == 0)
        if self.every_seconds is not None:
            elapsed = time.monotonic() - self._last_save_time
            due = trainer.strategy.reduce_boolean_decision(
                due or elapsed >= self.every_seconds, all=False
            )
        if not due:
            return
        if _validates_after(trainer):
            # A checkpoint taken before this round's validation would skip it on resume.
            self._save_after_validation = True
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        if stop:
            raise self.interrupted  # type: ignore[misc]

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)  # top-k saves (last.ckpt only with them)
        if trainer.sanity_checking or not self._save_after_validation:
            return
        self._save_after_validation = False
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        if self._signal is not None:
            raise self.interrupted  # type: ignore[misc]

    @property
    def interrupted(self) -> RunInterrupted | None:
        """The error to stop with if SIGINT/SIGTERM arrived (None otherwise)."""
        if self._signal is None:
            return None
        return RunInterrupted(
            f"{signal.Signals(self._signal).name} received: stopped after round "
            f"{self._last_global_step_saved} and saved {self.last_model_path}. Resume with the "
            "same command and --ckpt_path last.",
            self._signal,
        )

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Write to ``<file>.tmp`` and rename it over ``filepath`` (atomic on POSIX)."""
        temporary = filepath + ".tmp"
        super()._save_checkpoint(trainer, temporary)
        if trainer.is_global_zero:
            os.replace(temporary, filepath)
        trainer.strategy.barrier()
        self._last_checkpoint_saved = filepath
        self._last_save_time = time.monotonic()
        self.resume_point = (filepath, trainer.global_step)


def _validates_after(trainer: Trainer) -> bool:
    """Whether Lightning validates after the current round (our final round always is)."""
    loop = trainer.fit_loop
    if not sum(trainer.num_val_batches):  # no validation data: nothing runs after the round
        return False
    if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        return loop.epoch_loop._should_check_val_epoch()
    return loop.epoch_loop._should_check_val_fx(loop._data_fetcher)  # type: ignore[arg-type]
