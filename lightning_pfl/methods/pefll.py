"""PeFLL (Scott, Zakerinia and Lampert, ICLR 2024): personalized FL by learning to learn."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pfl.engine import Params, derive_seed
from lightning_pfl.methods.base import BATCH_STREAM
from lightning_pfl.methods.pfedhn import PFedHN
from lightning_pfl.models import HyperNetwork
from lightning_pfl.models.hypernetwork import BaseHyperNetwork, apply_heads
from lightning_pfl.validation import NonNegativeInt, PositiveInt

DESCRIPTOR_PHASE = 1
CALIBRATION_DESCRIPTORS = 64


class EmbeddingNetwork(nn.Module):
    """e(x, y; psi): an MLP on [flatten(x), onehot(y)] giving one embedding per sample.

    A client's descriptor is the (weighted) mean of its samples' embeddings, so it does not
    depend on the order of the samples and accepts any number of them.
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int, dim: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.mlp = nn.Sequential(
            nn.Linear(math.prod(input_shape) + num_classes, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, dim),
        )

    def embed(self, x: Tensor, y: Tensor) -> Tensor:
        """Per-sample embeddings of ``x [..., *input_shape]``, ``y [...]``: ``[..., dim]``."""
        lead = y.shape
        pairs = torch.cat(
            [x.reshape(*lead, -1).float(), F.one_hot(y, self.num_classes).float()], -1
        )
        return self.mlp(pairs)

    def forward(self, x: Tensor, y: Tensor, weight: Tensor) -> Tensor:
        """Descriptors v_c = sum_b w_cb e(x_cb, y_cb) / sum_b w_cb of ``[C, B]`` batches."""
        z = self.embed(x, y)
        return (z * weight.unsqueeze(-1)).sum(-2) / weight.sum(-1, keepdim=True).clamp_min(1)


class PeFLLNetwork(BaseHyperNetwork):
    """The two learned maps: descriptor v = e(S; psi), then theta = h(v; phi).

    h is pFedHN's hypernetwork (MLP, fixed feature scale, one head per target tensor) fed with
    the descriptor instead of a looked-up embedding; its embedding table only serves to
    calibrate the initialization and is frozen.
    """

    def __init__(
        self,
        embedder: EmbeddingNetwork,
        target_shapes: Mapping[str, tuple[int, ...]],
        dim: int,
        hidden_dim: int,
        n_hidden: int,
        spectral_norm: bool,
        target_init: Mapping[str, Tensor],
    ) -> None:
        super().__init__()
        self.embedder = embedder
        self.generator = HyperNetwork(
            CALIBRATION_DESCRIPTORS,
            target_shapes,
            dim,
            hidden_dim,
            n_hidden,
            spectral_norm,
            target_init,
        )
        self.generator.embeddings.weight.requires_grad_(False)

    def generate(self, descriptors: Tensor) -> dict[str, Tensor]:
        """theta = h(v; phi) for descriptors ``[C, dim]``, stacked ``[C, *shape]``."""
        g = self.generator
        return apply_heads(g.feature_scale(g.mlp(descriptors)), g.target_shapes, g.heads)

    def forward(self, x: Tensor, y: Tensor, weight: Tensor) -> dict[str, Tensor]:
        return self.generate(self.embedder(x, y, weight))

    def embedding_parameters(self) -> list[nn.Parameter]:
        """psi, the embedding network (trained with ``embed_lr``)."""
        return list(self.embedder.parameters())

    def body_parameters(self) -> list[nn.Parameter]:
        """phi, the hypernetwork (without its frozen calibration table)."""
        return [p for p in self.generator.parameters() if p.requires_grad]


