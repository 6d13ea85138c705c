"""Per-client network assignment: which clients use which architecture.

A method whose clients have different networks (FedSimSup's supervisors, MH-pFedHN's model
zoo, FedGH) describes them as named groups in YAML::

    architectures:
      lenet: {net: lenet5, net_args: {width: 0.5}, share: 0.5}
      mlp: {net: mlp, share: 0.5}

Every group has ``net`` (a registry name) and optionally ``net_args`` and either ``share``
(proportions; equal shares when left out, i.e. an even split) or ``clients`` (an explicit list
of client ids; then every group lists its clients and together they cover each client once).
Proportions become exact counts by largest-remainder rounding and are dealt to clients in a
seeded random order. Clients of one group are trained together (one vmap per group) and the
group's accuracy is reported as ``{val,test}/<prefix>_<name>/acc``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_pfl.engine import Architecture, Params
from lightning_pfl.errors import ConfigError
from lightning_pfl.models import build_network
from lightning_pfl.partition import largest_remainder
from lightning_pfl.streams import ARCHITECTURE_STREAM

GROUP_KEYS = {"net", "net_args", "share", "clients"}
SEP = "/"  # a group's personalized tensors are keyed "<group>/<tensor>" (see NetworkGroups.tagged)


@dataclass(frozen=True)
class GroupShare:
    """The clients of one architecture group among a round's clients."""

    name: str  # the group's name
    rows: Tensor  # their positions among the round's clients (to select batches, slice results)
    members: Tensor  # their client ids
    arch: Architecture  # the group's network


class NetworkGroups:
    """Named client groups, each with its own network architecture.

    Attributes:
        names: group names in config order.
        group_of: ``[n]`` index into ``names`` of every client's group.
        row_of: ``[n]`` every client's row within its group (for per-group client-store fields).
        archs: the architecture of every group, by name.
    """

    def __init__(
        self,
        specs: Mapping[str, Mapping[str, Any]],
        num_clients: int,
        input_shape: tuple[int, ...],
        num_classes: int,
        seed: int,
        section: str,
    ) -> None:
        _check_specs(specs, section)
        self.names = list(specs)
        self.group_of = _assign(specs, num_clients, seed, section)
        self.row_of = torch.zeros(num_clients, dtype=torch.int64)
        for g in range(len(self.names)):
            members = self.members(g)
            self.row_of[members] = torch.arange(len(members))
        self.archs = {
            name: Architecture(
                build_network(spec["net"], input_shape, num_classes, **(spec.get("net_args") or {}))
            )
            for name, spec in specs.items()
        }

    def members(self, group: int | str) -> Tensor:
        """Client ids of ``group`` (index or name), ascending."""
        index = self.names.index(group) if isinstance(group, str) else group
        return (self.group_of == index).nonzero()[:, 0]

    def group_of_clients(self, clients: Tensor) -> str:
        """The one group every client of ``clients`` belongs to (evaluation is per group)."""
        names = [name for name, _ in self.split(clients)]
        if len(names) != 1:
            raise ValueError(f"expected clients of one architecture group, got groups {names}")
        return names[0]

    @staticmethod
    def tagged(group: str, params: Params) -> Params:
        """``params`` of ``group``'s network keyed ``"<group>/<tensor>"``, as :meth:`predict`
        reads them."""
        return {f"{group}{SEP}{n}": t for n, t in params.items()}

    def predict(self, params: Params, x: Tensor) -> Tensor:
        """Logits of the network of the group named in ``params``' keys (see :meth:`tagged`)."""
        group = next(iter(params)).split(SEP, 1)[0]
        return self.archs[group]({n.split(SEP, 1)[1]: t for n, t in params.items()}, x)

    def split(self, clients: Tensor) -> Iterator[tuple[str, Tensor]]:
        """(group name, positions in ``clients``) for every group among ``clients``."""
        groups = self.group_of[clients.cpu()]
        for g, name in enumerate(self.names):
            rows = (groups == g).nonzero()[:, 0]
            if len(rows):
                yield name, rows.to(clients.device)

    def train_groups(self, clients: Tensor, train: Callable[[GroupShare], Tensor]) -> Tensor:
        """Call ``train`` once for each group among ``clients`` (its clients train together:
        one vmap per group) and gather the per-client losses it returns, in the order of
        ``clients``."""
        losses = torch.zeros(len(clients), device=clients.device)
        for name, rows in self.split(clients):
            losses[rows] = train(GroupShare(name, rows, clients[rows], self.archs[name]))
        return losses

    def client_groups(self, prefix: str) -> dict[str, Tensor]:
        """``{f"{prefix}_{name}": client ids}`` for per-group accuracy."""
        return {f"{prefix}_{name}": self.members(g) for g, name in enumerate(self.names)}


def _check_specs(specs: Mapping[str, Mapping[str, Any]], section: str) -> None:
    if not specs:
        raise ConfigError(f"{section}: give at least one group.")
    listed = [name for name, spec in specs.items() if "clients" in spec]
    for name, spec in specs.items():
        unknown = set(spec) - GROUP_KEYS
        if "." in name or not isinstance(spec, Mapping) or "net" not in spec or unknown:
            raise ConfigError(
                f"{section}.{name}: give a name without dots and a dict with 'net' and "
                f"optionally 'net_args' and 'share' or 'clients' (unknown keys: {sorted(unknown)})."
            )
        if "share" in spec and "clients" in spec:
            raise ConfigError(f"{section}.{name}: give 'share' or 'clients', not both.")
    if listed and len(listed) != len(specs):
        raise ConfigError(
            f"{section}: groups {listed} list their clients, so every group must "
            f"(missing in {sorted(set(specs) - set(listed))})."
        )


def _assign(
    specs: Mapping[str, Mapping[str, Any]], num_clients: int, seed: int, section: str
) -> Tensor:
    """The group index of every client: from the lists, or dealt by seeded proportions."""
    if all("clients" in spec for spec in specs.values()):
        group_of = torch.full((num_clients,), -1, dtype=torch.int64)
        for g, (name, spec) in enumerate(specs.items()):
            ids = torch.as_tensor(list(spec["clients"]), dtype=torch.int64)
            if len(ids) and (ids.min() < 0 or ids.max() >= num_clients):
                raise ConfigError(f"{section}.{name}.clients: ids must be in 0..{num_clients - 1}.")
            if (group_of[ids] >= 0).any() or len(ids.unique()) != len(ids):
                raise ConfigError(f"{section}.{name}.clients: a client is listed twice.")
            group_of[ids] = g
        missing = (group_of < 0).nonzero()[:, 0].tolist()
        if missing:
            raise ConfigError(f"{section}: clients {missing[:10]} are in no group's 'clients'.")
        return group_of
    shares = np.array([float(spec.get("share", 1.0)) for spec in specs.values()])
    if (shares < 0).any() or shares.sum() <= 0:
        raise ConfigError(f"{section}: shares must be >= 0 with a positive sum, got {shares}.")
    rng = np.random.default_rng([seed, 0, ARCHITECTURE_STREAM])
    counts = largest_remainder(num_clients, shares / shares.sum(), rng)
    return torch.from_numpy(rng.permutation(np.repeat(np.arange(len(shares)), counts)))
