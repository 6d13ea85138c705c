"""Gradient inversion: how much of a client's batch one uploaded update gives away.

DLG (Zhu et al., "Deep Leakage from Gradients", NeurIPS 2019) optimizes a dummy batch (inputs
and soft labels) until its gradient matches the observed one; iDLG (Zhao et al., "iDLG:
Improved Deep Leakage from Gradients", 2020) first reads the label of a single sample off the
last layer's gradient (the only row whose entries sum to a negative number: with cross-entropy
it is (p_y - 1) h, with h >= 0 after a ReLU) and then optimizes the input alone.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor
from torchmetrics.functional.image import (
    peak_signal_noise_ratio,
    structural_similarity_index_measure,
)

from lightning_pfl.assignment import SEP
from lightning_pfl.engine import Params, derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.streams import ATTACK_STREAM
from lightning_pfl.validation import (
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Seed,
    check_arguments,
)


class GradientInversion(Callback):
    """DLG / iDLG against one client's upload, as ``trainer.callbacks`` (an evaluation: it does
    not change training).

    At the start of round ``at_round`` (None: after the last round) the victim ``client`` takes
    one plain SGD step (learning rate ``local_lr``, no momentum nor weight decay: DLG's threat
    model) on a batch of ``batch_size`` of its training samples from its model of that round
    (:meth:`~lightning_pfl.methods.base.FederatedMethod.personalized_params`) and uploads the
    update of the tensors the method uploads (the FedAvg family: its ``payload``; others: the
    whole model). Under ``client_dp`` the attacker sees the clipped update plus the noise of
    the round's sum, N(0, z^2 S^2 I): the attacker who knows every other update of the round,
    the strongest one the guarantee covers. The attack then optimizes a dummy batch for
    ``iterations`` steps of ``optimizer`` so that its gradient matches the observed
    update / -lr, and reports PSNR and SSIM (torchmetrics) of the reconstruction against the
    real batch in pixel space [0, 1], and the labels.

    Results: ``results.json``'s ``gradient_inversion`` and TensorBoard ``attack/psnr``,
    ``attack/ssim``, ``attack/label_accuracy`` and the images ``attack/real`` and
    ``attack/reconstructed``.

    Args:
        attack: ``idlg`` (label from the last layer, then the input; needs ``batch_size`` 1)
            or ``dlg`` (inputs and soft labels jointly).
        client: the victim's client id.
        at_round: attack the update of this round (0: the initial model); None: the model
            after the last round.
        batch_size: the victim's batch size (DLG/iDLG's experiments: 1).
        optimizer: ``lbfgs`` (the papers', learning rate 1) or ``adam``.
        lr: the optimizer's learning rate.
        iterations: optimizer steps (DLG's: 300 L-BFGS steps, each up to 20 iterations with
            its line search off, PyTorch's defaults).
        seed: seed of the victim's batch and of the dummy's initialization.
        ssim_kernel: SSIM's Gaussian window size (odd); made smaller, and odd, for images
            smaller than it (8x8 digits: 7).
    """

    def __init__(
        self,
        attack: Literal["idlg", "dlg"] = "idlg",
        client: NonNegativeInt = 0,
        at_round: NonNegativeInt | None = None,
        batch_size: PositiveInt = 1,
        optimizer: Literal["lbfgs", "adam"] = "lbfgs",
        lr: PositiveFloat = 1.0,
        iterations: PositiveInt = 300,
        seed: Seed = 0,
        ssim_kernel: PositiveInt = 11,
    ) -> None:
        check_arguments(self, dict(locals()), "trainer.callbacks GradientInversion")
        if attack == "idlg" and batch_size != 1:
            raise ConfigError(
                f"GradientInversion: attack 'idlg' reads the label of one sample; batch_size = "
                f"{batch_size}: use batch_size 1 or attack 'dlg'."
            )
        if ssim_kernel % 2 == 0:
            raise ConfigError(f"GradientInversion: ssim_kernel = {ssim_kernel} must be odd.")
        self.attack = attack
        self.client = client
        self.at_round = at_round
        self.batch_size = batch_size
        self.optimizer = optimizer
        self.lr = lr
        self.iterations = iterations
        self.seed = seed
        self.ssim_kernel = ssim_kernel
        self.done = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        method: Any = pl_module
        if self.client >= method.num_training_clients:
            raise ConfigError(
                f"GradientInversion: client = {self.client} is not a training client "
                f"(0..{method.num_training_clients - 1})."
            )
        if method.client_dp is not None and getattr(method, "payload", None) is None:
            raise ConfigError(
                f"GradientInversion: {type(method).__name__}'s client_dp noise is not on the "
                "upload the attack inverts (docs/privacy.md); run the attack without client_dp."
            )
        if getattr(method.hp, "upload_fraction", 1.0) < 1.0:
            raise ConfigError(
                f"GradientInversion: {type(method).__name__} uploads only the largest "
                f"upload_fraction = {method.hp.upload_fraction} of each update's entries; the "
                "attack inverts a whole update: run it with upload_fraction 1."
            )
        arch, tag = self.victim_network(method, self.client)
        heads = {tag + n for n in arch.head_names}
        if self.attack == "idlg" and not heads <= self.observed(method, self.client):
            raise ConfigError(
                f"GradientInversion: {type(method).__name__} does not upload the classifier "
                f"{sorted(heads)}, which iDLG reads the label from; use attack: dlg."
            )

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self.done and self.at_round == pl_module.global_step:
            self.run(trainer, pl_module)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.done and self.at_round is None:
            self.run(trainer, pl_module)

    # ----------------------------------------------------------------- the attack
    @staticmethod
    def victim_network(method: Any, client: int) -> tuple[Any, str]:
        """The victim's architecture and the prefix of its tensors' names in
        :meth:`~lightning_pfl.methods.base.FederatedMethod.personalized_params` (a model zoo
        keys them by group, ``NetworkGroups.tagged``)."""
        groups = method.network_groups()
        if groups is None:
            return method.arch, ""
        kind = groups.names[int(groups.group_of[client])]
        return groups.archs[kind], f"{kind}{SEP}"

    @staticmethod
    def observed(method: Any, client: int = 0) -> set[str]:
        """Names of the victim's trainable tensors whose update the method uploads (a model
        zoo: those it generates, not the layers a client keeps)."""
        arch, tag = GradientInversion.victim_network(method, client)
        names = {tag + n for n in arch.shapes}
        kept = getattr(method, "local_names", {}).get(tag.removesuffix(SEP), ())
        names -= {tag + n for n in kept}
        payload = getattr(method, "payload", None)
        if payload is None:
            return names
        return names & set(payload(torch.tensor([client], device=method.device)))

    def run(self, trainer: Trainer, method: Any) -> dict[str, Any]:
        """Attack, record in ``extra_results`` and TensorBoard; returns the record."""
        self.done = True
        with torch.enable_grad():
            record, real, fake = self.invert(method)
        record["round"] = int(method.global_step)
        method.record.extra_results["gradient_inversion"] = record
        if isinstance(trainer.logger, TensorBoardLogger) and trainer.is_global_zero:
            step = int(method.global_step)
            trainer.logger.experiment.add_images("attack/real", real, step)
            trainer.logger.experiment.add_images("attack/reconstructed", fake, step)
            for key in ("psnr", "ssim", "label_accuracy"):
                trainer.logger.log_metrics({f"attack/{key}": record[key]}, step=step)
        return record

    def invert(self, method: Any) -> tuple[dict[str, Any], Tensor, Tensor]:
        """The attack on the current model: (record, real images, reconstructions) in [0, 1]."""
        data = method.data
        client = torch.tensor([self.client], device=data.device)
        generator = torch.Generator(data.device).manual_seed(derive_seed(self.seed, ATTACK_STREAM))
        index = data.client_batches(client, self.batch_size, generator, steps=1).index
        x, y = data.fetch(index.view(-1))
        x, y = x.to(method.device), y.to(method.device)
        model = {n: t[0].detach() for n, t in method.personalized_params(client).items()}
        names = sorted(self.observed(method, self.client))
        arch, tag = self.victim_network(method, self.client)
        target = self.observed_gradient(method, model, names, x, y)

        torch.manual_seed(derive_seed(self.seed, ATTACK_STREAM, 1))
        dummy_x = torch.randn_like(x).requires_grad_(True)
        num_classes = method.hp.num_classes
        if self.attack == "idlg":
            head = tag + arch.head_names[0]  # the weight [classes, features]
            labels = target[names.index(head)].sum(-1).argmin().view(1)
            soft = F.one_hot(labels, num_classes).float()
            variables = [dummy_x]
        else:
            label_logits = torch.randn(len(y), num_classes, device=x.device, requires_grad=True)
            variables = [dummy_x, label_logits]

        def matching_loss() -> Tensor:
            targets = soft if self.attack == "idlg" else label_logits.softmax(-1)
            grads = self.gradients(method, model, names, dummy_x, targets, create_graph=True)
            return sum(((g - t) ** 2).sum() for g, t in zip(grads, target, strict=True))  # type: ignore[return-value]

        loss = self.optimize(variables, matching_loss)
        inferred = labels if self.attack == "idlg" else label_logits.argmax(-1)
        real, fake = self.pixels(data, x), self.pixels(data, dummy_x.detach())
        kernel = min(self.ssim_kernel, min(real.shape[-2:]) - (1 - min(real.shape[-2:]) % 2))
        psnr = peak_signal_noise_ratio(fake, real, data_range=1.0, reduction="none", dim=(1, 2, 3))
        ssim = structural_similarity_index_measure(
            fake, real, data_range=1.0, kernel_size=kernel, reduction="none"
        )
        record = {
            "attack": self.attack,
            "client": self.client,
            "batch_size": self.batch_size,
            "iterations": self.iterations,
            "optimizer": self.optimizer,
            "client_dp": method.client_dp is not None,
            "labels": y.tolist(),
            "labels_inferred": inferred.tolist(),
            "label_accuracy": float((inferred == y).float().mean()),
            "psnr": float(psnr.mean()),
            "psnr_per_sample": psnr.tolist(),
            "ssim": float(ssim.mean()),  # type: ignore[union-attr]
            "gradient_match_loss": loss,
        }
        return record, real, fake

    def gradients(
        self,
        method: Any,
        model: Params,
        names: list[str],
        x: Tensor,
        targets: Tensor,
        create_graph: bool = False,
    ) -> tuple[Tensor, ...]:
        """Gradient of the mean cross-entropy (soft ``targets``) w.r.t. ``model[names]``."""
        params = {n: t.requires_grad_(True) if n in names else t for n, t in model.items()}
        loss = torch.sum(-targets * method.predict(params, x).log_softmax(-1), -1).mean()
        return torch.autograd.grad(loss, [params[n] for n in names], create_graph=create_graph)

    def observed_gradient(
        self, method: Any, model: Params, names: list[str], x: Tensor, y: Tensor
    ) -> list[Tensor]:
        """-update / lr of the victim's one SGD step; under ``client_dp`` the update is clipped
        and noised as the round's sum is."""
        onehot = F.one_hot(y, method.hp.num_classes).float()
        model = {n: t.detach().clone() for n, t in model.items()}
        grads = [g.detach() for g in self.gradients(method, model, names, x, onehot)]
        dp = method.client_dp
        if dp is None:
            return grads
        from lightning_pfl.privacy import clip_updates, gaussian_noise

        lr = method.hp.local_lr
        update = {n: -lr * g.unsqueeze(0) for n, g in zip(names, grads, strict=True)}
        clipped = clip_updates(update, dp.clip_norm)
        generator = torch.Generator(x.device).manual_seed(
            derive_seed(self.seed, ATTACK_STREAM, 2, self.client)
        )
        noise = gaussian_noise(clipped, dp.noise_multiplier * dp.clip_norm, generator)
        return [(clipped[n] + noise[n])[0] / -lr for n in names]

    def optimize(self, variables: list[Tensor], matching_loss: Any) -> float:
        """Minimize the gradient-matching loss over ``variables``, which end at the iterate
        with the lowest loss (L-BFGS without a line search can leave a good point for a worse
        one, and the attacker can evaluate the loss); returns that loss."""
        best = (float(matching_loss().detach()), [v.detach().clone() for v in variables])
        if self.optimizer == "lbfgs":
            lbfgs = torch.optim.LBFGS(variables, lr=self.lr)

            def closure() -> Tensor:
                lbfgs.zero_grad()
                loss = matching_loss()
                loss.backward()
                return loss

            def step() -> None:  # DLG's loop: each step up to 20 L-BFGS iterations
                lbfgs.step(closure)
        else:
            adam = torch.optim.Adam(variables, lr=self.lr)

            def step() -> None:
                adam.zero_grad()
                matching_loss().backward()
                adam.step()

        for _ in range(self.iterations):
            step()
            loss = float(matching_loss().detach())
            if loss < best[0]:  # False for NaN
                best = (loss, [v.detach().clone() for v in variables])
        with torch.no_grad():
            for v, kept in zip(variables, best[1], strict=True):
                v.copy_(kept)
        return best[0]

    @staticmethod
    def pixels(data: Any, x: Tensor) -> Tensor:
        """Normalized inputs back to pixel values in [0, 1] ``[B, C, H, W]``."""
        shape = (1, -1) + (1,) * (x.dim() - 2)
        return (x * data.std.view(shape) + data.mean.view(shape)).clamp(0, 1)
