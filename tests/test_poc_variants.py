"""Power-of-Choice's cpow-d and rpow-d (Cho, Wang & Joshi, AISTATS 2022): each variant's
selection against a hand-computed case, vmap == one by one == threads, exact resume of rpow-d's
per-client losses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pfl.costs import payload_bytes
from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.power_of_choice import LAST_LOSS, FedAvgPoC
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    capture_local_training,
)

F64 = torch.float64
BIAS = [0.4 * c for c in range(10)]  # logits of every input: class 9 likeliest, 0 least likely


def poc(dm: FederatedDataModule, **kwargs: Any) -> FedAvgPoC:
    method = build(FedAvgPoC, dm, **kwargs)
    assert isinstance(method, FedAvgPoC)
    return method


def queried(method: FedAvgPoC) -> tuple[torch.Tensor, torch.Tensor]:
    """The last round's candidates (by client id) and the values they were ranked by."""
    assert method.queried is not None
    return method.queried


def predict_bias(method: FedAvgPoC) -> torch.Tensor:
    """Make the global model predict BIAS for every input; returns -log p(c), the loss of a
    sample of class c."""
    with torch.no_grad():
        for p in method.net.parameters():
            p.zero_()
        method.net.get_parameter("fc2.bias").copy_(torch.tensor(BIAS))
    return -torch.log_softmax(torch.tensor(BIAS, dtype=F64), 0)


def expected_pick(value: torch.Tensor, drawn: torch.Tensor, m: int) -> torch.Tensor:
    """The m candidates with the highest value, equal values in the order drawn (the authors'
    stable sort); ``value`` indexed by client id."""
    order = sorted(range(len(drawn)), key=lambda i: (-float(value[drawn[i]]), i))
    return drawn[order[:m]].sort().values


def test_cpow_d_estimates_each_candidates_loss_on_b_samples() -> None:
    """b = 1: each candidate's value is the loss of one of its own samples, -log p(y); over
    rounds each class comes up with its share of the client's samples (an unbiased estimate
    of F_k). b >= every n_k: exactly F_k, computed from the class counts."""
    dm = digits_data(6)
    counts = torch.tensor(dm.partition_counts()["train"], dtype=F64)
    clients = torch.arange(6)
    method = poc(dm, candidates=6, clients_per_round=2, variant="cpow-d", loss_batch_size=1)
    class_loss = predict_bias(method)
    rounds = 400
    hits = torch.zeros(6, 10, dtype=F64)
    for round_idx in range(rounds):
        method.sample_clients(round_idx)
        candidates, value = queried(method)
        assert torch.equal(candidates, clients)
        value = value.double()
        match = (value.view(-1, 1) - class_loss.view(1, -1)).abs() < 1e-5
        assert torch.equal(match.sum(1), torch.ones(6, dtype=torch.long)), round_idx
        hits += match.double()
    assert (hits[counts == 0] == 0).all()  # only the client's own classes
    share = counts / counts.sum(1, keepdim=True)
    torch.testing.assert_close(hits / rounds, share, atol=0.08, rtol=0)
    method.sample_clients(7)
    again = queried(method)[1]
    method.sample_clients(7)
    assert torch.equal(again, queried(method)[1])  # seeded by round

    everything = int(dm.num_samples("train").max())
    method = poc(
        dm, candidates=6, clients_per_round=2, variant="cpow-d", loss_batch_size=everything
    )
    class_loss = predict_bias(method)
    full = (counts * class_loss).sum(1) / counts.sum(1)
    picked = method.sample_clients(0)
    candidates, value = queried(method)
    assert torch.equal(candidates, clients)
    torch.testing.assert_close(value.double(), full, rtol=1e-5, atol=1e-6)
    assert torch.equal(picked, full.topk(2).indices.sort().values)


