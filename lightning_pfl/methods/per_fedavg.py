"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar, NeurIPS 2020): MAML-style personalized FedAvg."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.func import grad, grad_and_value, vmap

from lightning_pfl.engine import Params, TrainResult, derive_seed, weighted_cross_entropy
from lightning_pfl.losses import linear_surrogate
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.novel_adaptation import NovelAdaptation
from lightning_pfl.streams import ADAPT_STREAM
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat


def hessian_vector_product(
    grad_fn: Callable[[Params], Params], params: Params, v: Params, delta: float
) -> Params:
    """H(params) v ~ (grad(params + delta v) - grad(params - delta v)) / (2 delta)."""
    plus = grad_fn({n: t + delta * v[n] for n, t in params.items()})
    minus = grad_fn({n: t - delta * v[n] for n, t in params.items()})
    return {n: (plus[n] - minus[n]) / (2 * delta) for n in params}


class PerFedAvg(FedAvg):
    """Per-FedAvg: FedAvg on the MAML objective F_i(w) = f_i(w - alpha grad f_i(w)).

    Each local step splits its batch into independent parts D, D' (and D'' for HF):
    w~ = w - alpha grad f(w; D); g = grad f(w~; D'); then w <- w - beta * d with d = g (FO,
    the first-order approximation) or d = g - alpha H(w; D'') g (HF, the Hessian-vector
    product by central finite differences of step delta). The server averages the w_i
    (sample-weighted). A client's personalized model is the global model after one SGD step
    of size alpha on a batch of its own training data (``batch_size`` samples, seeded by the
    round).

    A novel client (:class:`~lightning_pfl.novel.NovelClients`) adapts as Per-FedAvg
    personalizes: plain SGD steps from the global model on batches of its own data, with the
    callback's ``steps`` and ``lr`` (``steps: 1, lr: alpha`` is exactly the personalization
    above); its accuracy at step 0 is the global model's.

    Args:
        variant: ``fo`` (Per-FedAvg (FO)) or ``hf`` (Per-FedAvg (HF)).
        alpha: inner (adaptation) step size alpha.
        delta: finite-difference step delta of the HF variant (paper: 0.001).
        local_lr: the outer step size beta.
        local_momentum: momentum of the outer step (paper: none).
        local_weight_decay: weight decay of the outer step (paper: none).
        local_max_grad_norm: clip of the outer direction d (paper: none).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`; ``batch_size`` is the
            size of D + D' (+ D'').
    """

    honours_conditions = True

    def __init__(
        self,
        variant: Literal["fo", "hf"] = "fo",
        alpha: PositiveFloat = 0.01,
        delta: PositiveFloat = 0.001,
        local_lr: PositiveFloat = 0.001,
        local_momentum: Momentum = 0.0,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        self.refuse_batch_norm("Per-FedAvg")
        # one object for every round: a recorded round (CUDA graph) is keyed by the loss
        self.client_loss = self.maml_loss

    def maml_loss(self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        h = self.hp
        parts = 2 if h.variant == "fo" else 3
        part = torch.arange(w.shape[0], device=w.device) * parts // w.shape[0]

        def f(k: int) -> Callable[[Params], Tensor]:
            def loss(p: Params) -> Tensor:
                return weighted_cross_entropy(self.arch(p, x, train=True), y, w * (part == k))

            return loss

        start = {n: t.detach() for n, t in params.items()}
        inner = grad(f(0))(start)
        adapted = {n: t - h.alpha * inner[n] for n, t in start.items()}
        outer, value = grad_and_value(f(1))(adapted)
        if h.variant == "hf":
            hv = hessian_vector_product(grad(f(2)), start, outer, h.delta)
            outer = {n: g - h.alpha * hv[n] for n, g in outer.items()}
        return value.detach() + linear_surrogate(params, outer)

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        return self.local_train(start, clients, round_idx, loss_fn=self.client_loss)

    def personalized_params(self, clients: Tensor) -> Params:
        """The global model after one step of size alpha on a batch of each client's data."""
        h = self.hp
        params = {n: t.contiguous() for n, t in super().personalized_params(clients).items()}
        seed = derive_seed(h.seed, self.current_round, ADAPT_STREAM)
        generator = torch.Generator(self.data.device).manual_seed(seed)
        batches = self.data.client_batches(clients, h.batch_size, generator, steps=1)
        x, y = self.data.fetch(batches.index[:, 0])

        def adapt(p: Params, x: Tensor, y: Tensor, w: Tensor) -> Params:
            g = grad(lambda q: weighted_cross_entropy(self.arch(q, x), y, w))(p)
            return {n: t - h.alpha * g[n] for n, t in p.items()}

        return vmap(adapt)(params, x, y, batches.weight[:, 0])

    def novel_adaptation(self, clients: Tensor) -> NovelAdaptation:
        """Gradient steps from the global model on each novel client's own batches."""
        return self.fine_tune_adaptation(clients)