class PeFLL(PFedHN):
    """PeFLL: an embedding network describes each client; a hypernetwork maps it to a model.

    Round (the paper's Algorithm 1): each client computes its descriptor
    v_i = (1/|B|) sum_{(x, y) in B} e(x, y; psi) on a random batch B of its training data; the
    server generates theta_i = h(v_i; phi); the client trains theta_i for K local SGD steps and
    uploads delta_i = theta_i - theta~_i. The server sets grad(phi) = (1/C) sum_i
    (d theta_i / d phi)^T delta_i, returns (d theta_i / d v_i)^T delta_i to the client, which
    back-propagates it through e to get its grad(psi); both networks take one optimizer step.
    This is the gradient of (1/C) sum_i <h(e(B_i; psi); phi), delta_i> in (phi, psi): the
    chain rule through the delta (computed here in one backward pass).

    Nothing is client-specific: a client's personalized model is h(e(S_i)) with its descriptor
    over all its training data S_i, so a new client gets a model with two forward passes and
    no training (:meth:`model_for`).

    Args:
        embed_dim: descriptor size (default floor(1 + n / 4), pFedHN's embedding size; PeFLL's
            per-dataset sizes are not fixed in the paper text we have, so this is our default).
        embedding_hidden: width of the embedding network's two hidden layers.
        descriptor_batch: samples per descriptor during training (default ``batch_size``).
        embed_lr: learning rate of the embedding network psi (default ``hn_lr``).
        **kwargs: see :class:`~lightning_pfl.methods.pfedhn.PFedHN` (hypernetwork size, server
            optimizer of phi and psi, ``hn_update``, and the inner loop K, eta).
    """

    def __init__(
        self,
        embedding_hidden: PositiveInt = 100,
        descriptor_batch: PositiveInt | None = None,
        n_hidden: NonNegativeInt = 3,
        **kwargs: Any,
    ) -> None:
        super().__init__(n_hidden=n_hidden, **kwargs)

    def build_hypernetwork(self) -> PeFLLNetwork:
        h = self.hp
        dim = h.embed_dim or int(1 + h.num_clients / 4)
        embedder = EmbeddingNetwork(h.input_shape, h.num_classes, h.embedding_hidden, dim)
        return PeFLLNetwork(
            embedder,
            self.generated_shapes(),
            dim,
            h.hidden_dim,
            h.n_hidden,
            h.spectral_norm,
            self.arch.initial_params(),
        )

    @property
    def network(self) -> PeFLLNetwork:
        """The embedding network and hypernetwork (``hnet``, typed)."""
        assert isinstance(self.hnet, PeFLLNetwork)
        return self.hnet

    def descriptor_batches(self, clients: Tensor, round_idx: int) -> tuple[Tensor, Tensor, Tensor]:
        """One random batch per client for this round's descriptors: x, y and weights."""
        h = self.hp
        seed = derive_seed(h.seed, round_idx, BATCH_STREAM, DESCRIPTOR_PHASE)
        generator = torch.Generator(self.data.device).manual_seed(seed)
        batches = self.data.client_batches(
            clients, h.descriptor_batch or h.batch_size, generator, steps=1
        )
        x, y = self.data.fetch(batches.index[:, 0])
        return x.to(self.device), y.to(self.device), batches.weight[:, 0].to(self.device)

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        x, y, weight = self.descriptor_batches(clients, round_idx)
        descriptors = self.network.embedder(x, y, weight)
        generated = self.network.generate(descriptors)
        start = {n: t.detach() for n, t in generated.items()}
        result = self.local_train({n: t.clone() for n, t in start.items()}, clients, round_idx)
        delta = {n: start[n] - result.params[n] for n in start}
        self.update_hypernetwork(generated, delta)
        psi = {
            n: p.detach().expand(len(clients), *p.shape)
            for n, p in self.network.embedder.named_parameters()
        }
        self.record_communication(
            down=start | {f"psi.{n}": t for n, t in psi.items()} | {"v_grad": descriptors},
            up={"v": descriptors.detach()} | delta | {f"psi_grad.{n}": t for n, t in psi.items()},
        )
        return result.loss

    @torch.no_grad()
    def model_for(self, x: Tensor, y: Tensor, weight: Tensor | None = None) -> Params:
        """The model h(e(S)) of clients with data ``x [C, N, ...]``, ``y [C, N]`` (no training)."""
        weight = torch.ones(y.shape, device=y.device) if weight is None else weight
        return self.network(x, y, weight)

    @torch.no_grad()
    def personalized_params(self, clients: Tensor) -> Params:
        embedder = self.network.embedder
        total: Tensor | None = None
        count = torch.zeros(len(clients), 1, device=self.device)
        for index, weight in self.data.eval_blocks(clients, "train", self.hp.eval_batch_size):
            x, y = self.data.fetch(index)
            z = embedder.embed(x, y) * weight.unsqueeze(-1)
            total = z.sum(1) if total is None else total + z.sum(1)
            count += weight.sum(1, keepdim=True)
        assert total is not None, "every client has training data"
        return self.network.generate(total / count.clamp_min(1))
