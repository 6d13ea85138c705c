"""What a run prints: its result at the end, and none of the third-party noise around it.

:func:`result_lines` closes ``fit`` and ``test`` with the test accuracy (mean over clients and
pooled) of :func:`closing_entries` (the best-validation round, or without a validation split the
mean +- std over the last evaluations and the best evaluation; then the last round), and where
``results.json`` and the TensorBoard logs are; a job's table over seeds
(:func:`lightning_pfl.jobs.format_summary`) shows the same entries. :func:`quiet_third_party`
drops, by message, Lightning's advertisements for its cloud loggers and torch's deprecation of
a class Lightning uses internally: neither is something a user of this command can act on.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Lightning's rank-zero messages go through these loggers (pytorch's replaces fabric's on import).
RANK_ZERO_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
)
ADVERTISED = ("[litlogger]", "[litmodels]")
# torch >= 2.9 deprecates ``LeafSpec``, which lightning.pytorch.utilities._pytree still builds.
LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class _NoAdvertisement(logging.Filter):
    """Drops Lightning's "Tip: try installing litlogger / litmodels" lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("💡 Tip:") and any(a in message for a in ADVERTISED))


_NO_ADVERTISEMENT = _NoAdvertisement()


def quiet_third_party() -> None:
    """Install the two filters (idempotent: the same filter objects every call)."""
    for name in RANK_ZERO_LOGGERS:
        logging.getLogger(name).addFilter(_NO_ADVERTISEMENT)
    warnings.filterwarnings("ignore", message=LEAFSPEC_DEPRECATION, category=FutureWarning)


@dataclass(frozen=True)
class ClosingEntry:
    """One entry of a closing table: the ``results.json`` test summary ``section``, read as the
    mean over clients (``key``) and pooled (``pooled``)."""

    title: str
    section: str
    key: str
    pooled: str


AT_BEST_VALIDATION = ClosingEntry("test@best", "test_at_best_val", "acc", "acc_weighted")
OVER_LAST_EVALUATIONS = ClosingEntry(
    "last-evals", "test_last_evals", "acc_mean", "acc_weighted_mean"
)
BEST_EVALUATION = ClosingEntry("best-eval", "test_max_over_evals", "acc", "acc_weighted")
AT_LAST_ROUND = ClosingEntry("test@last", "test_last", "acc", "acc_weighted")


def closing_entries(validated: bool) -> tuple[ClosingEntry, ...]:
    """What closes a run (and a job): the test accuracy at the best-validation round, then at
    the last round; without a validation split (``validated`` False: no best round) the mean
    over the last evaluations and the best evaluation, the papers' summaries over evaluations,
    take the best round's place."""
    first = (AT_BEST_VALIDATION,) if validated else (OVER_LAST_EVALUATIONS, BEST_EVALUATION)
    return (*first, AT_LAST_ROUND)


def result_lines(
    results: Mapping[str, Any], results_path: str | None, tensorboard_dir: str | None
) -> list[str]:
    """The closing table of a run from its ``results.json`` entries (``results_path``: None
    when no logger wrote it; ``tensorboard_dir``: None without a TensorBoard logger). Without a
    validation split (``select_metric`` None) the best-validation row gives way to the summaries
    over the periodic test evaluations (``test_last_evals``, ``test_max_over_evals``)."""
    best_round = results.get("best_round")
    if results.get("subcommand") == "fit":
        last, missing = "last round", "not evaluated (--test_after_fit false)"
    else:
        last, missing = "checkpoint's round", "not evaluated"
    best_label = (
        f"best val/{results['select_metric']} round {best_round}"
        if best_round is not None
        else "best validation round"
    )
    rows_of = {
        AT_BEST_VALIDATION: [
            (best_label, _accuracies(results.get("test_at_best_val"), "no validation ran"))
        ],
        OVER_LAST_EVALUATIONS: _over_evaluations_rows(results),
        BEST_EVALUATION: [],  # in the over-evaluations rows, which need both summaries
        AT_LAST_ROUND: [
            (f"{last} {results['rounds']}", _accuracies(results.get("test_last"), missing))
        ],
    }
    validated = results.get("select_metric") is not None
    rows = [row for entry in closing_entries(validated) for row in rows_of[entry]]
    width = max(len(label) for label, _ in rows)
    lines = [f"{results['method'] + ' test accuracy':<{width}}  mean over clients  pooled"]
    lines += [f"{label:<{width}}  {values}" for label, values in rows]
    lines.append(f"results: {results_path or 'not written (trainer.logger is off)'}")
    if tensorboard_dir is not None:
        lines.append(f"TensorBoard: tensorboard --logdir {tensorboard_dir}")
    return lines


def _accuracies(test: Mapping[str, float] | None, why_not: str) -> str:
    return f"{test['acc']:>17.4f}  {test['acc_weighted']:.4f}" if test else f"{why_not:>17}"


def _over_evaluations_rows(results: Mapping[str, Any]) -> list[tuple[str, str]]:
    spread, best = results.get("test_last_evals"), results.get("test_max_over_evals")
    if not spread or not best:
        return [("periodic test evaluations", f"{'none ran':>17}")]
    rounds = spread["rounds"]
    pooled = f"{spread['acc_weighted_mean']:.4f} +- {spread['acc_weighted_std']:.4f}"
    return [
        (
            f"mean +- std of the last {spread['n']} evaluations (rounds {rounds[0]}-{rounds[-1]})",
            f"{spread['acc_mean']:.4f} +- {spread['acc_std']:.4f}".rjust(17) + f"  {pooled}",
        ),
        (
            f"best evaluation (rounds {best['round_acc']} / {best['round_acc_weighted']})",
            _accuracies(best, ""),
        ),
    ]
