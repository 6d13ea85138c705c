"""FedPAC's statistics and alignment targets as the authors' code computes them (issue 43 item 3).

JianXu95/FedPAC (commit 5770f4f): ``running.py`` ``train_round_fedpac`` calls
``statistics_extraction`` (h_ik, v_i) before ``local_training`` (lines 202-208), on the received
global body; ``methods/fedpac.py`` ``local_training`` aligns a sample whose class has no global
centroid to the client's own centroid under the received body (lines 177, 233-242), with no
alignment term in the first round; the server's centroids are the round's clients' only
(``tools.py`` ``protos_aggregation``; ``running.py`` lines 224 and 229).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import fedpac as fedpac_module
from lightning_pfl.methods.fedpac import FedPAC
from tests.conftest import build, digits_data
from tests.helpers import (
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    capture_local_training,
)

CONF = Path(__file__).parent / "conf"
NEW = (
    "--model.init_args.statistics=before_training",
    "--model.init_args.missing_centroid=local",
    "--model.init_args.global_centroids=round",
)


def fedpac(**options: Any) -> FedPAC:
    method = build(FedPAC, digits_data(4), local_epochs=None, clients_per_round=2, **options)
    assert isinstance(method, FedPAC)
    return method


def training_split(method: FedPAC, client: int) -> tuple[Tensor, Tensor]:
    index = torch.as_tensor(method.data._parts["train"][client], dtype=torch.int64)
    return method.data.fetch(index)


def one_client(params: dict[str, Tensor], c: int) -> dict[str, Tensor]:
    return {n: t[c] for n, t in params.items()}


def by_hand(
    method: FedPAC, params: dict[str, Tensor], client: int
) -> tuple[dict[int, Tensor], Tensor, Tensor]:
    """Per-class centroids, h_k = pi_k mu_k ``[K, D]`` and v of one client, sample by sample
    as ``statistics_extraction``: v = (sum_k pi_k mean ||z||^2 - pi_k^2 ||mu_k||^2) / n."""
    x, y = training_split(method, client)
    with torch.no_grad():
        z = method.arch.features(params, x).double()
    n = len(y)
    mu: dict[int, Tensor] = {}
    h = torch.zeros(method.hp.num_classes, z.shape[-1], dtype=torch.float64)
    v = torch.zeros((), dtype=torch.float64)
    for k in y.unique().tolist():
        zk = z[y == k]
        pi = len(zk) / n
        mu[k] = zk.mean(0)
        h[k] = pi * mu[k]
        v = v + pi * (zk * zk).sum(1).mean() - pi**2 * (mu[k] * mu[k]).sum()
    return mu, h, v / n


def record_statistics(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Tensor, Tensor]]:
    seen: list[tuple[Tensor, Tensor]] = []
    original = fedpac_module.combination_weights

    def wrapped(h: Tensor, v: Tensor) -> Tensor:
        seen.append((h.clone(), v.clone()))
        return original(h, v)

    monkeypatch.setattr(fedpac_module, "combination_weights", wrapped)
    return seen


@pytest.mark.parametrize("statistics", ["before_training", "after_training"])
def test_fedpac_statistics_are_computed_with_the_chosen_body(
    statistics: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """h_ik and v_i that reach the QP: by default the received global body's (the authors'
    code), with ``after_training`` the trained body's; the two differ after a round."""
    method = fedpac(statistics=statistics)
    clients = torch.tensor([0, 3])
    received = {n: t.clone() for n, t in method.global_state().items()}
    trained = capture_local_training(method)
    seen = record_statistics(monkeypatch)
    method.run_round(0, clients)
    (h, v), (_, body) = seen[0], trained
    for c, client in enumerate(clients.tolist()):
        params = received if statistics == "before_training" else one_client(body.params, c)
        _, h_hand, v_hand = by_hand(method, params, client)
        torch.testing.assert_close(h[c].double(), h_hand, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(v[c].double(), v_hand, rtol=1e-4, atol=1e-6)
        other = one_client(body.params, c) if statistics == "before_training" else received
        assert not torch.allclose(h[c].double(), by_hand(method, other, client)[1], atol=1e-4)


def test_fedpac_aligns_a_class_without_global_centroid_to_the_clients_own() -> None:
    """Round 1 with a global centroid for class 0 only: a sample of class 0 is pulled to it, a
    sample of any other class to the client's own centroid under the received body; the body
    phase's loss is CE + lambda * mean_b mean_D (z - target)^2 on a batch, by hand."""
    lam = 0.7
    method = fedpac(lam=lam)
    method.centroids[0] = torch.linspace(-1.0, 1.0, method.centroids.shape[1])
    method.has_centroid[0] = 1.0
    clients = torch.tensor([0, 2])
    received = {n: t.clone() for n, t in method.global_state().items()}
    calls: list[dict[str, Any]] = []
    original = method.local_train

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(
            {"params": args[0], "context": {n: t.clone() for n, t in kwargs["context"].items()}}
        )
        return original(*args, **kwargs)

    method.local_train = wrapped  # type: ignore[method-assign]
    batches = method.draw_batches(clients, 1)
    method.run_round(1, clients)
    body_call = calls[1]
    for c, client in enumerate(clients.tolist()):
        own, _, _ = by_hand(method, received, client)
        x, y = method.data.fetch(batches.index[c, 0])
        weight = batches.weight[c, 0]
        params, context = one_client(body_call["params"], c), one_client(body_call["context"], c)
        model = {n: t for n, t in context.items() if not n.startswith("proto.")} | params
        z = method.arch.features(model, x, train=True)
        targets = torch.stack(
            [method.centroids[0] if k == 0 else own[k].float() for k in y.tolist()]
        )
        assert (y != 0).any()  # a class without a global centroid enters
        ce = (F.cross_entropy(method.arch.classify(model, z), y, reduction="none") * weight).sum()
        align = (((z - targets) ** 2).mean(-1) * weight).sum()
        expected = (ce + lam * align) / weight.sum()
        loss = method.align_loss(params, context, x, y, weight)
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-6)


