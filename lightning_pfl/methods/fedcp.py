"""FedCP (Zhang et al., KDD 2023): a conditional policy network splits each feature vector into
a global and a personalized part."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pfl.engine import Params, weighted_cross_entropy
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedproto import feature_dim
from lightning_pfl.privacy import privatizes
from lightning_pfl.validation import NonNegativeFloat, PositiveFloat

CPN, GLOBAL, FROZEN, CONTEXT = "cpn.", "global_head.", "global_body.", "context"
BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # the authors' RBF kernels of the MMD


def policy(params: Params, gate_in: Tensor, tau: float, noise: bool) -> tuple[Tensor, Tensor]:
    """The CPN: ``ReLU(LayerNorm(W x + b))`` reshaped to two scores per feature dimension, then
    (Gumbel-)softmax over the two: the personalized and the global share r, s (r + s = 1)."""
    h = F.linear(gate_in, params[f"{CPN}weight"], params[f"{CPN}bias"])
    h = F.relu(F.layer_norm(h, h.shape[-1:], params[f"{CPN}ln_weight"], params[f"{CPN}ln_bias"]))
    scores = h.unflatten(-1, (2, -1))
    if noise:
        uniform = torch.rand_like(scores)
        scores = scores - torch.log(-torch.log(uniform + 1e-20) + 1e-20)
    shares = torch.softmax(scores / tau, dim=-2)
    return shares[..., 0, :], shares[..., 1, :]


def rbf_mmd(a: Tensor, b: Tensor, weight: Tensor) -> Tensor:
    """The biased MMD^2 estimate mean(k(a, a') + k(b, b') - 2 k(a, b)) over the weighted pairs,
    k = sum over the bandwidths s of exp(-||u - v||^2 / (2 s))."""

    def kernel(u: Tensor, v: Tensor) -> Tensor:
        d = (u * u).sum(-1)[:, None] + (v * v).sum(-1)[None, :] - 2 * u @ v.T
        return sum(torch.exp(-0.5 * d / s) for s in BANDWIDTHS)  # type: ignore[return-value]

    pairs = weight[:, None] * weight[None, :]
    total = kernel(a, a) + kernel(b, b) - 2 * kernel(a, b)
    return (total * pairs).sum() / pairs.sum().clamp_min(1.0)


class FedCP(FedAvg):
    """FedCP: Federated Conditional Policy.

    Client i's model: the feature extractor phi (shared), the conditional policy network CPN
    (shared), a personalized head (kept by the client) and the global head (received, frozen
    during local training). On a batch: h = phi(x); the CPN reads h * v_i / ||v_i|| (v_i: the
    client's context, the column sums of its personalized head's weight, refreshed after each
    of its rounds; uniform random before the first) and gives per-dimension shares r, s with
    r + s = 1 (:func:`policy`, Gumbel-softmax at temperature ``tau`` in training, plain
    softmax at evaluation); the output is head_p(h * r) + head_g(h * s). The loss is the
    cross-entropy plus lambda * MMD(h, phi_g(x)) (:func:`rbf_mmd`), phi_g the received extractor
    (frozen). The client uploads phi, the CPN and (head_p + head_g) / 2; the server averages
    them (sample-weighted) into the next phi, CPN and global head.

    Args:
        lam: lambda, weight of the MMD between the local and the global features (the authors'
            script: 5).
        tau: Gumbel-softmax temperature (the authors' code: 1).
        gumbel_noise: draw Gumbel noise in training (the authors' code); false: the plain
            softmax in training too.
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        lam: NonNegativeFloat = 5.0,
        tau: PositiveFloat = 1.0,
        gumbel_noise: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("FedCP splits the representation")
        d, n = feature_dim(self), self.hp.num_clients
        with self.seeded_init():
            layer = nn.Linear(d, 2 * d)
            context = torch.rand(n, d)
        cpn = {"weight": layer.weight, "bias": layer.bias}
        cpn |= {"ln_weight": torch.ones(2 * d), "ln_bias": torch.zeros(2 * d)}
        self.cpn = nn.ParameterDict({k: nn.Parameter(t.detach().clone()) for k, t in cpn.items()})
        head = {n: t for n, t in self.arch.initial_params().items() if n in self.arch.head_names}
        self.store.add_field("personal", head | {CONTEXT: torch.zeros(d)})
        self.store.scatter("personal", torch.arange(n), {CONTEXT: context})
        self.body = tuple(n for n in self.arch.shapes if n not in self.arch.head_names)
        if gumbel_noise:
            # the policy draws random numbers: clients may not share a thread's generator
            self.arch.stochastic = True
            threads = self.hp.client_threads
            if threads is not None and threads > 1:
                raise ConfigError(
                    f"model.init_args.client_threads = {threads} trains clients concurrently, "
                    "which needs a client step without random numbers, and FedCP's policy draws "
                    "Gumbel noise; use client_threads 1 or null, or gumbel_noise: false."
                )
        self.client_loss = self.policy_loss  # one object: a recorded round is keyed by it

    def shared_extras(self) -> dict[str, nn.Parameter]:
        """The conditional policy network."""
        return {f"{CPN}{k}": p for k, p in self.cpn.items()}

    def outputs(self, params: Params, x: Tensor, noise: bool, train: bool = False) -> Tensor:
        """head_p(h * r) + head_g(h * s) for one client (``params``: its model, the global head
        under ``global_head.``, its context)."""
        h = self.arch.features({n: params[n] for n in self.body}, x, train=train)
        gate_in = h * F.normalize(params[CONTEXT], dim=-1)
        r, s = policy(params, gate_in, self.hp.tau, noise)
        global_head = {n: params[GLOBAL + n] for n in self.arch.head_names}
        return self.arch.classify(params, h * r) + self.arch.classify(global_head, h * s)

    def policy_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor:
        h = self.hp
        logits = self.outputs(params | context, x, h.gumbel_noise, train=True)
        local = self.arch.features({n: params[n] for n in self.body}, x, train=True)
        reference = self.arch.features({n: context[FROZEN + n] for n in self.body}, x)
        return weighted_cross_entropy(logits, y, w) + h.lam * rbf_mmd(local, reference, w)

    @privatizes(
        "the update of everything the client uploads (phi, the CPN and (head_p + head_g) / 2 "
        "minus head_g), clipped as one vector"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        state = self.global_state()
        sent = {n: t.expand(len(clients), *t.shape) for n, t in state.items()}
        own = self.store.gather("personal", clients, self.device)
        shared = tuple(n for n in sent if n not in self.arch.head_names)
        start = {n: sent[n].clone() for n in shared} | {n: own[n] for n in self.arch.head_names}
        context = {GLOBAL + n: sent[n] for n in self.arch.head_names}
        context |= {FROZEN + n: sent[n] for n in self.body} | {CONTEXT: own[CONTEXT]}
        result = self.local_train(
            start, clients, round_idx, loss_fn=self.client_loss, context=context
        )
        heads = {n: result.params[n] for n in self.arch.head_names}
        weight = next(n for n in self.arch.head_names if n.endswith("weight"))
        kept = heads | {CONTEXT: heads[weight].sum(1)}
        self.store.scatter("personal", clients, self.where_arrived(clients, round_idx, kept, own))
        uploaded = {n: result.params[n] for n in shared}
        uploaded |= {n: 0.5 * (heads[n] + sent[n]) for n in self.arch.head_names}
        if self.client_dp is None:
            if not self.nothing_arrived(clients, round_idx):
                self.aggregate(uploaded, self.client_weights(clients, round_idx))
        else:  # as FedAvg's
            self.aggregate(*self.dp_uploads(round_idx, sent, uploaded))
        self.record_communication(down=sent, up=uploaded)
        return result.loss

    def personalized_params(self, clients: Tensor) -> Params:
        state = self.global_state()
        own = self.store.gather("personal", clients, self.device)
        params = {n: t.expand(len(clients), *t.shape) for n, t in state.items()}
        params |= {GLOBAL + n: params[n] for n in self.arch.head_names}
        return params | own

    def predict(self, params: Params, x: Tensor) -> Tensor:
        return self.outputs(params, x, noise=False)
