"""Power-of-Choice client selection (Cho, Wang & Joshi, AISTATS 2022, "Towards Understanding
Biased Client Selection in Federated Learning"): FedAvg on the highest-loss candidates."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_pfl.engine import derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.streams import CLIENT_STREAM
from lightning_pfl.validation import PositiveInt


class FedAvgPoC(FedAvg):
    """FedAvg whose clients are chosen by Power-of-Choice (pow-d): biasing the selection
    towards clients with a higher local loss speeds up convergence.

    Round: (1) the server draws a candidate set A of d clients without replacement, client k
    with probability proportional to p_k = n_k / n (its share of the training samples);
    (2) it sends w^t to the candidates and each returns ``F_k(w^t)``, its mean training loss on
    all its training samples (evaluation mode); (3) the m = ``clients_per_round`` candidates
    with the highest loss train as in FedAvg from w^t, and the server averages their models
    uniformly, ``w^{t+1} = (1/m) sum_{k in S} w_k`` (the p_k are already in the draw of A).
    The draw of A is seeded by round, and the losses are a function of w^t, so a resumed run
    picks the same clients. Communication counts w^t sent to all d candidates (the m picked
    train from that copy) and a loss back from each, beside the m uploaded models. Every
    client's personalized model is the global model.

    Args:
        candidates: d, the size of the candidate set (m <= d <= the number of training
            clients; d = m is FedAvg with clients drawn by p_k). None: 2m, the smallest d of
            the paper's FMNIST runs (d in {6, 9, 15} for m = 3), at most every training client.
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (``clients_per_round``: m).
    """

    def __init__(self, candidates: PositiveInt | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        m, n = self.hp.clients_per_round, self.num_training_clients
        if candidates is not None and not m <= candidates <= n:
            raise ConfigError(
                f"model.init_args.candidates = {candidates}: the candidate set must hold at "
                f"least clients_per_round = {m} and at most the {n} training clients; use "
                f"{m}..{n}."
            )
        if self.client_dp is not None:
            raise ConfigError(
                "model.init_args.client_dp: FedAvgPoC picks the clients with the highest loss, "
                "not a uniform sample, so the DP accountant's subsampling bound does not hold; "
                "remove client_dp or use FedAvg."
            )
        self.d = candidates if candidates is not None else min(2 * m, n)
        # The last round's candidates and their losses, counted in its communication.
        self.queried: tuple[Tensor, Tensor] | None = None

    def draw_candidates(self, round_idx: int) -> Tensor:
        """A: d training clients without replacement, client k with probability p_k (seeded by
        round, so the same after resume)."""
        generator = torch.Generator().manual_seed(
            derive_seed(self.hp.seed, round_idx, CLIENT_STREAM)
        )
        share = self.data.num_samples("train")[: self.num_training_clients].double().cpu()
        drawn = torch.multinomial(share, self.d, replacement=False, generator=generator)
        return drawn.sort().values.to(self.device)

    def sample_clients(self, round_idx: int) -> Tensor:
        candidates = self.draw_candidates(round_idx)
        _, samples, loss_sum = self.evaluate_clients(
            candidates, "train", params=self.payload(candidates)
        )
        loss = loss_sum / samples  # F_k(w^t)
        self.queried = (candidates, loss)
        picked = loss.topk(self.hp.clients_per_round).indices
        return candidates[picked].sort().values

    def client_weights(
        self, clients: Tensor, round_idx: int | None = None, uniform: bool = True
    ) -> Tensor:
        """The selected clients' models are averaged uniformly (the draw of A weighs by p_k)."""
        return super().client_weights(clients, round_idx, uniform=True)

    def record_communication(self, down: Mapping[str, Tensor], up: Mapping[str, Tensor]) -> None:
        assert self.queried is not None, "sample_clients queries the candidates first"
        candidates, loss = self.queried
        sent_to_candidates = {
            n: t[:1].expand(len(candidates), *t.shape[1:]) for n, t in down.items()
        }
        super().record_communication(sent_to_candidates, {**up, "candidate_loss": loss})
