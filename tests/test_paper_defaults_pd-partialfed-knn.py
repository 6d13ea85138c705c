"""PartialFed and kNN-Per: the papers' behaviour is the default (issue 43, item 3)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.func import grad

from lightning_pfl.engine import derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.knn_per import KNNPer
from lightning_pfl.methods.partialfed import PartialFed, layer_of
from lightning_pfl.streams import LOAD_STREAM
from tests.conftest import build, digits_data, fit
from tests.helpers import assert_vectorized_equals_sequential


# ----------------------------------------------------------------------------- kNN-Per
def test_knn_per_chooses_each_clients_lambda_on_its_validation_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default picks lambda_m per client: the grid value with the best validation accuracy
    (ties: lower validation loss, then smaller lambda), checked against one method per fixed
    lambda; the test split is never read for it, and the test predictions use lambda_m."""
    dm = digits_data(4)
    grid = [0.0, 0.25, 0.5, 0.75, 1.0]
    # momentum: with plain SGD the 2-round features leave every client at lambda = 1
    tuned = build(KNNPer, dm, knn_weight_grid=len(grid), local_momentum=0.9)
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
    with pytest.raises(ConfigError, match="knn_weight.*val_fraction"):
        build(KNNPer, dm).check_data(dm)
    build(KNNPer, dm, knn_weight=0.5).personalized_params(torch.arange(2))  # a fixed lambda runs


# ----------------------------------------------------------------------------- PartialFed
def logistic(u: torch.Tensor) -> torch.Tensor:
    return u.log() - torch.log1p(-u)


def test_partialfed_samples_the_load_choice_from_the_learned_bernoulli() -> None:
    """Default (the paper): layer l of client c starts from the global layer when
    beta_l + L > 0, L logistic noise drawn from (seed, round, LOAD_STREAM) for client c, i.e.
    a Bernoulli(sigmoid(beta_l)) sample, not the rounding of sigmoid(beta_l)."""
    dm = digits_data(4)
    method = build(PartialFed, dm, local_lr=1e-30, local_weight_decay=0.0, select_lr=1e-30, seed=3)
    assert method.hp.decision == "sampled"
    clients = torch.tensor([0, 1, 3])
    start = {n: t.detach().clone() for n, t in method.net.named_parameters()}
    method.run_round(0, clients)  # lr 1e-30 changes no float32 value: the kept models = start
    with torch.no_grad():
        for p in method.net.parameters():
            p.add_(1.0)  # the global model now differs from every kept local model
    shifted = {n: t.detach().clone() for n, t in method.net.named_parameters()}
    method.run_round(1, clients)
    generator = torch.Generator().manual_seed(derive_seed(3, 1, LOAD_STREAM))
    u = torch.rand((4, len(method.layers)), generator=generator)[clients]
    beta = torch.stack([method.store.fields["select"][layer][clients] for layer in method.layers])
    loads = (beta.T + logistic(u)) >= 0  # [C, L]
    assert loads.any() and not loads.all(), "a case with both choices"
    for row, c in enumerate(clients.tolist()):
        for name, kept in method.store.fields["local"].items():
            load = loads[row, method.layers.index(layer_of(name))]
            assert torch.equal(kept[c], (shifted if load else start)[name]), (c, name)


def test_partialfed_selection_step_uses_a_relaxed_bernoulli_sample() -> None:
    """s_l = sigmoid((beta_l + L_s) / tau) with the noise row of the step the client takes
    (its clock), and the clock advances by one per step (gradient 1)."""
    dm = digits_data(4)
    method = build(PartialFed, dm, select_temperature=0.5)
    glob = method.arch.initial_params()
    local = {n: t + 0.3 * torch.randn_like(t) for n, t in glob.items()}
    x, y = dm.fetch(dm.index["train"].flat[:8])
    w = torch.ones(8)
    beta = {layer: torch.tensor(0.2 * i - 0.3) for i, layer in enumerate(method.layers)}
    noise = torch.randn(3, len(method.layers))
    context = {f"global.{n}": t for n, t in glob.items()} | {
        f"local.{n}": t for n, t in local.items()
    }
    context["select_noise"] = noise
    params = beta | {"step_clock": torch.tensor(1.0)}
    loss = method.relaxed_loss(params, context, x, y, w)
    s = {
        layer: torch.sigmoid((beta[layer] + noise[1, i]) / 0.5)
        for i, layer in enumerate(method.layers)
    }
    theta = {n: s[layer_of(n)] * glob[n] + (1 - s[layer_of(n)]) * local[n] for n in glob}
    expected = torch.nn.functional.cross_entropy(method.arch(theta, x), y)
    torch.testing.assert_close(loss, expected)
    assert float(grad(method.relaxed_loss)(params, context, x, y, w)["step_clock"]) == 1.0


def test_partialfed_load_noise_is_keyed_by_client() -> None:
    method = build(PartialFed, digits_data(4))
    alone = method.load_noise(2, torch.tensor([3]), 5)
    together = method.load_noise(2, torch.tensor([0, 3]), 5)
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a[0], b[1])


def test_partialfed_rounded_decision_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(PartialFed, select_lr=1.0, decision="rounded")
