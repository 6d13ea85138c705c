"""What a run reports: its evaluations and best round, time and communication, the checkpoint's
record fields and ``results.json``; and the TensorBoard entries that go with them."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.errors import ConfigError, NonFiniteLossError
from lightning_pfl.metrics import ACCURACIES, over_evaluations
from lightning_pfl.reporting import per_client_figure

# Checkpoints written before runs kept every evaluation cannot resume to an uninterrupted state.
OLD_CHECKPOINT = (
    "the checkpoint was written before runs kept the test accuracy of every evaluation "
    "(eval_history, behind results.json's test_max_over_evals and test_last_evals), so a run "
    "resumed from it could not reach the state of an uninterrupted one; start the run again "
    "without --ckpt_path."
)


@dataclass
class PendingLoss:
    """A trained round's losses, still where they were computed: the host reads them one round
    later (:meth:`RunRecord.settle`), so that it does not wait for the device at the end of
    every round."""

    round_idx: int
    clients: Tensor  # [C] the round's clients
    finite: Tensor  # [C] whether each client's loss is finite
    summary: Tensor  # [2] all finite (1.0 / 0.0), the round's mean loss

    def read(self) -> float:
        """The round's mean loss; a NonFiniteLossError naming the clients if one is not finite."""
        all_finite, loss = self.summary.tolist()
        if not all_finite:
            bad = self.clients[~self.finite].tolist()
            raise NonFiniteLossError(
                f"non-finite local training loss in round {self.round_idx} for clients "
                f"{bad[:10]}; lower model.init_args.local_lr, set "
                "model.init_args.local_max_grad_norm, or check the inputs."
            )
        return loss


