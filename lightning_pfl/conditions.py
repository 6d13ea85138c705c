"""Unreliable clients inside the round: drops, stragglers and availability (docs/conditions.md).

:class:`Conditions` is one model argument (``model.init_args.conditions``). Every draw is a
function of ``(seed, round, CONDITIONS_STREAM)`` and of the client id, never of the order in
which the round's code asks, so a resumed run and every DDP rank see the same clients drop and
straggle as an uninterrupted single-process run. The conditions act through masks: a client
that does not report back, or the steps a straggler does not take, are idle steps of
:class:`~lightning_pfl.engine.ClientBatches` (nothing changes), and the methods' aggregation
weighs only what arrived (:meth:`FederatedMethod.client_weights`). The round keeps its shape,
so vmap and recorded CUDA graphs serve every round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
from torch import Tensor

from lightning_pfl.engine import ClientBatches, derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.streams import CONDITIONS_STREAM
from lightning_pfl.validation import Range, UnitInterval, _ranges_in, argument_ranges

KEY = "model.init_args.conditions"
Fraction = Annotated[float, Range(gt=0, le=1)]
Probability = Annotated[float, Range(gt=0, le=1)]


@dataclass(frozen=True)
class Stragglers:
    """Sampled clients that complete only a fraction of their local steps and still report.

    A straggler completes ``ceil(f * S)`` of its ``S`` local steps of every training phase (a
    method that trains in several phases, e.g. Ditto's global and personal models, cuts each).

    Attributes:
        rate: probability that a sampled client straggles in a round (independently per
            client and round; 1: every client).
        fraction: f, the fraction of its local steps a straggler completes, in (0, 1];
            with ``min_fraction``, the upper end of its distribution.
        min_fraction: None: every straggler completes ``fraction``; else each straggler's f
            is drawn per round from Uniform(min_fraction, fraction).
    """

    rate: UnitInterval = 1.0
    fraction: Fraction = 0.5
    min_fraction: Fraction | None = None


@dataclass(frozen=True)
class Conditions:
    """Unreliable clients (``model.init_args.conditions``); the defaults are reliable clients.

    Attributes:
        drop_rate: probability that a sampled, available client never reports back in a round
            (independently per client and round): it receives the round's payload, its own
            state stays as it was, and the aggregation uses the clients that arrived. In [0, 1).
        stragglers: clients that report back after only part of their local steps.
        availability: which clients can be sampled in a round: a probability for every
            client, a list of one probability per client, or the path of a trace file (``.csv``
            or ``.npy``, 0/1, shaped ``[period, num_clients]``; round r reads row r % period).
            The server samples ``clients_per_round`` clients among the available ones; when
            fewer are available, the remaining slots are taken by unavailable clients that
            receive nothing and never report back (the round keeps its shape). None: always.
    """

    drop_rate: Annotated[float, Range(ge=0, lt=1)] = 0.0
    stragglers: Stragglers | None = None
    availability: Probability | list[Probability] | str | None = None


@dataclass
class RoundDraws:
    """One round's conditions for every client id (host tensors ``[num_clients]``).

    Attributes:
        available: may be sampled this round.
        arrives: reports back if sampled (available and not dropped).
        fraction: share of its local steps completed if sampled (1 unless a straggler).
    """

    available: Tensor
    arrives: Tensor
    fraction: Tensor


class UnreliableClients:
    """The per-round draws of :class:`Conditions` for ``num_clients`` clients, checked.

    Every round draws four uniform numbers per client id (availability, drop, straggling,
    straggler fraction) whatever the settings, so that switching one condition on does not
    change which clients another one picks.
    """

    def __init__(self, conditions: Conditions | dict, num_clients: int, seed: int) -> None:
        if isinstance(conditions, dict):
            stragglers = conditions.get("stragglers")
            conditions = Conditions(
                **{
                    **conditions,
                    "stragglers": Stragglers(**stragglers)
                    if isinstance(stragglers, dict)
                    else stragglers,
                }
            )
        check_ranges(conditions, KEY)
        self.conditions = conditions
        self.num_clients = num_clients
        self.seed = seed
        stragglers = conditions.stragglers
        if stragglers is not None:
            check_ranges(stragglers, f"{KEY}.stragglers")
            low = stragglers.min_fraction
            if low is not None and low > stragglers.fraction:
                raise ConfigError(
                    f"{KEY}.stragglers.min_fraction = {low} exceeds "
                    f"{KEY}.stragglers.fraction = {stragglers.fraction}, the upper end of the "
                    "uniform draw; make min_fraction <= fraction."
                )
        self.availability = self._availability(conditions.availability)
        self._cached: tuple[int, RoundDraws] | None = None

    @property
    def drops(self) -> bool:
        """Whether some sampled client may not report back (drops or availability)."""
        return self.conditions.drop_rate > 0 or self.availability is not None

    @property
    def limits_availability(self) -> bool:
        return self.availability is not None

    def _availability(self, value: float | list[float] | str | None) -> Tensor | None:
        """``[period, num_clients]`` 0/1 trace, ``[1, num_clients]`` probabilities, or None."""
        n = self.num_clients
        if value is None:
            return None
        if isinstance(value, (int, float)):
            return self._probabilities([float(value)] * n)
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ConfigError(
                    f"{KEY}.availability lists {len(value)} probabilities for the data's {n} "
                    f"clients; give one per client ({n} values)."
                )
            return self._probabilities([float(v) for v in value])
        return self._trace(Path(value))

    def _probabilities(self, values: list[float]) -> Tensor:
        bad = [v for v in values if not (0 < v <= 1)]
        if bad:
            raise ConfigError(
                f"{KEY}.availability = {bad[0]!r} is not a probability in (0, 1]; a client "
                "that is never available would never train: remove it from the data instead."
            )
        return torch.tensor([values], dtype=torch.float64)

    def _trace(self, path: Path) -> Tensor:
        if path.suffix not in (".csv", ".npy"):
            raise ConfigError(
                f"{KEY}.availability = '{path}' is neither a probability nor a .csv / .npy "
                "trace file; give a number in (0, 1], a list of them, or such a file."
            )
        if not path.is_file():
            raise ConfigError(f"{KEY}.availability: the trace file '{path}' does not exist.")
        try:
            trace = np.load(path) if path.suffix == ".npy" else np.loadtxt(path, delimiter=",")
        except ValueError as error:
            raise ConfigError(f"{KEY}.availability: cannot read '{path}' ({error}).") from None
        trace = np.atleast_2d(trace)
        if trace.ndim != 2 or trace.shape[1] != self.num_clients:
            raise ConfigError(
                f"{KEY}.availability: the trace '{path}' has shape {list(trace.shape)}; it needs "
                f"one column per client of the data: [rounds or period, {self.num_clients}]."
            )
        if not np.isin(trace, (0, 1)).all():
            raise ConfigError(
                f"{KEY}.availability: the trace '{path}' holds values other than 0 and 1."
            )
        return torch.from_numpy(trace.astype(bool))

    def draws(self, round_idx: int) -> RoundDraws:
        """The conditions of round ``round_idx`` (a pure function of seed and round)."""
        if self._cached is not None and self._cached[0] == round_idx:
            return self._cached[1]
        c = self.conditions
        generator = torch.Generator().manual_seed(
            derive_seed(self.seed, round_idx, CONDITIONS_STREAM)
        )
        u = torch.rand(4, self.num_clients, generator=generator, dtype=torch.float64)
        trace = self.availability
        if trace is None:
            available = torch.ones(self.num_clients, dtype=torch.bool)
        elif trace.dtype == torch.bool:
            available = trace[round_idx % len(trace)]
        else:
            available = u[0] < trace[0]
        arrives = available & (u[1] >= c.drop_rate)
        fraction = torch.ones(self.num_clients, dtype=torch.float64)
        s = c.stragglers
        if s is not None:
            low = s.fraction if s.min_fraction is None else s.min_fraction
            drawn = low + (s.fraction - low) * u[3]
            fraction = torch.where(u[2] < s.rate, drawn, fraction)
        result = RoundDraws(available, arrives, fraction)
        self._cached = (round_idx, result)
        return result

    def order_by_availability(self, candidates: Tensor, round_idx: int) -> Tensor:
        """``candidates`` (a random order of client ids) with the available ones first, each
        part in its order: the first ``k`` are a uniform sample of the available clients."""
        if self.availability is None:
            return candidates
        unavailable = ~self.draws(round_idx).available[candidates]
        return candidates[torch.argsort(unavailable.to(torch.uint8), stable=True)]

    def restrict(self, batches: ClientBatches, clients: Tensor, round_idx: int) -> ClientBatches:
        """``batches`` of ``clients`` with the steps not taken made idle: every step of a client
        that does not report back, and a straggler's steps after its first ``ceil(f * S)``."""
        draws = self.draws(round_idx)
        active = batches.active
        ids = clients.to(active.device)
        arrives = draws.arrives.to(active.device)[ids]
        fraction = draws.fraction.to(active.device)[ids]
        taken = torch.cumsum(active.long(), 1)
        steps = taken[:, -1:].double()
        # the tolerance keeps f * S that is an integer up to float rounding from rounding up
        keep = torch.ceil(fraction[:, None] * steps - 1e-9)
        active = active & (taken <= keep) & arrives[:, None]
        return ClientBatches(batches.index, batches.weight, active)

    def counts(self, clients: Tensor, round_idx: int) -> tuple[int, int]:
        """How many of ``clients`` were contacted (available) and how many reported back."""
        draws = self.draws(round_idx)
        ids = clients.cpu()
        return int(draws.available[ids].sum()), int(draws.arrives[ids].sum())


def check_ranges(settings: Conditions | Stragglers, prefix: str) -> None:
    """Raise a ConfigError naming the first field of ``settings`` outside its Range."""
    hints = argument_ranges(type(settings))
    for field in fields(settings):
        value = getattr(settings, field.name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        for allowed in _ranges_in(hints[field.name]):
            if not allowed.contains(value):
                raise ConfigError(
                    f"{prefix}.{field.name} = {value!r} must be {allowed}; change it in the "
                    "config file or on the command line."
                )


def straggler_steps(fraction: float, steps: int) -> int:
    """Local steps a client with fraction ``fraction`` of ``steps`` completes (as restrict)."""
    return math.ceil(fraction * steps - 1e-9)


def unreliable_clients(
    method: type, conditions: Conditions | dict | None, num_clients: int, seed: int
) -> UnreliableClients | None:
    """The checked conditions of a ``method`` run (None: reliable clients).

    A method honours the conditions when it declares ``honours_conditions = True`` in its own
    class body (not inherited: a subclass may aggregate differently): its local training draws
    its batches through ``draw_batches`` and its server update weighs only the clients that
    reported back (``client_weights(clients, round_idx)``, ``arrived``), leaving the server
    unchanged in a round where none did.
    """
    if conditions is None:
        return None
    unreliable = UnreliableClients(conditions, num_clients, seed)
    c = unreliable.conditions
    if (c.drop_rate > 0 or c.stragglers is not None or c.availability is not None) and not vars(
        method
    ).get("honours_conditions", False):
        raise ConfigError(
            f"{KEY}: {method.__name__} does not weigh its aggregation by the clients that "
            "reported back, so it cannot simulate dropped, straggling or unavailable clients; "
            f"use one of {', '.join(honouring_methods())} or remove {KEY}."
        )
    return unreliable


def honouring_methods() -> list[str]:
    """Names of the methods that honour :class:`Conditions`."""
    from lightning_pfl.methods import method_classes

    return sorted(n for n, cls in method_classes().items() if vars(cls).get("honours_conditions"))
