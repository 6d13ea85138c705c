"""FedPHP (Li et al., 2021): federated personalization with inherited private models."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import Params, TrainResult, weighted_cross_entropy
from lightning_pfl.losses import distillation_loss
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import PositiveFloat, PositiveInt, UnitInterval


def moving_average(history: Params, trained: Params, mu: Tensor) -> Params:
    """``v <- mu v + (1 - mu) w`` per client: ``mu`` is ``[C]``, the tensors ``[C, ...]``."""
    out = {}
    for n, v in history.items():
        m = mu.to(v).view(-1, *([1] * (v.dim() - 1)))
        out[n] = m * v + (1 - m) * trained[n].to(v)
    return out


def history_weight(count: Tensor, mu: float, participation: float, rounds: int) -> Tensor:
    """FedPHP's mu_k: ``mu * z_k / max(floor(q T), 1)`` clipped to ``[0, mu]``.

    ``count`` is z_k, the client's participations before this one; ``q T`` the expected number
    of participations in ``rounds`` rounds at participation rate q.
    """
    expected = max(int(participation * rounds), 1)
    return (mu * count.double() / expected).clamp(0.0, mu)


class FedPHP(FedAvg):
    """FedPHP: each client keeps a historical personalized model (HPM), a moving average of its
    local models, and distils it into local training.

    Round for sampled client k: it receives the global model theta; starts local training from
    ``(1 - inherit) * theta + inherit * v_k`` (the reference code: ``inherit = 0``, the global
    model); trains ``(1 - lambda) * CE + lambda * KD(v_k -> w_k)`` (KD:
    :func:`~lightning_pfl.losses.distillation_loss` at temperature T, the HPM in eval mode as
    teacher); updates its HPM ``v_k <- mu_k v_k + (1 - mu_k) w_k`` with
    ``mu_k = min(mu * z_k / max(floor(q T), 1), mu)`` (z_k: the client's earlier
    participations, q: participation rate, T: total rounds), so a new client's HPM follows its
    local model and an experienced client's HPM changes slowly; uploads ``w_k`` for FedAvg.
    The personalized model is the HPM (the initial model for never-sampled clients).

    Args:
        lam: lambda, weight of the distillation term (0.1, the default of the public ports of
            the reference code).
        mu: mu, the largest weight of the history in the HPM update (0.9).
        temperature: T of the distillation (4, the reference code's teacher temperature; the
            reference divides only the teacher by T and has no T^2 factor).
        inherit: weight of the HPM in the local model's starting point (0: start from the global
            model, as the reference code).
        total_rounds: T of mu_k (None: ``trainer.max_steps``).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    def __init__(
        self,
        lam: UnitInterval = 0.1,
        mu: UnitInterval = 0.9,
        temperature: PositiveFloat = 4.0,
        inherit: UnitInterval = 0.0,
        total_rounds: PositiveInt | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.store.add_field("hpm", self.arch.initial_state())
        self.store.add_field("count", {"participations": torch.zeros(())})
        self.loss_fn = self.php_loss  # one object per run (recorded rounds are keyed by it)

    def php_loss(
        self, params: Params, frozen: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        """``(1 - lambda) CE(w_k) + lambda KD(v_k -> w_k)`` (frozen ``hpm.*`` is v_k)."""
        h = self.hp
        hpm = {n[4:]: t for n, t in frozen.items() if n.startswith("hpm.")}
        own = {n: t for n, t in frozen.items() if not n.startswith("hpm.")}
        logits, buffers = self.arch.forward_train({**own, **params}, x)
        teacher = self.arch(hpm, x)
        ce = weighted_cross_entropy(logits, y, w)
        loss = (1 - h.lam) * ce + h.lam * distillation_loss(logits, teacher, h.temperature, w)
        return (loss, buffers) if buffers else loss

    def starting_point(self, start: Params, hpm: Params) -> Params:
        """``(1 - inherit) theta + inherit v_k`` of every tensor (parameters and buffers)."""
        inherit = torch.full((len(next(iter(hpm.values()))),), self.hp.inherit)
        return moving_average(start, hpm, 1 - inherit)

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        h = self.hp
        hpm = self.store.gather("hpm", clients, self.device)
        if h.inherit > 0:
            start = self.starting_point(start, hpm)
        frozen = {f"hpm.{n}": t for n, t in hpm.items()}
        result = self.local_train(start, clients, round_idx, loss_fn=self.loss_fn, frozen=frozen)
        count = self.store.gather("count", clients, self.device)["participations"]
        rounds = h.total_rounds or (self.trainer.max_steps if self._trainer is not None else 1)
        participation = h.clients_per_round / h.num_clients
        mu = history_weight(count, h.mu, participation, rounds)
        self.store.scatter("hpm", clients, moving_average(hpm, result.params, mu))
        self.store.scatter("count", clients, {"participations": count + 1})
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        return self.store.gather("hpm", clients, self.device)
