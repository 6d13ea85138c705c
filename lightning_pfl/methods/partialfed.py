"""PartialFed (Sun et al., 2021): per layer, load the global layer or keep the local one."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from lightning_pfl.engine import (
    ParamGroup,
    Params,
    SGDConfig,
    TrainResult,
    derive_seed,
)
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.step_inputs import CLOCK, CLOCK_GROUP, at, start_clock, tick
from lightning_pfl.streams import LOAD_STREAM
from lightning_pfl.validation import PositiveFloat, PositiveInt

NOISE = "select_noise"  # [C, S, L] logistic noise of each selection step (frozen)


def layer_of(name: str) -> str:
    """The module a tensor belongs to (``conv1.weight`` -> ``conv1``)."""
    return name.rsplit(".", 1)[0]


def mix_layers(glob: Params, local: Params, load: Params) -> Params:
    """Per layer l: ``s_l * global + (1 - s_l) * local``; ``load[l]`` is s_l, ``[C]``."""
    out = {}
    for n, g in glob.items():
        s = load[layer_of(n)].to(g).view(-1, *([1] * (g.dim() - 1)))
        out[n] = s * g + (1 - s) * local[n]
    return out


class PartialFed(FedAvg):
    """PartialFed-Adaptive: each client learns, per layer, whether to start the round from the
    global layer or from its own layer.

    Every client keeps its last trained model (its local model; before its first round, the
    global model) and one selection logit beta_l per layer (module), the probability of
    loading the global layer being ``sigmoid(beta_l)`` (initially 0.5). Round for a sampled
    client: it receives the global model; (1) selection: ``select_steps`` SGD steps on the
    betas only, on the cross-entropy of the relaxed model
    ``s_l * global_l + (1 - s_l) * local_l``; (2) partial initialization: layer l starts from
    the global layer (s_l = 1) or from the local one (s_l = 0); (3) local training of that
    model (cross-entropy); it keeps the trained model as its local model and uploads it; the
    server averages as FedAvg. The personalized model is the client's local model (the one
    it trained last), so evaluation makes no choice.

    ``decision: sampled`` (the paper's learned relaxed Bernoulli, as we read it): at each
    selection step s_l is a relaxed Bernoulli (binary Concrete / Gumbel-softmax) sample
    ``sigmoid((beta_l + L) / tau)`` with fresh logistic noise ``L = log u - log(1 - u)``, and
    the load decision is a Bernoulli(sigmoid(beta_l)) sample ``[beta_l + L' > 0]``; the noise
    is drawn per (seed, round, client) on the server (stream ``LOAD_STREAM``), so the clients'
    steps stay free of random numbers. ``decision: rounded`` (our earlier reading):
    ``s_l = sigmoid(beta_l)`` and the load decision is ``[sigmoid(beta_l) >= 0.5]``.
    ``choice: global`` loads every layer (FedAvg's start), ``choice: local`` none
    (PartialFed's fixed extremes; selection is skipped).

    Args:
        choice: ``adaptive`` (learned per layer), ``global`` or ``local``.
        decision: how an adaptive choice is made: ``sampled`` (the paper) or ``rounded``.
        select_temperature: tau of the relaxed Bernoulli in the selection steps (``sampled``;
            ours: 1.0, the temperature of Gumbel-softmax's default form).
        select_steps: SGD steps on the selection logits per round (ours: 5).
        select_lr: their learning rate (ours: 0.1; no momentum, no weight decay).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        choice: Literal["adaptive", "global", "local"] = "adaptive",
        decision: Literal["sampled", "rounded"] = "sampled",
        select_temperature: PositiveFloat = 1.0,
        select_steps: PositiveInt = 5,
        select_lr: PositiveFloat = 0.1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        initial = self.arch.initial_state()
        self.layers = tuple(dict.fromkeys(layer_of(n) for n in initial))
        self.store.add_field("local", initial)
        self.store.add_field("seen", {"seen": torch.zeros(())})
        self.store.add_field("select", {layer: torch.zeros(()) for layer in self.layers})
        self.loss_fn = self.relaxed_loss  # one object per run (recorded rounds are keyed by it)

    def relaxed_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor:
        """Cross-entropy of the model mixing global and local layers by s_l: the relaxed
        Bernoulli sample of this step when ``context`` holds the noise, else sigmoid(beta_l)."""
        glob = {n[7:]: t for n, t in context.items() if n.startswith("global.")}
        local = {n[6:]: t for n, t in context.items() if n.startswith("local.")}
        beta = torch.stack([params[layer] for layer in self.layers])
        if NOISE in context:
            beta = (beta + at(context[NOISE], params[CLOCK])) / self.hp.select_temperature
        load = dict(zip(self.layers, torch.sigmoid(beta), strict=True))
        loss = self.cross_entropy(mix_layers(glob, local, load), {}, x, y, w)
        loss = loss[0] if isinstance(loss, tuple) else loss
        return tick(loss, params[CLOCK]) if CLOCK in params else loss

    def load_noise(self, round_idx: int, clients: Tensor, steps: int) -> tuple[Tensor, Tensor]:
        """Logistic noise of ``clients`` in round ``round_idx``: ``[C, L]`` for the load
        decision and ``[C, steps, L]`` for the selection steps, each client's drawn from the
        run's seed, the round and its id alone."""
        generator = torch.Generator().manual_seed(derive_seed(self.hp.seed, round_idx, LOAD_STREAM))
        n, layers = self.hp.num_clients, len(self.layers)
        u = [torch.rand(shape, generator=generator) for shape in ((n, layers), (n, steps, layers))]
        noise = [(v.log() - torch.log1p(-v)).to(self.device)[clients] for v in u]
        return noise[0], noise[1]

    def local_models(self, clients: Tensor, glob: Params) -> Params:
        """The clients' local models; the global model for clients never sampled."""
        seen = self.store.gather("seen", clients, self.device)["seen"]
        local = self.store.gather("local", clients, self.device)
        return mix_layers(local, glob, {layer: seen for layer in self.layers})

    def select(self, round_idx: int, clients: Tensor, glob: Params, local: Params) -> Params:
        """Train the selection logits; return the load decision s_l of every layer, ``[C]``."""
        h = self.hp
        if h.choice != "adaptive":
            value = 1.0 if h.choice == "global" else 0.0
            return {layer: torch.full((len(clients),), value) for layer in self.layers}
        logits = self.store.gather("select", clients, self.device)
        batches = self.draw_batches(clients, round_idx, phase=1, first_steps=h.select_steps)
        context = {f"global.{n}": t for n, t in glob.items()}
        context |= {f"local.{n}": t for n, t in local.items()}
        groups = [ParamGroup(self.layers, SGDConfig(h.select_lr))]
        if h.decision == "sampled":
            decision, context[NOISE] = self.load_noise(round_idx, clients, batches.index.shape[1])
            logits |= start_clock(len(clients), self.device)
            groups.append(CLOCK_GROUP)
        else:
            decision = torch.zeros(len(clients), len(self.layers), device=self.device)
        result = self.local_train(
            logits, clients, round_idx, groups, self.loss_fn, context, batches=batches
        )
        beta = {layer: result.params[layer] for layer in self.layers}
        self.store.scatter("select", clients, beta)
        return {
            layer: (beta[layer] + decision[:, i] >= 0).float()
            for i, layer in enumerate(self.layers)
        }

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        local = self.local_models(clients, start)
        load = self.select(round_idx, clients, start, local)
        result = self.local_train(mix_layers(start, local, load), clients, round_idx)
        self.scatter_arrived("local", clients, round_idx, result.params)
        seen = {"seen": torch.ones(len(clients), device=self.device)}
        self.scatter_arrived("seen", clients, round_idx, seen)
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        return self.local_models(clients, self.payload(clients))

    def load_probabilities(self) -> Params:
        """sigmoid(beta_l) of every client and layer."""
        return {layer: torch.sigmoid(t) for layer, t in self.store.fields["select"].items()}
