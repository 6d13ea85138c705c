"""Tensor dicts: a model's tensors by name, one client's or stacked over a round's clients.

A *stacked* dict holds each tensor with a leading client dimension ``[C, ...]``; the engine
trains, and methods aggregate, whole stacks at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

Params = dict[str, Tensor]


def client_row(tensors: Params, c: int) -> Params:
    """Client ``c``'s tensors of a stacked dict."""
    return {n: t[c] for n, t in tensors.items()}


def prefixed(prefix: str, params: Params) -> Params:
    """``params`` renamed ``prefix.<name>`` (several models in one tensor dict)."""
    return {f"{prefix}.{n}": t for n, t in params.items()}


def split_prefixed(params: Params, *prefixes: str) -> tuple[Params, ...]:
    """The tensors of ``params`` under each ``prefix.``, with the prefix removed."""
    return tuple(
        {n[len(p) + 1 :]: t for n, t in params.items() if n.startswith(p + ".")} for p in prefixes
    )


def client_mean(stacked: Tensor, weights: Tensor) -> Tensor:
    """``sum_i weights_i * stacked[i]`` over the leading client dimension, accumulated in float64
    so that the average of many clients does not depend on their order."""
    w = weights.to(stacked.device, torch.float64).view(-1, *([1] * (stacked.dim() - 1)))
    return (w * stacked.double()).sum(0)
