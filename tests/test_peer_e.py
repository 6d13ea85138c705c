"""FedMGDA+ and Power-of-Choice (issue 46): their distinguishing math on hand examples, vmap ==
one by one == threads (exact resume: tests/test_cli.py, RESUMED)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_pfl.costs import payload_bytes
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedmgda_plus import (
    FedMGDAPlus,
    min_norm_weights,
    project_onto_capped_simplex,
)
from lightning_pfl.methods.power_of_choice import FedAvgPoC
from lightning_pfl.privacy import ClientDP
from tests.conftest import build, digits_data, fit
from tests.helpers import (
    assert_vectorized_equals_sequential,
    capture_local_training,
)

F64 = torch.float64


def gram(*vectors: list[float]) -> torch.Tensor:
    v = torch.tensor(vectors, dtype=F64)
    return v @ v.T


# ----------------------------------------------------------------------------- FedMGDA+
def test_projection_onto_the_capped_simplex_by_hand() -> None:
    # clamp(v - tau, 0, 1/2) summing to 1: v_1 is capped, tau = -1/4 shares the rest
    out = project_onto_capped_simplex(
        torch.tensor([3.0, 0.0, 0.0], dtype=F64), torch.zeros(3, dtype=F64), torch.full((3,), 0.5)
    )
    torch.testing.assert_close(out, torch.tensor([0.5, 0.25, 0.25], dtype=F64))
    inside = torch.tensor([0.2, 0.3, 0.5], dtype=F64)
    bounds = torch.zeros(3, dtype=F64), torch.ones(3, dtype=F64)
    torch.testing.assert_close(project_onto_capped_simplex(inside, *bounds), inside)


def test_min_norm_weights_by_hand() -> None:
    # two orthogonal unit vectors: the midpoint
    torch.testing.assert_close(
        min_norm_weights(gram([1, 0], [0, 1]), 1.0, 200), torch.tensor([0.5, 0.5], dtype=F64)
    )
    # (2, 0) and (0, 1): min 4 l^2 + (1 - l)^2 at l = 1/5
    g = gram([2, 0], [0, 1])
    torch.testing.assert_close(min_norm_weights(g, 1.0, 200), torch.tensor([0.2, 0.8], dtype=F64))
    # ... with |l_i - 1/2| <= 0.1: the bound is active
    torch.testing.assert_close(min_norm_weights(g, 0.1, 200), torch.tensor([0.4, 0.6], dtype=F64))
    torch.testing.assert_close(min_norm_weights(g, 0.0, 200), torch.tensor([0.5, 0.5], dtype=F64))
    # the box centred at lambda0 = (0.8, 0.2): l_1 in [0.7, 0.9], so l = (0.7, 0.3)
    center = torch.tensor([0.8, 0.2], dtype=F64)
    torch.testing.assert_close(
        min_norm_weights(g, 0.1, 200, center), torch.tensor([0.7, 0.3], dtype=F64)
    )
    # e1, e2 and (e1 + e2)/sqrt(2): the hull's min-norm point is (e1 + e2)/2, so l_3 = 0; with
    # |l_i - 1/3| <= 0.1, l_3 sits at its lower bound 1/3 - 0.1 and e1, e2 share the rest
    s = 1 / math.sqrt(2)
    g = gram([1, 0, 0], [0, 1, 0], [s, s, 0])
    torch.testing.assert_close(
        min_norm_weights(g, 1.0, 200), torch.tensor([0.5, 0.5, 0.0], dtype=F64), atol=1e-6, rtol=0
    )
    low = 1 / 3 - 0.1
    expected = torch.tensor([(1 - low) / 2, (1 - low) / 2, low], dtype=F64)
    torch.testing.assert_close(min_norm_weights(g, 0.1, 200), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("epsilon", [0.05, 0.3, 1.0])
def test_min_norm_weights_meet_the_optimality_conditions(epsilon: float) -> None:
    """Feasible, and the gradient 2 G l is equal on the free weights, no smaller on those at
    their lower bound and no larger on those at their upper bound (KKT)."""
    g = torch.Generator().manual_seed(1)
    v = torch.randn(6, 40, generator=g, dtype=F64) + 0.5
    v = v / v.norm(dim=1, keepdim=True)
    weights = min_norm_weights(v @ v.T, epsilon, 500)
    lower, upper = max(0.0, 1 / 6 - epsilon), min(1.0, 1 / 6 + epsilon)
    assert abs(float(weights.sum()) - 1) < 1e-9
    assert bool((weights >= lower - 1e-9).all() and (weights <= upper + 1e-9).all())
    grad = 2 * (v @ v.T) @ weights
    at_low, at_high = weights < lower + 1e-6, weights > upper - 1e-6
    free = ~at_low & ~at_high
    assert bool(free.any())
    level = grad[free].mean()
    torch.testing.assert_close(grad[free], level.expand(int(free.sum())), atol=1e-5, rtol=0)
    assert bool((grad[at_low] >= level - 1e-5).all() and (grad[at_high] <= level + 1e-5).all())


def whole_updates(
    before: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], names: list[str]
) -> list[torch.Tensor]:
    """Each client's update w - w_i over all parameters, as one float64 vector."""
    return [
        torch.cat([(before[n] - trained[n][i]).double().flatten() for n in names])
        for i in range(len(trained[names[0]]))
    ]


