"""FedLC (Zhang et al., ICML 2022): local training on logits calibrated by the label counts."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.engine import Params, TrainResult
from lightning_pfl.losses import weighted_mean
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import NonNegativeFloat

COUNTS = "class_counts"


def calibrated_cross_entropy(
    logits: Tensor,
    y: Tensor,
    class_counts: Tensor,
    tau: float,
    weight: Tensor,
    denominator: Literal["all", "others"] = "all",
) -> Tensor:
    """FedLC's calibrated loss of one client's batch, weighted mean over the samples.

    Calibrated logits a_c = f_c(x) - tau * n_c^(-1/4), with n_c the client's training samples
    of class c (classes it lacks count as 1e-8, a margin of 100 tau). ``all``: the softmax
    cross-entropy of a, -log(e^(a_y) / sum_{y'} e^(a_y')), which is the pairwise label-margin
    loss log(1 + sum_{y' != y} e^(Delta_{y,y'} + f_y' - f_y)) the paper derives L_cal from;
    ``others``: the paper's printed L_cal, whose denominator sums over y' != y only.
    """
    margin = tau * class_counts.float().clamp_min(1e-8).pow(-0.25)
    calibrated = logits.float() - margin
    if denominator == "all":
        return weighted_mean(F.cross_entropy(calibrated, y, reduction="none"), weight)
    target = calibrated.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    classes = torch.arange(calibrated.shape[-1], device=y.device)
    others = calibrated.masked_fill(classes == y.unsqueeze(-1), float("-inf"))
    return weighted_mean(torch.logsumexp(others, -1) - target, weight)


class FedLC(FedAvg):
    """FedLC: FedAvg whose clients minimize the logit-calibrated loss L_cal.

    Round: as FedAvg (sample-weighted average of the uploaded models), but every local step
    minimizes :func:`calibrated_cross_entropy` under the client's training label counts
    n_{i,c}: each logit is lowered by tau * n_{i,c}^(-1/4) before the softmax, a larger margin
    for the classes the client has few samples of. Only the loss changes; the global model
    is evaluated as it is (uncalibrated logits).

    Args:
        tau: calibration strength tau (the paper's value is not in our sources; 1.0 as in the
            FL-bench and PFLlib implementations).
        denominator: ``all`` (the softmax cross-entropy of the calibrated logits: the
            pairwise-margin loss L_cal is derived from) or ``others`` (L_cal as printed, the
            target class left out of the denominator; it collapses, docs/methods.md).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        tau: NonNegativeFloat = 1.0,
        denominator: Literal["all", "others"] = "all",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        # one object for every round: a recorded round (CUDA graph) is keyed by the loss
        self.client_loss = self.calibrated_loss

    def class_counts(self, clients: Tensor) -> Tensor:
        """Training samples per class of ``clients``, ``[C, num_classes]``."""
        counts = torch.as_tensor(self.data.partition_counts()["train"], dtype=torch.float32)
        return counts[clients.cpu()].to(self.device)

    def calibrated_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        h = self.hp
        rest = {n: t for n, t in context.items() if n != COUNTS}
        logits, buffers = self.arch.forward_train({**rest, **params}, x)
        loss = calibrated_cross_entropy(logits, y, context[COUNTS], h.tau, weight, h.denominator)
        return (loss, buffers) if buffers else loss

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        return self.local_train(
            start,
            clients,
            round_idx,
            loss_fn=self.client_loss,
            context={COUNTS: self.class_counts(clients)},
        )
