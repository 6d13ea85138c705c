"""FedFomo (Zhang et al., ICLR 2021): first-order model optimization for personalized FL."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap

from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.engine import Params, derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.local import Local
from lightning_pfl.streams import FOMO_STREAM
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    UnitInterval,
)


def fomo_weights(own_loss: Tensor, candidate_loss: Tensor, distance: Tensor) -> Tensor:
    """w_ij = max(L_i(theta_i) - L_i(theta_j), 0) / ||theta_j - theta_i||, normalized per row.

    Args:
        own_loss: ``[C]`` validation loss of each client's current model, L_i(theta_i).
        candidate_loss: ``[C, M]`` its validation loss of each downloaded model, L_i(theta_j).
        distance: ``[C, M]`` parameter distances ||theta_j - theta_i||.

    Returns:
        ``[C, M]`` weights; a row sums to one unless no model improves on the client's own,
        then it is all zeros (the client keeps its model).
    """
    gain = (own_loss.unsqueeze(1) - candidate_loss).clamp_min(0.0)
    w = gain / distance.clamp_min(1e-12)
    total = w.sum(1, keepdim=True)
    return torch.where(total > 0, w / total.clamp_min(1e-30), torch.zeros_like(w))


class FedFomo(Local):
    """FedFomo: each client combines the models of the clients that help it most.

    The server keeps every client's latest model theta_j and an affinity matrix P. Round for
    sampled client i: it downloads M = ``models_per_client`` other clients' models, the M with
    the largest P_ij, or with probability epsilon M random ones (epsilon-greedy); it computes
    the weights w_ij of :func:`fomo_weights` from losses on its validation split (held out of its
    training data, never the test split), sets
    theta_i <- theta_i + sum_j w_ij (theta_j - theta_i), trains locally
    (as :class:`~lightning_pfl.methods.local.Local`, momentum kept) and uploads its model;
    the server adds w_ij to P_ij.

    Args:
        models_per_client: models M downloaded per client and round (paper: 5).
        epsilon: initial exploration probability epsilon (paper: 0.3).
        epsilon_decay: epsilon decreases by this much per round, down to 0.
        local_momentum: client SGD momentum (the authors' code, NVlabs/FedFomo: ``--momentum``
            0.0 in its argument defaults and in every command of its README).
        local_weight_decay: client SGD weight decay (the authors' code: ``--weight_decay``
            1e-4, ``federated/args.py``, applied by ``federated/optimizer.py``).
        local_max_grad_norm: client gradient clip (the authors' code: none outside its
            differential-privacy mode).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    honours_conditions = True

    def __init__(
        self,
        models_per_client: PositiveInt = 5,
        epsilon: UnitInterval = 0.3,
        epsilon_decay: NonNegativeFloat = 0.01,
        local_momentum: Momentum = 0.0,
        local_weight_decay: NonNegativeFloat = 1e-4,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        n = self.hp.num_clients
        if n < 2:
            raise ConfigError("FedFomo needs at least 2 clients.")
        self.affinity: Tensor
        self.register_buffer("affinity", torch.zeros(n, n))

    def check_data(self, data: FederatedDataModule) -> None:
        if not data.has_validation:
            raise ConfigError(
                "FedFomo weighs models on the clients' validation split, but "
                "data.init_args.val_fraction is 0 (no validation split): set "
                "data.init_args.val_fraction > 0."
            )

    def choose_models(self, round_idx: int, clients: Tensor) -> Tensor:
        """``[C, M]`` ids of the models each client downloads (never its own)."""
        h = self.hp
        n, m = h.num_clients, min(h.models_per_client, h.num_clients - 1)
        generator = torch.Generator().manual_seed(derive_seed(h.seed, round_idx, FOMO_STREAM))
        epsilon = max(h.epsilon - h.epsilon_decay * round_idx, 0.0)
        explore = torch.rand(len(clients), generator=generator) < epsilon
        affinity = self.affinity[clients].cpu()
        chosen = []
        for row, client in enumerate(clients.tolist()):
            order = torch.randperm(n, generator=generator)  # random ties / random exploration
            order = order[order != client]
            if not explore[row]:
                order = order[torch.sort(-affinity[row, order], stable=True).indices]
            chosen.append(order[:m])
        return torch.stack(chosen).to(self.device)

    @torch.no_grad()
    def validation_losses(self, clients: Tensor, models: list[Params]) -> Tensor:
        """``[C, len(models)]`` mean loss of each of ``models`` (stacked ``[C, ...]``) on the
        clients' validation split."""
        predict = vmap(self.arch)
        sums = torch.zeros(len(clients), len(models), device=self.device)
        count = torch.zeros(len(clients), 1, device=self.device)
        by_size = self.data.by_size(clients, "val")
        models = [by_size.sort(params) for params in models]
        for k, x, y, weight in by_size.blocks(self.hp.eval_batch_size):
            for m, params in enumerate(models):
                logits = predict({n: t[:k] for n, t in params.items()}, x).float()
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
                sums[:k, m] += (loss.view_as(weight) * weight).sum(1)
            count[:k] += weight.sum(1, keepdim=True)
        return by_size.unsort(sums / count.clamp_min(1.0))

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        own = self.store.gather("params", clients, self.device)
        chosen = self.choose_models(round_idx, clients)  # [C, M]
        c, m = chosen.shape
        flat = self.store.gather("params", chosen.flatten(), self.device)
        downloaded = {n: t.view(c, m, *t.shape[1:]) for n, t in flat.items()}
        candidates = [{n: t[:, k] for n, t in downloaded.items()} for k in range(m)]
        losses = self.validation_losses(clients, [own, *candidates])
        trainable = list(self.arch.shapes)
        squared = [
            ((downloaded[n] - own[n].unsqueeze(1)) ** 2).flatten(2).sum(-1) for n in trainable
        ]
        distance = torch.stack(squared).sum(0).sqrt()  # [C, M]
        weights = fomo_weights(losses[:, 0], losses[:, 1:], distance)
        start = {}
        for n, theta in own.items():
            w = weights.view(c, m, *([1] * (theta.dim() - 1))).to(theta.dtype)
            start[n] = theta + (w * (downloaded[n] - theta.unsqueeze(1))).sum(1)
        # the w_ij of a client that did not report back never reach P
        arrived = self.arrived(clients, round_idx).unsqueeze(1)
        self.affinity[clients.unsqueeze(1), chosen] += weights * arrived.to(weights)
        momentum = self.store.gather("momentum", clients, self.device)
        result = self.local_train(start, clients, round_idx, momentum=momentum)
        # nor its combined, untrained theta_i the server's copy: it keeps the one it had
        self.store.scatter(
            "params", clients, self.where_arrived(clients, round_idx, result.params, own)
        )
        self.store.scatter("momentum", clients, result.momentum)
        self.record_communication(down=downloaded, up=result.params)
        return result.loss
