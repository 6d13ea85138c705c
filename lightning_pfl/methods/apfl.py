"""APFL (Deng et al., 2020): adaptive mixtures of a local and the global model."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import ParamGroup, Params, SGDConfig, TrainResult, weighted_cross_entropy
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import PositiveFloat, UnitInterval

LOCAL, ALPHA = "v.", "alpha"


class ProjectedStep(torch.autograd.Function):
    """Identity on alpha in [0, 1] whose gradient makes one SGD step land on the projection.

    Backward turns the gradient g into ``(alpha - clamp(alpha - lr * g, 0, 1)) / lr``: equal
    to g whenever ``alpha - lr * g`` stays in [0, 1], so a plain SGD step (no momentum, no
    weight decay) of size ``lr`` on alpha is exactly projected SGD, as in APFL's code.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(alpha: Tensor, lr: float) -> Tensor:
        return alpha.clamp(0.0, 1.0)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.lr = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (alpha,) = ctx.saved_tensors
        stepped = alpha - ctx.lr * grad
        inside = (stepped >= 0) & (stepped <= 1)
        projected = (alpha - stepped.clamp(0.0, 1.0)) / ctx.lr
        return torch.where(inside, grad, projected), None


def mix(alpha: Tensor, local: Params, global_: Params) -> Params:
    """The personalized model ``alpha * v + (1 - alpha) * w``, tensor by tensor."""
    return {n: alpha * local[n] + (1 - alpha) * global_[n] for n in global_}


class APFL(FedAvg):
    """APFL: each client learns a local model v_i and a mixing weight alpha_i.

    Round for a sampled client i: receive the global model w; at every local step, on the
    same batch, update w <- w - eta grad f_i(w), v_i <- v_i - eta grad_v f_i(v_bar) and
    alpha_i <- Proj_[0,1](alpha_i - eta_alpha grad_alpha f_i(v_bar)) with the mixed model
    v_bar = alpha_i v_i + (1 - alpha_i) w (w enters v_bar without gradient; the three updates
    are simultaneous, as in the paper's Algorithm 1); upload w; the server averages
    (sample-weighted). grad_alpha f_i(v_bar) = <v_i - w, grad f_i(v_bar)>. v_i (from the
    initial model) and alpha_i never leave the client. Personalized model:
    alpha_i v_i + (1 - alpha_i) w with the current global w. The logged training loss is
    f_i(w) + f_i(v_bar).

    Args:
        alpha: initial mixing weight alpha_i (paper: 0.5 for adaptive alpha).
        alpha_lr: step size of alpha (None: ``local_lr``, the paper's single eta); plain SGD,
            projected onto [0, 1] after every step.
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (w and v_i use the local
            SGD settings, a fresh optimizer each round).
    """

    honours_conditions = True

    def __init__(
        self, alpha: UnitInterval = 0.5, alpha_lr: PositiveFloat | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("APFL mixes model weights")
        self.store.add_field("local", self.arch.initial_params())
        self.store.add_field(ALPHA, {ALPHA: torch.tensor(float(alpha))})
        self.apfl_loss = self.make_loss()

    @property
    def alpha_lr(self) -> float:
        return float(self.hp.alpha_lr if self.hp.alpha_lr is not None else self.hp.local_lr)

    def make_loss(self) -> Any:
        lr = self.alpha_lr

        def loss(params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor) -> Tensor:
            w = {n: params[n] for n in self.arch.shapes}
            v = {n: params[LOCAL + n] for n in self.arch.shapes}
            alpha = ProjectedStep.apply(params[ALPHA], lr)
            mixed = mix(alpha, v, {n: t.detach() for n, t in w.items()})
            global_loss = weighted_cross_entropy(self.arch(w, x, train=True), y, weight)
            mixed_loss = weighted_cross_entropy(self.arch(mixed, x, train=True), y, weight)
            return global_loss + mixed_loss

        return loss

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        local = {LOCAL + n: t for n, t in self.store.gather("local", clients, self.device).items()}
        alpha = self.store.gather(ALPHA, clients, self.device)
        sgd = self.local_sgd()
        groups = [
            ParamGroup(tuple(start), sgd),
            ParamGroup(tuple(local), sgd),
            ParamGroup((ALPHA,), SGDConfig(self.alpha_lr)),
        ]
        result = self.local_train(
            {**start, **local, **alpha}, clients, round_idx, groups, self.apfl_loss
        )
        self.store.scatter("local", clients, {n[len(LOCAL) :]: result.params[n] for n in local})
        self.store.scatter(ALPHA, clients, {ALPHA: result.params[ALPHA].clamp(0.0, 1.0)})
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        v = self.store.gather("local", clients, self.device)
        alpha = self.store.gather(ALPHA, clients, self.device)[ALPHA]
        w = super().personalized_params(clients)
        return {n: mix(alpha.view(-1, *[1] * (t.dim() - 1)), v, {n: t})[n] for n, t in w.items()}
