"""Which samples each client holds in each split (train, val, test), as index lists into the
pooled inputs (the training set, then the test set).

``matched``: a uniformly random validation pool is held out of the training set, the rest is
partitioned, and the clients' validation and test sets take each client's training class shares
of the validation pool and the test set. ``holdout``: the training and test sets are pooled and
partitioned (or split by their natural clients), and each client's own samples are split into
train / val / test. Pure functions of the arrays and the settings: the DataModule calls them.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import Tensor

from lightning_pfl.datasets import DatasetArrays
from lightning_pfl.partition import (
    IndexLists,
    Partitioner,
    PartitionError,
    count_matrix,
    split_by_shares,
)


def split_clients(
    arrays: DatasetArrays,
    partition: Partitioner,
    num_clients: int,
    num_classes: int,
    eval_split: Literal["matched", "holdout"],
    val_fraction: float,
    test_fraction: float,
    rng: np.random.Generator,
) -> dict[str, IndexLists]:
    """Every client's samples of each split, by ``eval_split`` (see the module's docstring)."""
    n_train = len(arrays.train_y)
    if eval_split == "holdout":
        labels = torch.cat([arrays.train_y, arrays.test_y]).numpy()
        if arrays.train_clients is not None:
            owners = arrays.train_clients.numpy()
            pooled = [np.flatnonzero(owners == i) for i in range(num_clients)]
        else:
            coarse = _cat_optional(arrays.train_coarse, arrays.test_coarse)
            pooled = partition.split(labels, num_clients, num_classes, rng, coarse)
        return holdout(pooled, val_fraction, test_fraction, rng)
    labels = arrays.train_y.numpy()
    order = rng.permutation(n_train)
    n_val = int(round(val_fraction * n_train))
    val_pool = np.sort(order[:n_val])
    train_pool = np.sort(order[n_val:])
    coarse = arrays.train_coarse.numpy()[train_pool] if arrays.train_coarse is not None else None
    local = partition.split(labels[train_pool], num_clients, num_classes, rng, coarse)
    train = [train_pool[p] for p in local]
    totals = np.bincount(labels[train_pool], minlength=num_classes)
    shares = count_matrix(labels, train, num_classes) / np.maximum(totals, 1)
    test_labels = arrays.test_y.numpy()
    test = [p + n_train for p in split_by_shares(test_labels, shares, rng)]
    val = [val_pool[p] for p in split_by_shares(labels[val_pool], shares, rng)]
    return {"train": train, "val": val, "test": test}


def holdout(
    pooled: IndexLists, val_fraction: float, test_fraction: float, rng: np.random.Generator
) -> dict[str, IndexLists]:
    """Each client's ``pooled`` samples shuffled and split into test, val and train."""
    out: dict[str, IndexLists] = {"train": [], "val": [], "test": []}
    for part in pooled:
        shuffled = rng.permutation(part)
        n_test = int(round(test_fraction * len(part)))
        n_val = int(round(val_fraction * len(part)))
        out["test"].append(np.sort(shuffled[:n_test]))
        out["val"].append(np.sort(shuffled[n_test : n_test + n_val]))
        out["train"].append(np.sort(shuffled[n_test + n_val :]))
    return out


def check_splits(parts: dict[str, IndexLists], val_fraction: float, dataset: str) -> None:
    """Refuse a split that leaves a client without training, test or (when there is a
    validation split) validation samples.

    Raises:
        PartitionError: naming the empty clients and what to change.
    """
    required: list[str] = ["train", "test"] + (["val"] if val_fraction > 0 else [])
    for split in required:
        empty = [i for i, p in enumerate(parts[split]) if len(p) == 0]
        if empty:
            advice = {
                "train": "use fewer clients or a larger Dirichlet min_samples",
                "val": "use a larger val_fraction or fewer clients",
                "test": "use fewer clients, a larger Dirichlet alpha or test_fraction, or "
                "eval_split: holdout",
            }[split]
            raise PartitionError(
                f"{len(empty)} client(s) (e.g. {empty[:5]}) have no {split} samples under "
                f"this split of '{dataset}'; {advice}."
            )


def _cat_optional(a: Tensor | None, b: Tensor | None) -> np.ndarray | None:
    if a is None or b is None:
        return None
    return torch.cat([a, b]).numpy()