def pseudo_gradient(method: FedMGDAPlus, names: list[str]) -> torch.Tensor:
    """The server's ``.grad`` over all parameters, as one float64 vector."""
    grads = [method.net.get_parameter(n).grad for n in names]
    return torch.cat([g.double().flatten() for g in grads if g is not None])


def test_fedmgda_plus_steps_along_the_mean_of_the_normalized_updates_of_two_clients() -> None:
    """The min-norm point of two unit vectors is their midpoint (epsilon = 1: unconstrained):
    the pseudo-gradient is (g_1/||g_1|| + g_2/||g_2||)/2, with norms over the whole model."""
    dm = digits_data(6)
    method = build(FedMGDAPlus, dm, epsilon=1.0, clients_per_round=2)
    assert isinstance(method, FedMGDAPlus)
    trained = capture_local_training(method)
    before = method.global_state()
    method.run_round(0, torch.tensor([1, 4]))
    names = [n for n, _ in method.net.named_parameters()]
    g1, g2 = whole_updates(before, trained[0].params, names)
    assert abs(float(g1.norm() / g2.norm()) - 1) > 0.05  # normalizing changes the direction
    expected = (g1 / g1.norm() + g2 / g2.norm()) / 2
    got = pseudo_gradient(method, names)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)


def test_fedmgda_plus_without_normalizing_takes_the_min_norm_point_of_the_raw_updates() -> None:
    """min_l ||l g_1 + (1 - l) g_2||^2 is at l = g_2.(g_2 - g_1) / ||g_1 - g_2||^2 (in [0, 1]);
    with epsilon the weights are clipped to [lambda0_1 - epsilon, lambda0_1 + epsilon], lambda0
    uniform or the clients' sample shares."""
    for epsilon, lambda0 in ((1.0, "uniform"), (0.05, "uniform"), (0.01, "samples")):
        dm = digits_data(6)
        method = build(
            FedMGDAPlus,
            dm,
            epsilon=epsilon,
            lambda0=lambda0,
            normalize=False,
            clients_per_round=2,
            seed=3,
        )
        assert isinstance(method, FedMGDAPlus)
        trained = capture_local_training(method)
        before = method.global_state()
        clients = torch.tensor([0, 5])
        method.run_round(0, clients)
        names = [n for n, _ in method.net.named_parameters()]
        g1, g2 = whole_updates(before, trained[0].params, names)
        free = float(g2 @ (g2 - g1) / (g1 - g2).pow(2).sum())
        n = dm.num_samples("train")[clients].double()
        center = 0.5 if lambda0 == "uniform" else float(n[0] / n.sum())
        low, high = max(0.0, center - epsilon), min(1.0, center + epsilon)
        lam = min(max(free, low), high)
        assert abs(free - center) > 1.2 * epsilon or epsilon == 1.0  # the bound binds
        assert abs(center - 0.5) > 0.02 or lambda0 == "uniform"  # the centres differ
        got = pseudo_gradient(method, names)
        torch.testing.assert_close(got, lam * g1 + (1 - lam) * g2, rtol=1e-5, atol=1e-9)


def test_fedmgda_plus_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedMGDAPlus)


# ----------------------------------------------------------------------------- Power-of-Choice
def set_prediction(method: FedAvgPoC, bias: list[float]) -> None:
    """The global model predicts ``bias`` for every input (all its other weights zero)."""
    with torch.no_grad():
        for p in method.net.parameters():
            p.zero_()
        method.net.get_parameter("fc2.bias").copy_(torch.tensor(bias))


def queried_by(method: FedAvgPoC) -> tuple[torch.Tensor, torch.Tensor]:
    """The last round's candidates and their losses."""
    assert method.queried is not None
    return method.queried


