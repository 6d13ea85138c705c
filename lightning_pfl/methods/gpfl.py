"""GPFL (Zhang et al., ICCV 2023): global and personalized feature information through a
Conditional Valve (CoV) and a Global Category Embedding layer (GCE)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pfl.engine import (
    ParamGroup,
    Params,
    SGDConfig,
    TrainResult,
    weighted_cross_entropy,
)
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedproto import feature_dim
from lightning_pfl.validation import NonNegativeFloat

GCE, COV = "gce.", "cov."
CONTEXT = "context."  # per-client conditional inputs (frozen during local training)


def conditional_valve(params: Params, z: Tensor, context: Tensor) -> Tensor:
    """CoV: ``relu(z * (1 + gamma(c)) + beta(c))`` with gamma, beta = LayerNorm(ReLU(W c + b)),
    each its own layer, for the conditional input c (the global g or the personal p_i)."""

    def affine(part: str) -> Tensor:
        h = F.relu(F.linear(context, params[f"{COV}{part}.weight"], params[f"{COV}{part}.bias"]))
        d = h.shape[-1]
        return F.layer_norm(
            h, (d,), params[f"{COV}{part}.ln_weight"], params[f"{COV}{part}.ln_bias"]
        )

    return F.relu(z * (affine("gamma") + 1) + affine("beta"))


def gce_loss(f_global: Tensor, y: Tensor, weight: Tensor, embedding: Tensor) -> Tensor:
    """GCE: cross-entropy of the cosine similarities between the global features and the class
    embeddings (no scale)."""
    cosine = F.normalize(f_global.float(), dim=-1) @ F.normalize(embedding, dim=-1).T
    return weighted_cross_entropy(cosine, y, weight)


def conditional_inputs(embedding: Tensor, proportions: Tensor) -> tuple[Tensor, Tensor]:
    """The global conditional input g = (1/K) sum_c e_c and the personalized one
    p_i = sum_c alpha_{i,c} e_c (alpha_i: client i's training label proportions), from class
    embeddings ``[..., K, D]`` and proportions ``[..., K]``."""
    return embedding.mean(-2), torch.einsum("...k,...kd->...d", proportions, embedding)


class GPFL(FedAvg):
    """GPFL: the feature extractor phi, the CoV and the GCE are shared; the head is personal.

    Client i on a batch: z = phi(x); the personalized route f_P = CoV(z, p_i) feeds the personal
    head (cross-entropy); the global route f_G = CoV(z, g) is trained towards the global
    category embeddings: :func:`gce_loss` plus lambda * ||f_G - E_y||_2 (the Euclidean norm over
    the whole batch; E_y the received GCE's embedding of each label, frozen); the GCE and the
    CoV carry a weight decay mu. The conditional inputs g and p_i (:func:`conditional_inputs`)
    come from the received GCE and the client's label proportions. phi, the GCE and the CoV
    are averaged (sample-weighted, as FedAvg); the head stays on the client. A client predicts
    with its head on CoV(phi(x), p_i) from the current global GCE.

    Args:
        lam: lambda, weight of the distance of the global features to their class embeddings
            (the authors' script for 4-layer CNNs: 0.01).
        mu: mu, weight decay of the GCE and the CoV (the authors' script for 4-layer CNNs: 0.1).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(self, lam: NonNegativeFloat = 0.01, mu: NonNegativeFloat = 0.1, **kwargs: Any):
        super().__init__(**kwargs)
        self.refuse_batch_norm("GPFL conditions the representation")
        d, k = feature_dim(self), self.hp.num_classes
        with self.seeded_init():
            gamma, beta = nn.Linear(d, d), nn.Linear(d, d)
            embedding = nn.Embedding(k, d)
        extra = {f"{GCE}embedding": embedding.weight}
        for part, layer in (("gamma", gamma), ("beta", beta)):
            extra |= {f"{COV}{part}.weight": layer.weight, f"{COV}{part}.bias": layer.bias}
            extra |= {
                f"{COV}{part}.ln_weight": torch.ones(d),
                f"{COV}{part}.ln_bias": torch.zeros(d),
            }
        self.extra = nn.ParameterDict(
            {_key(n): nn.Parameter(t.detach().clone()) for n, t in extra.items()}
        )
        self.extra_names = tuple(extra)
        self.client_loss = self.gpfl_loss  # one object: a recorded round is keyed by it

    def network(self, params: Params) -> Params:
        """The target network's tensors of ``params`` (without the GCE, CoV and inputs)."""
        return {n: t for n, t in params.items() if n in self.arch.shapes}

    def personal_names(self) -> tuple[str, ...]:
        return self.arch.head_names

    def shared_extras(self) -> dict[str, nn.Parameter]:
        """The GCE and CoV modules' tensors."""
        return {n: self.extra[_key(n)] for n in self.extra_names}

    def contexts(self, params: Params, clients: Tensor) -> Params:
        """Conditional inputs from the clients' GCE (``params``, stacked) and label shares."""
        counts = torch.as_tensor(self.data.partition_counts()["train"], dtype=torch.float32)
        shares = counts[clients.cpu()].to(self.device)
        embedding = params[f"{GCE}embedding"]
        generic, personal = conditional_inputs(embedding, shares / shares.sum(1, keepdim=True))
        return {
            f"{CONTEXT}global": generic,
            f"{CONTEXT}personal": personal,
            f"{CONTEXT}embedding": embedding.detach().clone(),
        }

    def gpfl_loss(self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        h = self.hp
        z = self.arch.features(self.network(params), x, train=True)
        f_personal = conditional_valve(params, z, context[f"{CONTEXT}personal"])
        f_global = conditional_valve(params, z, context[f"{CONTEXT}global"])
        ce = weighted_cross_entropy(self.arch.classify(params, f_personal), y, w)
        target = context[f"{CONTEXT}embedding"][y]
        distance = (((f_global - target) ** 2).sum(-1) * w).sum().sqrt()
        return ce + gce_loss(f_global, y, w, params[f"{GCE}embedding"]) + h.lam * distance

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        sgd = self.local_sgd()
        decayed = SGDConfig(sgd.lr, sgd.momentum, self.hp.mu, sgd.max_grad_norm)
        net = tuple(n for n in start if n not in self.extra_names)
        return self.local_train(
            start,
            clients,
            round_idx,
            groups=[ParamGroup(net, sgd), ParamGroup(self.extra_names, decayed)],
            loss_fn=self.client_loss,
            context=self.contexts(start, clients),
        )

    def personalized_params(self, clients: Tensor) -> Params:
        params = super().personalized_params(clients)
        return params | {f"{CONTEXT}personal": self.contexts(params, clients)[f"{CONTEXT}personal"]}

    def predict(self, params: Params, x: Tensor) -> Tensor:
        z = self.arch.features(self.network(params), x)
        return self.arch.classify(
            params, conditional_valve(params, z, params[f"{CONTEXT}personal"])
        )


def _key(name: str) -> str:
    return name.replace(".", "__")
