"""Which clients take part in a round: the sample (without the held-out novel clients), which
of them report back under ``conditions`` (:mod:`lightning_pfl.conditions`), the weights that
aggregate what arrived and the bytes the round exchanges.

:class:`Participation` is a base class of :class:`~lightning_pfl.methods.base.FederatedMethod`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from lightning import LightningModule
from lightning.fabric.utilities.data import AttributeDict
from torch import Tensor

from lightning_pfl.conditions import UnreliableClients
from lightning_pfl.costs import payload_bytes
from lightning_pfl.engine import derive_seed
from lightning_pfl.run_record import RunRecord
from lightning_pfl.streams import CLIENT_STREAM

if TYPE_CHECKING:
    from lightning_pfl.client_state import ClientStateStore
    from lightning_pfl.datamodule import FederatedDataModule


class Participation(LightningModule):
    """The client-sampling part of :class:`~lightning_pfl.methods.base.FederatedMethod` (a base
    class of it): :meth:`sample_clients`, and for a method's round :meth:`client_weights`,
    :meth:`arrived`, :meth:`nothing_arrived` and :meth:`record_communication`."""

    if TYPE_CHECKING:  # FederatedMethod's
        unreliable: UnreliableClients | None
        round_reach: tuple[int, int, int, int]
        record: RunRecord
        store: ClientStateStore

        @property
        def hp(self) -> AttributeDict: ...

        @property
        def data(self) -> FederatedDataModule: ...

    @property
    def num_training_clients(self) -> int:
        """Clients that train and are evaluated: all but the last ``novel_clients``."""
        return int(self.hp.num_clients - self.hp.novel_clients)

    def training_clients_of(self, clients: Tensor) -> Tensor:
        """``clients`` without the held-out novel clients (unchanged when there are none)."""
        if not self.hp.novel_clients:
            return clients
        return clients[clients < self.num_training_clients]

    def sample_clients(self, round_idx: int) -> Tensor:
        generator = torch.Generator().manual_seed(
            derive_seed(self.hp.seed, round_idx, CLIENT_STREAM)
        )
        chosen = torch.randperm(self.num_training_clients, generator=generator)
        if self.unreliable is not None:
            chosen = self.unreliable.order_by_availability(chosen, round_idx)
        sample = chosen[: self.hp.clients_per_round].sort().values
        if self.unreliable is not None:
            self.round_reach = (round_idx, len(sample), *self.unreliable.counts(sample, round_idx))
        if self.device.type == "cuda":  # a pageable copy would wait for the queued rounds
            return sample.pin_memory().to(self.device, non_blocking=True)
        return sample.to(self.device)

    def client_weights(
        self, clients: Tensor, round_idx: int | None = None, uniform: bool = False
    ) -> Tensor:
        """Training-sample counts of ``clients`` (``uniform``: ones) normalized to sum to one
        over the clients that reported back in round ``round_idx`` (:meth:`arrived`); zero for
        the others, all zero when none did. ``round_idx`` None: over all ``clients``."""
        ids = clients.to(self.data.device)
        n = self.data.num_samples("train")[ids].double()
        if uniform:
            n = torch.ones_like(n)
        if round_idx is not None and self.unreliable is not None:
            n = n * self.arrived(ids, round_idx).to(n)
        return (n / n.sum().clamp_min(1)).to(self.device)  # counts: a sum > 0 is >= 1

    def arrived(self, clients: Tensor, round_idx: int) -> Tensor:
        """Whether each of ``clients`` reported back in round ``round_idx`` (bool ``[C]``; all
        True without ``conditions``)."""
        if self.unreliable is None:
            return torch.ones(len(clients), dtype=torch.bool, device=clients.device)
        arrives = self.unreliable.draws(round_idx).arrives.to(clients.device)
        return arrives[clients]

    def where_arrived(
        self, clients: Tensor, round_idx: int, new: Mapping[str, Tensor], old: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        """Per-client state ``[C, ...]`` at the end of round ``round_idx``: ``new`` for the
        ``clients`` that reported back, ``old`` for the others, which end the round as they began
        it. Without ``conditions``, ``new`` as it is. No host sync."""
        if self.unreliable is None:
            return dict(new)
        arrived = self.arrived(clients, round_idx)
        return {
            n: torch.where(arrived.view(-1, *[1] * (t.dim() - 1)), t, old[n])
            for n, t in new.items()
        }

    def scatter_arrived(
        self, field: str, clients: Tensor, round_idx: int, new: Mapping[str, Tensor]
    ) -> None:
        """Store ``new`` as client-store ``field`` of the ``clients`` that reported back in round
        ``round_idx``; the others keep theirs (:meth:`where_arrived`). Without ``conditions``
        a plain scatter: the kept state is read only when a client can drop."""
        if self.unreliable is not None:
            kept = self.store.gather(field, clients, self.device)
            new = self.where_arrived(clients, round_idx, new, kept)
        self.store.scatter(field, clients, new)

    def nothing_arrived(self, clients: Tensor, round_idx: int) -> bool:
        """Whether none of ``clients`` reported back in round ``round_idx``: the server then
        leaves its state unchanged. Server side: reads the mask on the host."""
        return self.unreliable is not None and not bool(self.arrived(clients, round_idx).any())

    def record_communication(self, down: Mapping[str, Tensor], up: Mapping[str, Tensor]) -> None:
        """Count the bytes of what the server sent and received this round (all clients).

        With ``conditions``, ``down`` and ``up`` stacked over the round's sampled clients count
        only the rows of the clients contacted (available) and of those that reported back.
        """
        down_bytes, up_bytes = float(payload_bytes(down)), float(payload_bytes(up))
        if self.unreliable is not None and self.round_reach[0] == self.global_step:
            _, sampled, contacted, arrived = self.round_reach
            down_bytes, up_bytes = down_bytes * contacted / sampled, up_bytes * arrived / sampled
        self.record.round_bytes = [down_bytes, up_bytes]
