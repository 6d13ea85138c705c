"""Per-step inputs of local training drawn on the server (generated samples, sampled mixing
weights, ...) and read by the client loss at the step it is taking.

The engine gives a loss one batch and the per-client tensors of the round, not the step index.
A method that needs fresh random inputs at every local step draws them for the whole round on
the server, seeded by round (a bank ``[C, S, ...]`` passed as context), and adds a *clock* to the
trained tensors: a scalar per client in its own SGD group with learning rate -1 whose loss term
:func:`tick` has gradient 1, so every step a client takes advances its clock by one (an idle
step does not) and :func:`at` reads the bank's row for the current step. The client step stays
free of random numbers and host syncs: vmap, the loop and the threads see the same inputs, and
a recorded round replays them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_pfl.engine import ParamGroup, SGDConfig

CLOCK = "step_clock"
CLOCK_GROUP = ParamGroup((CLOCK,), SGDConfig(lr=-1.0))


def start_clock(num_clients: int, device: torch.device) -> dict[str, Tensor]:
    """The clocks of ``num_clients`` clients at step 0 (add them to the trained tensors and
    :data:`CLOCK_GROUP` to the groups)."""
    return {CLOCK: torch.zeros(num_clients, device=device)}


def at(bank: Tensor, clock: Tensor) -> Tensor:
    """Row ``clock`` of one client's ``bank`` ``[S, ...]`` (vmappable, no host sync)."""
    return bank.index_select(0, clock.detach().long().view(1)).squeeze(0)


def tick(loss: Tensor, clock: Tensor) -> Tensor:
    """``loss`` unchanged in value, plus gradient 1 on the clock (which SGD at lr -1 turns into
    +1 per step)."""
    return loss + (clock - clock.detach())
