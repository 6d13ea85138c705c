"""Where each client's samples are, and how its local-training batches are drawn from them.

A split's clients are one CSR index over the pooled inputs (:class:`ClientIndex`); batches are
drawn as positions into it (:func:`draw_batches`), on the data's device, with no per-client
Python loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_pfl.engine import ClientBatches
from lightning_pfl.partition import IndexLists


@dataclass
class ClientIndex:
    """The samples of every client in one split, grouped by client (CSR layout)."""

    flat: Tensor  # [total] indices into the pooled inputs, client 0's first
    offsets: Tensor  # [n] start of each client's run in ``flat``
    counts: Tensor  # [n] samples per client

    @classmethod
    def from_lists(cls, parts: IndexLists, device: torch.device) -> ClientIndex:
        counts = torch.tensor([len(p) for p in parts], dtype=torch.int64)
        offsets = torch.cumsum(counts, 0) - counts
        flat = torch.from_numpy(np.concatenate(parts).astype(np.int64)) if parts else torch.zeros(0)
        return cls(flat.to(device), offsets.to(device), counts.to(device))

    def lookup(self, clients: Tensor, positions: Tensor) -> Tensor:
        """Pooled-input index of position ``positions[c, ...]`` of client ``clients[c]``.

        Positions past a client's count wrap around its samples, so the padding of a batch
        repeats the client's own samples in turn (batch-norm statistics of a padded batch are
        not dominated by one repeated image).
        """
        counts = self.counts[clients].view(-1, *([1] * (positions.dim() - 1)))
        safe = positions % counts.clamp_min(1)
        offsets = self.offsets[clients].view_as(counts)
        return self.flat[offsets + safe]


def draw_batches(
    index: ClientIndex,
    clients: Tensor,
    batch_size: int,
    generator: torch.Generator,
    steps: int | None = None,
    epochs: int | None = None,
    drop_last: bool = False,
) -> ClientBatches:
    """Draw the local-training batches of ``clients`` by index, on the index's device.

    ``steps=K``: K batches, each ``min(batch_size, n_i)`` distinct random samples (pFedHN's
    "fresh random batch per inner step"). ``epochs=E``: E shuffled passes over each
    client's data in batches of ``batch_size`` (the last one smaller), so client i takes
    ``E * ceil(n_i / batch_size)`` steps; clients that finish early idle. With ``drop_last``
    an epoch's last, smaller batch is not taken (PyTorch's ``DataLoader(drop_last=True)``):
    client i takes ``E * floor(n_i / batch_size)`` steps, none if it has fewer than
    ``batch_size`` samples. ``drop_last`` changes nothing with ``steps``, where no batch is
    left over.
    """
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps or epochs")
    device = index.counts.device
    counts = index.counts[clients]
    n_max = int(counts.max())
    batch = min(batch_size, n_max)
    positions = torch.arange(n_max, device=device)
    invalid = positions >= counts.view(-1, 1)  # [C, n_max]
    reps = steps if steps is not None else epochs
    assert reps is not None
    keys = torch.rand(len(clients), reps, n_max, generator=generator, device=device)
    keys = keys.masked_fill(invalid.unsqueeze(1), 2.0)
    if steps is not None:
        chosen = keys.topk(batch, dim=-1, largest=False, sorted=False).indices  # [C, S, B]
    else:
        perm = keys.argsort(dim=-1)
        per_epoch = math.ceil(n_max / batch)
        pad = per_epoch * batch - n_max
        padding = torch.arange(n_max, n_max + pad, device=device)
        perm = torch.cat([perm, padding.expand(*perm.shape[:2], pad)], -1)
        chosen = perm.view(len(clients), reps * per_epoch, batch)
    weight = (chosen < counts.view(-1, 1, 1)).float()
    if drop_last and epochs is not None:
        # batch j of an epoch holds that epoch's samples j*B .. (j+1)*B - 1 (B = batch_size)
        ends = (torch.arange(per_epoch, device=device) + 1) * batch_size
        full = (ends <= counts.view(-1, 1)).repeat(1, reps)  # [C, S]
        weight = weight * full.unsqueeze(-1)
    return ClientBatches(index.lookup(clients, chosen), weight, weight.amax(-1) > 0)
