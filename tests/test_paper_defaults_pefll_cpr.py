"""PeFLL's clients per server step: the authors' code's 5 (pefllauthors/PeFLL ``train.py``,
``--clients-per-step``, line 511), whose server step is the mean of the sampled clients'
gradients of <h(e(B_i; psi); phi), delta_i>, clipped to norm 50 (lines 272-366)."""

from __future__ import annotations

import pytest
import torch

from lightning_pfl.methods.pefll import PeFLL
from tests.conftest import build, digits_data, fit
from tests.helpers import assert_vectorized_equals_sequential, capture_local_training

AUTHORS_CLIENTS_PER_STEP = 5


def test_pefll_default_round_trains_the_authors_five_distinct_clients() -> None:
    dm = digits_data(10)
    method = build(PeFLL, dm)
    assert isinstance(method, PeFLL)
    assert method.hp.clients_per_round == AUTHORS_CLIENTS_PER_STEP
    for round_idx in range(3):  # uniform without replacement: distinct training clients
        clients = method.sample_clients(round_idx)
        assert len(clients.unique()) == AUTHORS_CLIENTS_PER_STEP
        assert bool((clients < dm.num_clients).all())
    trained = capture_local_training(method)
    fit(method, dm, rounds=1)
    assert len(trained) == 1
    assert all(len(t) == AUTHORS_CLIENTS_PER_STEP for t in trained[0].params.values())


@pytest.mark.parametrize("clip", [50.0, 1e-3])  # the default clip, and one that binds
def test_pefll_default_server_gradient_is_the_mean_of_the_clients_gradients_then_clipped(
    clip: float,
) -> None:
    method = build(PeFLL, digits_data(8), hn_max_grad_norm=clip)
    assert isinstance(method, PeFLL)
    assert method.hp.lambda_h == method.hp.lambda_v == method.hp.lambda_theta == 0
    clients = method.sample_clients(0)
    assert len(clients) == AUTHORS_CLIENTS_PER_STEP
    trained = capture_local_training(method)
    x, y, w = method.descriptor_batches(clients, 0)
    with torch.no_grad():
        start = method.network(x, y, w)
    method.run_round(0, clients)
    params = method.network.body_parameters() + method.network.embedding_parameters()
    # the authors' loop: client by client, J_i^T delta_i with its own descriptor, summed
    total = [torch.zeros_like(p) for p in params]
    for i in range(len(clients)):
        theta = method.network(x[i : i + 1], y[i : i + 1], w[i : i + 1])
        delta = [start[n][i : i + 1] - trained[0].params[n][i : i + 1] for n in theta]
        grads = torch.autograd.grad(list(theta.values()), params, delta, allow_unused=True)
        total = [t + (g if g is not None else 0) for t, g in zip(total, grads, strict=True)]
    mean = [t / len(clients) for t in total]
    norm = torch.linalg.vector_norm(torch.stack([m.norm() for m in mean]))
    expected = [m * torch.clamp(clip / (norm + 1e-6), max=1.0) for m in mean]
    assert (norm > clip) == (clip < 1)  # the small clip binds, the default does not here
    for p, e in zip(params, expected, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-7)


def test_pefll_five_clients_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(PeFLL, clients_per_round=AUTHORS_CLIENTS_PER_STEP)
