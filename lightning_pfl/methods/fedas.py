"""FedAS (Yang et al., CVPR 2024): federated parameter alignment and client synchronization."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.func import grad, vmap

from lightning_pfl.engine import ParamGroup, Params, SGDConfig, weighted_cross_entropy
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedproto import class_means, class_statistics
from lightning_pfl.validation import PositiveFloat, PositiveInt

ALIGN_PHASE, FISHER_PHASE = 1, 2  # batch draws of the alignment and of the Fisher pass


def alignment_loss(
    features: Tensor, y: Tensor, weight: Tensor, prototypes: Tensor, present: Tensor
) -> Tensor:
    """Parameter alignment: sum over the batch's classes c that have a local prototype P_c of
    the mean squared error between the global extractor's features of class c and P_c
    (``nn.MSELoss`` per class, averaged over samples and dimensions)."""
    per_sample = ((features.float() - prototypes[y]) ** 2).mean(-1) * present[y] * weight
    classes = torch.arange(len(prototypes), device=y.device)
    onehot = (y[:, None] == classes).to(per_sample.dtype)  # one_hot checks values: not vmappable
    counts = onehot.T @ (weight * present[y])
    return ((onehot.T @ per_sample) / counts.clamp_min(1)).sum()


class FedAS(FedAvg):
    """FedAS: each client aligns the received shared body to its own model's class prototypes,
    then trains; the server averages the bodies weighted by the clients' Fisher information.

    Every client keeps its whole model (body + head; its personalized model). Round, for each
    sampled client i:

    1. Parameter alignment: its previous local model's class prototypes P_c (mean features of
       its training samples of class c, evaluation mode) are the targets; the received global
       body is trained for ``alignment_epochs`` epochs of plain SGD (``alignment_lr``) on
       :func:`alignment_loss`, so that it describes the client's data as its own model did.
    2. The aligned body with the client's own head is trained on cross-entropy (local SGD
       settings) and kept.
    3. Client synchronization: the client reports the trace of its empirical Fisher information,
       F_i = sum over one pass of batches of ||grad_theta mean NLL(batch)||^2 (evaluation mode),
       and uploads its body; the server sets the global body to sum_i F_i / sum_j F_j theta_i.

    Under ``conditions`` the sums run over the clients that reported back (none: the body
    stays); a client that dropped keeps its model (its aligned start is the global body), and
    a straggler's alignment, training and Fisher pass are each cut to its fraction.

    Args:
        alignment_lr: SGD learning rate of the alignment (the authors' code: 0.01).
        alignment_epochs: epochs of the alignment (the authors' code: 1).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        alignment_lr: PositiveFloat = 0.01,
        alignment_epochs: PositiveInt = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("FedAS aligns and weighs plain parameters")
        self.store.add_field("model", self.arch.initial_params())
        self.body = tuple(n for n in self.arch.shapes if n not in self.arch.head_names)
        self.align_loss = self.feature_alignment  # one object: a recorded round is keyed by it

    def feature_alignment(
        self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor:
        z = self.arch.features(params, x, train=True)
        return alignment_loss(z, y, w, context["proto.value"], context["proto.present"])

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        h = self.hp
        sent = {n: t for n, t in self.payload(clients).items() if n in self.body}
        local = self.store.gather("model", clients, self.device)
        sums, _, counts = class_statistics(self, local, clients)
        context = {
            "proto.value": class_means(sums, counts),
            "proto.present": (counts > 0).float(),
        }
        aligned = self.local_train(
            {n: t.clone() for n, t in sent.items()},
            clients,
            round_idx,
            groups=[ParamGroup(self.body, SGDConfig(h.alignment_lr))],
            loss_fn=self.align_loss,
            context=context,
            batches=self.draw_batches(clients, round_idx, h.alignment_epochs, ALIGN_PHASE),
        )
        head = {n: local[n] for n in self.arch.head_names}
        result = self.local_train(aligned.params | head, clients, round_idx)
        # the aligned start of a client that dropped is not its model: it keeps its own
        self.store.scatter(
            "model", clients, self.where_arrived(clients, round_idx, result.params, local)
        )
        fisher = self.fisher_trace(result.params, clients, round_idx)
        uploaded = {n: result.params[n] for n in self.body}
        if not self.nothing_arrived(clients, round_idx):
            total = fisher.sum()  # a client that did not report back took no step: F_i = 0
            # a round of perfectly fitted clients has no Fisher information: sample weights then
            weights = torch.where(
                total > 0, fisher / total.clamp_min(1e-30), self.client_weights(clients, round_idx)
            )
            self.aggregate(uploaded, weights)
        self.record_communication(down=sent, up=uploaded | {"fisher": fisher})
        return result.loss

    def fisher_trace(self, params: Params, clients: Tensor, round_idx: int) -> Tensor:
        """F_i: the sum over one epoch of each client's batches of the squared norm of the
        gradient of the batch's mean negative log-likelihood, ``[C]``."""

        def nll(p: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            return weighted_cross_entropy(self.arch(p, x), y, w)

        per_client = vmap(grad(nll))
        batches = self.draw_batches(clients, round_idx, 1, FISHER_PHASE)
        trace = torch.zeros(len(clients), device=self.device)
        for s in range(batches.active.shape[1]):
            x, y = self.data.fetch(batches.index[:, s])
            grads = per_client(params, x, y, batches.weight[:, s])
            squared = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0)
            trace = trace + squared * batches.active[:, s]
        return trace

    def personalized_params(self, clients: Tensor) -> Params:
        return self.store.gather("model", clients, self.device)
