"""Evaluation passes over every sample of a set of clients, in blocks of positions.

:func:`eval_blocks` pads every client to the largest; :func:`ragged_eval_blocks` (and
:class:`ClientsBySize`, which orders clients for it) pads a client only up to the next of a
few sample counts, so unequal clients cost little more than their own samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_pfl.client_index import ClientIndex
from lightning_pfl.engine import Params

if TYPE_CHECKING:
    from lightning_pfl.datamodule import FederatedDataModule, Split


def eval_blocks(index: ClientIndex, clients: Tensor, block: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(index [C, b], weight [C, b])`` blocks covering every sample of ``clients``."""
    counts = index.counts[clients]
    n_max = int(counts.max()) if len(clients) else 0
    for start in range(0, n_max, block):
        positions = torch.arange(start, min(start + block, n_max), device=counts.device)
        positions = positions.expand(len(clients), -1)
        yield index.lookup(clients, positions), (positions < counts.view(-1, 1)).float()


def ragged_eval_blocks(
    index: ClientIndex,
    clients: Tensor,
    block: int,
    levels: int = 16,
    min_saving: int = 32,
) -> Iterator[tuple[int, Tensor, Tensor]]:
    """:func:`eval_blocks` without most of the padding of unequal clients.

    ``clients`` must come in descending order of their sample count. Yields
    ``(k, index [k, b], weight [k, b])``: the positions ``[start, start + b)`` of the first
    ``k`` clients, the ones holding more than ``start`` samples. Blocks end at the sample
    counts of ``levels`` evenly spaced ranks (and at most ``block`` apart), so a client is
    padded only up to the next such count instead of up to the largest client. An end
    that saves fewer than ``min_saving`` padded samples is dropped (cheapest first): each
    block is one more network call, which costs more than that little computation (the
    measured effect: docs/performance.md).
    """
    counts = index.counts[clients]
    if len(clients) == 0:
        return
    host = counts.tolist()
    if any(a < b for a, b in zip(host, host[1:], strict=False)):
        raise ValueError("ragged_eval_blocks needs clients in descending order of samples")
    ranks = {min(len(host) - 1, len(host) * level // levels) for level in range(levels)}
    ends = _worthwhile_ends(host, sorted({host[rank] for rank in ranks} - {0}), min_saving)
    start = 0
    for end in ends:
        while start < end:
            stop = min(start + block, end)
            k = sum(count > start for count in host)
            positions = torch.arange(start, stop, device=counts.device).expand(k, -1)
            weight = (positions < counts[:k].view(-1, 1)).float()
            yield k, index.lookup(clients[:k], positions), weight
            start = stop


class ClientsBySize:
    """A pass over every sample of ``clients`` in ``split`` without padding them all to the
    largest client (:func:`ragged_eval_blocks`).

    The pass runs in descending order of sample count: :meth:`sort` reorders per-client tensors
    once, each block of :meth:`blocks` concerns the first ``k`` clients of that order (slice
    tensors and accumulators with ``[:k]``), and :meth:`unsort` puts per-client results back in
    the order of ``clients``.
    """

    def __init__(self, data: FederatedDataModule, clients: Tensor, split: Split) -> None:
        self.data, self.split = data, split
        self.order = data.num_samples(split)[clients].argsort(descending=True, stable=True)
        self.sorted = bool(
            torch.equal(self.order, torch.arange(len(clients), device=self.order.device))
        )
        self.clients = clients if self.sorted else clients[self.order]

    def sort(self, params: Params) -> Params:
        """Per-client tensors ``[C, ...]`` in the pass's order (shared stride-0 ones kept)."""
        if self.sorted:
            return params
        return {k: v if v.stride(0) == 0 else v[self.order] for k, v in params.items()}

    def unsort(self, values: Tensor) -> Tensor:
        """Per-client results ``[C, ...]`` of the pass back in the order of the clients."""
        return values if self.sorted else values[self.order.argsort()]

    def blocks(self, block: int) -> Iterator[tuple[int, Tensor, Tensor, Tensor]]:
        """Yield ``(k, x [k, b, ...], y [k, b], weight [k, b])`` for the first ``k`` clients."""
        samples = self.data.index[self.split]
        for k, index, weight in ragged_eval_blocks(samples, self.clients, block):
            x, y = self.data.fetch(index)
            yield k, x, y, weight


def _worthwhile_ends(counts: list[int], ends: list[int], min_saving: int) -> list[int]:
    """``ends`` (ascending) without the block ends that save fewer than ``min_saving`` padded
    samples of the descending ``counts``, removed cheapest first; the last end always stays.

    Ending a block at ``ends[i]`` instead of ``ends[i + 1]`` spares the clients that hold more
    than ``ends[i - 1]`` but at most ``ends[i]`` samples ``ends[i + 1] - ends[i]`` positions.
    """
    ends = list(ends)

    def holding_more_than(n: int) -> int:
        return sum(count > n for count in counts)

    while len(ends) > 1:
        savings = [
            (holding_more_than(ends[i - 1] if i else 0) - holding_more_than(ends[i]))
            * (ends[i + 1] - ends[i])
            for i in range(len(ends) - 1)
        ]
        cheapest = min(range(len(savings)), key=savings.__getitem__)
        if savings[cheapest] >= min_saving:
            break
        del ends[cheapest]
    return ends