def test_power_of_choice_picks_the_candidates_with_the_highest_loss() -> None:
    """With d = every client, the m picked are the m clients whose mean training CE under the
    global model is highest, computed here from their class counts."""
    dm = digits_data(6)
    method = build(FedAvgPoC, dm, candidates=6, clients_per_round=2)
    assert isinstance(method, FedAvgPoC)
    bias = [0.4 * c for c in range(10)]  # class 9 likeliest, class 0 least likely
    set_prediction(method, bias)
    log_p = torch.log_softmax(torch.tensor(bias, dtype=F64), 0)
    counts = torch.tensor(dm.partition_counts()["train"], dtype=F64)
    loss = -(counts * log_p).sum(1) / counts.sum(1)
    expected = loss.topk(2).indices.sort().values
    assert float(loss.sort(descending=True).values[1] - loss.sort(descending=True).values[2]) > 0.01
    assert torch.equal(method.sample_clients(0), expected)
    candidates, queried = queried_by(method)
    assert torch.equal(candidates, torch.arange(6))
    torch.testing.assert_close(queried.double(), loss, rtol=1e-5, atol=1e-6)
    # a model favouring the other classes picks other clients
    set_prediction(method, bias[::-1])
    loss = -(counts * log_p.flip(0)).sum(1) / counts.sum(1)
    assert torch.equal(method.sample_clients(0), loss.topk(2).indices.sort().values)


def test_power_of_choice_picks_among_a_seeded_candidate_draw() -> None:
    dm = digits_data(8)
    method = build(FedAvgPoC, dm, candidates=4, clients_per_round=2)
    assert isinstance(method, FedAvgPoC)
    draws = []
    for round_idx in range(6):
        picked = method.sample_clients(round_idx)
        candidates, loss = queried_by(method)
        assert len(candidates) == 4 and len(set(candidates.tolist())) == 4
        assert torch.equal(picked, candidates[loss.topk(2).indices].sort().values)
        draws.append(candidates)
    assert any(not torch.equal(draws[0], d) for d in draws[1:])  # a new draw each round
    method.sample_clients(2)
    assert torch.equal(queried_by(method)[0], draws[2])  # the same draw when asked again


def test_power_of_choice_draws_candidates_by_their_share_of_the_samples() -> None:
    """Client k enters A with probability growing with p_k: with one candidate (d = m = 1),
    exactly p_k."""
    from lightning_pfl.partition import Dirichlet

    dm = digits_data(4, partition=Dirichlet(0.5, min_samples=5))
    method = build(FedAvgPoC, dm, candidates=1, clients_per_round=1)
    assert isinstance(method, FedAvgPoC)
    rounds = 3000
    hits = torch.zeros(4)
    for round_idx in range(rounds):
        hits[method.draw_candidates(round_idx)] += 1
    share = dm.num_samples("train").double() / dm.num_samples("train").sum()
    assert float(share.max() / share.min()) > 1.3  # unequal clients
    torch.testing.assert_close(hits.double() / rounds, share, atol=0.03, rtol=0)


def test_power_of_choice_averages_uniformly_and_counts_the_loss_queries() -> None:
    """w^{t+1} = (1/m) sum_S w_k; down: w^t to all d candidates; up: m models + d losses."""
    dm = digits_data(6)
    method = build(FedAvgPoC, dm, candidates=5, clients_per_round=3)
    assert isinstance(method, FedAvgPoC)
    trained = capture_local_training(method)
    before = method.global_state()
    clients = method.sample_clients(0)
    n = dm.num_samples("train")[clients]
    assert len(set(n.tolist())) > 1  # a sample-weighted mean would differ
    method.run_round(0, clients)
    for name, p in method.net.named_parameters():
        expected = (before[name] - trained[0].params[name]).mean(0)
        torch.testing.assert_close(p.grad, expected, rtol=1e-5, atol=1e-7, msg=name)
    model = payload_bytes(before)
    assert method.record.round_bytes == [5 * model, 3 * model + 5 * 4]


def test_power_of_choice_trains_through_the_trainer_with_the_counted_bytes() -> None:
    dm = digits_data(6)
    method = build(FedAvgPoC, dm, candidates=4, clients_per_round=2)
    assert isinstance(method, FedAvgPoC)
    fit(method, dm, rounds=2)
    model = payload_bytes(method.global_state())
    assert method.record.comm_bytes_total.tolist() == [2 * 4 * model, 2 * (2 * model + 4 * 4)]


def test_power_of_choice_refuses_a_bad_candidate_count_and_client_dp() -> None:
    dm = digits_data(6)
    for d in (1, 7):
        with pytest.raises(ConfigError, match="candidates"):
            build(FedAvgPoC, dm, candidates=d, clients_per_round=2)
    with pytest.raises(ConfigError, match="client_dp"):
        build(FedAvgPoC, dm, client_dp=ClientDP(clip_norm=1.0, noise_multiplier=1.0))


def test_power_of_choice_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedAvgPoC, candidates=5)
