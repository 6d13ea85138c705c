"""Writes the client x class partition statistics of a run (CSV, JSON, TensorBoard heatmap)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from lightning_pfl.datamodule import FederatedDataModule


def report_partition(data: FederatedDataModule, log_dir: str, logger: Any) -> None:
    """Save ``partition.json`` and ``partition_<split>.csv`` and log a heatmap per split."""
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
    if experiment is not None and hasattr(experiment, "add_figure"):
        for split, matrix in counts.items():
            experiment.add_figure(f"partition/{split}_counts", _heatmap(matrix, split), 0)


def _heatmap(matrix: np.ndarray, split: str) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, max(2.0, min(12.0, 0.15 * len(matrix)))))
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    ax.set_title(f"{split} samples per client and class")
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    return fig
