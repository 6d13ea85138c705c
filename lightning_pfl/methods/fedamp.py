"""FedAMP (Huang et al., AAAI 2021): federated attentive message passing."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import Params
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.methods.fedprox import anchor, proximal_loss
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat


def attention_weights(squared_distance: Tensor, own: Tensor, alpha: float, sigma: float) -> Tensor:
    """FedAMP's message-passing weights xi of the round's clients over every client.

    xi_ij = alpha_k A'(||w_i - w_j||^2) for j != i and xi_ii = 1 - sum_{j != i} xi_ij, with
    the attention function A(x) = 1 - exp(-x / sigma), A'(x) = exp(-x / sigma) / sigma.

    Args:
        squared_distance: ``[C, n]`` ||w_i - w_j||^2 of each round client i to every client j.
        own: ``[C, n]`` True at (i, i).
        alpha: the step size alpha_k.
        sigma: the scale sigma of A.
    """
    xi = (alpha * torch.exp(-squared_distance / sigma) / sigma).masked_fill(own, 0.0)
    return torch.where(own, 1.0 - xi.sum(1, keepdim=True), xi)


class FedAMP(FederatedMethod):
    """FedAMP: the server builds a personalized cloud model u_i for every client from all
    clients' models, weighted by their similarity; each client trains towards its u_i.

    The server keeps every client's latest model w_j (all start at the same initialization).
    Round for the sampled clients: the server computes, for each sampled client i, the cloud
    model u_i = sum_j xi_ij w_j over all n clients (:func:`attention_weights`: one gradient step
    of size alpha_k on the attention regularizer sum_{i<j} A(||w_i - w_j||^2)); client i
    receives u_i, starts from it and trains F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2 (the
    paper's proximal step; fresh SGD with the local settings) and uploads w_i, which the
    server keeps. Personalized model: w_i.

    The paper's values of alpha_k, lambda and sigma are not in our sources; the defaults are
    chosen for the scale of the digits benchmark's models (squared distances of 30 to 150
    between client models after 10 rounds, smallest between clients that share a class).

    Args:
        alpha: the step size alpha_k of the message passing (constant over rounds).
        lam: lambda, the weight of the attention regularizer (the proximal coefficient is
            lambda / alpha_k).
        sigma: sigma of the attention function A(x) = 1 - exp(-x / sigma).
        local_momentum: client SGD momentum (0: plain SGD, PFLlib's port
            ``system/flcore/clients/clientbase.py``; we found no code of the authors').
        local_weight_decay: client SGD weight decay (PFLlib's port: 0).
        local_max_grad_norm: client gradient clip (PFLlib's port: none).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.

    alpha (n - 1) / sigma must be at most 1, so that xi_ii >= 0 even when all models coincide
    (as at the start).
    """

    honours_conditions = True

    def __init__(
        self,
        alpha: PositiveFloat = 1.0,
        lam: NonNegativeFloat = 1.0,
        sigma: PositiveFloat = 50.0,
        local_momentum: Momentum = 0.0,
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
        if alpha * (h.num_clients - 1) / sigma > 1:
            raise ConfigError(
                f"model.init_args.alpha * (num_clients - 1) / sigma = "
                f"{alpha * (h.num_clients - 1) / sigma:g} > 1 gives a client a negative weight "
                f"on its own model (xi_ii < 0) while models are close; lower alpha to at most "
                f"{sigma / max(h.num_clients - 1, 1):g} or raise sigma."
            )
        self.refuse_batch_norm("FedAMP combines model weights")
        self.trainable = tuple(self.arch.shapes)
        self.store.add_field("params", self.arch.initial_params())
        self.prox_loss = proximal_loss(self.cross_entropy, lam / alpha, self.trainable)

    def cloud_models(self, clients: Tensor) -> Params:
        """u_i of ``clients`` from every client's stored model (stacked ``[C, ...]``)."""
        h = self.hp
        every = torch.arange(h.num_clients, device=self.device)
        models = self.store.gather("params", every, self.device)
        flat = torch.cat([models[n].flatten(1) for n in self.trainable], 1).double()
        own = flat[clients.to(self.device)]
        distance = torch.cdist(own, flat, compute_mode="donot_use_mm_for_euclid_dist") ** 2
        xi = attention_weights(distance, clients.view(-1, 1) == every, h.alpha, h.sigma)
        return {
            n: (xi @ models[n].flatten(1).double()).view(len(clients), *t.shape[1:]).to(t.dtype)
            for n, t in models.items()
        }

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        cloud = self.cloud_models(clients)
        result = self.local_train(
            {n: t.clone() for n, t in cloud.items()},
            clients,
            round_idx,
            loss_fn=self.prox_loss,
            context=anchor(cloud, self.trainable),
        )
        # a client that did not report back keeps its w_i (it trained nothing from u_i)
        self.scatter_arrived("params", clients, round_idx, result.params)
        self.record_communication(down=cloud, up=result.params)
        return result.loss

    def personalized_params(self, clients: Tensor) -> Params:
        return self.store.gather("params", clients, self.device)
