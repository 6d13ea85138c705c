"""kNN-Per (Marfoq et al., 2022): FedAvg's model interpolated with a local kNN memory."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import Params
from lightning_pfl.losses import interpolate_with_knn, knn_probabilities
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import PositiveFloat, PositiveInt, UnitInterval

MEMORY = ("memory.features", "memory.labels", "memory.mask")


class KNNPer(FedAvg):
    """kNN-Per: a FedAvg global model plus, on each client, a kNN memory of its training data.

    Training is FedAvg. For evaluation, each client stores the global model's features
    (the classifier's input) of all its training samples with their labels, and predicts
    ``lambda * p_kNN(y | x) + (1 - lambda) * p_global(y | x)``, where p_kNN weights the k
    nearest stored features (squared Euclidean distance d) by ``softmax(-d / T)``
    (:func:`~lightning_pfl.losses.knn_probabilities`). The memory is rebuilt from the current
    global model at every evaluation; nothing is sent besides FedAvg's model.

    The paper picks lambda per client on held-out data; here lambda is one fixed value.

    Args:
        knn_weight: lambda, weight of the kNN probabilities (ours: 0.5; the paper tunes it
            per client in [0, 1]).
        neighbours: k, stored samples voting per prediction (paper: 10).
        temperature: T of the distance softmax (1.0).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    def __init__(
        self,
        knn_weight: UnitInterval = 0.5,
        neighbours: PositiveInt = 10,
        temperature: PositiveFloat = 1.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    @torch.no_grad()
    def memory(self, clients: Tensor, glob: Params) -> Params:
        """Global-model features, labels and a validity mask of each client's training data."""
        features, labels, mask = [], [], []
        for index, weight in self.data.eval_blocks(clients, "train", self.hp.eval_batch_size):
            x, y = self.data.fetch(index)
            z = self.arch.features(glob, x.flatten(0, 1))
            features.append(z.view(*index.shape, -1))
            labels.append(y)
            mask.append(weight > 0)
        stacked = (torch.cat(features, 1), torch.cat(labels, 1), torch.cat(mask, 1))
        return dict(zip(MEMORY, stacked, strict=True))

    def personalized_params(self, clients: Tensor) -> Params:
        params = self.payload(clients)
        return params | self.memory(clients, self.global_state())

    def predict(self, params: Params, x: Tensor) -> Tensor:
        h = self.hp
        glob = {n: t for n, t in params.items() if n not in MEMORY}
        z = self.arch.features(glob, x)
        logits = self.arch.classify(glob, z)
        knn = knn_probabilities(
            z,
            params["memory.features"],
            params["memory.labels"],
            params["memory.mask"],
            h.num_classes,
            h.neighbours,
            h.temperature,
        )
        return interpolate_with_knn(logits, knn, h.knn_weight)
