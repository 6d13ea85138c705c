"""CFL (Sattler, Mueller & Samek, IEEE TNNLS 2020): clustered FL by the cosine similarity of
the clients' updates."""

from __future__ import annotations

from typing import Annotated, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.engine import Params
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    Range,
)

Decay = Annotated[float, Range(gt=0, le=1)]


def optimal_bipartition(similarity: Tensor) -> Tensor:
    """The paper's optimal bipartition of a cluster: ``c_1, c_2 = argmin max_{i in c_1, j in
    c_2} alpha_ij``, found by merging the members in the order of decreasing similarity until
    two groups remain (the minimum-weight edge of the maximum spanning tree is the cut). Returns
    a bool mask of ``c_2`` (member 0 is in ``c_1``); ties go to the earlier pair."""
    m = len(similarity)
    parent = list(range(m))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    rows, cols = torch.triu_indices(m, m, 1, device=similarity.device)
    order = similarity[rows, cols].argsort(descending=True, stable=True)
    groups = m
    for k in order.tolist():
        if groups == 2:
            break
        a, b = root(int(rows[k])), root(int(cols[k]))
        if a != b:
            parent[b] = a
            groups -= 1
    first = root(0)
    return torch.tensor([root(i) != first for i in range(m)], device=similarity.device)


