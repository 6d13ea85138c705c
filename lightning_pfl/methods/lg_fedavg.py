"""LG-FedAvg (Liang et al., 2020): local representations, a global head."""

from __future__ import annotations

from typing import Any

import torch

from lightning_pfl.engine import Architecture
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import NonNegativeInt, PositiveInt


def weighted_layers(arch: Architecture) -> list[str]:
    """The layers with weights (a parameter of two or more dimensions: linear, convolution), by
    module name in the network's order: the layers LG-FedAvg's and FedPer's counts count."""
    return list(dict.fromkeys(n.rsplit(".", 1)[0] for n, s in arch.shapes.items() if len(s) >= 2))


class LGFedAvg(FedAvg):
    """LG-FedAvg: each client keeps its representation layers, the top layers are averaged.

    Round: the server sends the global layers (the last ``global_layers`` layers with weights,
    by default the classifier); each client joins them with its own local layers (everything
    else, batch-norm statistics included), trains the whole model, keeps the local layers and
    uploads the global ones, which the server averages (sample-weighted). The local layers
    never leave the client. Personalized model: the client's layers with the global head.

    The paper (and pFedHN's comparison) starts LG-FedAvg from a FedAvg model:
    ``init_from_fedavg_rounds`` = R runs R rounds of plain FedAvg on every tensor first; after
    round R every client's local layers start from the FedAvg model and the LG rounds follow.
    Evaluations up to round R report the FedAvg model.

    Args:
        global_layers: how many of the last layers with weights (linear / convolution) are
            global (1: the classifier).
        init_from_fedavg_rounds: R, the FedAvg rounds before LG-FedAvg (0: none).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        global_layers: PositiveInt = 1,
        init_from_fedavg_rounds: NonNegativeInt = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if "personal" not in self.store.fields:  # FedAvg phase at construction: added here
            initial = self.arch.initial_state()
            self.store.add_field("personal", {n: initial[n] for n in self.local_names()})

    def local_names(self) -> tuple[str, ...]:
        """The tensors each client keeps: all but the last ``global_layers`` weighted layers."""
        shared = set(weighted_layers(self.arch)[-self.hp.global_layers :])
        names = (*self.arch.shapes, *self.arch.buffer_shapes)
        return tuple(n for n in names if n.rsplit(".", 1)[0] not in shared)

    def in_fedavg_phase(self) -> bool:
        """Whether the current round (or, in evaluation, the rounds done) is a FedAvg round."""
        return self.current_round < self.hp.init_from_fedavg_rounds

    def personal_names(self) -> tuple[str, ...]:
        return () if self.in_fedavg_phase() else self.local_names()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        rounds = self.hp.init_from_fedavg_rounds
        if rounds and self.global_step == rounds:  # the FedAvg model is final: start LG
            self.start_local_layers()

    def start_local_layers(self) -> None:
        """Give every client the global model's local layers (the end of the FedAvg phase)."""
        state = self.global_state()
        clients = torch.arange(self.hp.num_clients)
        self.store.scatter(
            "personal",
            clients,
            {n: state[n].expand(len(clients), *state[n].shape) for n in self.local_names()},
        )
