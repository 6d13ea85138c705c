"""PartialFed and kNN-Per: the papers' behaviour is the default (issue 43, item 3)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.knn_per import KNNPer
from tests.conftest import build, digits_data, fit


# ----------------------------------------------------------------------------- kNN-Per
def test_knn_per_chooses_each_clients_lambda_on_its_validation_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default picks lambda_m per client: the grid value with the best validation accuracy
    (ties: lower validation loss, then smaller lambda), checked against one method per fixed
    lambda; the test split is never read for it, and the test predictions use lambda_m."""
    dm = digits_data(4)
    grid = [0.0, 0.25, 0.5, 0.75, 1.0]
    tuned = build(KNNPer, dm, knn_weight_grid=len(grid))
    assert tuned.hp.knn_weight is None
    fit(tuned, dm, rounds=2)
    clients = torch.arange(4)
    fixed = []
    for knn_weight in grid:
        method = build(KNNPer, dm, knn_weight=knn_weight)
        method.load_state_dict(tuned.state_dict())
        fixed.append(method)
    with torch.inference_mode():
        val = [method.evaluate(clients, "val") for method in fixed]
        test = [method.evaluate(clients, "test") for method in fixed]
    expected = []
    for c in range(4):
        best = min(range(len(grid)), key=lambda g: (-val[g][0][c], val[g][2][c], g))
        expected.append(grid[best])

    read: list[str] = []
    blocks = dm.eval_blocks

    def recording(clients: torch.Tensor, split: Any, block: int) -> Iterator[Any]:
        read.append(split)
        return blocks(clients, split, block)

    monkeypatch.setattr(dm, "eval_blocks", recording)
    with torch.inference_mode():
        chosen = tuned.personalized_params(clients)["memory.knn_weight"]
    assert chosen.tolist() == expected
    assert len(set(expected)) > 1, "a case where the clients' lambdas differ"
    assert set(read) == {"train", "val"}
    monkeypatch.undo()
    with torch.inference_mode():
        correct = tuned.evaluate(clients, "test")[0]
    for c in range(4):
        assert correct[c] == test[grid.index(expected[c])][0][c]


def test_knn_per_refuses_a_tuned_lambda_without_a_validation_split() -> None:
    dm = digits_data(4, val_fraction=0.0)
    method = build(KNNPer, dm)
    with pytest.raises(ConfigError, match="knn_weight.*val_fraction"):
        method.personalized_params(torch.arange(2))
    build(KNNPer, dm, knn_weight=0.5).personalized_params(torch.arange(2))  # a fixed lambda runs
