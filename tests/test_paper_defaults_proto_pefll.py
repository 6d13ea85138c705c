"""Paper defaults of FedProto (the authors' loader drops an epoch's last, smaller batch) and
PeFLL (the authors' client SGD: lr 2e-3, batch 32).

FedProto: yuetan031/FedProto ``lib/update.py`` lines 41-42, ``DataLoader(..., shuffle=True,
drop_last=True)``. PeFLL: pefllauthors/PeFLL ``train.py`` lines 522 and 534 (``--batch-size``
32, ``--inner-lr`` 2e-3), its inner SGD at lines 309-310 and 337 (momentum 0.9, ``--inner-wd``
5e-5, clip 50) over ``--inner-steps`` 50 (line 523), each step on ``next(iter(train_loader))``
(line 332), the first batch of a fresh shuffle (``dataset.py`` line 293).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.func import grad

from lightning_pfl.client_index import ClientIndex, draw_batches
from lightning_pfl.engine import Params, TrainResult
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.methods.fedproto import FedProto
from lightning_pfl.methods.pefll import PeFLL
from lightning_pfl.validation import argument_default
from tests.conftest import build, digits_data
from tests.helpers import assert_vectorized_equals_sequential


# ------------------------------------------------------------------ the sampler's drop_last
def small_index(counts: list[int]) -> ClientIndex:
    starts = np.cumsum([0, *counts])
    return ClientIndex.from_lists(
        [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:], strict=True)],
        torch.device("cpu"),
    )


def test_epochs_with_drop_last_take_only_each_epochs_full_batches() -> None:
    """Clients of 5, 8, 3 and 4 samples, B = 4, E = 2: floor(n / B) full batches per epoch
    (2, 4, 0, 2 steps), the batches the same draw takes first in each epoch without
    drop_last (E * ceil(n / B) steps: 4, 4, 2, 2)."""
    counts, batch, epochs = [5, 8, 3, 4], 4, 2
    index = small_index(counts)
    clients = torch.arange(len(counts))

    def draw(drop_last: bool) -> Any:
        generator = torch.Generator().manual_seed(7)
        return draw_batches(index, clients, batch, generator, epochs=epochs, drop_last=drop_last)

    kept, every = draw(True), draw(False)
    assert kept.active.sum(1).tolist() == [epochs * (n // batch) for n in counts]
    assert every.active.sum(1).tolist() == [epochs * math.ceil(n / batch) for n in counts]
    per_epoch = math.ceil(max(counts) / batch)
    for c, n in enumerate(counts):
        for e in range(epochs):
            steps = slice(e * per_epoch, (e + 1) * per_epoch)
            weight, taken = kept.weight[c, steps], kept.active[c, steps]
            assert torch.equal(weight.sum(-1), taken.float() * batch)  # full batches only
            full = n // batch
            assert torch.equal(kept.index[c, steps][:full], every.index[c, steps][:full])
            assert torch.equal(weight[:full], every.weight[c, steps][:full])
            samples = kept.index[c, steps][weight > 0]
            assert len(samples.unique()) == full * batch  # distinct within the epoch


def test_drop_last_changes_no_step_draw() -> None:
    """``local_steps`` batches leave no sample over: drop_last draws the same batches."""
    index = small_index([5, 8, 3])
    clients = torch.arange(3)
    drawn = [
        draw_batches(index, clients, 4, torch.Generator().manual_seed(3), steps=5, drop_last=d)
        for d in (False, True)
    ]
    for name in ("index", "weight", "active"):
        assert torch.equal(getattr(drawn[0], name), getattr(drawn[1], name)), name


# ------------------------------------------------------------------------------- FedProto
def fedproto_one_round(drop_last: bool | None) -> tuple[Params, Params, Params, int]:
    """One default round (one epoch, fresh momentum 0.5) of client 1 (238 samples) in batches
    of 100: (trained, two steps by hand, three steps by hand, n)."""
    dm = digits_data(4)
    lr, mu, batch = 0.05, 0.5, 100
    kwargs = {} if drop_last is None else {"drop_last": drop_last}
    method = build(FedProto, dm, batch_size=batch, local_lr=lr, clients_per_round=1, **kwargs)
    assert isinstance(method, FedProto)
    assert (method.hp.local_epochs, method.hp.local_momentum) == (1, mu)
    clients = torch.tensor([1])
    n = int(dm.num_samples("train")[1])
    names = tuple(method.arch.shapes)
    start = method.store.gather("params", clients, method.device)
    w = {k: t[0].clone() for k, t in start.items()}
    sent = {k: v[0] for k, v in method.prototype_payload(clients).items()}
    batches = method.draw_batches(clients, 0)  # every batch of the epoch, the last smaller
    assert batches.active.sum().item() == math.ceil(n / batch) == 3
    hand, m = [], {k: torch.zeros_like(t) for k, t in w.items()}
    for step in range(3):
        x, y = dm.fetch(batches.index[0, step])
        g = grad(method.proto_loss)(w, sent, x, y, batches.weight[0, step])
        m = {k: mu * m[k] + g[k] for k in names}
        w = {k: w[k] - lr * m[k] for k in names}
        hand.append(w)
    method.run_round(0, clients)
    trained = {k: t[0] for k, t in method.store.gather("params", clients, method.device).items()}
    return trained, hand[1], hand[2], n


def test_fedproto_default_drops_the_epochs_last_smaller_batch() -> None:
    """238 samples in batches of 100: the authors' loader trains two full batches and drops
    the 38 left over (main trained a third step on them)."""
    assert argument_default(FedProto, "drop_last") is True
    trained, two_steps, three_steps, n = fedproto_one_round(None)
    assert n % 100 != 0
    for name in two_steps:
        torch.testing.assert_close(trained[name], two_steps[name], rtol=1e-4, atol=1e-6)
    assert any(not torch.allclose(trained[k], three_steps[k], atol=1e-5) for k in three_steps)


def test_fedproto_without_drop_last_trains_the_last_batch() -> None:
    trained, _, three_steps, _ = fedproto_one_round(False)
    for name in three_steps:
        torch.testing.assert_close(trained[name], three_steps[name], rtol=1e-4, atol=1e-6)


def test_fedproto_drop_last_vectorized_equals_sequential() -> None:
    """Six clients of 125-257 samples in batches of 64: 1-4 full batches each, so clients
    idle for different numbers of dropped and padded steps."""
    assert_vectorized_equals_sequential(FedProto, batch_size=64)


# ---------------------------------------------------------------------------------- PeFLL
AUTHORS_CLIENT_SGD = {
    "local_lr": 2e-3,
    "batch_size": 32,
    "local_steps": 50,
    "local_epochs": None,
    "local_momentum": 0.9,
    "local_weight_decay": 5e-5,
    "local_max_grad_norm": 50.0,
}


def test_pefll_defaults_to_the_authors_client_sgd() -> None:
    defaults = {k: argument_default(PeFLL, k) for k in AUTHORS_CLIENT_SGD}
    assert defaults == AUTHORS_CLIENT_SGD


def pefll_with_its_defaults(**kwargs: Any) -> FederatedMethod:
    """PeFLL with its own defaults but the network (the conftest's ``build`` would set its
    test steps, batch and lr)."""
    dm = digits_data(4)
    method = PeFLL(
        num_clients=dm.num_clients,
        num_classes=dm.num_classes,
        input_shape=dm.input_shape,
        net="digits_cnn",
        **kwargs,
    )
    method.attach_data(dm)
    return method


def test_pefll_default_client_takes_the_authors_sgd_steps() -> None:
    """Two local steps (of the default 50, for time) from the generated theta in batches of 32:
    clip to 50, add 5e-5 theta, momentum 0.9, lr 2e-3 (main: lr 5e-3, batch 64)."""
    method = pefll_with_its_defaults(local_steps=2, clients_per_round=2)
    assert isinstance(method, PeFLL)
    clients = torch.tensor([0, 3])
    started: list[Params] = []
    results: list[TrainResult] = []
    original = method.local_train

    def wrapped(params: Params, *args: Any, **kwargs: Any) -> TrainResult:
        started.append({n: t.clone() for n, t in params.items()})
        results.append(original(params, *args, **kwargs))
        return results[-1]

    method.local_train = wrapped  # type: ignore[method-assign]
    batches = method.draw_batches(clients, 0)
    assert batches.index.shape == (2, 2, 32)
    assert method.descriptor_batches(clients, 0)[2].shape == (2, 32)
    method.run_round(0, clients)
    lr, mu, wd, clip = 2e-3, 0.9, 5e-5, 50.0
    for c in range(len(clients)):
        w = {n: t[c] for n, t in started[0].items()}
        m = {n: torch.zeros_like(t) for n, t in w.items()}
        for step in range(2):
            x, y = method.data.fetch(batches.index[c, step])
            g = grad(method.cross_entropy)(w, {}, x, y, batches.weight[c, step])
            norm = torch.sqrt(sum((t**2).sum() for t in g.values()))
            scale = torch.clamp(clip / (norm + 1e-6), max=1.0)
            g = {n: g[n] * scale + wd * w[n] for n in w}
            m = {n: mu * m[n] + g[n] for n in w}
            w = {n: w[n] - lr * m[n] for n in w}
        for n in w:
            torch.testing.assert_close(results[0].params[n][c], w[n], rtol=1e-4, atol=1e-6)
