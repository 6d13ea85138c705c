"""FedPHP (Li et al., 2021): federated personalization with inherited private models."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.engine import Params, TrainResult, weighted_cross_entropy
from lightning_pfl.losses import distillation_loss, weighted_mean
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


def tempered_teacher_loss(
    student: Tensor, teacher: Tensor, temperature: float, weight: Tensor
) -> Tensor:
    """``-sum_c softmax(teacher / T)_c log softmax(student)_c``: the teacher's tempered
    probabilities as soft targets of the student's ordinary softmax, no T^2 factor (FedPHP's
    reference code). Its gradient is that of ``KL(softmax(teacher / T) || softmax(student))``;
    ``teacher`` is not differentiated."""
    target = F.softmax(teacher.detach().float() / temperature, -1)
    return weighted_mean(-(target * F.log_softmax(student.float(), -1)).sum(-1), weight)


def gaussian_mmd(
    source: Tensor, target: Tensor, weight: Tensor, kernels: int = 5, factor: float = 2.0
) -> Tensor:
    """Biased squared MMD between ``source`` and ``target`` (``[B, D]``) with a sum of Gaussian
    kernels ``exp(-||a - b||^2 / s_i)``, ``s_i = s factor^(i - kernels // 2)``, i < kernels.

    ``s`` is the mean squared distance between distinct samples of the joint batch, not
    differentiated (FedPHP's reference code: ``mmd_rbf_noaccelerate``). Samples with weight 0
    (padding) take no part.
    """
    joint = torch.cat([source, target]).float()
    w = torch.cat([weight, weight]).float()
    distance = (joint[:, None] - joint[None]).pow(2).sum(-1)
    pairs = w[:, None] * w[None, :]
    scale = (distance.detach() * pairs).sum() / (w.sum().square() - w.sum()).clamp_min(1.0)
    scale = scale + 1e-8
    kernel = sum(
        torch.exp(-distance / (scale * factor ** (i - kernels // 2))) for i in range(kernels)
    )
    n = len(source)
    sign = torch.cat([torch.ones(n), -torch.ones(n)]).to(joint)
    signed = sign[:, None] * sign[None, :] * pairs
    return (kernel * signed).sum() / weight.float().sum().square().clamp_min(1.0)


class FedPHP(FedAvg):
    """FedPHP: each client keeps a historical personalized model (HPM), a moving average of its
    local models, and distils it into local training.

    Round for sampled client k: it receives the global model theta; starts local training from
    ``(1 - inherit) * theta + inherit * v_k`` (the reference code: ``inherit = 0``, the global
    model); trains ``(1 - lambda) * CE + lambda * L_kt(v_k -> w_k)`` with the HPM in eval mode
    as teacher (``distillation`` selects L_kt); updates its HPM
    ``v_k <- mu_k v_k + (1 - mu_k) w_k`` with ``mu_k = min(mu * z_k / max(floor(q T), 1), mu)``
    (z_k: the client's earlier participations, q: participation rate, T: total rounds), so a
    new client's HPM follows its local model and an experienced client's HPM changes slowly;
    uploads ``w_k`` for FedAvg. The personalized model is the HPM (the initial model for
    never-sampled clients).

    The paper's text was not reachable here; the knowledge-transfer losses are those of the
    authors' reference code (lxcnju/FedRepo, ``algorithms/fedphp.py``, ``reg_way`` KD / MMD).

    Args:
        lam: lambda, weight of the knowledge-transfer term (0.1, the default of the public ports
            of the reference code).
        mu: mu, the largest weight of the history in the HPM update (0.9).
        temperature: T of the distillation (4, the reference code's teacher temperature).
        distillation: L_kt. ``tempered_teacher`` (the reference code's KD):
            ``-sum_c softmax(v_k(x) / T)_c log softmax(w_k(x))_c``, only the teacher tempered,
            no T^2; ``hinton``: Hinton et al.'s ``T^2 KL`` with both at temperature T
            (:func:`~lightning_pfl.losses.distillation_loss`); ``mmd`` (the reference code's
            MMD): the squared MMD between the local model's and the HPM's features (the input
            of the classifier) on the batch, with five Gaussian kernels (:func:`gaussian_mmd`;
            ``temperature`` unused; networks with batch norm refused).
        inherit: weight of the HPM in the local model's starting point (0: start from the global
            model, as the reference code).
        total_rounds: T of mu_k (None: ``trainer.max_steps``).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        lam: UnitInterval = 0.1,
        mu: UnitInterval = 0.9,
        temperature: PositiveFloat = 4.0,
        distillation: Literal["tempered_teacher", "hinton", "mmd"] = "tempered_teacher",
        inherit: UnitInterval = 0.0,
        total_rounds: PositiveInt | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if distillation == "mmd":
            self.refuse_batch_norm(
                "model.init_args.distillation: mmd compares training-mode features of the local "
                "model with the HPM's (choose tempered_teacher or hinton)"
            )
        self.store.add_field("hpm", self.arch.initial_state())
        self.store.add_field("count", {"participations": torch.zeros(())})
        self.loss_fn = self.php_loss  # one object per run (recorded rounds are keyed by it)

    def php_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        """``(1 - lambda) CE(w_k) + lambda L_kt(v_k -> w_k)`` (frozen ``hpm.*`` is v_k)."""
        h = self.hp
        hpm = {n[4:]: t for n, t in context.items() if n.startswith("hpm.")}
        own = {n: t for n, t in context.items() if not n.startswith("hpm.")}
        model = {**own, **params}
        if h.distillation == "mmd":
            features = self.arch.features(model, x, train=True)
            logits = self.arch.classify(model, features)
            transfer = gaussian_mmd(features, self.arch.features(hpm, x).detach(), w)
            buffers: Params = {}
        else:
            logits, buffers = self.arch.forward_train(model, x)
            teacher = self.arch(hpm, x)
            kd = (
                tempered_teacher_loss if h.distillation == "tempered_teacher" else distillation_loss
            )
            transfer = kd(logits, teacher, h.temperature, w)
        ce = weighted_cross_entropy(logits, y, w)
        loss = (1 - h.lam) * ce + h.lam * transfer
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
        context = {f"hpm.{n}": t for n, t in hpm.items()}
        result = self.local_train(start, clients, round_idx, loss_fn=self.loss_fn, context=context)
        count = self.store.gather("count", clients, self.device)["participations"]
        rounds = h.total_rounds or (self.trainer.max_steps if self._trainer is not None else 1)
        participation = h.clients_per_round / h.num_clients
        mu = history_weight(count, h.mu, participation, rounds)
        arrived = self.arrived(clients, round_idx)
        updated = moving_average(hpm, result.params, mu)
        self.store.scatter("hpm", clients, self.where_arrived(clients, round_idx, updated, hpm))
        self.store.scatter("count", clients, {"participations": count + arrived.to(count)})
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        return self.store.gather("hpm", clients, self.device)
