"""pFedKT (personalized FL via knowledge transfer): local hypernetworks and contrastive KD."""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call, vjp, vmap

from lightning_pfl.engine import Params, TrainResult, weighted_cross_entropy
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.models.chunked_hypernetwork import ChunkedHyperNetwork
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    UnitInterval,
)

Distance = Literal["kl", "cosine", "l2", "mse"]
Ablation = Literal["A", "B", "C", "D"]


def logit_distance(target: Tensor, logits: Tensor, kind: Distance, weight: Tensor) -> Tensor:
    """Weighted batch mean of a per-sample distance from ``target`` logits to ``logits``."""
    if kind == "kl":  # KL(softmax(target) || softmax(logits))
        t = F.log_softmax(target.float(), -1)
        d = (t.exp() * (t - F.log_softmax(logits.float(), -1))).sum(-1)
    elif kind == "cosine":
        d = 1 - F.cosine_similarity(target.float(), logits.float(), dim=-1)
    elif kind == "l2":
        d = (target.float() - logits.float()).norm(dim=-1)
    else:
        d = ((target.float() - logits.float()) ** 2).mean(-1)
    return (d * weight).sum() / weight.sum().clamp_min(1.0)


class PFedKT(FedAvg):
    """pFedKT (Algorithm 1): each client's private model (PM) comes from its own local HN.

    Every client's PM starts as omega^0, the global model's initialization. Round t, sampled
    client i: the server sends the global model w; the client takes its PM theta_i (omega^0 at
    its first visit, HN_i(phi_i) afterwards), trains it E epochs on
    mu * l_con + (1 - mu) * CE with l_con = max(d+ - d- + alpha, 0), d+ = d(global logits, PM
    logits), d- = d(last trained PM's logits, PM logits) on the same batch; keeps the trained
    PM theta~_i (its personalized model and next visit's negative); updates phi_i by one SGD
    step (``hn_lr``) along (grad_phi HN_i)^T (theta_i - theta~_i), by default divided by the
    number of chunks (``hn_reduction``); uploads theta~_i; the server takes the sample-weighted
    FedAvg.

    Args:
        mu: weight of the contrastive loss (paper: 0.001).
        alpha: triplet margin (paper: 0.1 CIFAR-10, 5 CIFAR-100).
        embed_dim: chunk embedding size (paper: 13 = floor(1 + 50 / 4)).
        hn_hidden: hidden widths of the local HN (paper: (100, 100); CIFAR-100 one more layer).
        chunk_size: HN output size per call (paper: 400; set >= the model size for "large").
        hn_lr: local HN learning rate (paper: 5e-3).
        hn_parametrization: ``scaled`` (default, not the paper's): features scaled to a fixed
            mean square and an output layer that starts at the target's init scale
            (:class:`ChunkedHyperNetwork` ``feature_scale`` and ``target_init``); ``paper``:
            PyTorch's default initialization and raw features, whose output has about 4.7x
            omega^0's standard deviation for the Table 2 CNN, the model every later visit
            starts from.
        hn_reduction: how the HN step combines the HN's calls, one per chunk: ``mean``
            (default, not the paper's): the pullback divided by the number of chunks, the
            gradient of 0.5 * (mean over chunks of ||theta_j - theta~_j||^2) from the second
            visit on; ``sum`` (the paper's (grad_phi theta)^T (theta - theta~) as written):
            the layers every chunk shares take the sum over all chunks, so the step grows
            with the number of chunks: for the CNN on FashionMNIST (2,882 chunks) hn_lr times
            the largest eigenvalue of J J^T is 244 at 5e-3, far above the 2 a stable step
            needs (``mean``: 0.085, and 0.0074 with the ``scaled`` HN, so the HN barely moves
            at the paper's 5e-3).
        chunk_embeddings: ``fixed`` (paper size, Appendix F.1: the HN is its MLP alone) or
            ``learned`` (one more learnable vector of ``embed_dim`` per chunk).
        contrastive: ``triplet`` (paper); the other losses of its Table 10 in the same
            mu * l_con + (1 - mu) * CE: ``moon`` (l_con = -log softmax of (-d+, -d-) at
            ``temperature``, MOON-style) and ``l2`` (l_con = ||theta - w||^2 over all
            parameters).
        distance: d of the triplet/MOON loss: ``kl`` (paper), ``cosine`` (1 - cos), ``l2``
            (Euclidean), ``mse`` (Table 10).
        temperature: temperature of the MOON-style loss.
        ablation: the cases of Table 11: ``A`` FedAvg (no HN, no l_con: the client trains the
            received global model on CE); ``B`` HN only (PMs from local HNs, CE); ``C`` l_con
            only (the client trains the received global model on mu * l_con + (1 - mu) * CE,
            its last trained model as negative); ``D`` pFedKT.
        no_hn_model: the model cases A and C are evaluated with: ``global`` (the server's
            model, FedAvg's own evaluation; case A is FedAvg's Table 1 number) or ``private``
            (each client's last trained model, omega^0 before its first visit).
        local_epochs: local epochs E per round (paper: 10, 50 or 100).
        local_lr: client SGD learning rate (paper: 1e-2).
        local_max_grad_norm: client gradient clip (paper: none).
        local_momentum: client SGD momentum (paper: 0.9).
        local_weight_decay: client SGD weight decay (paper: 5e-5).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (paper: batch 64,
            ``clients_per_round`` = 10% of clients).
    """

    honours_conditions = True

    def __init__(
        self,
        mu: UnitInterval = 0.001,
        alpha: NonNegativeFloat = 0.1,
        embed_dim: PositiveInt = 13,
        hn_hidden: tuple[PositiveInt, ...] = (100, 100),
        chunk_size: PositiveInt = 400,
        hn_lr: PositiveFloat = 5e-3,
        hn_parametrization: Literal["paper", "scaled"] = "scaled",
        hn_reduction: Literal["sum", "mean"] = "mean",
        chunk_embeddings: Literal["fixed", "learned"] = "fixed",
        contrastive: Literal["triplet", "moon", "l2"] = "triplet",
        distance: Distance = "kl",
        temperature: PositiveFloat = 0.5,
        ablation: Ablation = "D",
        no_hn_model: Literal["global", "private"] = "global",
        local_epochs: PositiveInt | None = 10,
        local_lr: PositiveFloat = 1e-2,
        local_max_grad_norm: PositiveFloat | None = None,
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 5e-5,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_epochs=local_epochs,
            local_lr=local_lr,
            local_max_grad_norm=local_max_grad_norm,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            **kwargs,
        )
        self.refuse_batch_norm("pFedKT generates whole models")
        self.uses_hn = ablation in ("B", "D")
        self.uses_con = ablation in ("C", "D")
        self.keeps_pm = self.uses_hn or self.uses_con or no_hn_model == "private"
        if self.uses_hn:
            scaled = hn_parametrization == "scaled"
            with self.seeded_init():
                hn = ChunkedHyperNetwork(
                    self.arch.shapes,
                    embed_dim,
                    hn_hidden,
                    chunk_size,
                    self.arch.initial_params() if scaled else None,
                    feature_scale=scaled,
                    learnable_embeddings=chunk_embeddings == "learned",
                )
            # A list keeps the weightless template off the module tree (and off .to(device));
            # its buffers (fixed embeddings, feature scale), the same for every client's HN,
            # are this module's buffers so that they move and are checkpointed with it.
            self._hn_template = [copy.deepcopy(hn).to("meta")]
            self._hn_buffer_names = [name for name, _ in hn.named_buffers()]
            for i, (_, buffer) in enumerate(hn.named_buffers()):
                self.register_buffer(f"hn_buffer_{i}", buffer.clone())
            self.store.add_field("hn", dict(hn.named_parameters()))
            self.store.add_field("visited", {"visited": torch.tensor(False)})
        if self.keeps_pm:
            self.store.add_field("pm", self.arch.initial_params())

    def generate(self, hn_params: Params) -> Tensor:
        """The flat PM of one client from its HN parameters (vmapped over clients)."""
        buffers = {
            name: getattr(self, f"hn_buffer_{i}") for i, name in enumerate(self._hn_buffer_names)
        }
        return functional_call(self._hn_template[0], {**hn_params, **buffers}, ())

    def kt_loss(self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        h = self.hp
        logits = self.arch(params, x, train=True)
        ce = weighted_cross_entropy(logits, y, w)
        if not self.uses_con:
            return ce
        global_params = {n[7:]: t for n, t in context.items() if n.startswith("global.")}
        if h.contrastive == "l2":
            l_con = torch.stack([((params[n] - global_params[n]) ** 2).sum() for n in params]).sum()
        else:
            previous = {n[5:]: t for n, t in context.items() if n.startswith("prev.")}
            positive = logit_distance(self.arch(global_params, x).detach(), logits, h.distance, w)
            negative = logit_distance(self.arch(previous, x).detach(), logits, h.distance, w)
            if h.contrastive == "triplet":
                l_con = F.relu(positive - negative + h.alpha)
            else:
                pair = torch.stack([-positive, -negative]) / h.temperature
                l_con = -F.log_softmax(pair, 0)[0]
        return h.mu * l_con + (1 - h.mu) * ce

    def private_start(self, clients: Tensor, stored: Params) -> tuple[Params, Params]:
        """Each client's PM to train (its stored PM, omega^0, at its first visit; HN_i(phi_i)
        afterwards) and its HN parameters."""
        hn = self.store.gather("hn", clients, self.device)
        generated = self._hn_template[0].unflatten(vmap(self.generate)(hn))
        visited = self.store.gather("visited", clients, self.device)["visited"]
        start = {
            n: torch.where(visited.view(-1, *([1] * (t.dim() - 1))), t, stored[n])
            for n, t in generated.items()
        }
        return start, hn

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        """Train each PM against the received global model, then update the local HNs."""
        stored = self.store.gather("pm", clients, self.device) if self.keeps_pm else {}
        hn: Params = {}
        if self.uses_hn:
            pm, hn = self.private_start(clients, stored)
        else:
            pm = start
        context = {f"global.{n}": t for n, t in start.items()}
        if self.uses_con:
            context |= {f"prev.{n}": t for n, t in stored.items()}
        result = self.local_train(
            {n: t.clone() for n, t in pm.items()},
            clients,
            round_idx,
            loss_fn=self.kt_loss,
            context=context,
        )
        if self.uses_hn:
            names = list(self.arch.shapes)
            delta = torch.cat([(pm[n] - result.params[n]).flatten(1) for n in names], 1)
            self.store.scatter(
                "hn", clients, self.where_arrived(clients, round_idx, self.hn_step(hn, delta), hn)
            )
            visited = self.store.gather("visited", clients, self.device)["visited"]
            visited = visited | self.arrived(clients, round_idx)
            self.store.scatter("visited", clients, {"visited": visited})
        if self.keeps_pm:
            trained = {n: result.params[n] for n in self.arch.shapes}
            self.store.scatter(
                "pm", clients, self.where_arrived(clients, round_idx, trained, stored)
            )
        return result

    def hn_step(self, hn: Params, delta: Tensor) -> Params:
        """The clients' HN parameters after one SGD step along the pullback of ``delta``
        (theta_i - theta~_i, flat, one row per client), reduced over chunks by
        ``hn_reduction``."""
        h = self.hp
        if h.hn_reduction == "mean":
            delta = delta / self._hn_template[0].num_chunks
        grads = self.hypernetwork_gradients(hn, delta)
        return {k: hn[k] - h.hn_lr * grads[k] for k in hn}

    def hypernetwork_gradients(self, hn: Params, delta: Tensor) -> Params:
        """Per client: (grad_phi theta)^T delta (at the HN's current output, the gradient of
        0.5 ||theta(phi) - theta~||^2 when delta = theta(phi) - theta~)."""

        def one(params: Params, d: Tensor) -> Params:
            pullback = vjp(self.generate, params)[1]
            return pullback(d)[0]

        return vmap(one)(hn, delta)

    def personalized_params(self, clients: Tensor) -> Params:
        if self.uses_hn or self.hp.no_hn_model == "private":
            return self.store.gather("pm", clients, self.device)
        return super().personalized_params(clients)
