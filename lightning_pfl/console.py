"""What a run prints: its result at the end, and none of the third-party noise around it.

:func:`result_lines` closes ``fit`` and ``test`` with the test accuracy (mean over clients and
pooled) at the best-validation round and at the last round, and where ``results.json`` and the
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
    when no logger wrote it; ``tensorboard_dir``: None without a TensorBoard logger)."""
    best_round = results.get("best_round")
    if results.get("subcommand") == "fit":
        last, missing = "last round", "not evaluated (--test_after_fit false)"
    else:
        last, missing = "checkpoint's round", "not evaluated"
    rows = [
        (
            f"best val/{results['select_metric']} round {best_round}"
            if best_round is not None
            else "best validation round",
            results.get("test_at_best_val"),
            "no validation ran",
        ),
        (f"{last} {results['rounds']}", results.get("test_last"), missing),
    ]
    width = max(len(label) for label, _, _ in rows)
    lines = [f"{results['method'] + ' test accuracy':<{width}}  mean over clients  pooled"]
    for label, test, why_not in rows:
        values = f"{test['acc']:>17.4f}  {test['acc_weighted']:.4f}" if test else f"{why_not:>17}"
        lines.append(f"{label:<{width}}  {values}")
    lines.append(f"results: {results_path or 'not written (trainer.logger is off)'}")
    if tensorboard_dir is not None:
        lines.append(f"TensorBoard: tensorboard --logdir {tensorboard_dir}")
    return lines
