"""What a run prints: its result at the end, and none of the third-party noise around it.

:func:`result_lines` closes ``fit`` and ``test`` with the test accuracy (mean over clients and
pooled) at the best-validation round (without a validation split: the mean +- std over the last
evaluations and the best evaluation) and at the last round, and where ``results.json`` and the
TensorBoard logs are. :func:`quiet_third_party` drops, by message, Lightning's advertisements
for its cloud loggers and torch's deprecation of a class Lightning uses internally: neither is
something a user of this command can act on.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
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
    last_row = (f"{last} {results['rounds']}", _accuracies(results.get("test_last"), missing))
    if results.get("select_metric") is None:
        rows = [last_row, *_over_evaluations_rows(results)]
    else:
        best_label = (
            f"best val/{results['select_metric']} round {best_round}"
            if best_round is not None
            else "best validation round"
        )
        rows = [
            (best_label, _accuracies(results.get("test_at_best_val"), "no validation ran")),
            last_row,
        ]
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
