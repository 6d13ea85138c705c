"""FedPAC's head phase as the authors' code trains it (issue 43 item 3).

JianXu95/FedPAC ``methods/fedpac.py`` ``local_training`` (commit 5770f4f): the classifier-only
epoch runs SGD at ``lr_g = 0.1``, momentum 0.5, weight decay 5e-4 (lines 193-195), the body
phase SGD at ``args.lr``, momentum 0.5, weight decay 5e-4 (lines 220-221), each optimizer new
every round.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor
from torch.func import grad

from lightning_pfl.engine import ClientBatches, LossFn, Params, TrainResult
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedpac import FedPAC
from tests.conftest import build, digits_data
from tests.helpers import assert_vectorized_equals_sequential

MOMENTUM = 0.5  # the paper's and the authors' code's, both phases
LOCAL_LR = 0.01  # the paper's eta on (E)MNIST and Fashion-MNIST


def momentum_sgd(
    loss: LossFn,
    w: Params,
    context: Params,
    steps: list[tuple[Tensor, Tensor, Tensor]],
    lr: float,
    weight_decay: float,
) -> Params:
    """torch.optim.SGD from a fresh buffer: d = g + wd w; m = d on the first step, then
    mu m + d; w <- w - lr m."""
    m: Params | None = None
    for x, y, weight in steps:
        g = grad(loss)(w, context, x, y, weight)
        d = {n: g[n] + weight_decay * w[n] for n in w}
        m = d if m is None else {n: MOMENTUM * m[n] + d[n] for n in w}
        w = {n: w[n] - lr * m[n] for n in w}
    return w


def record_local_training(
    method: FedPAC,
) -> list[tuple[tuple[Any, ...], dict[str, Any], TrainResult]]:
    """Every ``local_train`` call of ``method``: its arguments and its result. The context is
    copied at the call: its centroids are views of buffers the server updates afterwards."""
    calls: list[tuple[tuple[Any, ...], dict[str, Any], TrainResult]] = []
    original = method.local_train

    def wrapped(*args: Any, **kwargs: Any) -> TrainResult:
        context = {n: t.clone() for n, t in kwargs["context"].items()}
        calls.append((args, kwargs | {"context": context}, original(*args, **kwargs)))
        return calls[-1][2]

    method.local_train = wrapped  # type: ignore[method-assign]
    return calls


def client_steps(
    method: FedPAC, batches: ClientBatches, c: int
) -> list[tuple[Tensor, Tensor, Tensor]]:
    steps = []
    for s in range(batches.active.shape[1]):
        if batches.active[c, s]:
            x, y = method.data.fetch(batches.index[c, s])
            steps.append((x, y, batches.weight[c, s]))
    return steps


def one(params: Params, c: int) -> Params:
    return {n: t[c] for n, t in params.items()}


def assert_same_update(trained: Params, expected: Params, start: Params) -> None:
    for n, t in expected.items():
        torch.testing.assert_close(trained[n] - start[n], t - start[n], rtol=1e-3, atol=5e-7, msg=n)


@pytest.mark.parametrize(
    ("options", "head_lr", "weight_decay"),
    [
        ({}, 0.1, 5e-4),  # the defaults: the authors' code
        ({"head_lr": None, "local_weight_decay": 0.0}, LOCAL_LR, 0.0),  # main's behaviour
    ],
    ids=["authors_code", "head_at_local_lr"],
)
def test_fedpac_phases_take_the_authors_sgd_steps(
    options: dict[str, Any], head_lr: float, weight_decay: float
) -> None:
    """The head epoch: momentum SGD at head_lr with weight decay on the frozen body; then three
    body steps at local_lr with the same weight decay on the trained, frozen head. The updates
    are compared, tightly enough that weight decay 5e-4 is told from none."""
    method = build(
        FedPAC,
        digits_data(4),
        local_lr=LOCAL_LR,
        batch_size=50,
        local_epochs=None,
        local_steps=3,
        clients_per_round=2,
        **options,
    )
    assert isinstance(method, FedPAC)
    clients = torch.tensor([0, 3])
    body_batches = method.draw_batches(clients, 0)
    calls = record_local_training(method)
    method.run_round(0, clients)
    (head_args, head_kwargs, head), (body_args, body_kwargs, body) = calls
    for c in range(len(clients)):
        steps = client_steps(method, head_kwargs["batches"], c)
        assert len(steps) > 1  # the momentum term enters
        expected = momentum_sgd(
            method.cross_entropy,
            one(head_args[0], c),
            one(head_kwargs["context"], c),
            steps,
            head_lr,
            weight_decay,
        )
        assert_same_update(one(head.params, c), expected, one(head_args[0], c))
        expected = momentum_sgd(
            method.align_loss,
            one(body_args[0], c),
            one(body_kwargs["context"], c),
            client_steps(method, body_batches, c),
            LOCAL_LR,
            weight_decay,
        )
        assert_same_update(one(body.params, c), expected, one(body_args[0], c))


def test_fedpac_head_lr_is_validated() -> None:
    with pytest.raises(ConfigError, match="head_lr"):
        build(FedPAC, digits_data(4), head_lr=0.0, local_epochs=None)


def test_fedpac_head_lr_vectorized_equals_sequential() -> None:
    # local_epochs None: the conftest's 3 body steps, not the paper's 5 epochs at batch 8
    assert_vectorized_equals_sequential(FedPAC, local_epochs=None, head_lr=0.2)
