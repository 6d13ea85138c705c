"""FedProx (Li et al., MLSys 2020): FedAvg with a proximal term in the local objective."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import LossFn, Params, TrainResult
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import NonNegativeFloat

ANCHOR = "anchor."


def proximal_loss(base: LossFn, mu: float, names: tuple[str, ...]) -> LossFn:
    """``base + mu/2 * sum_n ||params[n] - anchor[n]||^2`` over the tensors ``names``.

    The anchor is passed as context, under ``"anchor." + name`` (see :func:`anchor`); ``base`` gets
    the remaining context tensors. Shared by FedProx (anchor = the received global model) and
    Ditto (the personal model's regularizer towards the global model).
    """

    def loss(
        params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        rest = {n: t for n, t in context.items() if not n.startswith(ANCHOR)}
        out = base(params, rest, x, y, weight)
        distance = torch.stack(
            [((params[n] - context[ANCHOR + n]) ** 2).sum() for n in names]
        ).sum()
        prox = 0.5 * mu * distance
        if isinstance(out, tuple):
            return out[0] + prox, out[1]
        return out + prox

    return loss


def anchor(params: Params, names: tuple[str, ...]) -> Params:
    """The frozen anchor tensors of :func:`proximal_loss` (detached copies of ``names``)."""
    return {ANCHOR + n: params[n].detach().clone() for n in names}


class FedProx(FedAvg):
    """FedProx: each client minimizes ``F_k(w) + mu/2 ||w - w^t||^2`` from the global ``w^t``.

    Round: as FedAvg (sample-weighted average of the uploaded models), but the local loss
    adds the proximal term ``mu/2 ||w - w^t||^2`` over every trainable tensor, with ``w^t`` the
    global model the client received this round (frozen). ``mu = 0`` is FedAvg. The paper's
    inexact local solver (a varying amount of local work per client) is not modelled: every
    client runs the configured local steps or epochs.

    Args:
        mu: proximal coefficient mu (the paper tunes it in {0.001, 0.01, 0.1, 1}; 0.01 here).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(self, mu: NonNegativeFloat = 0.01, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trainable = tuple(self.arch.shapes)
        self.prox_loss = proximal_loss(self.cross_entropy, mu, self.trainable)

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        return self.local_train(
            start,
            clients,
            round_idx,
            loss_fn=self.prox_loss,
            context=anchor(start, self.trainable),
        )