class CFL(FederatedMethod):
    """CFL: clusters of clients split by the cosine similarity of their updates.

    The server keeps one model per cluster (a client's personalized model is its cluster's);
    all clients start in one cluster. Round: each sampled client i trains its cluster's model
    theta_c and uploads the update dtheta_i = theta_i - theta_c. For every cluster c with
    sampled members, with p_i = |D_i| / |D_c| over those members: when the round is at least
    ``split_from_round``, c has more than ``min_cluster_size`` members and

        || sum_i p_i dtheta_i || < eps_1   and   max_i || dtheta_i || > eps_2

    (FedAvg is near a stationary point of the cluster's joint objective while some clients are
    not), c is split by :func:`optimal_bipartition` of the cosine similarities
    alpha_ij = <dtheta_i, dtheta_j> / (||dtheta_i|| ||dtheta_j||) of its members. Then every
    cluster moves by its members' weighted mean update, theta_c += sum_i p_i dtheta_i (both
    halves of a split start from the parent's model); buffers (batch-norm statistics) become the
    members' weighted mean. A cluster without sampled members is unchanged.

    The paper assumes every client takes part in every round. With fewer clients per round,
    the similarities use each member's most recent update (kept per client); members that never
    trained stay in the first half of a split.

    Client SGD as in the authors' code (``fl_devices.py``): each client keeps its optimizer over
    the whole run, so its momentum buffer carries from one of its rounds to the next (the model
    it starts from is still its cluster's), and before each of its rounds multiplies its
    learning rate by ``lr_decay``: its k-th round (k = 1, 2, ...) trains at
    ``local_lr * lr_decay ** k``. The code has every client train every round, where the k-th
    round of a client is round k.

    Args:
        eps_1: epsilon_1, the bound on the norm of the cluster's mean update (the authors' code:
            0.4). Both bounds are on raw parameter updates (the code normalizes nothing), so they
            hold at the code's scale (lr 0.1, one epoch of batch 128, every client every round);
            docs/methods.md has the norms measured on digits.
        eps_2: epsilon_2, the bound the largest client update norm must exceed (the code: 1.6).
        min_cluster_size: a cluster splits only with more members than this (the code: 2).
        split_from_round: no split before this round (the code: 20).
        local_momentum: client SGD momentum (the code's clients,
            ``clustered_federated_learning.ipynb``: SGD with momentum 0.9).
        local_weight_decay: client SGD weight decay (the code: none).
        local_max_grad_norm: client gradient clip (the code: none).
        keep_client_optimizer: each client's momentum buffer persists across its rounds (the
            code: True); False starts a fresh optimizer every round.
        lr_decay: factor on a client's learning rate before each of its rounds (the code: 0.99
            from lr 0.1, so its first round trains at 0.099); 1.0 keeps ``local_lr``.
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    cluster_of: Tensor  # [num_clients] each client's cluster slot
    honours_conditions = True

    def __init__(
        self,
        eps_1: NonNegativeFloat = 0.4,
        eps_2: NonNegativeFloat = 1.6,
        min_cluster_size: NonNegativeInt = 2,
        split_from_round: NonNegativeInt = 20,
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        keep_client_optimizer: bool = True,
        lr_decay: Decay = 0.99,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        n = self.hp.num_clients
        # at most one cluster per client: room for every split without reallocating
        for name, tensor in self.arch.initial_state().items():
            self.register_buffer(_key(name), tensor.expand(n, *tensor.shape).clone())
        self.register_buffer("cluster_of", torch.zeros(n, dtype=torch.long))
        size = sum(torch.Size(s).numel() for s in self.arch.shapes.values())
        self.store.add_field("update", {"delta": torch.zeros(size), "seen": torch.zeros(())})
        if keep_client_optimizer:
            momentum = {n: torch.zeros_like(p) for n, p in self.arch.initial_params().items()}
            self.store.add_field("momentum", momentum)
        if lr_decay != 1.0:
            self.store.add_field("rounds", {"trained": torch.zeros((), dtype=torch.float64)})

    def models(self) -> Params:
        """Every cluster slot's model by tensor name, ``[num_clients, ...]``."""
        return {n: getattr(self, _key(n)) for n in self.arch.initial_state()}

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        cluster = self.cluster_of[clients]
        start = {n: t[cluster] for n, t in self.models().items()}
        h = self.hp
        momentum = (
            self.store.gather("momentum", clients, self.device) if h.keep_client_optimizer else None
        )
        rates = None
        if h.lr_decay != 1.0:
            counted = self.store.gather("rounds", clients, self.device)
            trained = counted["trained"] + 1
            # a round of a client that did not report back is not one of its rounds
            kept = self.where_arrived(clients, round_idx, {"trained": trained}, counted)
            self.store.scatter("rounds", clients, kept)
            # the decayed lr alone: the engine keeps the group's other SGD values
            rates = {"0.lr": (h.local_lr * h.lr_decay**trained).float()}
        params = {n: t.clone() for n, t in start.items()}
        result = self.local_train(params, clients, round_idx, momentum=momentum, rates=rates)
        if h.keep_client_optimizer:
            self.store.scatter("momentum", clients, result.momentum)
        delta = torch.cat(
            [(result.params[n] - start[n]).flatten(1) for n in self.arch.shapes], 1
        ).float()
        arrived = self.arrived(clients, round_idx)
        delta = delta * arrived[:, None].to(delta)  # an update that did not arrive: none
        update = {"delta": delta, "seen": torch.ones(len(clients), device=delta.device)}
        self.scatter_arrived("update", clients, round_idx, update)
        self.split(round_idx, clients, delta)
        weights = self.client_weights(clients, round_idx)
        self.aggregate(self.cluster_of[clients], start, result.params, weights)
        self.record_communication(down=start, up=result.params)
        return result.loss

    @torch.no_grad()
    def split(self, round_idx: int, clients: Tensor, delta: Tensor) -> None:
        """Bipartition every cluster whose round updates meet the eps_1 / eps_2 criterion."""
        h = self.hp
        if round_idx < h.split_from_round:
            return
        n = h.num_clients
        cluster = self.cluster_of[clients]
        weights = self.client_weights(clients, round_idx).double()
        members = F.one_hot(cluster, n).double() * weights[:, None]  # [C, n]
        mass = members.sum(0)
        mean_norm = ((members / mass.clamp_min(1e-300)).T @ delta.double()).norm(dim=1)
        max_norm = torch.zeros(n, dtype=torch.float64, device=delta.device).scatter_reduce(
            0, cluster, delta.double().norm(dim=1), "amax"
        )
        size = torch.bincount(self.cluster_of, minlength=n)
        due = (mass > 0) & (mean_norm < h.eps_1) & (max_norm > h.eps_2)
        due &= size > h.min_cluster_size
        for c in due.nonzero().flatten().tolist():  # server side: one host sync per round
            self.bipartition(c)

    def bipartition(self, c: int) -> None:
        """Split cluster ``c``: the members in ``c_2`` move to a new slot holding a copy of
        ``c``'s model."""
        members = (self.cluster_of == c).nonzero().flatten()
        update = self.store.gather("update", members, self.device)
        known = members[update["seen"] > 0]
        deltas = update["delta"][update["seen"] > 0]
        if len(known) < 2:
            return
        unit = F.normalize(deltas.double(), dim=1, eps=1e-12)
        second = known[optimal_bipartition(unit @ unit.T)]
        new = int(self.cluster_of.max()) + 1
        for tensor in self.models().values():
            tensor[new] = tensor[c]
        self.cluster_of[second] = new

    @torch.no_grad()
    def aggregate(self, cluster: Tensor, start: Params, trained: Params, weights: Tensor) -> None:
        """``theta_c += sum_i p_i dtheta_i`` over each cluster's round members; buffers: their
        weighted mean."""
        members = F.one_hot(cluster, self.hp.num_clients).double() * weights.double()[:, None]
        mass = members.sum(0)
        share = members / mass.clamp_min(1e-300)  # columns of clusters without members: 0
        for name, tensor in self.models().items():
            if name in self.arch.shapes:
                step = torch.einsum("cq,c...->q...", share, (trained[name] - start[name]).double())
                tensor.add_(step.to(tensor.dtype))
            else:
                mean = torch.einsum("cq,c...->q...", share, trained[name].double())
                has = (mass > 0).view(-1, *([1] * (tensor.dim() - 1)))
                tensor.copy_(torch.where(has, mean.to(tensor.dtype), tensor))

    def personalized_params(self, clients: Tensor) -> Params:
        cluster = self.cluster_of[clients]
        return {n: t[cluster] for n, t in self.models().items()}


def _key(name: str) -> str:
    return "cluster_" + name.replace(".", "__")
