"""FedGen (Zhu, Hong & Zhou, ICML 2021): data-free knowledge distillation through a server-side
generator of representations."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.engine import (
    ParamGroup,
    Params,
    TrainResult,
    derive_seed,
    weighted_cross_entropy,
)
from lightning_pfl.generator import ConditionalGenerator, sample_labels, train_generator
from lightning_pfl.losses import weighted_mean
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.step_inputs import CLOCK, CLOCK_GROUP, at, start_clock, tick
from lightning_pfl.streams import GENERATOR_STREAM
from lightning_pfl.validation import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

GEN_Z, GEN_Y, GEN_TARGET = "generated.z", "generated.y", "generated.target"


class FedGen(FedAvg):
    """FedGen: FedAvg whose clients learn from representations a server generator produces.

    The model is a feature extractor f (theta^f) and a classifier g (theta^p). The server keeps
    a conditional generator G_w(z | y) of representations and the label prior p^(y). Round:
    the server sends the global model, w and p^; each client, at every local step, draws B
    real samples and B pairs ``y^ ~ p^(y), z^ ~ G_w(. | y^)`` and takes an SGD step on
    (eq. 5)

        ``L^_k(theta) + alpha * mean l(g(z^; theta^p), y^)
        [+ beta * KL(softmax(g(G_w(y_b); theta^p)) || softmax(h(x_b; theta)))]``

    (the bracket is the reference code's "latent" term, off by default), counting its batches'
    labels c_k; the server averages the models (FedAvg), sets p^ to the normalized sum of the
    round's c_k, and takes ``generator_steps`` Adam steps on (eq. 4)
    ``E_{y ~ p^, z ~ G_w(.|y)} l(softmax((1/K) sum_k g(z; theta_k^p)), y)`` with the K
    classifiers the clients uploaded. Evaluation: the global model (FedGen is not personalized).

    The generated pairs of a round are drawn on the server for every client and local step
    (the generator is fixed within a round, so this is the same distribution as drawing them on
    the client) and passed as context; the loss reads the current step's row
    (:mod:`lightning_pfl.step_inputs`).

    Args:
        alpha: weight of the generated-representation cross-entropy (eq. 5: 1; the reference
            code's runs: 10, decayed by 0.98 per round).
        beta: weight of the reference code's KL term between the classifier on generated
            representations of the batch's labels and the model on the batch (not in the paper:
            0; the reference code: 10 on MNIST).
        generator_lr: Adam learning rate of the generator (the paper's alpha step size; the
            reference code's 3e-4 on MNIST).
        generator_weight_decay: Adam weight decay of the generator (reference code: 1e-2).
        generator_steps: generator steps per round (reference code: 50 = 10 epochs of 5).
        generator_batch_size: labels per generator step (reference code: the local batch
            size); None = ``batch_size``.
        generated_batch_size: generated pairs per local step (B, as the real batch); None =
            ``batch_size``.
        noise_dim: size of the generator's noise (reference code: 32 on MNIST).
        hidden_dim: width of the generator's hidden layer (reference code: 256 on MNIST).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    label_prior: Tensor
    honours_conditions = True

    def __init__(
        self,
        alpha: NonNegativeFloat = 1.0,
        beta: NonNegativeFloat = 0.0,
        generator_lr: PositiveFloat = 3e-4,
        generator_weight_decay: NonNegativeFloat = 1e-2,
        generator_steps: NonNegativeInt = 50,
        generator_batch_size: PositiveInt | None = None,
        generated_batch_size: PositiveInt | None = None,
        noise_dim: PositiveInt = 32,
        hidden_dim: PositiveInt = 256,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        h = self.hp
        feature_dim = self.arch.shapes[self.arch.head_names[0]][-1]
        with self.seeded_init():
            self.generator = ConditionalGenerator(h.num_classes, feature_dim, noise_dim, hidden_dim)
        self.register_buffer("label_prior", torch.full((h.num_classes,), 1.0 / h.num_classes))
        self.generator_optimizer = torch.optim.Adam(
            self.generator.parameters(), lr=generator_lr, weight_decay=generator_weight_decay
        )
        self.model_names = tuple(self.arch.shapes)

    # ----------------------------------------------------------------- client side
    def fedgen_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        """Eq. 5 on one batch and the generated pairs of the step the clock points at."""
        h = self.hp
        clock = params[CLOCK]
        model = {n: t for n, t in params.items() if n != CLOCK}
        rest = {n: t for n, t in context.items() if not n.startswith("generated.")}
        logits, buffers = self.arch.forward_train({**rest, **model}, x)
        loss = weighted_cross_entropy(logits, y, weight)
        generated = self.arch.classify(model, at(context[GEN_Z], clock))
        loss = loss + h.alpha * F.cross_entropy(generated.float(), at(context[GEN_Y], clock))
        if h.beta:
            target = torch.softmax(self.arch.classify(model, at(context[GEN_TARGET], clock)), -1)
            kl = (target * (target.clamp_min(1e-12).log() - logits.float().log_softmax(-1))).sum(-1)
            loss = loss + h.beta * weighted_mean(kl, weight)
        loss = tick(loss, clock)
        return (loss, buffers) if buffers else loss

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        h = self.hp
        batches = self.draw_batches(clients, round_idx)
        rng = torch.Generator(self.device).manual_seed(
            derive_seed(h.seed, round_idx, GENERATOR_STREAM)
        )
        steps = batches.index.shape[1]
        y_hat = sample_labels(
            self.label_prior, (len(clients), steps, h.generated_batch_size or h.batch_size), rng
        )
        context = {GEN_Y: y_hat, GEN_Z: self.generator.sample(y_hat, rng)}
        if h.beta:
            _, labels = self.data.fetch(batches.index)
            context[GEN_TARGET] = self.generator.sample(labels.to(self.device), rng)
        # the labels of the steps taken (a straggler's cut ones and a dropped client's: none)
        taken = batches.weight * batches.active.unsqueeze(-1).to(batches.weight)
        self.round_label_counts = self.batch_label_counts(batches.index, taken)
        return self.local_train(
            start | start_clock(len(clients), self.device),
            clients,
            round_idx,
            groups=[ParamGroup(self.model_names, self.local_sgd()), CLOCK_GROUP],
            loss_fn=self.fedgen_loss,
            context=context,
            batches=batches,
        )

    def batch_label_counts(self, index: Tensor, weight: Tensor) -> Tensor:
        """``[C, classes]`` labels of each client's batches this round (c_k)."""
        _, labels = self.data.fetch(index)
        onehot = F.one_hot(labels.to(self.device), self.hp.num_classes).float()
        return (onehot * weight.to(self.device)[..., None]).sum((1, 2))

    # ----------------------------------------------------------------- server side
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        h = self.hp
        sent = self.payload(clients)
        result = self.train_with_personal(
            round_idx, clients, {n: t.clone() for n, t in sent.items()}
        )
        uploaded = {n: result.params[n] for n in sent}
        if not self.nothing_arrived(clients, round_idx):
            self.aggregate(uploaded, self.client_weights(clients, round_idx))
            counts = self.round_label_counts.sum(0)
            self.label_prior.copy_(counts / counts.sum())
            rng = torch.Generator(self.device).manual_seed(
                derive_seed(h.seed, round_idx, GENERATOR_STREAM, 1)
            )
            # the ensemble of the heads that arrived (the server reads the mask)
            rows = self.arrived(clients, round_idx).nonzero().squeeze(1)
            heads = {n: uploaded[n][rows] for n in self.arch.head_names}
            train_generator(
                self.generator,
                self.generator_optimizer,
                self.arch,
                heads,
                self.label_prior,
                h.generator_steps,
                h.generator_batch_size or h.batch_size,
                rng,
            )
        generator = {
            n: t.expand(len(clients), *t.shape) for n, t in self.generator.state_dict().items()
        }
        prior = {"label_prior": self.label_prior.expand(len(clients), -1)}
        self.record_communication(
            down=sent | prior | {f"generator.{n}": t for n, t in generator.items()},
            up=uploaded | {"label_counts": self.round_label_counts},
        )
        return result.loss

    # ----------------------------------------------------------------- state
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["pfl"]["generator_optimizer"] = self.generator_optimizer.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.generator_optimizer.load_state_dict(checkpoint["pfl"]["generator_optimizer"])
