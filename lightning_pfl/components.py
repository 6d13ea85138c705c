"""M models of one architecture held and trained together (the components of FedEM's mixture,
or of any method with several whole models per client).

:class:`Components` is an ``nn.Module`` holding the M networks under ``members.<m>.``, so one
:class:`~lightning_pfl.engine.Architecture` of it gives a client's M models as one tensor dict:
the server keeps them as one module (FedAvg's payload, aggregation and server optimizer work on
it unchanged), and one ``local_train(..., arch=components_arch)`` trains every client's M models
at once. :func:`component_groups` gives each member its own SGD group, so gradient clipping acts
on each model alone, as if the M models were trained one after the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_pfl.architecture import drop_batch_counters
from lightning_pfl.engine import Architecture, ParamGroup, SGDConfig

PREFIX = "members"


class Components(nn.Module):
    """M networks of one architecture; ``forward(x)`` stacks their outputs ``[M, B, ...]``."""

    def __init__(self, nets: Sequence[nn.Module]) -> None:
        super().__init__()
        self.members = nn.ModuleList(drop_batch_counters(net) for net in nets)

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack([net(x) for net in self.members])


def member_names(arch: Architecture, m: int) -> tuple[str, ...]:
    """The parameter names of member ``m`` in an architecture of :class:`Components`."""
    return tuple(n for n in arch.shapes if n.startswith(f"{PREFIX}.{m}."))


def component_groups(arch: Architecture, count: int, sgd: SGDConfig) -> list[ParamGroup]:
    """One SGD group per member (clipping, momentum and weight decay per model)."""
    return [ParamGroup(member_names(arch, m), sgd) for m in range(count)]
