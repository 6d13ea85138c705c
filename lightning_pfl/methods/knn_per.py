"""kNN-Per (Marfoq et al., 2022): FedAvg's model interpolated with a local kNN memory."""

from __future__ import annotations

from typing import Annotated, Any

import torch
from torch import Tensor
from torch.func import vmap

from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.engine import Params
from lightning_pfl.errors import ConfigError
from lightning_pfl.losses import interpolate_with_knn, knn_probabilities
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import PositiveFloat, PositiveInt, Range, UnitInterval

MEMORY = ("memory.features", "memory.labels", "memory.mask")
WEIGHT = "memory.knn_weight"  # lambda_m of each client, ``[C]``


class KNNPer(FedAvg):
    """kNN-Per: a FedAvg global model plus, on each client, a kNN memory of its training data.

    Training is FedAvg. For evaluation, each client m stores the global model's features
    (the classifier's input) of all its training samples with their labels, and predicts
    ``lambda_m * p_kNN(y | x) + (1 - lambda_m) * p_global(y | x)``, where p_kNN weights the k
    nearest stored features (squared Euclidean distance d) by ``exp(-d / T)``, normalized over
    the k (:func:`~lightning_pfl.losses.knn_probabilities`); T defaults to the feature
    dimension D, as the authors' code (``client.py``, ``gather_knn_outputs``). The memory is
    rebuilt from the current global model at every evaluation; nothing is sent besides FedAvg's
    model.

    lambda_m is chosen per client on its own validation split, as in the paper (each client's
    held-out validation data; the authors' code scores lambda on a grid of step 0.01): the
    grid value with the highest validation accuracy of the interpolated prediction, ties
    going to the lowest validation cross-entropy, then to the smaller lambda. The test split
    never enters the choice. It is made again at every evaluation, for the model and memory
    being evaluated.

    Args:
        knn_weight: lambda_m, weight of the kNN probabilities. None (paper): chosen per client
            on its validation split (needs ``data.init_args.val_fraction > 0``); a number:
            that lambda for every client.
        knn_weight_grid: G, how many evenly spaced values of lambda in [0, 1] are scored
            (101: the authors' step of 0.01).
        neighbours: k, stored samples voting per prediction (paper: 10).
        temperature: T of the Gaussian kernel ``exp(-d / T)`` on the squared Euclidean
            distances d of the k neighbours (their weights are normalized to sum to one).
            None (the authors' code, ``exp(-d / (D * scale))`` with its default scale 1): T = D,
            the dimension of the global model's features; a number: that T (1.0 was this
            library's former default, under which the kNN probabilities are one-hot on digits).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        knn_weight: UnitInterval | None = None,
        knn_weight_grid: Annotated[int, Range(ge=2)] = 101,
        neighbours: PositiveInt = 10,
        temperature: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    def check_data(self, data: FederatedDataModule) -> None:
        """Refuse a per-client lambda when the clients have no validation split."""
        if self.hp.knn_weight is None and not data.has_validation:
            raise ConfigError(
                "model.init_args.knn_weight is null: kNN-Per chooses each client's lambda on "
                "its validation split, but data.init_args.val_fraction is 0 (no validation "
                "split); set data.init_args.val_fraction > 0, or knn_weight to one lambda in "
                "[0, 1] for every client (e.g. 0.5)."
            )

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

    def outputs(self, params: Params, x: Tensor) -> tuple[Tensor, Tensor]:
        """One client's global-model logits and kNN probabilities of the batch ``x``."""
        h = self.hp
        glob = {n: t for n, t in params.items() if n not in MEMORY and n != WEIGHT}
        z = self.arch.features(glob, x)
        knn = knn_probabilities(
            z,
            params["memory.features"],
            params["memory.labels"],
            params["memory.mask"],
            h.num_classes,
            h.neighbours,
            z.shape[-1] if h.temperature is None else h.temperature,
        )
        return self.arch.classify(glob, z), knn

    @torch.no_grad()
    def tuned_weights(self, clients: Tensor, params: Params) -> Tensor:
        """``[C]`` lambda_m of each client: the grid value whose interpolated prediction is
        best on the client's validation split (accuracy, then cross-entropy, then smaller)."""
        size = self.hp.knn_weight_grid
        grid = [g / (size - 1) for g in range(size)]
        hits = torch.zeros(len(grid), len(clients), device=self.device)
        loss = torch.zeros(len(grid), len(clients), device=self.device)
        outputs = vmap(self.outputs)
        for index, weight in self.data.eval_blocks(clients, "val", self.hp.eval_batch_size):
            x, y = self.data.fetch(index)
            logits, knn = outputs(params, x)
            for g, knn_weight in enumerate(grid):
                log_p = interpolate_with_knn(logits, knn, knn_weight)
                hits[g] += ((log_p.argmax(-1) == y) * weight).sum(1)
                loss[g] -= (log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1) * weight).sum(1)
        best = hits == hits.max(0, keepdim=True).values
        choice = torch.where(best, loss, torch.full_like(loss, float("inf"))).argmin(0)
        return torch.tensor(grid, device=self.device)[choice]

    def personalized_params(self, clients: Tensor) -> Params:
        params = self.payload(clients) | self.memory(clients, self.global_state())
        if self.hp.knn_weight is not None:
            weight = torch.full((len(clients),), self.hp.knn_weight, device=self.device)
        else:
            weight = self.tuned_weights(clients, params)
        return params | {WEIGHT: weight}

    def predict(self, params: Params, x: Tensor) -> Tensor:
        logits, knn = self.outputs(params, x)
        return interpolate_with_knn(logits, knn, params[WEIGHT])
