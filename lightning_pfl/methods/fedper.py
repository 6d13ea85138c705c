"""FedPer (Arivazhagan et al., 2019): a shared body, a personal classifier per client."""

from __future__ import annotations

from lightning_pfl.methods.fedavg import FedAvg


class FedPer(FedAvg):
    """FedAvg with personalization layers: each client keeps its classifier head.

    Round: the server sends the body (every tensor but the network's classifier,
    ``Architecture.head_names``: ``fc3`` of ``cnn``, ``fc2`` of ``digits_cnn``/``mlp``); the
    client joins it with its own head, trains the whole model jointly for the local steps
    (or epochs), keeps the trained head and uploads the body; the server averages the bodies
    (sample-weighted). The head never leaves the client, so the server's copy of it stays at
    the initialization. Personalized model: the global body with the client's head.

    FedPer has no hyperparameters beyond FedAvg's (``server_lr``, ``server_momentum``) and the
    local SGD settings; the paper's "base + personalization layers" split is body / head.
    """

    honours_conditions = True

    def personal_names(self) -> tuple[str, ...]:
        return self.arch.head_names