def test_fedpac_first_round_has_no_alignment_term() -> None:
    """Round 0 (no global centroid yet): the body phase's loss is the cross-entropy alone, as
    ``if round > 0`` in the authors' code."""
    method = fedpac(lam=5.0)
    clients = torch.tensor([1, 2])
    contexts: list[dict[str, Tensor]] = []
    original = method.local_train

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        contexts.append({n: t.clone() for n, t in kwargs["context"].items()})
        return original(*args, **kwargs)

    method.local_train = wrapped  # type: ignore[method-assign]
    method.run_round(0, clients)
    assert torch.equal(contexts[1]["proto.present"], torch.zeros_like(contexts[1]["proto.present"]))


@pytest.mark.parametrize("global_centroids", ["round", "kept"])
def test_fedpac_global_centroids_are_the_rounds_clients(global_centroids: str) -> None:
    """After a round of clients 0 and 3: the classes they have get their class-count-weighted
    centroids of the trained bodies; any other class has none (``round``, the authors' code)
    or keeps the previous one (``kept``)."""
    method = fedpac(global_centroids=global_centroids)
    previous = torch.randn(method.centroids.shape)
    method.centroids.copy_(previous)
    method.has_centroid.fill_(1.0)
    clients = torch.tensor([0, 3])
    trained = capture_local_training(method)
    method.run_round(0, clients)
    body = trained[-1]
    sums: dict[int, Tensor] = {}
    counts: dict[int, int] = {}
    for c, client in enumerate(clients.tolist()):
        mu, _, _ = by_hand(method, one_client(body.params, c), client)
        _, y = training_split(method, client)
        for k, m in mu.items():
            n = int((y == k).sum())
            sums[k] = sums.get(k, 0) + n * m
            counts[k] = counts.get(k, 0) + n
    for k in range(method.hp.num_classes):
        if k in counts:
            assert method.has_centroid[k] == 1.0
            torch.testing.assert_close(
                method.centroids[k].double(), sums[k] / counts[k], rtol=1e-4, atol=1e-6
            )
        elif global_centroids == "round":
            assert method.has_centroid[k] == 0.0, k
        else:
            assert method.has_centroid[k] == 1.0
            assert torch.equal(method.centroids[k], previous[k])
    assert len(counts) < method.hp.num_classes  # some class is missing from the round


@pytest.mark.parametrize(
    ("argument", "value"),
    [("statistics", "before"), ("missing_centroid", "zero"), ("global_centroids", "all")],
)
def test_fedpac_choices_are_validated(argument: str, value: str) -> None:
    with pytest.raises(ConfigError, match=argument):
        fedpac(**{argument: value})


@pytest.mark.parametrize(
    "options",
    [{}, {"statistics": "after_training", "missing_centroid": "skip", "global_centroids": "kept"}],
    ids=["authors_code", "main"],
)
def test_fedpac_statistics_vectorized_equals_sequential(options: dict[str, Any]) -> None:
    # 3 rounds of 3 of 6 clients with 2 classes each: rounds 1-2 have classes without a
    # global centroid
    assert_vectorized_equals_sequential(FedPAC, local_epochs=None, **options)


def test_fedpac_statistics_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "fedpac.yaml", tmp_path, *NEW)
