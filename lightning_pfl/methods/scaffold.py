"""SCAFFOLD (Karimireddy et al., ICML 2020): stochastic controlled averaging."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import LossFn, Params
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.params import prefixed, split_prefixed
from lightning_pfl.privacy import privatizes
from lightning_pfl.server_state import NamedBuffers
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat

CORRECTION = "correction"


def linear_loss(base: LossFn, names: tuple[str, ...], prefix: str) -> LossFn:
    """``base + sum_n <params[n], context[prefix.n]>``: the loss whose gradient is the base
    gradient plus the frozen per-client coefficient (SCAFFOLD's ``c - c_i``, FedDyn's
    ``-grad L_k(theta_k^{t-1})``). ``base`` gets the context tensors without the prefix."""
    head = prefix + "."

    def loss(
        params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        rest = {n: t for n, t in context.items() if not n.startswith(head)}
        out = base(params, rest, x, y, weight)
        linear = torch.stack([(params[n] * context[head + n]).sum() for n in names]).sum()
        if isinstance(out, tuple):
            return out[0] + linear, out[1]
        return out + linear

    return loss


def per_client(values: Tensor, like: Tensor) -> Tensor:
    """``values [C]`` shaped to broadcast against a stacked tensor ``like [C, ...]``."""
    return values.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


class SCAFFOLD(FedAvg):
    """SCAFFOLD: local steps corrected by control variates, ``y <- y - eta_l (g(y) - c_i + c)``.

    Round (Algorithm 1): the server sends x and its control variate c; client i starts from
    y_i = x and takes K SGD steps on its loss plus ``<y, c - c_i>`` (gradient ``g - c_i + c``);
    it updates its control variate with option II, ``c_i+ = c_i - c + (x - y_i) / (K eta_l)``
    (K the steps it took), and uploads ``(y_i - x, c_i+ - c_i)``. The server averages both over
    the sampled set S (uniformly): ``x <- x + eta_g mean(y_i - x)``, ``c <- c + |S|/N
    mean(c_i+ - c_i)``. c starts at zero, as every c_i. Uplink and downlink both carry two
    models' worth of tensors (counted). Buffers (batch-norm statistics) are averaged, not
    corrected. Every client's personalized model is the global model x.

    Unreliable clients (``conditions``): S is the set that reported back; a client that did
    not keeps its c_i, x moves by the uniform mean over S and c by ``|S|/N mean_S(c_i+ -
    c_i)``; a round where nothing arrived leaves x and c as they were.

    Client-level DP (``client_dp``, z and clip norm C): DP-FedAvg on the joint upload
    ``[y_i - x, c_i+ - c_i]``, clipped as one vector to norm C and noised with
    N(0, z^2 C^2 I) on the sum, which both means divide by the fixed qN (noise std z C / qN on
    each coordinate): x and c move by that one release. The client keeps its c_i+ as computed
    (unclipped): it is personal and reaches the server only through the clipped c_i+ - c_i,
    so c is no longer the mean of the c_i. A client that did not report back adds nothing to
    the sum, which still divides by qN.

    Args:
        server_lr: eta_g, the global step size (paper: 1).
        local_lr: eta_l, the local step size (option II divides by it).
        local_momentum: client SGD momentum (paper: none; option II's ``(x - y_i) / (K eta_l)``
            is the mean corrected gradient only for plain SGD).
        local_weight_decay: client weight decay (paper: none).
        local_max_grad_norm: client gradient clip (paper: none).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (K: ``local_steps`` or
            ``local_epochs``).
    """

    honours_conditions = True

    def __init__(
        self,
        server_lr: PositiveFloat = 1.0,
        local_lr: PositiveFloat = 5e-3,
        local_momentum: Momentum = 0.0,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            server_lr=server_lr,
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        zeros = {n: torch.zeros(s) for n, s in self.arch.shapes.items()}
        self.control = NamedBuffers(zeros)  # c
        self.store.add_field("control", zeros)  # c_i
        # one object for every round: a recorded round (CUDA graph) is keyed by the loss
        self.corrected_loss = linear_loss(self.cross_entropy, tuple(zeros), CORRECTION)

    @privatizes(
        "the model update y_i - x and the control-variate update c_i+ - c_i of each client, "
        "clipped together as one vector; x and c move by the one noisy release, and the "
        "client's own c_i+ (kept unclipped) never leaves it"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        sent = self.payload(clients)
        c = {n: t.expand(len(clients), *t.shape) for n, t in self.control.tensors().items()}
        c_i = self.store.gather("control", clients, self.device)
        correction = {n: c[n] - c_i[n] for n in c}
        result = self.local_train(
            {n: t.clone() for n, t in sent.items()},
            clients,
            round_idx,
            loss_fn=self.corrected_loss,
            context=prefixed(CORRECTION, correction),
        )
        steps = result.steps.to(self.device).clamp_min(1) * self.hp.local_lr  # K eta_l
        # a client that did not report back took no step and uploads nothing: Delta c_i = 0
        arrived = self.arrived(clients, round_idx)
        delta_c = {
            n: torch.where(
                arrived.view(-1, *([1] * (sent[n].dim() - 1))),
                (sent[n] - result.params[n]) / per_client(steps, sent[n]) - c[n],
                0.0,
            )
            for n in c
        }
        self.store.scatter("control", clients, {n: c_i[n] + delta_c[n] for n in c})
        uploaded = {n: result.params[n] for n in sent}
        if self.client_dp is not None:  # Delta c_i is itself an update: its "sent" is zero
            zeros = {n: torch.zeros_like(d) for n, d in delta_c.items()}
            private, weights = self.dp_uploads(
                round_idx,
                sent | prefixed(CORRECTION, zeros),
                uploaded | prefixed(CORRECTION, delta_c),
            )
            self.update_server(
                {n: private[n] for n in sent}, weights, *split_prefixed(private, CORRECTION)
            )
        elif not self.nothing_arrived(clients, round_idx):
            self.update_server(
                uploaded, self.client_weights(clients, round_idx, uniform=True), delta_c
            )
        self.record_communication(
            down=sent | prefixed(CORRECTION, c), up=uploaded | prefixed(CORRECTION, delta_c)
        )
        return result.loss

    def update_server(self, uploaded: Params, weights: Tensor, delta_c: Params) -> None:
        """x <- x + eta_g (sum_i w_i y_i - x) (the server optimizer's step) and
        c <- c + (1/N) sum_i Delta c_i (that is, |S|/N times their mean over the |S| uploads)."""
        self.aggregate(uploaded, weights)
        with torch.no_grad():
            for n, d in delta_c.items():
                self.control[n].add_(d.sum(0) / self.num_training_clients)
