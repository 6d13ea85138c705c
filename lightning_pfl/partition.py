"""Seeded client partitioners for non-IID federated benchmarks.

Every partitioner turns the labels of a training pool into one index array per client. The
result is summarized by a client x class count matrix; a *matched* evaluation split applies
the same per-class shares (``count[i, c] / total[c]``) to the test or validation labels, which
is how pFedHN, pFedMe and FedTP build their per-client test sets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from lightning_pfl.errors import ConfigError
from lightning_pfl.validation import NonNegativeInt, PositiveFloat, PositiveInt, check_arguments

IndexLists = list[np.ndarray]
SECTION = "data.init_args.partition"


class PartitionError(ConfigError):
    """Raised for a split that cannot be made; the message says what to change."""


def largest_remainder(total: int, shares: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Integer counts summing to ``round(total * shares.sum())`` in proportion to ``shares``.

    Leftover units go to the largest fractional parts, ties broken at random (a fixed order
    would starve the same clients in every class).
    """
    exact = total * shares
    counts = np.floor(exact).astype(np.int64)
    target = min(int(round(exact.sum())), total)
    missing = target - int(counts.sum())
    if missing > 0:
        order = np.lexsort((rng.random(len(exact)), -(exact - counts)))
        counts[order[:missing]] += 1
    return counts


