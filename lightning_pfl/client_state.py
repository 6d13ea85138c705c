"""Per-client state kept between rounds (:class:`ClientStateStore`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from lightning_pfl.params import Params


class ClientStateStore:
    """Per-client state (personal layers, embeddings, kept momentum) for all clients.

    Each *field* is a dict of tensors shaped ``[num_clients, ...]``. Only the round's clients
    are gathered onto the compute device; with ``offload=True`` the store itself stays in
    (pinned) CPU memory, so device memory grows with clients per round, not with clients.
    """

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.fields: dict[str, Params] = {}
        self.device = torch.device("cpu")

    def add_field(
        self, name: str, per_client_init: Mapping[str, Tensor], rows: int | None = None
    ) -> None:
        """Give every client (or ``rows`` rows, for state only some clients have) a copy."""
        rows = self.num_clients if rows is None else rows
        self.fields[name] = {
            k: v.detach().unsqueeze(0).repeat(rows, *([1] * v.dim())).to(self.device)
            for k, v in per_client_init.items()
        }

    def gather(self, name: str, clients: Tensor, device: torch.device) -> Params:
        ids = clients.to(self.device)
        return {k: v[ids].to(device, non_blocking=True) for k, v in self.fields[name].items()}

    def scatter(self, name: str, clients: Tensor, values: Mapping[str, Tensor]) -> None:
        ids = clients.to(self.device)
        for k, v in values.items():
            self.fields[name][k][ids] = v.detach().to(self.device, self.fields[name][k].dtype)

    def to(self, device: torch.device, offload: bool = False) -> None:
        """Place the store on ``device``, or in pinned CPU memory when ``offload`` is set."""
        target = torch.device("cpu") if offload else device
        pin = offload and device.type == "cuda"
        for fld in self.fields.values():
            for k, v in fld.items():
                moved = v.to(target)
                fld[k] = moved.pin_memory() if pin and not moved.is_pinned() else moved
        self.device = target

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        return {name: {k: v.cpu() for k, v in fld.items()} for name, fld in self.fields.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        if set(state) != set(self.fields):
            raise KeyError(f"client state fields {sorted(state)} != expected {sorted(self.fields)}")
        self.fields = {
            name: {k: v.to(self.device) for k, v in fld.items()} for name, fld in state.items()
        }

    def nbytes(self) -> int:
        return sum(
            v.numel() * v.element_size() for fld in self.fields.values() for v in fld.values()
        )
