"""CFL, CCVR, FedAS, GPFL and FedCP (issue 46): their math on hand examples, vmap == loop,
exact resume."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from lightning_pfl.methods.cfl import CFL, optimal_bipartition
from lightning_pfl.methods.fedavg import FedAvg
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    capture_local_training,
)


# ----------------------------------------------------------------------------- CFL
def brute_force_bipartition(similarity: torch.Tensor) -> float:
    """min over every bipartition of the largest cross similarity."""
    m = len(similarity)
    best = float("inf")
    for mask in itertools.product([False, True], repeat=m - 1):
        second = torch.tensor([False, *mask])
        if second.any():
            best = min(best, float(similarity[~second][:, second].max()))
    return best


def test_cfl_bipartition_minimizes_the_largest_cross_similarity() -> None:
    # A chain 0 - 1 - 2 weakly tied to 3: {0, 1, 2} | {3}, whose cross maximum is 0.1, where
    # complete linkage (the authors' code) would cut the chain between 1 and 2.
    alpha = torch.tensor(
        [[1.0, 0.9, 0.2, -0.5], [0.9, 1.0, 0.8, 0.0], [0.2, 0.8, 1.0, 0.1], [-0.5, 0.0, 0.1, 1.0]]
    )
    assert optimal_bipartition(alpha).tolist() == [False, False, False, True]
    g = torch.Generator().manual_seed(0)
    for m in (2, 3, 5, 7):
        u = torch.nn.functional.normalize(torch.randn(m, 4, generator=g), dim=1)
        alpha = u @ u.T
        second = optimal_bipartition(alpha)
        assert second.any() and not second.all()
        assert float(alpha[~second][:, second].max()) == brute_force_bipartition(alpha)


def cfl_round(**kwargs: float) -> tuple[CFL, torch.Tensor, dict[str, torch.Tensor], list]:
    dm = digits_data(6)
    method = build(CFL, dm, split_from_round=0, min_cluster_size=2, **kwargs)
    assert isinstance(method, CFL)
    before = {n: t.clone() for n, t in method.models().items()}
    trained = capture_local_training(method)
    clients = torch.arange(6)
    method.run_round(0, clients)
    return method, clients, before, trained


def test_cfl_splits_by_the_optimal_bipartition_when_the_criterion_holds() -> None:
    method, clients, before, trained = cfl_round(eps_1=1e6, eps_2=0.0)
    delta = torch.cat(
        [(trained[0].params[n] - before[n][0]).flatten(1) for n in method.arch.shapes], 1
    )
    unit = torch.nn.functional.normalize(delta.double(), dim=1)
    second = optimal_bipartition(unit @ unit.T)
    assert method.cluster_of.tolist() == second.long().tolist()
    # both halves start from the one model and move by their own members' weighted mean update
    n = method.data.num_samples("train")[clients].double()
    for name in method.arch.shapes:
        d = (trained[0].params[name] - before[name][0]).double()
        for c, rows in ((0, ~second), (1, second)):
            w = n * rows
            mean = (w.view(-1, *[1] * (d.dim() - 1)) * d).sum(0) / w.sum()
            torch.testing.assert_close(
                method.models()[name][c], (before[name][0] + mean).float(), msg=name
            )
        assert torch.equal(method.models()[name][2:], before[name][2:])
    stored = method.store.gather("update", clients, method.device)["delta"]
    torch.testing.assert_close(stored, delta)


def test_cfl_keeps_one_cluster_unless_both_norm_bounds_hold() -> None:
    # the mean update is never below 0 (eps_1 = 0), the largest never above 1e6 (eps_2)
    for eps in ({"eps_1": 0.0, "eps_2": 0.0}, {"eps_1": 1e6, "eps_2": 1e6}):
        method, clients, before, trained = cfl_round(**eps)
        assert method.cluster_of.tolist() == [0] * 6
        n = method.data.num_samples("train")[clients].double()
        name = "fc2.weight"
        d = (trained[0].params[name] - before[name][0]).double()
        mean = (n.view(-1, 1, 1) * d).sum(0) / n.sum()  # FedAvg within the cluster
        torch.testing.assert_close(method.models()[name][0], (before[name][0] + mean).float())
    # the mean norm bound is strict: just above the round's mean norm it splits, at it not
    method, clients, before, trained = cfl_round(eps_1=1e6, eps_2=0.0)
    delta = torch.cat(
        [(trained[0].params[n] - before[n][0]).flatten(1) for n in method.arch.shapes], 1
    )
    weights = method.client_weights(clients).double()
    mean_norm = float((weights[:, None] * delta.double()).sum(0).norm())
    assert cfl_round(eps_1=mean_norm * 1.001, eps_2=0.0)[0].cluster_of.max() == 1
    assert cfl_round(eps_1=mean_norm * 0.999, eps_2=0.0)[0].cluster_of.max() == 0


def test_cfl_without_a_split_is_fedavg() -> None:
    dm = digits_data(6)
    cfl, fedavg = build(CFL, dm, eps_1=0.0), build(FedAvg, dm)
    for r in range(3):
        clients = cfl.sample_clients(r)
        cfl.run_round(r, clients)
        fedavg.run_round(r, clients)
        for p in fedavg.net.parameters():  # the server step: lr 1, no momentum
            p.data -= p.grad
    assert cfl.cluster_of.max() == 0
    for name, t in fedavg.global_state().items():
        torch.testing.assert_close(cfl.models()[name][0], t, rtol=1e-5, atol=1e-6, msg=name)


def test_cfl_personalized_model_is_the_clusters() -> None:
    method, clients, _, _ = cfl_round(eps_1=1e6, eps_2=0.0)
    params = method.personalized_params(clients)
    for name, t in params.items():
        assert torch.equal(t, method.models()[name][method.cluster_of]), name


def test_cfl_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(CFL, eps_1=1e6, eps_2=0.0, split_from_round=1)


def test_cfl_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "cfl.yaml", tmp_path)