def split_by_counts(labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> IndexLists:
    """Give client i ``counts[i, c]`` random samples of class c (disjoint across clients)."""
    num_clients = counts.shape[0]
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(counts.shape[1]):
        pool = rng.permutation(np.flatnonzero(labels == c))
        if counts[:, c].sum() > len(pool):
            raise PartitionError(f"class {c}: {counts[:, c].sum()} requested, {len(pool)} exist")
        bounds = np.concatenate([[0], np.cumsum(counts[:, c])])
        for i in range(num_clients):
            parts[i].append(pool[bounds[i] : bounds[i + 1]])
    return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def split_by_shares(labels: np.ndarray, shares: np.ndarray, rng: np.random.Generator) -> IndexLists:
    """Give client i the fraction ``shares[i, c]`` of class c (largest-remainder rounding)."""
    num_classes = shares.shape[1]
    totals = np.bincount(labels, minlength=num_classes)
    counts = np.stack(
        [largest_remainder(int(totals[c]), shares[:, c], rng) for c in range(num_classes)], 1
    )
    return split_by_counts(labels, counts, rng)


def count_matrix(labels: np.ndarray, parts: IndexLists, num_classes: int) -> np.ndarray:
    """Client x class sample counts."""
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def _draw(rng: np.random.Generator, weights: np.ndarray, available: np.ndarray) -> int:
    """Draw an index by ``weights`` restricted to ``available`` (uniform if they all underflow)."""
    p = weights * available
    if p.sum() <= 0:
        p = available.astype(np.float64)
    return int(rng.choice(len(p), p=p / p.sum()))


class Partitioner(ABC):
    """Splits a labelled training pool across clients."""

    def _check(self, **values: Any) -> None:
        """Range-check this partitioner's arguments (message names the config key)."""
        check_arguments(self, values, SECTION, PartitionError)

    @abstractmethod
    def split(
        self,
        labels: np.ndarray,
        num_clients: int,
        num_classes: int,
        rng: np.random.Generator,
        coarse_labels: np.ndarray | None = None,
    ) -> IndexLists:
        """Return one sorted, disjoint index array per client."""

    @staticmethod
    def _check_clients(num_clients: int, num_samples: int) -> None:
        if num_clients < 1:
            raise PartitionError(f"num_clients must be >= 1, got {num_clients}.")
        if num_samples < num_clients:
            raise PartitionError(
                f"{num_samples} samples cannot give each of {num_clients} clients a sample; "
                "lower num_clients."
            )


class IID(Partitioner):
    """IID split: a random permutation cut into ``num_clients`` parts of equal size (+-1)."""

    def split(
        self,
        labels: np.ndarray,
        num_clients: int,
        num_classes: int,
        rng: np.random.Generator,
        coarse_labels: np.ndarray | None = None,
    ) -> IndexLists:
        self._check_clients(num_clients, len(labels))
        return [np.sort(p) for p in np.array_split(rng.permutation(len(labels)), num_clients)]


class Dirichlet(Partitioner):
    """Per-class Dirichlet(alpha) shares over clients, with a guaranteed minimum client size.

    Args:
        alpha: concentration (small = more skewed); must be > 0.
        min_samples: every client gets at least this many training samples. Satisfied by
            construction (first ``min_samples`` per client drawn from the client's own Dirichlet
            class profile, the remainder spread by the per-class shares), so it never resamples
            and terminates for any number of clients.
    """

    def __init__(self, alpha: PositiveFloat = 0.5, min_samples: NonNegativeInt = 10) -> None:
        self._check(alpha=alpha, min_samples=min_samples)
        self.alpha = alpha
        self.min_samples = min_samples

    def split(
        self,
        labels: np.ndarray,
        num_clients: int,
        num_classes: int,
        rng: np.random.Generator,
        coarse_labels: np.ndarray | None = None,
    ) -> IndexLists:
        self._check_clients(num_clients, len(labels))
        totals = np.bincount(labels, minlength=num_classes)
        if num_clients * self.min_samples > len(labels):
            raise PartitionError(
                f"Dirichlet: {num_clients} clients x min_samples={self.min_samples} = "
                f"{num_clients * self.min_samples} > {len(labels)} samples; lower min_samples or "
                "num_clients."
            )
        shares = rng.dirichlet(np.full(num_clients, self.alpha), size=num_classes).T  # [n, C]
        present = totals > 0
        profile = shares * present
        profile = profile / np.maximum(profile.sum(1, keepdims=True), 1e-300)
        reserved = rng.multinomial(self.min_samples, profile)  # [n, C]
        # Move reservations away from classes that are over-demanded, into classes with room.
        for c in range(num_classes):
            excess = int(reserved[:, c].sum() - totals[c])
            while excess > 0:
                holders = np.flatnonzero(reserved[:, c])
                take = rng.choice(holders, size=min(excess, len(holders)), replace=False)
                room = totals - reserved.sum(0)
                room[c] = 0
                room = np.maximum(room, 0)
                targets = rng.choice(num_classes, size=len(take), p=room / room.sum())
                np.subtract.at(reserved[:, c], take, 1)
                np.add.at(reserved, (take, targets), 1)
                excess = int(reserved[:, c].sum() - totals[c])
        remaining = totals - reserved.sum(0)
        extra = np.stack(
            [largest_remainder(int(remaining[c]), shares[:, c], rng) for c in range(num_classes)],
            1,
        )
        return split_by_counts(labels, reserved + extra, rng)


class ClassesPerClient(Partitioner):
    """The pFedMe / pFedHN pathological split: ``classes`` classes per client.

    Classes are dealt greedily from those with the most free slots (``ceil(classes * n / C)``
    slots per class, ties broken at random); each (client, class) pair draws a ~ U(low, high)
    and the client receives a / sum_j a_j of that class. A matched evaluation split applies the
    same classes and proportions to validation and test data.

    Args:
        classes: classes per client (the paper's c: 2 for CIFAR-10, 10 for CIFAR-100).
        low: lower bound of the proportion weight a.
        high: upper bound of the proportion weight a.
    """

    def __init__(
        self, classes: PositiveInt = 2, low: PositiveFloat = 0.4, high: PositiveFloat = 0.6
    ) -> None:
        self._check(classes=classes, low=low, high=high)
        if low > high:
            raise PartitionError(
                f"{SECTION}.init_args.low = {low} > high = {high}; need 0 < low <= high."
            )
        self.classes = classes
        self.low = low
        self.high = high

    def shares(self, num_clients: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
        if self.classes > num_classes:
            raise PartitionError(
                f"classes per client = {self.classes} but the dataset has only {num_classes} "
                f"classes; lower {SECTION}.init_args.classes."
            )
        slots = np.full(num_classes, -(-self.classes * num_clients // num_classes))
        weights = np.zeros((num_clients, num_classes))
        for i in range(num_clients):
            tie_break = rng.random(num_classes)
            chosen = np.lexsort((tie_break, -slots))[: self.classes]
            slots[chosen] -= 1
            weights[i, chosen] = rng.uniform(self.low, self.high, self.classes)
        return weights / np.maximum(weights.sum(0, keepdims=True), 1e-300)

    def split(
        self,
        labels: np.ndarray,
        num_clients: int,
        num_classes: int,
        rng: np.random.Generator,
        coarse_labels: np.ndarray | None = None,
    ) -> IndexLists:
        self._check_clients(num_clients, len(labels))
        return split_by_shares(labels, self.shares(num_clients, num_classes, rng), rng)


class Shards(Partitioner):
    """FedAvg's pathological split: label-sorted shards, ``shards_per_client`` per client.

    Args:
        shards_per_client: shards each client receives (McMahan et al. use 2).
    """

    def __init__(self, shards_per_client: PositiveInt = 2) -> None:
        self._check(shards_per_client=shards_per_client)
        self.shards_per_client = shards_per_client

    def split(
        self,
        labels: np.ndarray,
        num_clients: int,
        num_classes: int,
        rng: np.random.Generator,
        coarse_labels: np.ndarray | None = None,
    ) -> IndexLists:
        num_shards = num_clients * self.shards_per_client
        if num_shards > len(labels):
            raise PartitionError(
                f"{num_clients} clients x {self.shards_per_client} shards = {num_shards} shards "
                f"> {len(labels)} samples; lower shards_per_client or num_clients."
            )
        order = np.lexsort((rng.random(len(labels)), labels))
        shards = np.array_split(order, num_shards)
        owner = rng.permutation(num_shards)
        return [
            np.sort(np.concatenate([shards[s] for s in owner[i::num_clients]]))
            for i in range(num_clients)
        ]


class Pachinko(Partitioner):
    """Pachinko allocation (FedTP, Reddi et al.) for datasets with coarse labels.

    Each client draws coarse weights ~ Dir(alpha) over superclasses and, within each
    superclass, fine weights ~ Dir(beta); each of its samples is drawn coarse-then-fine without
    replacement, renormalizing as classes run out. Clients get equal sizes (floor(N / n)).

    Args:
        alpha: concentration over coarse labels (FedTP: 0.3).
        beta: concentration over fine labels within a coarse label (FedTP: 10).
    """

    def __init__(self, alpha: PositiveFloat = 0.3, beta: PositiveFloat = 10.0) -> None:
        self._check(alpha=alpha, beta=beta)
        self.alpha = alpha
        self.beta = beta

    def split(
        self,
        labels: np.ndarray,
        num_clients: int,
        num_classes: int,
        rng: np.random.Generator,
        coarse_labels: np.ndarray | None = None,
    ) -> IndexLists:
        if coarse_labels is None:
            raise PartitionError(
                "Pachinko needs coarse labels; use a dataset that has them (cifar100)."
            )
        self._check_clients(num_clients, len(labels))
        num_coarse = int(coarse_labels.max()) + 1
        fine_of = [np.unique(labels[coarse_labels == k]) for k in range(num_coarse)]
        pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in range(num_classes)]
        left = np.array([len(p) for p in pools])
        coarse_left = np.array([left[f].sum() for f in fine_of])
        per_client = len(labels) // num_clients
        parts = []
        for _ in range(num_clients):
            coarse_w = rng.dirichlet(np.full(num_coarse, self.alpha))
            fine_w = [rng.dirichlet(np.full(len(f), self.beta)) for f in fine_of]
            taken = []
            for _ in range(per_client):
                k = _draw(rng, coarse_w, coarse_left > 0)
                c = fine_of[k][_draw(rng, fine_w[k], left[fine_of[k]] > 0)]
                taken.append(pools[c].pop())
                left[c] -= 1
                coarse_left[k] -= 1
            parts.append(np.sort(np.array(taken, dtype=np.int64)))
        return parts


class ClientDirichlet(Partitioner):
    """Per-client Dirichlet class proportions (pFedHN section 5.3): client i draws its class
    proportions q_i ~ Dir(alpha_i 1_C), alpha_i = ``alpha`` for the first ``n - novel_clients``
    clients and ``novel_alpha`` for the last ``novel_clients`` (the held-out novel clients of
    ``model.init_args.novel_clients``).

    Every client gets the same number of training samples s and holds s q_i of them, rounded
    by largest remainder (its counts sum to exactly s), dealt without replacement: class c's
    samples are shuffled once and cut into consecutive runs, one per client in client order.
    s is the largest size for which every class has enough samples whatever the rounding,
    ``s = floor(min_c (N_c - n) / sum_i q_ic)`` (N_c the class's samples), capped at
    ``samples_per_client``; the samples no client needs stay unused, so the proportions are
    the drawn ones instead of being bent by the classes that run out. Three independent
    streams of the split's generator draw the training clients' proportions, the novel
    clients' and the dealing, so with the same seed and the same s the training clients get
    the same samples whatever ``novel_alpha`` is.

    Args:
        alpha: concentration of the training clients (pFedHN section 5.3: 0.1).
        novel_alpha: concentration of the novel clients (section 5.3: 0.1, 0.25, 0.5 or 1);
            None: ``alpha``.
        novel_clients: how many of the last clients draw with ``novel_alpha``; must equal
            ``model.init_args.novel_clients`` (the ``NovelClients`` callback checks).
        samples_per_client: the largest s (None: as many as the classes allow).
    """

    def __init__(
        self,
        alpha: PositiveFloat = 0.1,
        novel_alpha: PositiveFloat | None = None,
        novel_clients: NonNegativeInt = 0,
        samples_per_client: PositiveInt | None = None,
    ) -> None:
        self._check(
            alpha=alpha,
            novel_alpha=novel_alpha,
            novel_clients=novel_clients,
            samples_per_client=samples_per_client,
        )
        self.alpha = alpha
        self.novel_alpha = alpha if novel_alpha is None else novel_alpha
        self.novel_clients = novel_clients
        self.samples_per_client = samples_per_client

    def proportions(
        self, num_clients: int, num_classes: int, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.random.Generator]:
        """Each client's drawn class proportions ``[n, C]`` and the generator that deals."""
        if self.novel_clients > num_clients:
            raise PartitionError(
                f"ClientDirichlet: novel_clients = {self.novel_clients} > num_clients = "
                f"{num_clients}; lower {SECTION}.init_args.novel_clients."
            )
        train_rng, novel_rng, deal_rng = rng.spawn(3)
        train = num_clients - self.novel_clients
        q = np.concatenate(
            [
                train_rng.dirichlet(np.full(num_classes, self.alpha), size=train),
                novel_rng.dirichlet(
                    np.full(num_classes, self.novel_alpha), size=self.novel_clients
                ),
            ]
        )
        return q, deal_rng

    def split(
        self,
        labels: np.ndarray,
        num_clients: int,
        num_classes: int,
        rng: np.random.Generator,
        coarse_labels: np.ndarray | None = None,
    ) -> IndexLists:
        self._check_clients(num_clients, len(labels))
        q, deal_rng = self.proportions(num_clients, num_classes, rng)
        totals = np.bincount(labels, minlength=num_classes)
        demand = q.sum(0)
        room = (totals - num_clients) / np.maximum(demand, 1e-300)
        size = int(np.floor(room.min())) if (demand > 0).any() else 0
        if self.samples_per_client is not None:
            size = min(size, self.samples_per_client)
        if size < 1:
            raise PartitionError(
                f"ClientDirichlet: {len(labels)} samples in {num_classes} classes cannot give "
                f"{num_clients} clients a sample each in their drawn proportions; lower "
                "num_clients or raise alpha."
            )
        counts = np.stack([largest_remainder(size, q[i], deal_rng) for i in range(num_clients)])
        return split_by_counts(labels, counts, deal_rng)
