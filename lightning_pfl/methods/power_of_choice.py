"""Power-of-Choice client selection (Cho, Wang & Joshi, AISTATS 2022, "Towards Understanding
Biased Client Selection in Federated Learning"): FedAvg on the highest-loss candidates."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.engine import derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.streams import CLIENT_STREAM, LOSS_SAMPLE_STREAM
from lightning_pfl.validation import PositiveInt

Variant = Literal["pow-d", "cpow-d", "rpow-d"]
LAST_LOSS = "last_loss"


class FedAvgPoC(FedAvg):
    """FedAvg whose clients are chosen by Power-of-Choice: biasing the selection towards
    clients with a higher local loss speeds up convergence.

    Round: (1) the server draws a candidate set A of d clients without replacement, client k
    with probability proportional to p_k = n_k / n (its share of the training samples);
    (2) it ranks the candidates by an estimate of their loss ``F_k(w^t)`` (``variant``);
    (3) the m = ``clients_per_round`` candidates ranked highest train as in FedAvg from w^t,
    and the server averages their models uniformly, ``w^{t+1} = (1/m) sum_{k in S} w_k`` (the
    p_k are already in the draw of A). Equal values (rpow-d's never-selected clients) go to
    the candidate drawn first, as the stable sort of the authors' code. Every client's
    personalized model is the global model.

    The paper's three strategies (``variant``):

    - ``pow-d``: w^t is sent to the d candidates and each returns ``F_k(w^t)``, its mean
      training loss on all its training samples (evaluation mode).
    - ``cpow-d`` (computation-efficient): each candidate returns the mean loss of w^t on b of
      its training samples drawn uniformly without replacement (all of them when n_k < b),
      ``~F_k(w^t) = (1/b) sum_{xi in xi_k} f(w^t, xi)``.
    - ``rpow-d`` (computation- and communication-efficient): nothing is sent to the
      candidates; the server ranks them by the loss each reported at its last participation,
      the mean training loss over its local steps then (stale by the rounds since), and a
      client never selected counts as +inf, so it is picked first. The values are kept per
      client (checkpointed); only the m picked receive w^t, and each uploads its loss with
      its model.

    The draws of A and of cpow-d's samples are seeded by round, and the values are a function
    of w^t and the stored losses, so a resumed run picks the same clients. Communication
    counts what is sent and returned: pow-d and cpow-d send w^t to all d candidates (the m
    picked train from that copy) and get a loss back from each, beside the m uploaded models;
    rpow-d sends w^t to the m picked and gets m models and m losses back.

    Args:
        candidates: d, the size of the candidate set (m <= d <= the number of training
            clients; d = m is FedAvg with clients drawn by p_k). None: 2m, the smallest d of
            the paper's FMNIST runs (d in {6, 9, 15} for m = 3), at most every training client.
        variant: the paper's selection strategy pi: ``pow-d`` (default), ``cpow-d`` or
            ``rpow-d``, as above.
        loss_batch_size: b, the samples cpow-d evaluates per candidate (cpow-d only). None:
            ``batch_size``, the paper's mini-batch size b (the authors' code draws the local
            batch size).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (``clients_per_round``: m).
    """

    def __init__(
        self,
        candidates: PositiveInt | None = None,
        variant: Variant = "pow-d",
        loss_batch_size: PositiveInt | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        m, n = self.hp.clients_per_round, self.num_training_clients
        if candidates is not None and not m <= candidates <= n:
            raise ConfigError(
                f"model.init_args.candidates = {candidates}: the candidate set must hold at "
                f"least clients_per_round = {m} and at most the {n} training clients; use "
                f"{m}..{n}."
            )
        if loss_batch_size is not None and variant != "cpow-d":
            raise ConfigError(
                f"model.init_args.loss_batch_size = {loss_batch_size}: only variant cpow-d "
                f"estimates the loss on b samples (variant is {variant}); remove "
                "loss_batch_size or set model.init_args.variant: cpow-d."
            )
        self.d = candidates if candidates is not None else min(2 * m, n)
        self.b = loss_batch_size if loss_batch_size is not None else self.hp.batch_size
        if variant == "rpow-d":
            self.store.add_field(LAST_LOSS, {LAST_LOSS: torch.tensor(float("inf"))})
        # The last round's candidates (by client id) and the values they were ranked by.
        self.queried: tuple[Tensor, Tensor] | None = None

    def candidate_draw(self, round_idx: int) -> Tensor:
        """A in the order drawn: d training clients without replacement, client k with
        probability p_k (seeded by round, so the same after resume)."""
        generator = torch.Generator().manual_seed(
            derive_seed(self.hp.seed, round_idx, CLIENT_STREAM)
        )
        share = self.data.num_samples("train")[: self.num_training_clients].double().cpu()
        drawn = torch.multinomial(share, self.d, replacement=False, generator=generator)
        return drawn.to(self.device)

    def draw_candidates(self, round_idx: int) -> Tensor:
        """A, by client id."""
        return self.candidate_draw(round_idx).sort().values

    def sample_clients(self, round_idx: int) -> Tensor:
        candidates, drawn_at = self.candidate_draw(round_idx).sort()
        value = self.selection_values(candidates, round_idx)
        self.queried = (candidates, value)
        in_draw_order = drawn_at.argsort()
        ranked = value[in_draw_order].sort(descending=True, stable=True).indices
        picked = in_draw_order[ranked[: self.hp.clients_per_round]]
        return candidates[picked].sort().values

    def selection_values(self, candidates: Tensor, round_idx: int) -> Tensor:
        """What the candidates are ranked by: F_k(w^t) (pow-d), its estimate on b samples
        (cpow-d), or the loss of each one's last participation (rpow-d)."""
        variant = self.hp.variant
        if variant == "rpow-d":
            return self.store.gather(LAST_LOSS, candidates, self.device)[LAST_LOSS]
        if variant == "cpow-d":
            return self.sampled_loss(candidates, round_idx)
        _, samples, loss_sum = self.evaluate_clients(
            candidates, "train", params=self.payload(candidates)
        )
        return loss_sum / samples

    @torch.no_grad()
    def sampled_loss(self, candidates: Tensor, round_idx: int) -> Tensor:
        """cpow-d's ~F_k(w^t): the mean cross-entropy of w^t (evaluation mode) on b samples of
        each candidate's training data, drawn uniformly without replacement (seeded by
        round)."""
        generator = torch.Generator(self.data.device).manual_seed(
            derive_seed(self.hp.seed, round_idx, LOSS_SAMPLE_STREAM)
        )
        batch = self.data.client_batches(candidates, self.b, generator, steps=1)
        x, y = self.data.fetch(batch.index[:, 0])
        x, y, weight = x.to(self.device), y.to(self.device), batch.weight[:, 0].to(self.device)
        logits = self.client_logits(self.payload(candidates), x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        return (loss.view_as(weight) * weight).sum(1) / weight.sum(1)

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        loss = super().run_round(round_idx, clients)
        if self.hp.variant == "rpow-d":
            self.store.scatter(LAST_LOSS, clients, {LAST_LOSS: loss})
        return loss

    def client_weights(
        self, clients: Tensor, round_idx: int | None = None, uniform: bool = True
    ) -> Tensor:
        """The selected clients' models are averaged uniformly (the draw of A weighs by p_k)."""
        return super().client_weights(clients, round_idx, uniform=True)

    def record_communication(self, down: Mapping[str, Tensor], up: Mapping[str, Tensor]) -> None:
        assert self.queried is not None, "sample_clients ranks the candidates first"
        if self.hp.variant == "rpow-d":
            # Each picked client's mean training loss travels with its model (counted here).
            losses = torch.zeros(self.hp.clients_per_round)
            super().record_communication(down, {**up, LAST_LOSS: losses})
            return
        candidates, loss = self.queried
        sent_to_candidates = {
            n: t[:1].expand(len(candidates), *t.shape[1:]) for n, t in down.items()
        }
        super().record_communication(sent_to_candidates, {**up, "candidate_loss": loss})
