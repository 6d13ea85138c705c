"""pFedGP's training objective (issue 43, item 3): the authors' code's predictive likelihood by
default, the marginal likelihood as ``objective: marginal``; each checked against a hand
computation, with vmap == one by one (exact resume: tests/test_cli.py, RESUMED)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_pfl.engine import TrainResult, derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.pfedgp import (
    KERNEL,
    SPLIT_KEYS,
    PFedGP,
    gp_negative_log_likelihood,
    gp_negative_log_predictive,
    predictive_split,
)
from lightning_pfl.step_inputs import CLOCK, CLOCK_GROUP
from lightning_pfl.streams import SPLIT_STREAM
from tests.conftest import build, digits_data
from tests.helpers import assert_vectorized_equals_sequential

D = torch.float64


def rbf(a: torch.Tensor, b: torch.Tensor, ell: float) -> torch.Tensor:
    return torch.exp(-((a[:, None] - b[None]) ** 2).sum(-1) / (2 * ell**2))


def test_pfedgp_trains_on_the_predictive_likelihood_by_default_as_the_authors_code() -> None:
    method = build(PFedGP, digits_data(6))
    assert isinstance(method, PFedGP)
    assert method.hp.objective == "predictive"
    assert method.hp.predict_ratio == 0.5


def test_pfedgp_refuses_an_unknown_objective_and_a_ratio_outside_zero_one() -> None:
    with pytest.raises(ConfigError, match="objective"):
        build(PFedGP, digits_data(6), objective="predictive_likelihood")
    for ratio in (0.0, 1.0):
        with pytest.raises(ConfigError, match="predict_ratio"):
            build(PFedGP, digits_data(6), predict_ratio=ratio)


def test_predictive_split_scores_floor_n_c_times_ratio_points_of_each_class() -> None:
    y = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 1, 0])
    weight = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=D)  # the last two are padding
    keys = torch.tensor([0.9, 0.1, 0.5, 0.3, 0.7, 0.2, 0.2, 0.0, 0.0, 0.0], dtype=D)
    # class 0: 4 points, 2 scored (keys 0.1, 0.3); class 1: 3 points, floor(1.5) = 1 scored,
    # of the tied keys 0.2 the earlier one (position 5); class 2: floor(0.5) = 0; padding never.
    expected = torch.tensor([0, 1, 0, 1, 0, 1, 0, 0, 0, 0], dtype=D)
    torch.testing.assert_close(predictive_split(y, weight, keys, 0.5), expected)
    # int(10 * 0.3) = 3 of ten points, the three smallest keys
    y10, w10 = torch.zeros(10, dtype=torch.long), torch.ones(10, dtype=D)
    keys10 = torch.tensor([0.5, 0.05, 0.9, 0.2, 0.8, 0.1, 0.7, 0.6, 0.95, 0.4], dtype=D)
    scored = predictive_split(y10, w10, keys10, 0.3)
    assert scored.nonzero().flatten().tolist() == [1, 3, 5]


def test_predictive_loss_is_the_hand_computed_gaussian_predictive_density() -> None:
    g = torch.Generator().manual_seed(0)
    z = F.normalize(torch.randn(7, 3, generator=g, dtype=D), dim=-1)
    y = torch.tensor([0, 1, 1, 2, 0, 1, 2])
    weight = torch.ones(7, dtype=D)
    scored = torch.tensor([0, 0, 1, 0, 1, 0, 1], dtype=D)
    ell, s2, classes = 0.7, 0.2, 3
    given, test = (scored == 0).nonzero().flatten(), scored.nonzero().flatten()
    inverse = torch.linalg.inv(rbf(z[given], z[given], ell) + s2 * torch.eye(len(given), dtype=D))
    k_star = rbf(z[test], z[given], ell)
    mean = k_star @ inverse @ F.one_hot(y[given], classes).to(D)
    variance = 1 - torch.einsum("ij,jk,ik->i", k_star, inverse, k_star) + s2
    normal = torch.distributions.Normal(mean, variance.sqrt()[:, None])
    expected = -normal.log_prob(F.one_hot(y[test], classes).to(D)).sum(-1).mean()
    loss = gp_negative_log_predictive(z, y, weight, scored, classes, ell, s2)
    torch.testing.assert_close(loss, expected)
    # one scored point: log p(y* | D_c) = log p(D_c and y*) - log p(D_c), both marginal likelihoods
    alone = torch.zeros(7, dtype=D)
    alone[4] = 1
    joint = 7 * gp_negative_log_likelihood(z, y, weight, classes, ell, s2)
    rest = 6 * gp_negative_log_likelihood(z, y, 1 - alone, classes, ell, s2)
    torch.testing.assert_close(
        gp_negative_log_predictive(z, y, weight, alone, classes, ell, s2), joint - rest
    )
    # padding points (weight 0) change nothing
    zp = torch.cat([z, F.normalize(torch.randn(3, 3, generator=g, dtype=D), dim=-1)])
    yp = torch.cat([y, torch.tensor([0, 2, 1])])
    wp = torch.cat([weight, torch.zeros(3, dtype=D)])
    sp = torch.cat([scored, torch.zeros(3, dtype=D)])
    torch.testing.assert_close(gp_negative_log_predictive(zp, yp, wp, sp, classes, ell, s2), loss)


def test_pfedgp_client_loss_scores_the_split_of_the_step_its_clock_reads() -> None:
    method = build(PFedGP, digits_data(6))
    assert isinstance(method, PFedGP)
    index, weight = next(method.data.eval_blocks(torch.tensor([0]), "train", 16))
    x, y = method.data.fetch(index)
    x, y, w = x[0], y[0], weight[0]
    params = {n: t[0] for n, t in method.payload(torch.tensor([0])).items()}
    keys = torch.rand(3, 16, generator=torch.Generator().manual_seed(1), dtype=D)
    z = method.extractor(params, x, train=True).double()
    for step in range(3):
        clock = torch.tensor(float(step), requires_grad=True)
        loss = method.gp_loss(params | {CLOCK: clock}, {SPLIT_KEYS: keys}, x, y, w)
        assert isinstance(loss, torch.Tensor)
        scored = predictive_split(y, w.double(), keys[step], 0.5)
        assert 0 < scored.sum() < w.sum()
        expected = gp_negative_log_predictive(z, y, w.double(), scored, 10, 0.5, 0.1)
        torch.testing.assert_close(loss, expected.float())
        # the clock's gradient 1 advances it by one step under its SGD at lr -1
        (grad,) = torch.autograd.grad(loss, clock)
        assert float(grad) == 1.0


def test_pfedgp_learned_kernel_is_trained_on_the_predictive_likelihood() -> None:
    method = build(PFedGP, digits_data(6), learn_kernel=True, lengthscale=0.7, noise=0.2)
    assert isinstance(method, PFedGP)
    index, weight = next(method.data.eval_blocks(torch.tensor([1]), "train", 16))
    x, y = method.data.fetch(index)
    x, y, w = x[0], y[0], weight[0]
    params = {
        n: t[0].clone().requires_grad_() for n, t in method.payload(torch.tensor([1])).items()
    }
    keys = torch.rand(2, 16, generator=torch.Generator().manual_seed(3), dtype=D)
    clock = torch.tensor(1.0)
    loss = method.gp_loss(params | {CLOCK: clock}, {SPLIT_KEYS: keys}, x, y, w)
    assert isinstance(loss, torch.Tensor)
    z = method.extractor(params, x, train=True).double()
    scored = predictive_split(y, w.double(), keys[1], 0.5)
    expected = gp_negative_log_predictive(z, y, w.double(), scored, 10, 0.7, 0.2)
    torch.testing.assert_close(loss, expected.float())
    grads = torch.autograd.grad(loss, [params[n] for n in KERNEL])
    assert all(float(g.abs()) > 0 for g in grads)


def test_pfedgp_round_draws_each_steps_split_from_its_stream() -> None:
    method = build(PFedGP, digits_data(6), clients_per_round=3, seed=4)
    assert isinstance(method, PFedGP)
    calls: list[dict[str, Any]] = []
    original = method.local_train

    def spy(*args: Any, **kwargs: Any) -> TrainResult:
        calls.append(kwargs)
        return original(*args, **kwargs)

    method.local_train = spy  # type: ignore[method-assign]
    clients = torch.tensor([0, 2, 5])
    method.run_round(7, clients)
    (call,) = calls
    batches = call["batches"]
    generator = torch.Generator().manual_seed(derive_seed(4, 7, SPLIT_STREAM))
    expected = torch.rand(batches.index.shape, generator=generator, dtype=D)
    torch.testing.assert_close(call["context"][SPLIT_KEYS], expected, rtol=0, atol=0)
    assert call["groups"][-1] == CLOCK_GROUP
    # the clock is trained, never sent: the upload is the extractor alone
    size = sum(p.numel() * 4 for n, p in method.net.named_parameters() if not n.startswith("fc2"))
    assert method.record.round_bytes == [3 * size, 3 * size]


def test_pfedgp_marginal_objective_trains_on_the_batch_marginal_likelihood() -> None:
    dm = digits_data(6)
    method = build(PFedGP, dm, clients_per_round=3, objective="marginal")
    assert isinstance(method, PFedGP)
    clients = torch.tensor([0, 1, 4])

    def marginal(params: dict[str, torch.Tensor], context: Any, x: Any, y: Any, w: Any) -> Any:
        net = {n: t for n, t in params.items() if not n.startswith("gp.")}
        z = F.normalize(method.arch.features(net, x, True).float(), dim=-1).double()
        return gp_negative_log_likelihood(z, y, w.double(), 10, 0.5, 0.1).float()

    start = method.payload(clients)
    expected = method.local_train(dict(start), clients, 0, loss_fn=marginal)
    got = method.train_clients(0, clients, dict(start))
    assert set(got.params) == set(start)
    for name in start:
        torch.testing.assert_close(got.params[name], expected.params[name], rtol=0, atol=0)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=0)
    # the predictive objective trains to a different extractor from the same start
    predictive = build(PFedGP, dm, clients_per_round=3)
    assert isinstance(predictive, PFedGP)
    other = predictive.train_clients(0, clients, dict(start))
    assert not torch.equal(other.params["fc1.weight"], got.params["fc1.weight"])
    assert math.isfinite(float(other.loss.sum()))


def test_pfedgp_predictive_vectorized_equals_sequential_with_idle_steps() -> None:
    # local epochs: smaller clients idle at the round's last steps, their last batch padded
    assert_vectorized_equals_sequential(
        PFedGP, local_steps=None, local_epochs=1, batch_size=16, predict_ratio=0.25
    )
