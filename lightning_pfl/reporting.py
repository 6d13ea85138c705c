"""Figures and files that describe a run: the client x class partition, per-client accuracy."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

if TYPE_CHECKING:
    from lightning_pfl.datamodule import FederatedDataModule

MAX_LABELLED_TICKS = 40
MAX_ANNOTATED_CELLS = 400


def report_partition(
    data: FederatedDataModule, log_dir: str, logger: Any, figures: bool = True
) -> None:
    """Save ``partition.json`` and ``partition_<split>.csv`` and (``figures``) log a heatmap
    per split."""
    os.makedirs(log_dir, exist_ok=True)
    counts = data.partition_counts()
    summary = {
        "dataset": data.dataset,
        "num_clients": data.num_clients,
        "num_classes": data.num_classes,
        "counts": {split: m.tolist() for split, m in counts.items()},
        "samples_per_client": {split: m.sum(1).tolist() for split, m in counts.items()},
    }
    with open(os.path.join(log_dir, "partition.json"), "w") as f:
        json.dump(summary, f)
    for split, matrix in counts.items():
        header = "client," + ",".join(f"class_{c}" for c in range(matrix.shape[1]))
        rows = np.column_stack([np.arange(len(matrix)), matrix])
        np.savetxt(
            os.path.join(log_dir, f"partition_{split}.csv"),
            rows,
            fmt="%d",
            delimiter=",",
            header=header,
            comments="",
        )
    experiment = getattr(logger, "experiment", None)
    if figures and experiment is not None and hasattr(experiment, "add_figure"):
        for split, matrix in counts.items():
            experiment.add_figure(f"partition/{split}_counts", heatmap(matrix, split), 0)


def _ticks(n: int) -> np.ndarray:
    """Every index up to MAX_LABELLED_TICKS, else about that many evenly spaced ones."""
    if n <= MAX_LABELLED_TICKS:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, MAX_LABELLED_TICKS).round().astype(int))


def heatmap(matrix: np.ndarray, split: str) -> Any:
    """Client x class counts: every client and class labelled (sampled ticks beyond 40) and
    the count written in each cell when there are at most 400 cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients, classes = matrix.shape
    height = max(2.5, min(14.0, 0.25 * min(clients, 60) + 1.5))
    width = max(4.0, min(14.0, 0.35 * min(classes, 40) + 2.5))
    fig, ax = plt.subplots(figsize=(width, height))
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis")
    rows, cols = _ticks(clients), _ticks(classes)
    ax.set_yticks(rows, [str(r) for r in rows], fontsize=7)
    ax.set_xticks(cols, [str(c) for c in cols], fontsize=7)
    if matrix.size <= MAX_ANNOTATED_CELLS:
        threshold = matrix.max() / 2 if matrix.size else 0
        for (i, j), value in np.ndenumerate(matrix):
            colour = "black" if value > threshold else "white"
            ax.text(j, i, str(int(value)), ha="center", va="center", fontsize=6, color=colour)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_title(f"{split} samples per client and class")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return fig


def per_client_figure(accuracy: Tensor, title: str) -> Any:
    """Per-client accuracies sorted from worst to best, with the mean marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = np.sort(accuracy.double().numpy())
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(np.arange(len(values)), values, marker="." if len(values) <= 200 else None)
    if len(values):
        ax.axhline(values.mean(), color="grey", linestyle="--", label=f"mean {values.mean():.3f}")
        ax.legend(loc="lower right")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("clients, sorted by accuracy")
    ax.set_ylabel("accuracy")
    ax.set_title(title)
    fig.tight_layout()
    return fig