class RunRecord:
    """The record of one run, kept by the method (``method.record``) and saved in its checkpoints.

    Args:
        select_metric: validation metric that picks the best round (``acc`` or
            ``acc_weighted``).
        last_evals: how many of the final evaluations ``test_last_evals`` averages.

    Attributes:
        best: the best-validation round: ``round``, its ``val`` and ``test`` statistics.
        last_val: the last validation's statistics and ``round``.
        eval_history: the test accuracies of every evaluation (``round``, ``acc``,
            ``acc_weighted``).
        test_last: the test statistics of the last ``test`` run, with its ``round``.
        comm_bytes_total: bytes sent and received so far (float64 ``[2]``).
        round_bytes: bytes sent and received in the current round (set by the method's
            ``record_communication``).
        stopped_by: why training stopped (``max_steps``, or ``max_time or a callback``).
        experiment: the run's experiment identity (set by the CLI, checked on resume).
        extra_results: entries callbacks add to ``results.json``.
        pending_loss: the last trained round's losses until :meth:`settle` reads them.
    """

    def __init__(self, select_metric: str, last_evals: int) -> None:
        self.select_metric = select_metric
        self.last_evals = last_evals
        self.best: dict[str, Any] = {}
        self.last_val: dict[str, float] = {}
        self.eval_history: list[dict[str, float]] = []
        self.test_last: dict[str, float] | None = None
        self.train_seconds = 0.0
        self.rounds_timed = 0
        self.checkpoint_round = 0
        self.comm_bytes_total = torch.zeros(2, dtype=torch.float64)
        self.round_bytes = [0.0, 0.0]
        self.stopped_by: str | None = None
        self.experiment: dict[str, Any] | None = None
        self.extra_results: dict[str, Any] = {}
        self.pending_loss: PendingLoss | None = None

    def settle(self) -> tuple[int, float] | None:
        """Read the pending round's losses (the round's one host synchronization): its
        rounds-completed step and mean loss, or None if no round is pending. Raises
        NonFiniteLossError for a non-finite loss, before anything saves or evaluates the
        state that round left."""
        pending, self.pending_loss = self.pending_loss, None
        return None if pending is None else (pending.round_idx + 1, pending.read())

    @property
    def seconds_per_round(self) -> float:
        return self.train_seconds / max(self.rounds_timed, 1)

    def end_round(self, seconds: float) -> dict[str, float]:
        """Count a trained round's time and bytes; returns its ``comm/*`` scalars."""
        down, up = self.round_bytes
        self.comm_bytes_total += torch.tensor(self.round_bytes, dtype=torch.float64)
        self.train_seconds += seconds
        self.rounds_timed += 1
        return {
            "comm/bytes_down": down,
            "comm/bytes_up": up,
            "comm/bytes_down_total": float(self.comm_bytes_total[0]),
            "comm/bytes_up_total": float(self.comm_bytes_total[1]),
        }

    def add_evaluation(
        self, round_idx: int, test: dict[str, float], validation: dict[str, float] | None
    ) -> tuple[dict[str, float], str]:
        """Record the evaluation of round ``round_idx``: its ``test`` statistics and, with a
        validation split, its ``validation`` ones (the round is then a best-round candidate).
        Returns the scalars to log and a one-line summary."""
        key = self.select_metric
        self.eval_history.append({"round": round_idx, **{k: test[k] for k in ACCURACIES}})
        logged = {f"test_eval/{k}": test[k] for k in ACCURACIES}
        if validation is None:
            return logged, f"test acc {test['acc']:.4f} (weighted {test['acc_weighted']:.4f})"
        self.last_val = {**validation, "round": round_idx}
        if not self.best or validation[key] > self.best["val"][key]:
            self.best = {"round": round_idx, "val": validation, "test": test}
        logged |= {f"val/{k}": v for k, v in validation.items()}
        logged["val/best_acc"] = self.best["val"][key]
        summary = (
            f"val acc {validation['acc']:.4f} (weighted {validation['acc_weighted']:.4f}), best "
            f"{self.best['val'][key]:.4f} at round {self.best['round']}"
        )
        return logged, summary

    def add_test(self, round_idx: int, stats: dict[str, float]) -> dict[str, float]:
        """Record a ``test`` run's statistics; returns ``test/*``, ``test_best/*`` and the
        over-evaluation summaries as scalars."""
        self.test_last = {**stats, "round": round_idx}
        logged = {f"test/{k}": v for k, v in stats.items()}
        if self.best:
            logged |= {f"test_best/{k}": v for k, v in self.best["test"].items()}
            logged["test_best/round"] = float(self.best["round"])
        for name, summary in over_evaluations(self.eval_history, self.last_evals).items():
            logged |= {
                f"{name}/{k}": float(v) for k, v in summary.items() if not isinstance(v, list)
            }
        return logged

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "last_val": self.last_val,
            "eval_history": self.eval_history,
            "train_seconds": self.train_seconds,
            "rounds_timed": self.rounds_timed,
            "comm_bytes_total": self.comm_bytes_total.tolist(),
            "experiment": self.experiment,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "eval_history" not in state:
            raise ConfigError(OLD_CHECKPOINT)
        self.best = state["best"]
        self.last_val = state["last_val"]
        self.eval_history = state["eval_history"]
        self.train_seconds = state["train_seconds"]
        self.rounds_timed = state["rounds_timed"]
        self.checkpoint_round = state["round"]
        self.comm_bytes_total = torch.tensor(state["comm_bytes_total"], dtype=torch.float64)

    def results(self, method: str, rounds: int, has_validation: bool, seed: int) -> dict[str, Any]:
        """The run's ``results.json``: metrics, rounds, speed, communication."""
        return {
            "method": method,
            "rounds": rounds,
            "stopped_by": self.stopped_by,
            "seconds_per_round": self.seconds_per_round,
            # None without a validation split: no round is selected (best_round etc. are None)
            "select_metric": self.select_metric if has_validation else None,
            "val_last": self.last_val,
            "best_round": self.best.get("round"),
            "val_at_best": self.best.get("val"),
            "test_at_best_val": self.best.get("test"),
            "test_last": self.test_last,
            **over_evaluations(self.eval_history, self.last_evals),
            "eval_history": self.eval_history,
            "comm_bytes_down_total": float(self.comm_bytes_total[0]),
            "comm_bytes_up_total": float(self.comm_bytes_total[1]),
            "seed": seed,
            **self.extra_results,
        }


def log_client_accuracy(
    logger: TensorBoardLogger, prefix: str, per_client: Tensor, step: int, figure: bool
) -> None:
    """The per-client accuracies as a histogram and, with ``figure``, a sorted bar figure."""
    seen = per_client[~per_client.isnan()].cpu()
    experiment = logger.experiment
    experiment.add_histogram(f"{prefix}/client_acc", seen, step)
    if figure:
        title = f"{prefix} accuracy per client, round {step}"
        experiment.add_figure(f"{prefix}/client_acc_sorted", per_client_figure(seen, title), step)


def hparams_table(
    method: str, hparams: Mapping[str, Any], data: FederatedDataModule
) -> dict[str, Any]:
    """Method, data and split settings, flattened for TensorBoard's HParams tab."""
    table: dict[str, Any] = {"method": method}
    for name, value in hparams.items():
        if not name.startswith("_"):
            table[f"model/{name}"] = value
    for name, value in data.describe().items():
        table[f"data/{name}"] = value
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in table.items()}


def log_hparams_table(logger: TensorBoardLogger, table: dict[str, Any]) -> None:
    """Write the HParams-tab entry with ``val/best_acc`` as its metric (no placeholder value)."""
    from torch.utils.tensorboard.summary import hparams

    metric = {"val/best_acc": math.nan}
    experiment, start, end = hparams(table, metric)
    writer = logger.experiment._get_file_writer()
    for summary in (experiment, start, end):
        writer.add_summary(summary)
