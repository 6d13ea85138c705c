"""FedProto (Tan et al., AAAI 2022): clients share class prototypes, never model weights."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap

from lightning_pfl.engine import (
    Architecture,
    ClientBatches,
    LossFn,
    Params,
    TrainResult,
    weighted_cross_entropy,
)
from lightning_pfl.losses import weighted_mean
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.methods.local import Local
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat, PositiveInt


def feature_dim(method: FederatedMethod) -> int:
    """Size of the representation ``arch.features`` returns (the classifier's input)."""
    state = method.arch.initial_state()
    with torch.no_grad():
        z = method.arch.features(state, torch.zeros(1, *method.hp.input_shape))
    return int(z.shape[-1])


@torch.no_grad()
def class_statistics(
    method: FederatedMethod, params: Params, clients: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Per client and class, over its whole training split, features in evaluation mode:
    feature sums ``[C, K, D]``, sums of squared feature norms ``[C, K]`` and counts ``[C, K]``."""
    classes = method.hp.num_classes
    features = vmap(method.arch.features)
    sums: Tensor | None = None
    sq = torch.zeros(len(clients), classes, device=method.device)
    counts = torch.zeros_like(sq)
    by_size = method.data.by_size(clients, "train")
    params = by_size.sort(params)
    for k, x, y, weight in by_size.blocks(method.hp.eval_batch_size):
        z = features({n: t[:k] for n, t in params.items()}, x).float()  # [k, b, D]
        onehot = F.one_hot(y, classes).float() * weight.unsqueeze(-1)  # [k, b, K]
        part = torch.einsum("cbk,cbd->ckd", onehot, z)
        if sums is None:
            sums = part.new_zeros(len(clients), *part.shape[1:])
        sums[:k] += part
        sq[:k] += torch.einsum("cbk,cb->ck", onehot, (z * z).sum(-1))
        counts[:k] += onehot.sum(1)
    assert sums is not None, "every client has training data"
    return by_size.unsort(sums), by_size.unsort(sq), by_size.unsort(counts)


def class_means(sums: Tensor, counts: Tensor) -> Tensor:
    """Per-class means ``[..., K, D]`` of feature ``sums`` over ``counts`` ``[..., K]`` (zero
    for a class without samples)."""
    return sums / counts.clamp_min(1).unsqueeze(-1)


def aggregate_prototypes(
    local: Tensor, counts: Tensor, previous: Tensor, present: Tensor
) -> tuple[Tensor, Tensor]:
    """Global prototypes C_k = sum_i w_ik C_ik / sum_i w_ik over the clients with w_ik > 0.

    Args:
        local: ``[C, K, D]`` client prototypes (rows of classes a client lacks are ignored).
        counts: ``[C, K]`` the clients' weights w_ik: their class counts n_ik (FedPAC, FedProto's
            ``prototype_average: samples``) or 1 where a client has a prototype (``uniform``).
        previous: ``[K, D]`` the current global prototypes, kept for classes no client has.
        present: ``[K]`` 1.0 where ``previous`` holds a prototype.

    Returns:
        The new prototypes ``[K, D]`` and their presence mask ``[K]``.
    """
    total = counts.sum(0)  # [K]
    mean = torch.einsum("ck,ckd->kd", counts, local) / total.clamp_min(1e-12).unsqueeze(-1)
    seen = total > 0
    return torch.where(seen.unsqueeze(-1), mean, previous), torch.maximum(present, seen.float())


def _regularized(
    arch: Architecture, lam: float, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
) -> tuple[Tensor, Params, Tensor]:
    """:func:`prototype_regularized_loss`'s objective, updated buffers and features f(x)."""
    model = {n: t for n, t in context.items() if not n.startswith("proto.")} | params
    buffers = {n: model[n].clone() for n in arch.buffer_shapes}
    z = arch.features({**model, **buffers}, x, train=True)
    ce = weighted_cross_entropy(arch.classify(model, z), y, w)
    target, mask = context["proto.value"][y], context["proto.present"][y]
    distance = ((z.float() - target) ** 2).mean(-1) * mask
    return ce + lam * weighted_mean(distance, w), buffers, z


def prototype_regularized_loss(arch: Architecture, lam: float) -> LossFn:
    """CE + lam * mean over the batch of ||f(x) - P_y||^2 / D (FedProto's and FedPAC's local loss).

    ``context`` holds the model's frozen tensors plus ``proto.value`` ``[K, D]`` (P) and
    ``proto.present`` ``[K]``; samples whose class has no prototype add no regularization.
    The squared distance is averaged over the D feature dimensions (``nn.MSELoss``, as in
    both papers' code).
    """

    def loss(
        params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        total, buffers, _ = _regularized(arch, lam, params, context, x, y, w)
        return (total, buffers) if buffers else total

    return loss


def prototype_collecting_loss(arch: Architecture, lam: float, num_classes: int) -> LossFn:
    """:func:`prototype_regularized_loss` that also sums the features it computes, per class.

    The loss's state holds, besides the network's buffers, ``proto.sum`` ``[K, D]`` and
    ``proto.count`` ``[K]``: the sums of the training-mode features f(x) (of the parameters
    before the step) of the batch samples (weight > 0) of the client's current local epoch, and
    their counts; ``proto.steps`` counts the client's steps. Both restart at every epoch's
    first step (every ``proto.epoch_steps``-th step, from ``context``), so that after local
    training they hold the last epoch's (FedProto's code collects the prototypes this way:
    yuetan031/FedProto ``lib/update.py`` ``update_weights_het``).
    """

    def loss(
        params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> tuple[Tensor, Params]:
        total, buffers, z = _regularized(arch, lam, params, context, x, y, w)
        steps = context["proto.steps"]
        kept = (torch.remainder(steps, context["proto.epoch_steps"]) != 0).float()
        classes = torch.arange(num_classes, device=y.device)  # F.one_hot cannot run under vmap
        onehot = (y.unsqueeze(-1) == classes).float() * (w > 0).float().unsqueeze(-1)  # [b, K]
        tally = {
            "proto.sum": context["proto.sum"] * kept + onehot.T @ z.detach().float(),
            "proto.count": context["proto.count"] * kept + onehot.sum(0),
            "proto.steps": steps + 1,
        }
        return total, buffers | tally

    return loss


def nearest_prototype_logits(z: Tensor, prototypes: Tensor, present: Tensor) -> Tensor:
    """Logits -||z - P_k||^2; classes without a prototype rank below every other class."""
    distance = ((z.float().unsqueeze(-2) - prototypes.float()) ** 2).sum(-1)
    worst = distance.amax(-1, keepdim=True) + 1.0
    return -torch.where(present.bool(), distance, worst)


class FedProto(Local):
    """FedProto: federated prototype learning.

    Round: each sampled client i trains its own model (kept on the client, like
    :class:`~lightning_pfl.methods.local.Local`) on CE + lambda * ||f_i(x) - C_y||^2 / D, with
    C_y the global prototype of its label (no term for classes without one yet); its
    prototypes C_ik are the mean of f_i(x) over the class-k samples of the batches of its last
    local epoch, computed in training mode by that epoch's forward passes (``prototypes``), and
    it uploads them with its class counts n_ik (zero for a class it has no prototype of). The
    server sets C_k = sum_i n_ik C_ik / sum_i n_ik over the clients that have class k
    (``prototype_average``; classes no client of the round has keep their prototype). Only
    prototypes (and class counts) are communicated.

    The client's model stays on the client; its SGD starts every round with zero momentum, as
    the authors' code builds a new optimizer each round (``client_momentum: fresh``), or keeps
    its momentum across rounds as :class:`~lightning_pfl.methods.local.Local` (``kept``).

    Args:
        lam: weight lambda of the prototype regularizer (paper: 1).
        predict_by: ``prototype``: the class of the nearest global prototype (the paper's
            inference); ``head``: the client model's own classifier.
        local_momentum: client SGD momentum (the authors' code, yuetan031/FedProto
            ``lib/update.py``: SGD with momentum 0.5).
        local_weight_decay: client SGD weight decay (the authors' SGD: none).
        local_max_grad_norm: client gradient clip (the authors' code: none).
        client_momentum: ``fresh``: the client's SGD momentum restarts from zero every round
            (the authors' code builds its optimizer in every round's local update); ``kept``:
            it carries over to the client's next round, as in ``Local``.
        local_lr: client SGD learning rate (the authors' code's ``--lr``: 0.01).
        local_epochs: local epochs per round (the authors' code's ``--train_ep``: 1; null
            trains ``local_steps``).
        prototypes: how a client computes its prototypes C_ik. ``last_epoch``: the mean of
            the training-mode features of its class-k samples in the batches of its last
            local epoch, each taken by that batch's forward pass, before its step; with
            ``local_steps``, in the batches of all the round's steps (the authors' code,
            yuetan031/FedProto ``lib/update.py`` ``update_weights_het``, which restarts its
            collection every epoch). ``training_split``: the mean of the evaluation-mode
            features of the trained model over all its class-k training samples. A class
            without such samples gets no prototype (n_ik = 0 in the server's average).
        prototype_average: how the server averages the prototypes C_ik of class k of the
            round's clients i in N_k (those with a class-k prototype) into C_k; |D_ik|: client
            i's class-k training samples, N_k = sum_{i in N_k} |D_ik|. ``samples``:
            C_k = sum_i |D_ik| / N_k * C_ik, the minimizer over C_k of the paper's eq. 5
            prototype term sum_i |D_ik| / N_k * ||C_k - C_ik||^2 and eq. 6's weights;
            ``uniform``: C_k = 1/|N_k| sum_i C_ik (the authors' code, yuetan031/FedProto
            ``lib/utils.py`` ``proto_aggregation``); ``eq6_as_printed``: eq. 6 as the paper
            prints it, C_k = 1/|N_k| sum_i |D_ik| / N_k * C_ik, the ``samples`` average
            divided once more by the number of clients |N_k|.
        drop_last: an epoch's last, smaller batch is not trained on (the authors' client
            loader, yuetan031/FedProto ``lib/update.py``: ``DataLoader(..., shuffle=True,
            drop_last=True)``), so client i takes E * floor(n_i / B) steps, none if n_i < B;
            False trains it too (E * ceil(n_i / B) steps). Only with ``local_epochs``: the
            ``local_steps`` batches leave no sample over.
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod` (the batch stays
            the library's: the paper's 8 as our docs read it, the authors' ``--local_bs`` 4).
    """

    honours_conditions = True

    def __init__(
        self,
        lam: NonNegativeFloat = 1.0,
        predict_by: Literal["head", "prototype"] = "prototype",
        local_momentum: Momentum = 0.5,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        client_momentum: Literal["fresh", "kept"] = "fresh",
        local_lr: PositiveFloat = 1e-2,
        local_epochs: PositiveInt | None = 1,
        drop_last: bool = True,
        prototypes: Literal["last_epoch", "training_split"] = "last_epoch",
        prototype_average: Literal["samples", "uniform", "eq6_as_printed"] = "samples",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            local_lr=local_lr,
            local_epochs=local_epochs,
            **kwargs,
        )
        if client_momentum == "fresh":
            del self.store.fields["momentum"]  # Local's kept momentum: not client state here
        k, d = self.hp.num_classes, feature_dim(self)
        self.prototypes: Tensor
        self.has_prototype: Tensor
        self.register_buffer("prototypes", torch.zeros(k, d))
        self.register_buffer("has_prototype", torch.zeros(k))
        self.proto_loss = prototype_regularized_loss(self.arch, lam)
        self.collecting_loss = prototype_collecting_loss(self.arch, lam, k)

    def prototype_payload(self, clients: Tensor) -> Params:
        """The global prototypes and their mask, expanded to ``clients``."""
        c = len(clients)
        return {
            "proto.value": self.prototypes.expand(c, *self.prototypes.shape),
            "proto.present": self.has_prototype.expand(c, *self.has_prototype.shape),
        }

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        sent = self.prototype_payload(clients)
        params = self.store.gather("params", clients, self.device)
        kept = self.hp.client_momentum == "kept"
        momentum = self.store.gather("momentum", clients, self.device) if kept else None
        batches = self.draw_batches(clients, round_idx, drop_last=self.hp.drop_last)
        if self.hp.prototypes == "last_epoch":
            result, sums, seen = self.train_collecting(
                params, clients, round_idx, sent, momentum, batches
            )
            local = class_means(sums, seen)
            # n_ik: the client's class-k training samples, for the classes it has a prototype of
            counts = torch.where(seen > 0, self.class_counts(clients), 0.0)
        else:
            result = self.local_train(
                params,
                clients,
                round_idx,
                loss_fn=self.proto_loss,
                context=sent,
                momentum=momentum,
                batches=batches,
            )
            sums, _, counts = class_statistics(self, result.params, clients)
            local = class_means(sums, counts)
        self.store.scatter("params", clients, result.params)
        if kept:
            self.store.scatter("momentum", clients, result.momentum)
        counts = counts * self.arrived(clients, round_idx).unsqueeze(-1).to(counts)
        new, present = self.global_prototypes(local, counts)
        self.prototypes.copy_(new)
        self.has_prototype.copy_(present)
        self.record_communication(down=sent, up={"prototypes": local, "counts": counts})
        return result.loss

    def global_prototypes(self, local: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """The server's new prototypes C_k and their mask from the clients' C_ik ``[C, K, D]``
        and n_ik ``[C, K]``, by ``prototype_average``."""
        holders = (counts > 0).float()  # i in N_k
        uniform = self.hp.prototype_average == "uniform"
        new, present = aggregate_prototypes(
            local, holders if uniform else counts, self.prototypes, self.has_prototype
        )
        if self.hp.prototype_average == "eq6_as_printed":
            # a class no client holds keeps its previous prototype: divided by 1
            new = new / holders.sum(0).clamp_min(1).unsqueeze(-1)
        return new, present

    def class_counts(self, clients: Tensor) -> Tensor:
        """Training samples per class of ``clients``, ``[C, K]``."""
        counts = torch.as_tensor(self.data.partition_counts()["train"], dtype=torch.float32)
        return counts[clients.cpu()].to(self.device)

    def train_collecting(
        self,
        params: Params,
        clients: Tensor,
        round_idx: int,
        sent: Params,
        momentum: Params | None,
        batches: ClientBatches,
    ) -> tuple[TrainResult, Tensor, Tensor]:
        """Local training with :func:`prototype_collecting_loss`: the result, the per-class
        feature sums ``[C, K, D]`` and sample counts ``[C, K]`` of each client's last local
        epoch."""
        c, (k, d) = len(batches.active), self.prototypes.shape
        epochs = self.hp.local_epochs or 1  # with local_steps: one pass of all the steps
        # a client's steps with samples: the same number in every epoch, idle ones not counted
        drawn = (batches.weight.amax(-1) > 0).sum(1)
        tally = {
            "proto.sum": torch.zeros(c, k, d, device=self.device),
            "proto.count": torch.zeros(c, k, device=self.device),
            "proto.steps": torch.zeros(c, dtype=torch.long, device=self.device),
        }
        epoch_steps = (drawn // epochs).clamp_min(1).to(self.device)
        result = self.local_train(
            params,
            clients,
            round_idx,
            loss_fn=self.collecting_loss,
            context=sent | {"proto.epoch_steps": epoch_steps},
            momentum=momentum,
            batches=batches,
            tally=tally,
        )
        return result, result.state["proto.sum"], result.state["proto.count"]

    def predict(self, params: Params, x: Tensor) -> Tensor:
        if self.hp.predict_by == "head":
            return self.arch(params, x)
        z = self.arch.features(params, x)
        return nearest_prototype_logits(z, self.prototypes, self.has_prototype)
