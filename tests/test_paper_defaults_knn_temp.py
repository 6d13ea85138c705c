"""kNN-Per's kernel temperature is the authors' by default (issue 43, item 3)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_pfl.engine import Params
from lightning_pfl.methods.knn_per import KNNPer
from tests.conftest import build, digits_data

LABELS = [0, 1, 0, 2, 2]


def hand_memory(method: KNNPer, x: torch.Tensor) -> tuple[Params, list[float]]:
    """The global model's parameters and a memory around the feature z of the one query ``x``:
    entries at squared distances 0, D ln 2, D ln 4 (labels 0, 1, 0; the three nearest) and two
    far ones (label 2); returns the parameters and those squared distances."""
    glob = method.global_state()
    z = method.arch.features(glob, x)[0]
    dim = z.shape[-1]
    squared = [0.0, dim * math.log(2.0), dim * math.log(4.0), 1e4, 2e4]
    direction = torch.zeros_like(z)
    direction[0] = 1.0
    memory = torch.stack([z + math.sqrt(d) * direction for d in squared])
    params = glob | {
        "memory.features": memory,
        "memory.labels": torch.tensor(LABELS),
        "memory.mask": torch.ones(len(LABELS), dtype=torch.bool),
    }
    return params, squared


def expected_probabilities(squared: list[float], temperature: float, k: int) -> torch.Tensor:
    weights = [math.exp(-d / temperature) for d in squared[:k]]
    p = [0.0] * 10
    for label, w in zip(LABELS, weights, strict=False):
        p[label] += w / sum(weights)
    return torch.tensor(p)


def test_knn_per_kernel_temperature_is_the_feature_dimension_by_default() -> None:
    """The authors' code weighs the k nearest by exp(-d / D) (faiss' squared L2 distance d, D
    the feature dimension), normalized over the k: at squared distances 0, D ln 2, D ln 4 the
    weights are 1, 1/2, 1/4, so p = (5/7, 2/7, 0, ...) for labels (0, 1, 0). The former
    default T = 1 made this (1, 2^-D, 0, ...), one-hot."""
    dm = digits_data(4)
    method = build(KNNPer, dm, neighbours=3)
    assert isinstance(method, KNNPer)
    assert method.hp.temperature is None
    x = dm.fetch(dm.index["train"].lookup(torch.tensor([0]), torch.tensor([[0]])))[0][0]
    params, squared = hand_memory(method, x)
    assert params["memory.features"].shape[-1] == 64  # digits_cnn: D = 64
    _, knn = method.outputs(params, x)
    hand = torch.zeros(10)
    hand[0], hand[1] = 5 / 7, 2 / 7
    torch.testing.assert_close(knn[0], hand, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(knn[0], expected_probabilities(squared, 64.0, 3))


@pytest.mark.parametrize("temperature", [1.0, 10.0])
def test_knn_per_fixed_temperature_stays_reachable(temperature: float) -> None:
    """A number is used as T itself; T = 1 is the former default (one-hot here)."""
    dm = digits_data(4)
    method = build(KNNPer, dm, neighbours=3, temperature=temperature)
    assert isinstance(method, KNNPer)
    x = dm.fetch(dm.index["train"].lookup(torch.tensor([0]), torch.tensor([[0]])))[0][0]
    params, squared = hand_memory(method, x)
    _, knn = method.outputs(params, x)
    expected = expected_probabilities(squared, temperature, 3)
    torch.testing.assert_close(knn[0], expected, rtol=1e-4, atol=1e-5)
    if temperature == 1.0:
        assert knn[0, 0] > 1 - 1e-6


def test_knn_per_default_temperature_vmap_equals_one_by_one() -> None:
    """The evaluation's vmap over clients gives each client's own prediction with T = D."""
    dm = digits_data(4)
    method = build(KNNPer, dm, knn_weight=0.5)
    assert isinstance(method, KNNPer)
    clients = torch.tensor([0, 1, 3])
    x = dm.fetch(dm.index["train"].lookup(clients, torch.arange(12).expand(3, -1)))[0]
    with torch.inference_mode():
        params = method.personalized_params(clients)
        together = torch.vmap(method.predict)(params, x)
        alone = [
            method.predict({n: t[c] for n, t in params.items()}, x[c]) for c in range(len(clients))
        ]
    torch.testing.assert_close(together, torch.stack(alone), rtol=1e-5, atol=1e-6)
