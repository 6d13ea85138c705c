"""Generalization to novel clients (pFedHN, Shamsian et al., ICML 2021, section 5.3).

A hypernetwork h(v; phi) trained on the first ``n - m`` clients is frozen; each of the last ``m``
clients (``model.init_args.novel_clients``), never seen in training, fits only its own
parameters of the hypernetwork (its embedding v_i, and whatever else the method's
:meth:`~lightning_pfl.methods.base.FederatedMethod.novel_adaptation` names) by gradient descent
on its own training loss through the hypernetwork:

    v_i <- v_i - lr * grad_{v_i} sum_j L_j(h(v_j; phi)),

where L_j is the mean cross-entropy of novel client j's personalized model on its batch of the
step. The sum over novel clients couples nothing: L_j depends on client j's own tensors only,
so each receives exactly its own client's gradient, and all novel clients adapt in one forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_pfl.engine import ClientBatches, derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.base import FederatedMethod, NovelAdaptation
from lightning_pfl.validation import PositiveFloat, PositiveInt, check_arguments

NOVEL_ADAPTATION_STREAM = 101  # derive_seed stream of the adaptation batches


@contextmanager
def requiring_grad(tensors: Sequence[Tensor]) -> Iterator[None]:
    """Let ``tensors`` (leaves such as client-store fields) require grad inside the block, and
    give each its former ``requires_grad`` back afterwards."""
    before = [t.requires_grad for t in tensors]
    try:
        for t in tensors:
            t.requires_grad_(True)
        yield
    finally:
        for t, flag in zip(tensors, before, strict=True):
            t.requires_grad_(flag)


def total_variation_to_nearest(novel_counts: Tensor, train_counts: Tensor) -> tuple[Tensor, Tensor]:
    """Per novel client, min over training clients of the total-variation distance
    0.5 * sum_c |p_novel(c) - p_train(c)| between training label distributions.

    Args:
        novel_counts: label counts of the novel clients ``[m, classes]``.
        train_counts: label counts of the training clients ``[k, classes]``.

    Returns:
        The distances ``[m]`` and the index of the nearest training client ``[m]``.
    """
    p_novel = novel_counts.double() / novel_counts.double().sum(1, keepdim=True).clamp_min(1)
    p_train = train_counts.double() / train_counts.double().sum(1, keepdim=True).clamp_min(1)
    distance = 0.5 * (p_novel[:, None, :] - p_train[None, :, :]).abs().sum(-1)  # [m, k]
    nearest = distance.min(1)
    return nearest.values, nearest.indices


class NovelClients(Callback):
    """pFedHN's novel-client protocol, run once training ends.

    The method's last ``novel_clients`` clients were never sampled nor evaluated during
    training. When training ends (``on_train_end``: after the final round's validation, while
    the model is still on its device), the hypernetwork body phi and the training clients'
    embeddings stay frozen and the tensors the method's
    :meth:`~lightning_pfl.methods.base.FederatedMethod.novel_adaptation` names take ``steps``
    plain SGD steps on the sum of the novel clients' mean training cross-entropy, each step on
    a fresh seeded batch of ``model.init_args.batch_size`` of every novel client's training
    data (the same for every run with the method's seed). What adapts: pFedHN the novel
    clients' embeddings; pFedHN-PC their embeddings and personal heads (from the heads' shared
    initialization); the MH-pFedHN family their slot embeddings, the hypernetwork heads no
    training client uses (an architecture size only novel clients have) and, through the
    training-mode forwards, their batch-norm running statistics.

    Logged at x = adaptation step, at step 0 and every ``eval_every`` steps (and the last):
    ``novel/test_acc`` (mean over novel clients of their personalized test accuracy) and
    ``novel/test_acc_weighted`` (pooled over their test samples); at step 0 also
    ``novel/train_clients_test_acc`` (mean test accuracy of the training clients, for
    reference). With a TensorBoard logger, ``novel/accuracy_vs_tv_distance`` plots each novel
    client's final accuracy against the total-variation distance of its training label
    distribution to the nearest training client's. ``results.json`` gets a ``novel_clients``
    entry (see :meth:`summary`). Every adapted tensor (and updated buffer) is restored to its
    trained value afterwards, so checkpoints and a resumed run never see the adaptation (call
    :meth:`adapt` directly to keep the adapted tensors).

    Args:
        steps: adaptation SGD steps.
        lr: learning rate of the adaptation SGD.
        eval_every: evaluate the novel clients every this many steps.
    """

    def __init__(
        self, steps: PositiveInt = 50, lr: PositiveFloat = 1e-2, eval_every: PositiveInt = 10
    ) -> None:
        arguments = {"steps": steps, "lr": lr, "eval_every": eval_every}
        check_arguments(self, arguments, "trainer.callbacks.NovelClients")
        self.steps = steps
        self.lr = lr
        self.eval_every = eval_every

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self.adaptation(pl_module)  # refuse before the first round, not after the last

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert isinstance(pl_module, FederatedMethod)
        if pl_module.stopped_by is None:  # interrupted: nothing was trained to the end
            return
        adaptation = self.adaptation(pl_module)
        changed = adaptation.tensors + adaptation.buffers
        trained = [t.detach().clone() for t in changed]
        history = self.adapt(pl_module, adaptation)
        with torch.no_grad():
            for tensor, value in zip(changed, trained, strict=True):
                tensor.copy_(value)
        train_acc = pl_module._evaluate_all("test")[0]["acc"]
        tv, nearest = self.label_distances(pl_module)
        final_acc = history["per_client_acc"][-1]
        ids = self.novel_ids(pl_module).tolist()
        summary = self.summary(history, train_acc, ids, tv, nearest)
        pl_module.extra_results["novel_clients"] = summary
        for logger in trainer.loggers:
            logger.log_metrics({"novel/train_clients_test_acc": train_acc}, step=0)
        if trainer.is_global_zero and isinstance(trainer.logger, TensorBoardLogger):
            trainer.logger.experiment.add_figure(
                "novel/accuracy_vs_tv_distance",
                accuracy_vs_distance_figure(tv.tolist(), final_acc),
                pl_module.global_step,
            )
        rank_zero_info(
            f"novel clients: test acc {summary['test_acc'][0]:.4f} at step 0, "
            f"{summary['test_acc'][-1]:.4f} after {self.steps} steps (training clients "
            f"{train_acc:.4f})"
        )

    # ----------------------------------------------------------------- the protocol
    def novel_ids(self, method: FederatedMethod) -> Tensor:
        """Ids of the novel clients (the last ``novel_clients``) on the method's device."""
        return torch.arange(
            method.num_training_clients, method.hp.num_clients, device=method.device
        )

    def draw_batches(self, method: FederatedMethod) -> ClientBatches:
        """``steps`` seeded training batches of every novel client ``[m, steps, B]``."""
        data = method.data
        generator = torch.Generator(data.device).manual_seed(
            derive_seed(method.hp.seed, NOVEL_ADAPTATION_STREAM)
        )
        clients = self.novel_ids(method).to(data.device)
        return data.client_batches(clients, method.hp.batch_size, generator, steps=self.steps)

    def adaptation(self, method: LightningModule) -> NovelAdaptation:
        """The method's :meth:`~lightning_pfl.methods.base.FederatedMethod.novel_adaptation` of
        its novel clients, or a ConfigError saying why it has none."""
        if not isinstance(method, FederatedMethod):
            raise ConfigError(f"NovelClients needs a FederatedMethod, got {type(method).__name__}.")
        if method.hp.novel_clients == 0:
            raise ConfigError(
                "trainer.callbacks NovelClients needs held-out clients: set "
                "model.init_args.novel_clients > 0 (the last that many clients), or remove the "
                "callback."
            )
        return method.novel_adaptation(self.novel_ids(method))

    def gradients(
        self, adaptation: NovelAdaptation, index: Tensor, weight: Tensor
    ) -> tuple[Tensor, list[Tensor]]:
        """Summed novel-client loss and its gradient w.r.t. each of ``adaptation.tensors``.

        ``index`` and ``weight`` ``[m, B]`` are one step's batch of each novel client; the
        gradient is zero outside the novel clients' parts, and nothing else (phi) gets one.
        """
        with torch.enable_grad(), requiring_grad(adaptation.tensors):
            total = adaptation.loss(index, weight)
            grads = torch.autograd.grad(total, adaptation.tensors)
        return total.detach(), list(grads)

    def evaluate_novel(self, method: FederatedMethod) -> Tensor:
        """Per-novel-client test accuracy (NaN without test samples), their mean over clients
        with samples and the pooled accuracy, concatenated ``[m + 2]`` (on device)."""
        correct, total, _ = method.evaluate(self.novel_ids(method), "test")
        per_client = torch.where(total > 0, correct / total.clamp_min(1), torch.nan)
        pooled = correct.sum() / total.sum().clamp_min(1)
        return torch.cat([per_client, per_client.nanmean()[None], pooled[None]])

    def adapt(
        self, method: FederatedMethod, adaptation: NovelAdaptation | None = None
    ) -> dict[str, Any]:
        """Run the adaptation SGD on the novel clients (``adaptation``, default the method's
        :meth:`adaptation`); return the accuracies at each evaluation step (``eval_steps``,
        ``per_client_acc`` [steps][m], ``acc``, ``acc_weighted``), also logged at x = step."""
        adaptation = adaptation or self.adaptation(method)
        batches = self.draw_batches(method)
        history: dict[str, Any] = {
            "eval_steps": [],
            "per_client_acc": [],
            "acc": [],
            "acc_weighted": [],
        }
        for step in range(self.steps + 1):
            if step % self.eval_every == 0 or step == self.steps:
                *per_client, mean, pooled = self.evaluate_novel(method).tolist()  # host sync
                history["eval_steps"].append(step)
                history["per_client_acc"].append(per_client)
                history["acc"].append(mean)
                history["acc_weighted"].append(pooled)
                metrics = {
                    "novel/test_acc": history["acc"][-1],
                    "novel/test_acc_weighted": history["acc_weighted"][-1],
                }
                for logger in method.loggers:
                    logger.log_metrics(metrics, step=step)
            if step == self.steps:
                break
            _, grads = self.gradients(adaptation, batches.index[:, step], batches.weight[:, step])
            with torch.no_grad():
                for tensor, grad in zip(adaptation.tensors, grads, strict=True):
                    tensor -= self.lr * grad
        return history

    def label_distances(self, method: FederatedMethod) -> tuple[Tensor, Tensor]:
        """TV distance of each novel client's training label distribution to the nearest
        training client's, and that client's id."""
        counts = torch.as_tensor(np.asarray(method.data.partition_counts()["train"]))
        first_novel = method.num_training_clients
        return total_variation_to_nearest(counts[first_novel:], counts[:first_novel])

    def summary(
        self,
        history: dict[str, Any],
        train_acc: float,
        ids: list[int],
        tv: Tensor,
        nearest: Tensor,
    ) -> dict[str, Any]:
        """The ``novel_clients`` entry of ``results.json``.

        Keys: ``steps``, ``lr``, ``eval_steps`` (adaptation steps evaluated), ``test_acc`` and
        ``test_acc_weighted`` (novel clients' mean and pooled test accuracy at each of them),
        ``train_clients_test_acc``, and ``clients``: per novel client its ``id``,
        ``tv_distance`` to the nearest training client (``nearest_train_client``) and its test
        accuracy at step 0 (``test_acc_start``) and at the end (``test_acc_end``).
        """
        first, last = history["per_client_acc"][0], history["per_client_acc"][-1]
        rows = zip(ids, tv.tolist(), nearest.tolist(), first, last, strict=True)
        return {
            "steps": self.steps,
            "lr": self.lr,
            "eval_steps": history["eval_steps"],
            "test_acc": history["acc"],
            "test_acc_weighted": history["acc_weighted"],
            "train_clients_test_acc": train_acc,
            "clients": [
                {
                    "id": i,
                    "tv_distance": d,
                    "nearest_train_client": j,
                    "test_acc_start": a0,
                    "test_acc_end": a1,
                }
                for i, d, j, a0, a1 in rows
            ],
        }


def accuracy_vs_distance_figure(distance: list[float], accuracy: list[float]) -> Any:
    """Scatter of each novel client's final test accuracy against its TV distance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    ax.scatter(distance, accuracy)
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("TV distance to the nearest training client")
    ax.set_ylabel("test accuracy after adaptation")
    ax.set_title("novel clients")
    fig.tight_layout()
    return fig


__all__ = [
    "NovelClients",
    "accuracy_vs_distance_figure",
    "requiring_grad",
    "total_variation_to_nearest",
]
