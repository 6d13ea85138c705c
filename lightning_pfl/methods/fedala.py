"""FedALA (Zhang et al., AAAI 2023): adaptive local aggregation of the global model."""

from __future__ import annotations

from typing import Annotated, Any

import torch
from torch import Tensor

from lightning_pfl.engine import (
    ClientBatches,
    ParamGroup,
    Params,
    SGDConfig,
    TrainResult,
    weighted_cross_entropy,
)
from lightning_pfl.methods.apfl import ProjectedStep
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import NonNegativeFloat, PositiveFloat, PositiveInt, Range

WEIGHT, LOCAL, GLOBAL = "ala.", "local.", "global."
ALA_PHASE = 5  # batch stream of the ALA subset (apart from local training's)
Percent = Annotated[float, Range(gt=0, le=100)]


class FedALA(FedAvg):
    """FedALA: each client mixes the received global model into its own model element-wise
    with weights it learns (ALA), then trains; the server averages as FedAvg.

    Round for a sampled client i with local model Theta_i (its model after its last local
    training) and the received global model Theta: the lower layers are taken from Theta;
    each of the top p layers becomes Theta_i + (Theta - Theta_i) * W_i, with element-wise
    weights W_i in [0, 1] (ones at first) learned on s% of the client's training data (a new
    random subset each round, in batches of ``batch_size``) by
    W_i <- clip(W_i - eta grad_{W_i} L, 0, 1), L the cross-entropy of the mixed model. At the
    client's first ALA (its second participation) W_i is trained epoch after epoch until the
    standard deviation of the last ``convergence_window`` epoch losses is below
    ``convergence_threshold``, at most ``ala_max_epochs`` epochs; afterwards one epoch per
    round. The client then trains the mixed model as FedAvg does, keeps it as Theta_i and
    uploads it. A client's first participation has no local model yet: it starts from Theta.

    Personalized model: Theta_i (the global model for a client never sampled).

    Under ``conditions`` a participation is a round in which the client reported back: a client
    that dropped keeps its Theta_i and W_i (its ALA and training took no step), and its record
    of participations does not count the round.

    All clients of a round learn their weights together: clients that converged, and clients
    past their first ALA after one epoch, idle (masked steps); the server knows from its record
    of participations which clients need an ALA and how many epochs the round may take. One
    host synchronization per ``convergence_window`` epochs stops the epochs once every client
    has converged, and, unless rounds are recorded as CUDA graphs (fixed shapes), the epochs
    after the first train only the clients still in their first ALA (at that synchronization)
    instead of masking the others: the same weights, far fewer steps.

    Args:
        eta: learning rate eta of the ALA weights (paper: 1.0).
        rand_percent: s, the percent of the local training data the weights learn on (80).
        ala_layers: p, the number of top layers (modules with parameters) that are mixed
            element-wise; the layers below take the global model (paper: 1).
        convergence_threshold: the first ALA stops once the standard deviation of the last
            ``convergence_window`` epoch losses is below it (the paper's 0.01, per the
            reference code's README).
        convergence_window: how many epoch losses that standard deviation reads (reference
            code: 10).
        ala_max_epochs: at most this many epochs in the first ALA (the paper has no limit).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        eta: PositiveFloat = 1.0,
        rand_percent: Percent = 80.0,
        ala_layers: PositiveInt = 1,
        convergence_threshold: NonNegativeFloat = 0.01,
        convergence_window: PositiveInt = 10,
        ala_max_epochs: PositiveInt = 100,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("FedALA mixes weights element-wise")
        layers = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in self.arch.shapes))
        top = set(layers[-ala_layers:])
        self.top = tuple(n for n in self.arch.shapes if n.rsplit(".", 1)[0] in top)
        initial = self.arch.initial_params()
        self.store.add_field("local", initial)
        self.store.add_field("weights", {WEIGHT + n: torch.ones_like(initial[n]) for n in self.top})
        # participations so far, on the host: which clients need an ALA is the server's record
        self.visits = torch.zeros(self.hp.num_clients, dtype=torch.long)
        # one object for every round: a recorded round (CUDA graph) is keyed by the loss
        self.weight_loss = self.ala_loss

    # ----------------------------------------------------------------- ALA
    def mixed(self, weights: Params, context: Params) -> Params:
        """The model Theta_i + (Theta - Theta_i) * W on the top layers, Theta below."""
        eta = self.hp.eta
        top = {}
        for n in self.top:
            w = ProjectedStep.apply(weights[WEIGHT + n], eta)
            top[n] = context[LOCAL + n] + (context[GLOBAL + n] - context[LOCAL + n]) * w
        lower = {n: context[GLOBAL + n] for n in self.arch.shapes if n not in top}
        return lower | top

    def ala_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor
    ) -> Tensor:
        logits = self.arch(self.mixed(params, context), x, train=True)
        return weighted_cross_entropy(logits, y, weight)

    def ala_batches(self, clients: Tensor, round_idx: int) -> ClientBatches:
        """One pass, in batches, over a random s% of each client's training data (under
        ``conditions``: a straggler's fraction of these steps, none for a dropped client)."""
        batches = self.draw_batches(clients, round_idx, epochs=1, phase=ALA_PHASE)
        n = self.data.num_samples("train")[clients.to(self.data.device)]
        size = (n.double() * self.hp.rand_percent / 100).floor().clamp_min(1)
        steps, batch = batches.index.shape[1:]
        position = torch.arange(steps * batch, device=n.device).view(steps, batch)
        weight = batches.weight * (position < size.view(-1, 1, 1)).float()
        subset = ClientBatches(batches.index, weight, weight.amax(-1) > 0)
        if self.unreliable is None:
            return subset
        # the weights keep the whole epoch: cut the subset's own steps, not the epoch's
        return self.unreliable.restrict(subset, clients, round_idx)

    def adaptive_local_aggregation(
        self, round_idx: int, clients: Tensor, received: Params, local: Params, first: Tensor
    ) -> tuple[Params, Params]:
        """The mixed models and the learned weights of ``clients``; ``first`` (on the host)
        marks the clients whose first ALA this is (trained to convergence)."""
        h = self.hp
        weights = self.store.gather("weights", clients, self.device)
        context = {GLOBAL + n: received[n] for n in self.arch.shapes}
        context |= {LOCAL + n: local[n] for n in self.top}
        batches = self.ala_batches(clients, round_idx)
        group = [ParamGroup(tuple(weights), SGDConfig(h.eta))]

        def epoch_of(weights: Params, rows: Tensor | None, active: Tensor) -> tuple[Params, Tensor]:
            """One epoch of the weights of clients ``rows`` (None: all); the others' steps
            idle, and their weights and epoch losses (0) are what a masked epoch gives them."""

            def take(t: Tensor) -> Tensor:
                return t if rows is None else t[rows]

            result = self.local_train(
                {n: take(t) for n, t in weights.items()},
                clients if rows is None else clients[rows.to(clients.device)],
                round_idx,
                groups=group,
                loss_fn=self.weight_loss,
                context={n: take(t) for n, t in context.items()},
                batches=ClientBatches(take(batches.index), take(batches.weight), take(active)),
            )
            if rows is None:
                return result.params, result.loss
            trained = {n: t.index_copy(0, rows, result.params[n]) for n, t in weights.items()}
            return trained, result.loss.new_zeros(len(clients)).index_copy(0, rows, result.loss)

        # Without recorded rounds (whose shapes are fixed) the epochs after the first train
        # only the clients still learning instead of masking the others' steps, which vmap
        # would compute in full: the same weights for a fraction of the work.
        compact = self.executor.graphs is None
        rows = first.nonzero().flatten().to(self.device) if compact else None
        running = first.to(self.device)
        losses: list[Tensor] = []
        for epoch in range(h.ala_max_epochs if bool(first.any()) else 1):
            if epoch:
                weights, loss = epoch_of(weights, rows, batches.active & running.view(-1, 1))
            else:
                weights, loss = epoch_of(weights, None, batches.active)
            losses.append(loss)
            if len(losses) > h.convergence_window:
                recent = torch.stack(losses[-h.convergence_window :], 1)
                done = recent.std(1, unbiased=False) < h.convergence_threshold
                running = running & ~done
                # once every client has converged the remaining epochs are idle (masked)
                # steps that change nothing: one host sync per window stops them
                if epoch % h.convergence_window == 0:
                    still = running.cpu()
                    if not bool(still.any()):
                        break
                    if compact:
                        rows = still.nonzero().flatten().to(self.device)
        weights = {n: t.clamp(0.0, 1.0) for n, t in weights.items()}
        with torch.no_grad():
            return self.mixed(weights, context), weights

    # ----------------------------------------------------------------- the round
    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        visits = self.visits[clients.cpu()]
        seen = visits > 0
        if bool(seen.any()):
            local = self.store.gather("local", clients, self.device)
            mask = seen.to(self.device)
            # a client without a local model mixes Theta with itself: its start is Theta
            local = {
                n: torch.where(mask.view(-1, *[1] * (t.dim() - 1)), local[n], t)
                for n, t in start.items()
            }
            start, weights = self.adaptive_local_aggregation(
                round_idx, clients, start, local, visits == 1
            )
            self.store.scatter("weights", clients, weights)
        result = self.local_train({n: t.clone() for n, t in start.items()}, clients, round_idx)
        # the mixed start of a client that dropped is not its model: it keeps Theta_i
        self.scatter_arrived("local", clients, round_idx, result.params)
        self.visits[clients.cpu()] += self.arrived(clients.cpu(), round_idx).long()
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        state = self.global_state()
        seen = (self.visits[clients.cpu()] > 0).to(self.device)
        local = self.store.gather("local", clients, self.device)
        return {
            n: torch.where(
                seen.view(-1, *[1] * t.dim()), local[n], t.expand(len(clients), *t.shape)
            )
            for n, t in state.items()
        }

    # ----------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["pfl"]["visits"] = self.visits.clone()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.visits = checkpoint["pfl"]["visits"].clone()
