"""Local SGD as tensor arithmetic: the configuration, its per-client values and one step.

:func:`_sgd_step` is what the vmapped and the sequential paths run (``torch.optim.SGD``'s math on
tensor dicts, per-client values allowed); :func:`_foreach_sgd_step` is the same step with
multi-tensor kernels for one client at a time (the threaded path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_pfl.params import Params


@dataclass(frozen=True)
class SGDConfig:
    """torch.optim.SGD semantics (dampening 0, no Nesterov) plus optional norm clipping.

    Clipping follows ``torch.nn.utils.clip_grad_norm_`` on the group's gradients and happens
    before weight decay is added, as when clipping precedes ``optimizer.step()``.
    """

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float | None = None


@dataclass(frozen=True)
class ParamGroup:
    """A set of parameter names trained with one SGD configuration."""

    names: tuple[str, ...]
    sgd: SGDConfig


SGD_FIELDS = ("lr", "momentum", "weight_decay", "max_grad_norm")


def sgd_rates(groups: Sequence[ParamGroup], num_clients: int, device: torch.device) -> Params:
    """The groups' SGD values as per-client tensors ``[C]`` (``"<group index>.<field>"``; no
    entry for a clip that is off), for clients trained together under different settings
    (:func:`~lightning_pfl.engine.train_clients`'s ``rates``)."""
    rates = {}
    for i, group in enumerate(groups):
        for name in SGD_FIELDS:
            value = getattr(group.sgd, name)
            if value is not None:
                rates[f"{i}.{name}"] = torch.full((num_clients,), float(value), device=device)
    return rates


def _client_groups(groups: Sequence[ParamGroup], rates: Params) -> tuple[ParamGroup, ...]:
    """One client's groups with its own SGD values (``rates`` of that client, 0-dim); a value
    ``rates`` lacks is the group's, as :func:`_sgd_step` reads it under vmap."""
    if not rates:
        return tuple(groups)
    return tuple(
        ParamGroup(
            group.names,
            SGDConfig(
                **{
                    name: float(rates[f"{i}.{name}"])
                    if f"{i}.{name}" in rates
                    else getattr(group.sgd, name)
                    for name in SGD_FIELDS
                }
            ),
        )
        for i, group in enumerate(groups)
    )


def _sgd_step(
    params: Params,
    grads: Params,
    momentum: Params,
    groups: Sequence[ParamGroup],
    rates: Params | None = None,
) -> tuple[Params, Params]:
    """One SGD step of every group; ``rates`` (this client's, 0-dim): its values instead of the
    groups' numbers (the same arithmetic in the parameters' dtype)."""
    new_params, new_momentum = {}, {}
    for i, group in enumerate(groups):
        cfg = group.sgd
        lr, momentum_factor, weight_decay, max_grad_norm = (
            rates.get(f"{i}.{name}", getattr(cfg, name)) if rates else getattr(cfg, name)
            for name in SGD_FIELDS
        )
        scale: Tensor | float = 1.0
        if max_grad_norm is not None:
            norm = torch.sqrt(sum((grads[n].float() ** 2).sum() for n in group.names))  # type: ignore[arg-type]
            scale = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
        for n in group.names:
            d = grads[n] * scale + weight_decay * params[n]
            buf = momentum_factor * momentum[n] + d
            new_momentum[n] = buf
            new_params[n] = params[n] - lr * buf
    return new_params, new_momentum


def _foreach_sgd_step(
    params: Params, grads: Params, momentum: Params, groups: Sequence[ParamGroup]
) -> tuple[Params, Params]:
    """:func:`_sgd_step` with multi-tensor kernels: a few calls per group instead of a few per
    tensor (one client at a time; vmap has no batching rules for them)."""
    new_params: Params = {}
    new_momentum: Params = {}
    for group in groups:
        cfg = group.sgd
        p = tuple(params[n] for n in group.names)
        d = tuple(grads[n] for n in group.names)
        if cfg.max_grad_norm is not None:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(d)))
            d = torch._foreach_mul(d, torch.clamp(cfg.max_grad_norm / (norm + 1e-6), max=1.0))
        if cfg.weight_decay:
            d = torch._foreach_add(d, p, alpha=cfg.weight_decay)
        if cfg.momentum:
            d = torch._foreach_add(
                torch._foreach_mul(tuple(momentum[n] for n in group.names), cfg.momentum), d
            )
        new_params.update(zip(group.names, torch._foreach_add(p, d, alpha=-cfg.lr), strict=True))
        new_momentum.update(zip(group.names, d, strict=True))
    return new_params, new_momentum
