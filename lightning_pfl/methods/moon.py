"""MOON (Li, He & Song, CVPR 2021): model-contrastive federated learning."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pfl.engine import (
    Architecture,
    Params,
    TrainResult,
    client_mean,
    prefixed,
    split_prefixed,
    weighted_cross_entropy,
)
from lightning_pfl.losses import weighted_mean
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import NonNegativeFloat, PositiveFloat, PositiveInt

PROJ = "projection."


def model_contrastive_loss(
    z: Tensor, positive: Tensor, negative: Tensor, temperature: float, weight: Tensor
) -> Tensor:
    """-log( e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}) ).

    ``sim`` is the cosine similarity; the weighted mean over the batch is returned.
    """
    sims = torch.stack(
        [F.cosine_similarity(z, positive, dim=-1), F.cosine_similarity(z, negative, dim=-1)], -1
    )
    return weighted_mean(-F.log_softmax(sims.float() / temperature, -1)[..., 0], weight)


class MOON(FedAvg):
    """MOON: FedAvg whose clients add a model-contrastive term to the cross-entropy.

    Client i on a batch: z = proj(features(x)) of the model being trained, z_glob of the
    received global model (positive), z_prev of client i's model after its previous round
    (negative, kept in the client store; the initial model before its first round); loss =
    CE + mu * l_con with :func:`model_contrastive_loss` at temperature tau. The projection
    head (Linear(D, D), ReLU, Linear(D, ``projection_dim``)) is part of the global model and
    averaged with it; the classifier reads the features (the paper's classifier reads the
    projection's output). Evaluation uses the global model, as in the paper.

    Args:
        mu: weight mu of the model-contrastive loss (paper: 5 on CIFAR-10, 1 on CIFAR-100 and
            Tiny-ImageNet).
        temperature: tau (paper: 0.5).
        projection_dim: output size of the projection head (paper: 256).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (paper: SGD lr 0.01,
            momentum 0.9, weight decay 1e-5, batch 64, 10 local epochs).
    """

    def __init__(
        self,
        mu: NonNegativeFloat = 1.0,
        temperature: PositiveFloat = 0.5,
        projection_dim: PositiveInt = 256,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("MOON reads representations")
        weight = next(n for n in self.arch.head_names if n.endswith("weight"))
        dim = self.arch.shapes[weight][1]
        with self.seeded_init():
            self.projection = nn.Sequential(
                nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, projection_dim)
            )
        self.projection_arch = Architecture(self.projection)  # weightless, safe in threads
        self.store.add_field("previous", self.global_state())
        # one object for every round: a recorded round (CUDA graph) is keyed by the loss
        self.client_loss = self.moon_loss

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        params = [*self.net.parameters(), *self.projection.parameters()]
        return torch.optim.SGD(params, lr=h.server_lr, momentum=h.server_momentum)

    def global_state(self) -> Params:
        own = {PROJ + n: p.detach() for n, p in self.projection.named_parameters()}
        return super().global_state() | own

    def aggregate(self, trained: Params, weights: Tensor) -> None:
        super().aggregate(trained, weights)
        for name, p in self.projection.named_parameters():
            p.grad = p.detach() - client_mean(trained[PROJ + name], weights).to(p.dtype)

    def represent(self, params: Params, x: Tensor, train: bool = False) -> tuple[Tensor, Tensor]:
        """Projected representation z and logits of one model (net and projection tensors)."""
        net = {n: t for n, t in params.items() if not n.startswith(PROJ)}
        proj = {n[len(PROJ) :]: t for n, t in params.items() if n.startswith(PROJ)}
        features = self.arch.features(net, x, train=train)
        z = self.projection_arch(proj, features)
        return z, self.arch.classify(net, features)

    def moon_loss(self, params: Params, frozen: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        z, logits = self.represent(params, x, train=True)
        glob, previous = split_prefixed(frozen, "global", "previous")
        z_glob = self.represent(glob, x)[0].detach()
        z_prev = self.represent(previous, x)[0].detach()
        contrastive = model_contrastive_loss(z, z_glob, z_prev, self.hp.temperature, w)
        return weighted_cross_entropy(logits, y, w) + self.hp.mu * contrastive

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        previous = self.store.gather("previous", clients, self.device)
        frozen = prefixed("global", start) | prefixed("previous", previous)
        result = self.local_train(
            {n: t.clone() for n, t in start.items()},
            clients,
            round_idx,
            loss_fn=self.client_loss,
            frozen=frozen,
        )
        self.store.scatter("previous", clients, result.params)
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        params = super().personalized_params(clients)
        return {n: t for n, t in params.items() if not n.startswith(PROJ)}
