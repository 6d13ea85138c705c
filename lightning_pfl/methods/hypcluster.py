"""HypCluster (Mansour et al., 2020): k cluster models, each client joins its best one."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pfl.architecture import drop_batch_counters
from lightning_pfl.engine import Params
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.models import build_network
from lightning_pfl.validation import Momentum, PositiveFloat, PositiveInt


class HypCluster(FederatedMethod):
    """HypCluster: the server keeps q hypotheses (cluster models); clients join the best one.

    Round: the server sends all q models to the sampled clients; each client picks the model
    with the lowest mean cross-entropy on its training data (eval mode; ties to the lower
    index), trains it locally and uploads it; each cluster model becomes the sample-weighted
    mean of the models its members uploaded (pseudo-gradient ``w_j - mean_j`` with the server
    SGD, as FedAvg; a cluster without members this round is left unchanged). The q models
    start from different seeded initializations. The personalized model of a client is the
    cluster model with the lowest loss on its training data, chosen again at evaluation.

    Args:
        num_hypotheses: q, the number of cluster models (the paper's experiments: 2 to 4).
        server_lr: server learning rate (1 = plain averaging within a cluster).
        server_momentum: server momentum (0 = plain averaging).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    honours_conditions = True

    def __init__(
        self,
        num_hypotheses: PositiveInt = 2,
        server_lr: PositiveFloat = 1.0,
        server_momentum: Momentum = 0.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        h = self.hp
        with self.seeded_init():
            nets = [
                drop_batch_counters(
                    build_network(h.net, h.input_shape, h.num_classes, **(h.net_args or {}))
                )
                for _ in range(num_hypotheses)
            ]
        states = [net.state_dict() for net in nets]
        self.clusters = nn.ParameterDict()
        for name in self.arch.shapes:
            self.clusters[_key(name)] = nn.Parameter(torch.stack([s[name] for s in states]))
        for name in self.arch.buffer_shapes:
            self.register_buffer(f"cluster_{_key(name)}", torch.stack([s[name] for s in states]))

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        return torch.optim.SGD(
            self.clusters.parameters(), lr=h.server_lr, momentum=h.server_momentum
        )

    def models(self) -> Params:
        """The q cluster models by tensor name, stacked ``[q, ...]`` (detached)."""
        models = {n: self.clusters[_key(n)].detach() for n in self.arch.shapes}
        return models | {n: getattr(self, f"cluster_{_key(n)}") for n in self.arch.buffer_shapes}

    @torch.no_grad()
    def cluster_losses(self, clients: Tensor) -> Tensor:
        """``[C, q]`` mean cross-entropy of every cluster model on each client's training data."""
        models = self.models()
        q = self.hp.num_hypotheses
        loss_sum = torch.zeros(len(clients), q, device=self.device)
        total = torch.zeros(len(clients), 1, device=self.device)
        by_size = self.data.by_size(clients, "train")
        for k, x, y, weight in by_size.blocks(self.hp.eval_batch_size):
            for j in range(q):
                logits = self.arch({n: t[j] for n, t in models.items()}, x.flatten(0, 1))
                loss = F.cross_entropy(logits.float(), y.flatten(), reduction="none")
                loss_sum[:k, j] += (loss.view_as(weight) * weight).sum(1)
            total[:k, 0] += weight.sum(1)
        return by_size.unsort(loss_sum / total.clamp_min(1.0))

    def assign(self, clients: Tensor) -> Tensor:
        """The cluster of each client: the model with the lowest training loss."""
        return self.cluster_losses(clients).argmin(1)

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        models = self.models()
        cluster = self.assign(clients)
        start = {n: t[cluster].clone() for n, t in models.items()}
        result = self.local_train(start, clients, round_idx)
        if not self.nothing_arrived(clients, round_idx):
            self.aggregate(result.params, cluster, self.client_weights(clients, round_idx))
        sent = {n: t.expand(len(clients), *t.shape) for n, t in models.items()}  # all q models
        self.record_communication(down=sent, up=result.params)
        return result.loss

    def aggregate(self, trained: Params, cluster: Tensor, weights: Tensor) -> None:
        """Each cluster model moves to the weighted mean of its members' models (if any)."""
        q = self.hp.num_hypotheses
        members = F.one_hot(cluster, q).double() * weights.double().view(-1, 1)  # [C, q]
        mass = members.sum(0)  # [q]
        share = members / mass.clamp_min(1e-300)

        def where_members(new: Tensor, old: Tensor) -> Tensor:
            return torch.where((mass > 0).view(-1, *([1] * (old.dim() - 1))), new, old)

        def mean(name: str, like: Tensor) -> Tensor:
            return torch.einsum("cq,c...->q...", share, trained[name].double()).to(like.dtype)

        for name in self.arch.shapes:
            p = self.clusters[_key(name)]
            p.grad = where_members(p.detach() - mean(name, p), torch.zeros_like(p))
        for name in self.arch.buffer_shapes:
            b = getattr(self, f"cluster_{_key(name)}")
            b.copy_(where_members(mean(name, b), b))

    def personalized_params(self, clients: Tensor) -> Params:
        cluster = self.assign(clients)
        return {n: t[cluster] for n, t in self.models().items()}


def _key(name: str) -> str:
    return name.replace(".", "__")
