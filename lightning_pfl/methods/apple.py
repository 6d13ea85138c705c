"""APPLE (Luo & Wu, IJCAI 2022): personalized models as learned mixtures of core models."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_pfl.engine import ParamGroup, Params, SGDConfig, weighted_cross_entropy
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.models import build_network
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat, PositiveInt

CORES, SELF, P0, COEF, P = "cores.", "self", "p0", "coef", "p"
EXPONENTIAL_FLOOR = 1e-3  # the exponential schedule's lambda at r = L (reference code's epsilon)


def regularization_weight(
    schedule: Literal["cosine", "exponential"], round_idx: int, decay_rounds: int
) -> float:
    """lambda(r): from 1 at r = 0 down to 0 at r = L (0 from then on).

    ``cosine``: (cos(pi r / L) + 1) / 2; ``exponential``: 0.001^(r / L) (the reference code's).
    """
    if round_idx >= decay_rounds:
        return 0.0
    if schedule == "cosine":
        return (math.cos(math.pi * round_idx / decay_rounds) + 1) / 2
    return float(EXPONENTIAL_FLOOR ** (round_idx / decay_rounds))


class APPLE(FederatedMethod):
    """APPLE: every client's model is sum_j p_ij w_j over all clients' core models w_j; each
    client learns its own core model w_i and its directed-relationship vector p_i.

    The server keeps every client's core model (initialized independently, as in the
    reference code, where every client knows all of them from the start). Round for a
    sampled client i: it downloads every core model; at each local step, on one batch, it
    trains its core model w_i and p_i on
    L_i(sum_j p_ij w_j) + lambda(r) mu ||p_i - p^0||^2 (the other clients' core models fixed;
    w_i gets the gradient p_ii dL/dw_p, p_ij gets <dL/dw_p, w_j>), with fresh SGD: the local
    settings for w_i, ``dr_lr`` (with the local momentum) for p_i, which is not constrained.
    p^0 (also p_i's start) is every client's share of the training samples; lambda(r) decays
    from 1 to 0 over the first L rounds (:func:`regularization_weight`), pulling p_i to p^0
    early (global, FedAvg-like) and leaving it free later (local). It uploads w_i.

    Personalized model of client i: sum_j p_ij w_j with the server's current core models.

    Args:
        dr_lr: learning rate of the directed relationships p_i (reference code: 0.001, a
            tenth of its core-model rate).
        mu: mu, the weight of the regularizer (reference code: 0.1).
        schedule: the shape of lambda(r): ``exponential`` (the reference code's default) or
            ``cosine``.
        decay_rounds: L, the rounds over which lambda(r) decays (None: 10% of
            ``trainer.max_steps``, the reference code's default).
        local_momentum: SGD momentum of w_i and p_i (the reference code, ljaiverson/pFL-APPLE
            ``train_APPLE.py``: one SGD with momentum 0.9 for both).
        local_weight_decay: weight decay of w_i (the reference code: none).
        local_max_grad_norm: per-step gradient-norm clip of w_i (the reference code: none).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    honours_conditions = True

    def __init__(
        self,
        dr_lr: PositiveFloat = 1e-3,
        mu: NonNegativeFloat = 0.1,
        schedule: Literal["exponential", "cosine"] = "exponential",
        decay_rounds: PositiveInt | None = None,
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        h = self.hp
        self.refuse_batch_norm("APPLE combines model weights")
        self.store.add_field("core", self.arch.initial_params())
        cores = self.store.fields["core"]
        with self.seeded_init():
            for j in range(h.num_clients):
                net = build_network(h.net, h.input_shape, h.num_classes, **(h.net_args or {}))
                for name, tensor in net.named_parameters():
                    cores[name][j] = tensor.detach()
        self.store.add_field("p_shift", {P: torch.zeros(h.num_clients)})  # p_i - p^0
        # one object for every round: a recorded round (CUDA graph) is keyed by the loss
        self.client_loss = self.apple_loss

    def initial_relationships(self) -> Tensor:
        """p^0: every client's share of the training samples, ``[n]``."""
        return self.client_weights(torch.arange(self.hp.num_clients, device=self.device)).float()

    def apple_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor:
        p, own = params[P], context[SELF]
        others, mine = p * (1 - own), (p * own).sum()
        model = {
            n: torch.tensordot(others, context[CORES + n], dims=1) + mine * params[n]
            for n in self.arch.shapes
        }
        logits = self.arch(model, x, train=True)
        return weighted_cross_entropy(logits, y, w) + context[COEF] * (p - context[P0]).pow(2).sum()

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        h = self.hp
        every = torch.arange(h.num_clients, device=self.device)
        cores = self.store.gather("core", every, self.device)
        p0 = self.initial_relationships()
        size = len(clients)
        decay = h.decay_rounds or max(int(0.1 * self._max_rounds()), 1)
        coef = h.mu * regularization_weight(h.schedule, round_idx, decay)
        context = {CORES + n: t.expand(size, *t.shape) for n, t in cores.items()}
        context[SELF] = (clients.view(-1, 1) == every).float()
        context[P0] = p0.expand(size, -1)
        context[COEF] = torch.full((size,), coef, device=self.device)
        own = {n: t[clients].clone() for n, t in cores.items()}
        shift = self.store.gather("p_shift", clients, self.device)
        p = p0 + shift[P]
        groups = [
            ParamGroup(tuple(own), self.local_sgd()),
            ParamGroup((P,), SGDConfig(h.dr_lr, h.local_momentum)),
        ]
        result = self.local_train(
            {**own, P: p},
            clients,
            round_idx,
            groups=groups,
            loss_fn=self.client_loss,
            context=context,
        )
        # a client that did not report back keeps w_i and p_i - p^0 bit for bit
        trained = {n: result.params[n] for n in own}
        self.store.scatter("core", clients, self.where_arrived(clients, round_idx, trained, own))
        new_shift = {P: result.params[P] - p0}
        self.store.scatter(
            "p_shift", clients, self.where_arrived(clients, round_idx, new_shift, shift)
        )
        downloaded = {n: context[CORES + n] for n in own}
        self.record_communication(down=downloaded, up={n: result.params[n] for n in own})
        return result.loss

    def _max_rounds(self) -> int:
        return int(self.trainer.max_steps) if self._trainer is not None else 1

    def personalized_params(self, clients: Tensor) -> Params:
        every = torch.arange(self.hp.num_clients, device=self.device)
        cores = self.store.gather("core", every, self.device)
        p = self.initial_relationships() + self.store.gather("p_shift", clients, self.device)[P]
        return {n: (p @ t.flatten(1)).view(len(clients), *t.shape[1:]) for n, t in cores.items()}
