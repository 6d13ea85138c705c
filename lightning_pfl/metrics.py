"""Personalized evaluation metrics: each client's model on its own split."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric


class ClientAccuracy(Metric):
    """Accumulates correct / total / summed loss per client and summarizes them.

    States are per-client sums reduced by ``sum`` across processes, so every rank may evaluate
    a disjoint subset of clients. :meth:`compute` returns:

    - ``acc``: mean over clients of each client's accuracy (the pFedHN paper's formula),
    - ``acc_weighted``: pooled correct / pooled total (sample-weighted; the pFedHN and FedTP code),
    - ``acc_std``, ``acc_min``, ``acc_p10``: spread of the per-client accuracies,
    - ``loss``: mean over clients of each client's mean cross-entropy,
    - ``loss_weighted``: pooled summed cross-entropy / pooled total.

    Clients with no samples in the split are left out of the per-client statistics. For every
    named group of clients in ``groups`` (e.g. FedSimSup's supervisor types), ``<group>/acc`` and
    ``<group>/acc_weighted`` are the same two accuracies over that group's clients only.
    """

    full_state_update = False
    correct: Tensor
    total: Tensor
    loss_sum: Tensor

    def __init__(self, num_clients: int, groups: dict[str, Tensor] | None = None) -> None:
        super().__init__()
        self.groups = groups or {}
        for name in ("correct", "total", "loss_sum"):
            self.add_state(
                name, torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum"
            )

    def update(self, clients: Tensor, correct: Tensor, total: Tensor, loss_sum: Tensor) -> None:
        clients = clients.to(self.correct.device)
        self.correct.index_add_(0, clients, correct.to(self.correct))
        self.total.index_add_(0, clients, total.to(self.total))
        self.loss_sum.index_add_(0, clients, loss_sum.to(self.loss_sum))

    def per_client(self) -> Tensor:
        """Accuracy of every client with samples (NaN for clients without)."""
        return torch.where(self.total > 0, self.correct / self.total.clamp_min(1), torch.nan)

    def compute(self) -> dict[str, Tensor]:
        seen = self.total > 0
        acc = (self.correct / self.total.clamp_min(1))[seen]
        loss = (self.loss_sum / self.total.clamp_min(1))[seen]
        by_group = {}
        for name, clients in self.groups.items():
            ids = clients.to(self.total.device)
            correct, total = self.correct[ids], self.total[ids]
            by_group[f"{name}/acc"] = (correct / total.clamp_min(1))[total > 0].mean()
            by_group[f"{name}/acc_weighted"] = correct.sum() / total.sum()
        return by_group | {
            "acc": acc.mean(),
            "acc_weighted": self.correct.sum() / self.total.sum(),
            "acc_std": acc.std(unbiased=False),
            "acc_min": acc.min(),
            "acc_p10": torch.quantile(acc, 0.1),
            "loss": loss.mean(),
            "loss_weighted": self.loss_sum.sum() / self.total.sum(),
        }


ACCURACIES = ("acc", "acc_weighted")


def over_evaluations(history: list[dict[str, float]], last: int) -> dict[str, dict[str, Any]]:
    """The papers' summaries of test accuracy over a run's evaluations.

    ``history`` holds one entry per evaluation in round order, with the test split's ``round``,
    ``acc`` (mean over clients) and ``acc_weighted`` (pooled). Returns:

    - ``test_max_over_evals``: the best of each accuracy over all evaluations and the round it
      was reached at (``round_acc``, ``round_acc_weighted``; the first such round on ties),
      pFedKT's Table 1 number;
    - ``test_last_evals``: mean and standard deviation (population, ddof 0) of each accuracy over
      the last ``last`` evaluations (all of them when there are fewer; ``n`` says how many were
      used, ``rounds`` which), FedTP's number (evaluations every 5 rounds over its last 200).
    """
    if not history:
        return {}
    best: dict[str, Any] = {}
    for key in ACCURACIES:
        top = max(history, key=lambda entry: entry[key])
        best[key] = top[key]
        best[f"round_{key}"] = top["round"]
    tail = history[-last:]
    spread: dict[str, Any] = {"n": len(tail), "rounds": [entry["round"] for entry in tail]}
    for key in ACCURACIES:
        values = torch.tensor([entry[key] for entry in tail], dtype=torch.float64)
        spread[f"{key}_mean"] = float(values.mean())
        spread[f"{key}_std"] = float(values.std(unbiased=False))
    return {"test_max_over_evals": best, "test_last_evals": spread}
