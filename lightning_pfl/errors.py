"""Errors that are the user's to fix: each message says what to change.

The command line prints these as one paragraph (no traceback; set ``PFL_DEBUG=1`` for it) and
exits with status 2; :class:`RunInterrupted` exits with 128 + the signal number.
"""

from __future__ import annotations


class PFLError(Exception):
    """Base class of every error whose message tells the user what to change."""

    exit_code = 2


class ConfigError(PFLError, ValueError):
    """An argument, or a combination of arguments, that cannot give a meaningful run."""


class DatasetError(PFLError, OSError):
    """Dataset files that are missing or corrupt."""


class NonFiniteLossError(PFLError, FloatingPointError):
    """A client's local training loss became NaN or infinite.

    :class:`~lightning_pfl.callbacks.RoundCheckpoint` adds where the run can continue from
    (``resume_from``: the last checkpoint and its round), since the failed round is not saved.
    """

    resume_from: tuple[str, int] | None = None

    def __str__(self) -> str:
        if self.resume_from is None:
            return super().__str__()
        path, round_idx = self.resume_from
        if not path:
            return f"{super().__str__()} No checkpoint was saved before this round."
        return (
            f"{super().__str__()} The last checkpoint, {path} (after round {round_idx}), is "
            f"intact: continue from it with the changed setting by adding --ckpt_path {path} "
            "--allow_changes=[<the key you changed>]."
        )


class RunInterrupted(PFLError):
    """A run stopped by SIGINT or SIGTERM after saving its checkpoint at a round boundary."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum
