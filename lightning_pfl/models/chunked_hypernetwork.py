"""pFedKT's local hypernetwork: an MLP called once per chunk of the flattened model."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from lightning_pfl.models.hypernetwork import FeatureScale, match_target_init


class ChunkedHyperNetwork(nn.Module):
    """Generates a whole model chunk by chunk: ``theta = concat_j f(e_j)[:K]``.

    The target's K parameters (flattened in name order) are cut into ``ceil(K / chunk_size)``
    chunks; chunk j has an embedding e_j, the shared MLP f maps it to ``chunk_size`` values,
    the outputs are concatenated, cut to K and reshaped into the target's tensors.

    With the defaults the module is pFedKT's HN as its paper sizes it (Appendix F.1: about
    0.198 MB for emb 13 -> 100 -> 100 -> 400, i.e. the MLP's 51,900 float32 parameters): the
    chunk embeddings are fixed N(0, 1) draws (a buffer, not learned) and every layer has
    PyTorch's default initialization.

    Args:
        target_shapes: parameter name -> shape of the generated model.
        embed_dim: chunk embedding size (pFedKT: 13).
        hidden: widths of the hidden layers (pFedKT: (100, 100); CIFAR-100 adds one more).
        chunk_size: values generated per call (pFedKT: 400; the "large" HN: all of K).
        target_init: the target network's initial tensors by name: given, the output layer
            starts so that the generated model has the mean and standard deviation of the
            target's own initialization, taken over all its parameters (one output layer serves
            every tensor, so a tensor whose own scale differs from the model's overall one
            starts off by that ratio, at most 4x for the networks we ship). None: PyTorch's
            default initialization (the paper).
        feature_scale: scale the features entering the output layer to a fixed mean square
            (0.5, see :class:`~lightning_pfl.models.hypernetwork.FeatureScale`; the (100, 100)
            HN's raw features have about 2.4, so a HN learning rate of 5e-3 on raw features
            is the step of 2.4e-2 on scaled ones at initialization). False: raw features (the
            paper).
        learnable_embeddings: learn the chunk embeddings with the MLP (not the paper's size:
            ``num_chunks * embed_dim`` more parameters, 55,471 for the CIFAR-10 CNN).
    """

    def __init__(
        self,
        target_shapes: Mapping[str, tuple[int, ...]],
        embed_dim: int = 13,
        hidden: Sequence[int] = (100, 100),
        chunk_size: int = 400,
        target_init: Mapping[str, Tensor] | None = None,
        feature_scale: bool = False,
        learnable_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.target_shapes = dict(target_shapes)
        self.numel = sum(math.prod(s) for s in self.target_shapes.values())
        self.chunk_size = min(chunk_size, self.numel)
        self.num_chunks = -(-self.numel // self.chunk_size)
        embeddings = torch.randn(self.num_chunks, embed_dim)
        self.chunk_embeddings: Tensor
        if learnable_embeddings:
            self.chunk_embeddings = nn.Parameter(embeddings)
        else:
            self.register_buffer("chunk_embeddings", embeddings)
        widths = [embed_dim, *hidden]
        layers: list[nn.Module] = []
        for i, o in zip(widths[:-1], widths[1:], strict=True):
            layers += [nn.Linear(i, o), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.feature_scale = FeatureScale() if feature_scale else nn.Identity()
        self.out = nn.Linear(widths[-1], self.chunk_size)
        with torch.no_grad():
            if isinstance(self.feature_scale, FeatureScale):
                self.feature_scale.calibrate(self.mlp(self.chunk_embeddings))
            features = self.feature_scale(self.mlp(self.chunk_embeddings))
            if target_init is not None:
                flat = torch.cat([target_init[n].flatten() for n in self.target_shapes])
                match_target_init([self.out], features, [flat])

    def forward(self) -> Tensor:
        """The flat generated model: K values in name order (see :meth:`unflatten`)."""
        features = self.feature_scale(self.mlp(self.chunk_embeddings))
        return self.out(features).float().flatten()[: self.numel]

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Cut a flat vector of K values into the target's tensors (name order)."""
        sizes = [math.prod(s) for s in self.target_shapes.values()]
        pieces = flat.split(sizes, dim=-1)
        lead = flat.shape[:-1]
        return {
            name: piece.reshape(*lead, *shape)
            for (name, shape), piece in zip(self.target_shapes.items(), pieces, strict=True)
        }
