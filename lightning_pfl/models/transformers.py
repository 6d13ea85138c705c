"""Transformer backbones (FedTP): networks registered by name.

Each network here is a :class:`~lightning_pfl.models.targets.TargetNetwork` registered with
:func:`~lightning_pfl.models.targets.register_network`, so any method can use it as ``net``:

- ``vit``: the vision transformer of FedTP (Li et al.) for small images;
- ``char_transformer``: a character-level transformer for LEAF Shakespeare (causal by default).

Both name each block's bias-free query/key/value projection ``blocks.{i}.attn.qkv.weight``
(:func:`qkv_names`), the tensors FedTP personalizes, hold no buffers, and run under
``torch.func.functional_call`` and ``vmap``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pfl.models.targets import TargetNetwork, register_network


def qkv_names(names: Sequence[str]) -> tuple[str, ...]:
    """The per-block query/key/value projections among parameter ``names`` (FedTP's W_i)."""
    return tuple(n for n in names if n.endswith(".attn.qkv.weight"))


class Attention(nn.Module):
    """Multi-head self-attention with a bias-free qkv projection ``qkv`` (dim -> 3 * heads * d).

    ``causal``: position t attends only to positions <= t.
    """

    def __init__(
        self, dim: int, heads: int, head_dim: int, dropout: float, causal: bool = False
    ) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.out = nn.Linear(heads * head_dim, dim)
        self.dropout = nn.Dropout(dropout)

    def attention_map(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Attention weights ``[B, heads, T, T]`` and values ``[B, heads, T, head_dim]``."""
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if self.causal:
            future = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        return torch.softmax(scores, -1), v

    def forward(self, x: Tensor) -> Tensor:
        attention, v = self.attention_map(x)
        mixed = (attention @ v).transpose(1, 2).flatten(2)
        return self.dropout(self.out(mixed))


class Block(nn.Module):
    """Encoder block: attention then a GELU MLP, each residual; pre-norm (ViT) or post-norm."""

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        mlp_dim: int,
        dropout: float,
        causal: bool = False,
        pre_norm: bool = True,
    ) -> None:
        super().__init__()
        self.pre_norm = pre_norm
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, head_dim, dropout, causal)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_dim),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp_dim, dim),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_norm:
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.mlp(x))


class ViT(TargetNetwork):
    """FedTP's vision transformer for small images.

    Non-overlapping ``patch`` x ``patch`` patches, flattened and linearly embedded, a CLS token
    and learned position embeddings (embedding dropout), ``depth`` pre-norm blocks (``heads``
    heads of ``head_dim``, GELU MLP of ``mlp_dim``, dropout ``dropout``), then the CLS token's
    LayerNorm as features and a linear classifier ``head``. Defaults are FedTP's CIFAR ViT:
    patch 4, dim 128, 8 heads of 64, MLP 256, dropout 0.1, depth 8 (the paper; its code uses 6).
    """

    classifier_name = "head"

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        input_size: int = 32,
        patch: int = 4,
        dim: int = 128,
        depth: int = 8,
        heads: int = 8,
        head_dim: int = 64,
        mlp_dim: int = 256,
        dropout: float = 0.1,
        emb_dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if input_size % patch:
            raise ValueError(f"patch {patch} does not divide the input size {input_size}.")
        if depth < 1 or min(dim, heads, head_dim, mlp_dim, patch) < 1:
            raise ValueError(
                "vit sizes (depth, dim, heads, head_dim, mlp_dim, patch) must be >= 1."
            )
        if not (0 <= dropout < 1 and 0 <= emb_dropout < 1):
            raise ValueError(f"dropout {dropout} / emb_dropout {emb_dropout} must be in [0, 1).")
        self.patch = patch
        self.embed = nn.Linear(in_channels * patch * patch, dim)
        self.cls_token = nn.Parameter(torch.randn(dim) * 0.02)
        self.position = nn.Parameter(torch.randn((input_size // patch) ** 2 + 1, dim) * 0.02)
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.blocks = nn.ModuleList(
            Block(dim, heads, head_dim, mlp_dim, dropout) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def tokens(self, x: Tensor) -> Tensor:
        """Patch embeddings with the CLS token first and position embeddings: ``[B, 1+P, dim]``."""
        b, c, h, w = x.shape
        p = self.patch
        patches = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1).flatten(3)
        embedded = self.embed(patches.flatten(1, 2))
        cls = self.cls_token.expand(b, 1, -1)
        return self.emb_dropout(torch.cat([cls, embedded], 1) + self.position)

    def features(self, x: Tensor) -> Tensor:
        z = self.tokens(x)
        for block in self.blocks:
            z = block(z)
        return self.norm(z[:, 0])

    @torch.no_grad()
    def attention_rollout(self, x: Tensor, discard: float = 0.3) -> Tensor:
        """Attention rollout (Abnar & Zuidema) from the CLS token to every patch: ``[B, h, w]``.

        Each block's attention is fused by the maximum over heads; the lowest ``discard``
        fraction of each map is set to zero (FedTP's figures: max fusion, 30% dropped); the
        identity is added for the residual path, rows are renormalized and the maps multiplied.
        """
        z = self.tokens(x)
        rollout = torch.eye(z.shape[1], device=x.device).expand(len(x), -1, -1)
        for block in self.blocks:
            assert isinstance(block, Block)
            attention = block.attn.attention_map(block.norm1(z))[0].amax(1)  # [B, T, T]
            flat = attention.flatten(1)
            cut = torch.quantile(flat, discard, dim=1, keepdim=True)
            attention = torch.where(flat < cut, 0.0, flat).view_as(attention)
            attention = attention + torch.eye(attention.shape[-1], device=x.device)
            attention = attention / attention.sum(-1, keepdim=True)
            rollout = attention @ rollout
            z = block(z)
        side = int(math.isqrt(z.shape[1] - 1))
        mask = rollout[:, 0, 1:]
        mask = mask / mask.amax(-1, keepdim=True).clamp_min(1e-12)
        return mask.view(len(x), side, side)


class CharTransformer(TargetNetwork):
    """A character-level transformer for next-character prediction (LEAF Shakespeare).

    Inputs are character ids ``[B, T]``; embedding (scaled by sqrt(dim)) plus sinusoidal
    positions, ``depth`` blocks, then the last position's representation as features and a
    linear ``head`` over the vocabulary. The defaults are FedTP's Shakespeare model: 2
    post-norm blocks, d_model 128, inner 256, 8 heads (head dim 16).
    :meth:`sequence_features` gives every position's representation.

    Args:
        causal: position t attends only to characters <= t, as next-character prediction
            requires (default). False: no mask, as FedTP's reference code, whose position t
            then also reads the character it is trained to predict (its targets are the inputs
            shifted by one); only for reproducing that code.
    """

    classifier_name = "head"

    def __init__(
        self,
        vocab_size: int = 80,
        num_classes: int = 80,
        dim: int = 128,
        depth: int = 2,
        heads: int = 8,
        mlp_dim: int = 256,
        dropout: float = 0.1,
        pre_norm: bool = False,
        causal: bool = True,
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"char_transformer dim {dim} is not divisible by heads {heads}.")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout {dropout} must be in [0, 1).")
        self.dim = dim
        self.embed = nn.Embedding(vocab_size, dim)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(dim, heads, dim // heads, mlp_dim, dropout, causal=causal, pre_norm=pre_norm)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim) if pre_norm else nn.Identity()
        self.head = nn.Linear(dim, num_classes)

    def sequence_features(self, x: Tensor) -> Tensor:
        """Representation of every position ``[B, T, dim]`` (``causal``: position t reads only
        x[:, :t+1])."""
        length = x.shape[-1]
        position = torch.arange(length, device=x.device, dtype=torch.float32).unsqueeze(1)
        freq = torch.exp(
            torch.arange(0, self.dim, 2, device=x.device, dtype=torch.float32)
            * (-math.log(10000.0) / self.dim)
        )
        angles = position * freq  # [T, dim / 2]
        encoding = torch.stack([angles.sin(), angles.cos()], -1).flatten(-2)
        z = self.dropout(self.embed(x.long()) * math.sqrt(self.dim) + encoding)
        for block in self.blocks:
            z = block(z)
        return self.norm(z)

    def features(self, x: Tensor) -> Tensor:
        return self.sequence_features(x)[:, -1]


def _vit(shape: Sequence[int], num_classes: int) -> dict[str, Any]:
    return {"in_channels": shape[0], "num_classes": num_classes, "input_size": shape[-1]}


def _chars(shape: Sequence[int], num_classes: int) -> dict[str, Any]:
    return {"vocab_size": num_classes, "num_classes": num_classes}


register_network("vit", ViT, _vit)
register_network("char_transformer", CharTransformer, _chars)
