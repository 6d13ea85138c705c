"""pFedHN-PC: pFedHN with a personal classifier kept by each client."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import ParamGroup, Params, SGDConfig
from lightning_pfl.methods.pfedhn import PFedHN
from lightning_pfl.novel_adaptation import NovelAdaptation
from lightning_pfl.privacy import privatizes
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat


class PFedHNPC(PFedHN):
    """pFedHN with personal classifiers (Shamsian et al., section 3.2).

    The hypernetwork generates every tensor but the last linear layer; each client keeps that
    head locally and trains it jointly with the generated body. The body uses a fresh inner
    optimizer with gradient clipping each round; the head has its own SGD whose momentum
    persists across rounds and is not clipped. Only the body's delta goes to the server.
    Novel clients (:class:`~lightning_pfl.novel.NovelClients`) adapt their embedding and their
    personal head jointly, the head from the initialization every client's head starts at.

    Args:
        head_lr: learning rate of the personal head (default ``local_lr``).
        head_momentum: momentum of the personal head's optimizer.
        head_weight_decay: weight decay of the head (default ``local_weight_decay``).
        hn_lr: server learning rate (5e-2 in the paper for pFedHN-PC).
        **kwargs: see :class:`~lightning_pfl.methods.pfedhn.PFedHN`.
    """

    honours_conditions = True

    def __init__(
        self,
        head_lr: PositiveFloat | None = None,
        head_momentum: Momentum = 0.9,
        head_weight_decay: NonNegativeFloat | None = None,
        hn_lr: PositiveFloat = 5e-2,
        **kwargs: Any,
    ) -> None:
        super().__init__(hn_lr=hn_lr, **kwargs)
        head = {n: p for n, p in self.arch.initial_params().items() if n in self.arch.head_names}
        self.store.add_field("head", head)
        self.store.add_field("head_momentum", {n: torch.zeros_like(p) for n, p in head.items()})

    def generated_shapes(self) -> Mapping[str, tuple[int, ...]]:
        return {n: s for n, s in self.arch.shapes.items() if n not in self.arch.head_names}

    @privatizes(
        "each client's contribution J_i^T delta_i to the gradient of the shared hypernetwork "
        "(every parameter but the embeddings), as pFedHN's; the embedding v_i is client i's "
        "personal parameter, and its head never leaves it"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        h = self.hp
        generated = self.hnet(clients)
        body = {n: t.detach() for n, t in generated.items()}
        head = self.store.gather("head", clients, self.device)
        head_momentum = self.store.gather("head_momentum", clients, self.device)
        head_sgd = SGDConfig(
            h.head_lr or h.local_lr,
            h.head_momentum,
            h.local_weight_decay if h.head_weight_decay is None else h.head_weight_decay,
        )
        groups = [ParamGroup(tuple(body), self.local_sgd()), ParamGroup(tuple(head), head_sgd)]
        momentum = {**{n: t.new_zeros(t.shape) for n, t in body.items()}, **head_momentum}
        result = self.local_train(
            {**{n: t.clone() for n, t in body.items()}, **head},
            clients,
            round_idx,
            groups,
            momentum=momentum,
        )
        self.store.scatter("head", clients, {n: result.params[n] for n in head})
        self.store.scatter("head_momentum", clients, {n: result.momentum[n] for n in head})
        delta = {n: body[n] - result.params[n] for n in body}
        if self.client_dp is not None:
            generator = self.client_dp_generator(round_idx)
            self.set_private_gradients(
                generated, delta, generator, self.embedding_weights(clients, round_idx)
            )
        else:
            self.update_from_arrived(generated, delta, clients, round_idx)
        self.record_communication(down=body, up=delta)
        return result.loss

    def personalized_params(self, clients: Tensor) -> Params:
        return {
            **super().personalized_params(clients),
            **self.store.gather("head", clients, self.device),
        }

    def novel_adaptation(self, clients: Tensor) -> NovelAdaptation:
        """The embeddings adapt as in pFedHN, and so do the personal heads: the loss reads
        them from the store (:meth:`personalized_params`), whose rows of the novel clients
        still hold the initial head, and only those rows get a gradient."""
        adaptation = super().novel_adaptation(clients)
        heads = list(self.store.fields["head"].values())
        return NovelAdaptation(adaptation.tensors + heads, adaptation.loss)