def test_cpow_d_picks_the_highest_estimates_ties_in_draw_order() -> None:
    """With b = 1 many candidates tie (a client of 2 classes has 2 possible values): the m
    picked are the highest, equal ones in the order A was drawn; w^t goes to all d
    candidates and a loss comes back from each."""
    dm = digits_data(8)
    method = poc(dm, candidates=6, clients_per_round=3, variant="cpow-d", loss_batch_size=1)
    predict_bias(method)
    assert method.b == 1
    ties = 0
    for round_idx in range(8):
        picked = method.sample_clients(round_idx)
        candidates, value = queried(method)
        drawn = method.candidate_draw(round_idx)
        assert torch.equal(candidates, drawn.sort().values)
        by_client = torch.full((8,), float("nan"), dtype=F64)
        by_client[candidates] = value.double()
        assert torch.equal(picked, expected_pick(by_client, drawn, 3)), round_idx
        ties += int(len(set(value.tolist())) < len(value))
    assert ties > 0  # the tie rule was exercised
    trained = capture_local_training(method)
    before = method.global_state()
    method.run_round(8, method.sample_clients(8))
    assert len(trained) == 1
    model = payload_bytes(before)
    assert method.record.round_bytes == [6 * model, 3 * model + 6 * 4]


def test_cpow_d_defaults_to_the_local_batch_size() -> None:
    method = poc(digits_data(6), variant="cpow-d", batch_size=5)
    assert method.b == 5


def test_rpow_d_ranks_by_the_stale_losses_of_the_last_participation() -> None:
    """No query: never-selected clients (+inf) go first, in the order drawn; once every
    client has trained, the picked are the candidates whose mean training loss at their last
    participation (tracked here from the captured local training) is highest. Only the m
    picked receive w^t; each uploads its model and its loss."""
    dm = digits_data(6)
    method = poc(dm, candidates=6, clients_per_round=2, variant="rpow-d")

    def no_query(*args: object, **kwargs: object) -> None:
        raise AssertionError("rpow-d evaluates no candidate")

    method.evaluate_clients = no_query  # type: ignore[method-assign,assignment]
    trained = capture_local_training(method)
    stale = torch.full((6,), float("inf"), dtype=F64)
    model = payload_bytes(method.global_state())
    for round_idx in range(6):
        drawn = method.candidate_draw(round_idx)
        picked = method.sample_clients(round_idx)
        assert torch.equal(picked, expected_pick(stale, drawn, 2)), round_idx
        if round_idx == 0:  # nobody has a loss yet: the first two drawn
            assert torch.equal(picked, drawn[:2].sort().values)
        if round_idx == 3:  # every client has one: the two highest
            assert torch.isfinite(stale).all()
            assert torch.equal(picked, stale.topk(2).indices.sort().values)
        method.run_round(round_idx, picked)
        stale[picked] = trained[-1].loss.double()
        stored = method.store.gather(LAST_LOSS, torch.arange(6), torch.device("cpu"))[LAST_LOSS]
        torch.testing.assert_close(stored.double(), stale)
        assert method.record.round_bytes == [2 * model, 2 * model + 2 * 4]


def test_variant_arguments_are_checked() -> None:
    dm = digits_data(6)
    for variant in ("pow-d", "rpow-d"):
        with pytest.raises(ConfigError, match="loss_batch_size"):
            poc(dm, variant=variant, loss_batch_size=4)
    with pytest.raises(ConfigError, match="variant"):
        poc(dm, variant="fast-d")


@pytest.mark.parametrize("variant", ["cpow-d", "rpow-d"])
def test_variants_vectorized_equal_sequential(variant: str) -> None:
    extra: dict[str, Any] = {"loss_batch_size": 4} if variant == "cpow-d" else {}
    assert_vectorized_equals_sequential(FedAvgPoC, rounds=4, candidates=5, variant=variant, **extra)


@pytest.mark.parametrize("variant", ["cpow-d", "rpow-d"])
def test_variants_resume_is_exact(variant: str, tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / "power_of_choice.yaml", tmp_path, f"--model.init_args.variant={variant}"
    )
