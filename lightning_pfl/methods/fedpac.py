"""FedPAC (Xu, Tong & Huang, ICLR 2023): feature alignment and classifier collaboration."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

import numpy as np
import torch
from scipy.optimize import minimize
from torch import Tensor

from lightning_pfl.engine import ParamGroup, Params, SGDConfig, TrainResult
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedproto import (
    aggregate_prototypes,
    class_means,
    class_statistics,
    feature_dim,
    prototype_regularized_loss,
)
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat, PositiveInt


def combination_weights(h: Tensor, v: Tensor, eps: float = 1e-3) -> Tensor:
    """FedPAC's classifier-combination weights, one row per client (the server's QP).

    For client i: minimize alpha^T (diag(v) + D_i) alpha over the simplex, where
    D_i[j, l] = sum_k (h_ik - h_jk) . (h_ik - h_lk) is the bias term and v_j the variance term.
    Solved with SciPy's SLSQP; weights below ``eps`` are set to 0 and the rest renormalized
    (the paper's code zeroes them too).

    Args:
        h: ``[C, K, D]`` per-client statistics h_ik = pi_ik * mu_ik (class prior times class
            feature mean).
        v: ``[C]`` per-client variance terms.
        eps: threshold below which a weight is dropped.

    Returns:
        ``[C, C]`` weights alpha_ij, rows on the simplex.
    """
    hd, vd = h.double().cpu(), v.double().cpu()
    c = len(vd)
    rows = []
    for i in range(c):
        diff = (hd[i] - hd).flatten(1)  # [C, K*D]
        p = (torch.diag(vd) + diff @ diff.T).numpy()
        p = 0.5 * (p + p.T)
        start = np.full(c, 1.0 / c)
        solution = minimize(
            lambda a, p=p: float(a @ p @ a),
            start,
            jac=lambda a, p=p: 2.0 * p @ a,
            bounds=[(0.0, 1.0)] * c,
            constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0}],
            method="SLSQP",
            options={"ftol": 1e-12, "maxiter": 200},
        )
        alpha = np.clip(solution.x, 0.0, None)
        alpha[alpha < eps] = 0.0
        rows.append(alpha / alpha.sum() if alpha.sum() > 0 else np.eye(c)[i])
    return torch.tensor(np.stack(rows), dtype=h.dtype, device=h.device)


def class_centroids(statistics: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Class centroids mu_ik ``[C, K, D]`` (zero for a class the client lacks) and class counts
    n_ik ``[C, K]`` from :func:`~lightning_pfl.methods.fedproto.class_statistics`."""
    sums, _, counts = statistics
    return class_means(sums, counts), counts


def feature_statistics(statistics: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """FedPAC's h_ik = pi_ik mu_ik ``[C, K, D]`` and v_i ``[C]`` (the authors' code's estimate
    (sum_k pi_ik E||z||^2_k - sum_k pi_ik^2 ||mu_ik||^2) / n_i) from
    :func:`~lightning_pfl.methods.fedproto.class_statistics`."""
    _, sq, counts = statistics
    mean, _ = class_centroids(statistics)
    n = counts.sum(1, keepdim=True)  # [C, 1]
    prior = counts / n  # pi_ik
    v = ((sq / n).sum(1) - (prior**2 * (mean**2).sum(-1)).sum(1)) / n.squeeze(1)
    return prior.unsqueeze(-1) * mean, v


class FedPAC(FedAvg):
    """FedPAC: a shared feature extractor aligned to global class centroids, and per-client
    classifiers combined from the other clients' classifiers.

    Round for the sampled clients: each client takes the global body theta and its own head
    phi_i and computes, with the received theta, its feature statistics h_ik = pi_ik mu_ik and
    v_i = (sum_k pi_ik E||f(x)||^2_k - sum_k pi_ik^2 ||mu_ik||^2) / n_i (``statistics``). It
    then trains the head alone (``head_epochs`` at ``head_lr``, body frozen), then the body on
    CE + lambda * ||f(x) - c_y||^2 / D with the head frozen (c_y: the global centroid of the
    label from the previous round; ``missing_centroid`` for a label without one). It uploads
    the body, its head, its class centroids of the trained body with counts, and h_i, v_i. The
    server averages the bodies (FedAvg), averages the centroids by class counts
    (``global_centroids``), and gives client i the head sum_j alpha_ij phi_j with alpha_i
    solving the QP of :func:`combination_weights` over the round's clients.

    Args:
        lam: weight lambda of the feature-alignment term (paper: 1).
        head_epochs: local epochs of the classifier-only phase (paper: 1).
        head_lr: SGD step size of the classifier-only phase (the authors' code: 0.1, ``lr_g``
            in JianXu95/FedPAC ``methods/fedpac.py`` ``local_training``, lines 193-195; the
            paper states only eta); null trains the head at ``local_lr``. Its momentum, weight
            decay and clip are the body phase's. Both phases start a fresh SGD every round.
        local_momentum: client SGD momentum (paper: 0.5).
        local_weight_decay: client SGD weight decay of both phases (the authors' code: 5e-4,
            ``methods/fedpac.py`` lines 195 and 221).
        local_lr: client SGD step size eta (paper: 0.01 on EMNIST and Fashion-MNIST, 0.02 on
            CIFAR-10 and CINIC-10).
        batch_size: local batch size B (paper: 50).
        local_epochs: local epochs E of the body phase per round (paper: 5; null trains
            ``local_steps``).
        statistics: the model the uploaded h_ik and v_i are computed with (the authors' code,
            JianXu95/FedPAC ``running.py`` ``train_round_fedpac`` lines 202-208, calls
            ``statistics_extraction`` before ``local_training``): ``before_training``, the
            received global body; ``after_training``, the client's trained body. The centroids
            averaged into c are the trained body's in both (``methods/fedpac.py`` line 251).
        missing_centroid: the alignment target of a sample whose class has no global centroid
            c_y: ``local``, the client's own centroid of the class under the received body, and
            no alignment term at all in the first round (the authors' code, ``methods/fedpac.py``
            lines 177 and 233-242); ``skip``, no alignment term for that sample.
        global_centroids: ``round``: c holds the class-count-weighted centroids of the round's
            clients only, a class none of them has has no centroid in the next round (the
            authors' code, ``tools.py`` ``protos_aggregation`` and ``running.py`` lines 224 and
            229); ``kept``: such a class keeps its previous centroid.
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (paper: no clipping).
    """

    honours_conditions = True

    def __init__(
        self,
        lam: NonNegativeFloat = 1.0,
        head_epochs: PositiveInt = 1,
        head_lr: PositiveFloat | None = 0.1,
        local_momentum: Momentum = 0.5,
        local_weight_decay: NonNegativeFloat = 5e-4,
        local_lr: PositiveFloat = 1e-2,
        batch_size: PositiveInt = 50,
        local_epochs: PositiveInt | None = 5,
        statistics: Literal["before_training", "after_training"] = "before_training",
        missing_centroid: Literal["local", "skip"] = "local",
        global_centroids: Literal["round", "kept"] = "round",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_lr=local_lr,
            batch_size=batch_size,
            local_epochs=local_epochs,
            **kwargs,
        )
        k, d = self.hp.num_classes, feature_dim(self)
        self.centroids: Tensor
        self.has_centroid: Tensor
        self.register_buffer("centroids", torch.zeros(k, d))
        self.register_buffer("has_centroid", torch.zeros(k))
        self.align_loss = prototype_regularized_loss(self.arch, lam)
        self._statistics: tuple[Tensor, Tensor] | None = None  # (h, v)
        self._centroids: tuple[Tensor, Tensor] | None = None

    def personal_names(self) -> tuple[str, ...]:
        return self.arch.head_names

    def head_sgd(self) -> SGDConfig:
        """The classifier-only phase's SGD: the local one at ``head_lr``."""
        lr = self.hp.head_lr
        return replace(self.local_sgd(), lr=self.hp.local_lr if lr is None else lr)

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        """Statistics of the received body, head phase (body frozen), then body phase with
        alignment (head frozen), then the trained body's centroids."""
        head = set(self.arch.head_names)
        buffers = set(self.arch.buffer_shapes)
        received = (
            class_statistics(self, start, clients)
            if self.hp.statistics == "before_training" or self.hp.missing_centroid == "local"
            else None
        )
        heads = {n: t for n, t in start.items() if n in head or n in buffers}
        body = {n: t for n, t in start.items() if n not in head and n not in buffers}
        batches = self.draw_batches(clients, round_idx, epochs=self.hp.head_epochs, phase=1)
        first = self.local_train(
            heads,
            clients,
            round_idx,
            groups=[ParamGroup(self.arch.head_names, self.head_sgd())],
            context=body,
            batches=batches,
        )
        trained_head = {n: first.params[n] for n in head}
        state = {n: first.params[n] for n in buffers}
        second = self.local_train(
            body | state,
            clients,
            round_idx,
            loss_fn=self.align_loss,
            context=trained_head | self.alignment_targets(round_idx, len(clients), received),
        )
        params = second.params | trained_head
        trained = class_statistics(self, params, clients)
        self._centroids = class_centroids(trained)
        before = self.hp.statistics == "before_training"
        self._statistics = feature_statistics(
            received if before and received is not None else trained
        )
        return TrainResult(params, second.momentum, second.loss, second.steps, second.state)

    def alignment_targets(
        self, round_idx: int, c: int, received: tuple[Tensor, Tensor, Tensor] | None
    ) -> Params:
        """c_y per client and class (``proto.value`` ``[C, K, D]``) and where the alignment
        term applies (``proto.present`` ``[C, K]``)."""
        target = self.centroids.expand(c, *self.centroids.shape)
        present = self.has_centroid.expand(c, *self.has_centroid.shape)
        if self.hp.missing_centroid == "local":
            assert received is not None
            own, _ = class_centroids(received)
            target = torch.where(present.unsqueeze(-1) > 0, target, own)
            # the authors' code adds no alignment term in the first round (``if round > 0``)
            present = present if round_idx == 0 else torch.ones_like(present)
        return {"proto.value": target, "proto.present": present}

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        loss = super().run_round(round_idx, clients)  # body FedAvg, trained heads kept
        assert self._statistics is not None and self._centroids is not None
        h, v = self._statistics
        mean, counts = self._centroids
        self._statistics = self._centroids = None
        heads = self.store.gather("personal", clients, self.device)
        combined = dict(heads)  # a client that did not report back keeps its head
        arrived = self.arrived(clients, round_idx)
        rows = arrived.nonzero().squeeze(1)  # the server's QP over the clients that arrived
        if len(rows):
            alpha = combination_weights(h[rows], v[rows])
            for name, t in heads.items():
                mixed = torch.einsum("ij,j...->i...", alpha, t[rows])
                combined[name] = t.index_copy(0, rows, mixed)
            if self.hp.global_centroids == "round":
                self.centroids.zero_()
                self.has_centroid.zero_()
            arrived_counts = counts * arrived.unsqueeze(-1).to(counts)
            new, present = aggregate_prototypes(
                mean, arrived_counts, self.centroids, self.has_centroid
            )
            self.centroids.copy_(new)
            self.has_centroid.copy_(present)
        self.store.scatter("personal", clients, combined)
        body = self.payload(clients)
        self.record_communication(
            down=body | combined | {"centroids": self.centroids.expand(len(clients), -1, -1)},
            up=body | heads | {"mu": mean, "counts": counts, "h": h, "v": v},
        )
        return loss
