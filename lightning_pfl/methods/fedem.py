"""FedEM (Marfoq et al., NeurIPS 2021): federated EM over a mixture of M shared components."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.components import Components, component_groups
from lightning_pfl.engine import Architecture, Params, TrainResult
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.models import build_network
from lightning_pfl.validation import PositiveInt

WEIGHTS = "mixture_weights"  # pi_t in personalized_params and the client store
RECEIVED = "received."  # Theta^{k-1} in the loss's context tensors
LOG_PI = "log_pi"  # log pi_t^{k-1} in the loss's context tensors


def component_losses(arch: Architecture, tensors: Params, x: Tensor, y: Tensor) -> Tensor:
    """``[M, B]`` cross-entropy of every component on every sample (evaluation mode)."""
    logits = arch(tensors, x).float()
    return F.cross_entropy(logits.flatten(0, 1), y.repeat(logits.shape[0]), reduction="none").view(
        logits.shape[:2]
    )


def responsibilities(log_pi: Tensor, losses: Tensor) -> Tensor:
    """E-step: ``q(z = m) proportional to pi_m exp(-l_m)`` over the components (dim 0 of the
    ``[M, ...]`` losses; ``log_pi`` is ``[M]``)."""
    return torch.softmax(log_pi.view(-1, *[1] * (losses.dim() - 1)) - losses, dim=0)


class FedEM(FedAvg):
    """FedEM: M shared components Theta = (theta_1..theta_M) and per-client mixture weights pi_t.

    Client t's model is the mixture ``p_t(y|x) = sum_m pi_tm p_{theta_m}(y|x)``. Round k
    (Algorithm 1 of the paper): the server sends Theta^{k-1} to the sampled clients; each client
    t

    - E-step: ``q_t(z_i = m) proportional to pi_tm^{k-1} exp(-l(h_{theta_m^{k-1}}(x_i), y_i))``
      for every training sample i (losses in evaluation mode);
    - M-step: ``pi_tm^k = (1/n_t) sum_i q_t(z_i = m)``;
    - trains every component from theta_m^{k-1} on ``(1/B) sum_b q_t(z_b = m) l(h_theta_m(x_b),
      y_b)`` over its batches (the paper's LocalSolver; all M in one ``local_train`` call, each
      component its own SGD group, see :mod:`lightning_pfl.components`);

    the server sets each theta_m to the sample-weighted mean ``sum_t (n_t / n) theta_m,t`` of
    the uploaded components (FedAvg's update on :class:`~lightning_pfl.components.Components`).
    The q of a batch's samples are the E-step's numbers recomputed from the received Theta^{k-1}
    and pi^{k-1} (passed as context), which spares a per-sample table. Components start from
    different seeded initializations, pi_t at uniform 1/M; a client keeps its pi_t between the
    rounds it is sampled in. The personalized model predicts the mixture
    ``log sum_m pi_tm softmax(h_theta_m(x))`` with the current Theta.

    Args:
        num_components: M, the number of shared components (the paper's experiments: 3).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(self, num_components: PositiveInt = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        h = self.hp
        with self.seeded_init():
            self.net = Components(
                [
                    build_network(h.net, h.input_shape, h.num_classes, **(h.net_args or {}))
                    for _ in range(num_components)
                ]
            )
        self.components = Architecture(self.net)
        self.groups = component_groups(self.components, num_components, self.local_sgd())
        uniform = torch.full((num_components,), 1.0 / num_components)
        self.store.add_field(WEIGHTS, {WEIGHTS: uniform})

    def em_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        """``sum_m (1/B) sum_b q(z_b = m) l(h_theta_m(x_b), y_b)`` with the E-step's q."""
        received = {n[len(RECEIVED) :]: t for n, t in context.items() if n.startswith(RECEIVED)}
        rest = {n: t for n, t in context.items() if n != LOG_PI and not n.startswith(RECEIVED)}
        q = responsibilities(context[LOG_PI], component_losses(self.components, received, x, y))
        logits, buffers = self.components.forward_train({**rest, **params}, x)
        losses = F.cross_entropy(
            logits.float().flatten(0, 1), y.repeat(logits.shape[0]), reduction="none"
        ).view(logits.shape[:2])
        loss = (q * losses * weight).sum() / weight.sum().clamp_min(1.0)
        return (loss, buffers) if buffers else loss

    @torch.no_grad()
    def mixture_weights(self, clients: Tensor, log_pi: Tensor) -> Tensor:
        """E-step and M-step on every training sample: ``[C, M]`` new pi of ``clients`` from
        the current components and their ``log_pi`` ``[C, M]``."""
        models = self.global_state()
        by_size = self.data.by_size(clients, "train")
        log_pi = by_size.sort({LOG_PI: log_pi})[LOG_PI]
        total = torch.zeros(len(clients), self.hp.num_components, device=self.device)
        for k, x, y, weight in by_size.blocks(self.hp.eval_batch_size):
            losses = component_losses(self.components, models, x.flatten(0, 1), y.flatten())
            losses = losses.view(-1, k, x.shape[1]).transpose(0, 1)  # [k, M, b]
            q = torch.softmax(log_pi[:k, :, None] - losses, dim=1)
            total[:k] += (q * weight[:, None]).sum(-1)
        return by_size.unsort(total / total.sum(1, keepdim=True))

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        pi = self.store.gather(WEIGHTS, clients, self.device)
        log_pi = pi[WEIGHTS].log()
        updated = {WEIGHTS: self.mixture_weights(clients, log_pi)}
        self.store.scatter(WEIGHTS, clients, self.where_arrived(clients, round_idx, updated, pi))
        received = {RECEIVED + n: t for n, t in self.payload(clients).items()}
        context = received | {LOG_PI: log_pi}
        return self.local_train(
            start,
            clients,
            round_idx,
            groups=self.groups,
            loss_fn=self.em_loss,
            context=context,
            arch=self.components,
        )

    def personalized_params(self, clients: Tensor) -> Params:
        return self.payload(clients) | self.store.gather(WEIGHTS, clients, self.device)

    def predict(self, params: Params, x: Tensor) -> Tensor:
        """Log of the mixture ``sum_m pi_m softmax(h_theta_m(x))`` (normalized: its
        cross-entropy is the mixture's negative log-likelihood)."""
        pi = params[WEIGHTS]
        logits = self.components({n: t for n, t in params.items() if n != WEIGHTS}, x)
        log_probs = torch.log_softmax(logits.float(), -1) + pi.log().view(-1, 1, 1)
        return torch.logsumexp(log_probs, dim=0)
