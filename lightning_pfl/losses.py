"""Losses and predictors several methods share, written for one client's batch (vmappable).

Every function takes per-sample weights ``weight`` (1 for real samples, 0 for padding) and
returns the weighted mean over the batch, like the engine's cross-entropy.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor


def weighted_mean(per_sample: Tensor, weight: Tensor) -> Tensor:
    """Mean of ``per_sample`` over the samples with weight 1 (padding has weight 0)."""
    return (per_sample * weight).sum() / weight.sum().clamp_min(1.0)


def linear_surrogate(params: Mapping[str, Tensor], direction: Mapping[str, Tensor]) -> Tensor:
    """A zero-valued loss whose gradient with respect to ``params`` is ``direction`` (a step
    direction computed inside the loss, handed to the engine's SGD as a gradient)."""
    inner = sum((params[n] * d.detach()).sum() for n, d in direction.items())
    return inner - inner.detach()  # type: ignore[union-attr]


def balanced_softmax_cross_entropy(
    logits: Tensor, y: Tensor, class_counts: Tensor, weight: Tensor
) -> Tensor:
    """Balanced softmax (Ren et al., 2020), FedRoD's generic-head loss.

    Cross-entropy of ``logits + log n_c``, where n_c is the client's number of training samples
    of class c (``class_counts``, shape [C]): the softmax is taken as if every class were
    equally frequent. Classes the client does not have get log(1e-12) instead of -inf.
    """
    adjusted = logits.float() + class_counts.float().clamp_min(1e-12).log()
    return weighted_mean(F.cross_entropy(adjusted, y, reduction="none"), weight)


def distillation_loss(
    student: Tensor, teacher: Tensor, temperature: float, weight: Tensor
) -> Tensor:
    """Hinton et al.'s knowledge distillation: T^2 KL(softmax(teacher/T) || softmax(student/T)).

    The T^2 factor keeps the gradient scale independent of T. ``teacher`` is not differentiated.
    """
    t = temperature
    teacher_log = F.log_softmax(teacher.detach().float() / t, -1)
    student_log = F.log_softmax(student.float() / t, -1)
    kl = (teacher_log.exp() * (teacher_log - student_log)).sum(-1)
    return t * t * weighted_mean(kl, weight)


def knn_probabilities(
    queries: Tensor,
    memory: Tensor,
    memory_labels: Tensor,
    memory_mask: Tensor,
    num_classes: int,
    k: int,
    temperature: float,
) -> Tensor:
    """Class probabilities from the k nearest stored features (kNN-Per, FedTP+kNN).

    p(c | x) = sum over the k nearest memory entries i (squared Euclidean distance d_i) of
    softmax_i(-d_i / T) [y_i = c]. Entries with ``memory_mask`` False are never neighbours;
    with fewer than k valid entries the rest get zero weight.

    Args:
        queries: ``[B, D]`` features of the batch.
        memory: ``[M, D]`` stored features (the client's training set).
        memory_labels: ``[M]`` their labels.
        memory_mask: ``[M]`` True for real entries (False for padding).
        num_classes: number of classes C.
        k: neighbours (at most M).
        temperature: T of the distance softmax.
    """
    distance = torch.cdist(queries.float(), memory.float()).pow(2)  # [B, M]
    distance = distance.masked_fill(~memory_mask.unsqueeze(0), float("inf"))
    nearest, index = distance.topk(min(k, memory.shape[0]), dim=-1, largest=False)
    valid = torch.isfinite(nearest)
    logits = torch.where(valid, -nearest / temperature, torch.full_like(nearest, -1e30))
    weights = torch.softmax(logits, -1) * valid  # [B, k]
    labels = F.one_hot(memory_labels[index], num_classes).float()  # [B, k, C]
    return (weights.unsqueeze(-1) * labels).sum(1)


def interpolate_with_knn(logits: Tensor, knn_probs: Tensor, knn_weight: float | Tensor) -> Tensor:
    """Log-probabilities of lambda * p_kNN + (1 - lambda) * softmax(logits) (kNN-LM/kNN-Per);
    ``knn_weight`` lambda is a number or a tensor broadcasting against the probabilities."""
    mixed = knn_weight * knn_probs + (1 - knn_weight) * torch.softmax(logits.float(), -1)
    return mixed.clamp_min(1e-12).log()
