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

Baselines adapt a novel client by what the method does for a new client (the method's
``novel_adaptation``): FedAvg and Per-FedAvg take SGD steps from the global model on a copy
of their own, FedPer and LG-FedAvg train their personal layers from the initialization on the
frozen shared ones, Local trains its own model from the common initialization; every method
runs the same protocol (``steps`` plain SGD steps of ``lr`` on the same seeded batches).

The paper's Figure 2 plots each method's generalization gap, the novel clients' accuracy minus
the training clients', against the total-variation distance of a novel client's label
distribution to the nearest training client's; ``python -m lightning_pfl.novel OUT.png
RESULTS.json...`` draws it from runs' ``results.json`` files.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
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
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.novel_adaptation import NovelAdaptation
from lightning_pfl.partition import ClientDirichlet
from lightning_pfl.streams import NOVEL_ADAPTATION_STREAM
from lightning_pfl.validation import PositiveFloat, PositiveInt, check_arguments


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
    data (the same for every run and method with the same seed). What adapts: pFedHN the
    novel clients' embeddings; pFedHN-PC their embeddings and personal heads (from the heads'
    shared initialization); the MH-pFedHN family their slot embeddings, the hypernetwork heads
    no training client uses (an architecture size only novel clients have) and, through the
    training-mode forwards, their batch-norm running statistics; FedAvg and Per-FedAvg a copy
    of the global model each; FedPer and LG-FedAvg their personal layers from the
    initialization, the shared ones frozen; Local its own model from the common
    initialization.

    The generalization gap of novel client j is ``acc_j - acc_train``: its test accuracy
    after the adaptation minus the training clients' mean test accuracy at the round with the
    best validation (``test_at_best_val.acc``, the number the paper's tables report; the
    final round's when nothing was validated).

    Logged at x = adaptation step, at step 0 and every ``eval_every`` steps (and the last):
    ``novel/test_acc`` (mean over novel clients of their personalized test accuracy) and
    ``novel/test_acc_weighted`` (pooled over their test samples); once, at step 0,
    ``novel/train_clients_test_acc`` (acc_train) and ``novel/gap`` (the mean gap). With a
    TensorBoard logger, ``novel/gap_vs_tv_distance`` plots each novel client's gap against the
    total-variation distance of its training label distribution to the nearest training
    client's (the paper's Figure 2). ``results.json`` gets a ``novel_clients`` entry (see
    :meth:`summary`). Every adapted tensor (and updated buffer) is restored to its trained
    value afterwards, so checkpoints and a resumed run never see the adaptation (call
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
            assert isinstance(pl_module, FederatedMethod)
            partition = getattr(pl_module.data, "partition", None)
            held_out = pl_module.hp.novel_clients
            if isinstance(partition, ClientDirichlet) and partition.novel_clients != held_out:
                raise ConfigError(
                    "data.init_args.partition.init_args.novel_clients = "
                    f"{partition.novel_clients} but model.init_args.novel_clients = {held_out}: "
                    "the clients drawn with novel_alpha must be the held-out ones; set both "
                    "to the same number."
                )

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert isinstance(pl_module, FederatedMethod)
        if pl_module.record.stopped_by is None:  # interrupted: nothing was trained to the end
            return
        adaptation = self.adaptation(pl_module)
        changed = adaptation.tensors + adaptation.buffers
        trained = [t.detach().clone() for t in changed]
        history = self.adapt(pl_module, adaptation)
        with torch.no_grad():
            for tensor, value in zip(changed, trained, strict=True):
                tensor.copy_(value)
        last_acc = pl_module._evaluate_all(("test",))[0][0]["acc"]
        best = pl_module.record.best
        train_acc = best["test"]["acc"] if best else last_acc
        tv, nearest = self.label_distances(pl_module)
        ids = self.novel_ids(pl_module).tolist()
        summary = self.summary(history, train_acc, ids, tv, nearest)
        summary["train_clients_round"] = best["round"] if best else pl_module.global_step
        summary["train_clients_test_acc_last"] = last_acc
        pl_module.record.extra_results["novel_clients"] = summary
        logged = {"novel/train_clients_test_acc": train_acc, "novel/gap": summary["gap"]}
        for logger in trainer.loggers:
            logger.log_metrics(logged, step=0)
        figures = pl_module.hp.log_figures
        if figures and trainer.is_global_zero and isinstance(trainer.logger, TensorBoardLogger):
            rows = summary["clients"]
            figure = gap_vs_distance_figure(
                {
                    type(pl_module).__name__: (
                        [c["tv_distance"] for c in rows],
                        [c["gap"] for c in rows],
                    )
                }
            )
            trainer.logger.experiment.add_figure(
                "novel/gap_vs_tv_distance", figure, pl_module.global_step
            )
        rank_zero_info(
            f"novel clients: test acc {summary['test_acc'][0]:.4f} at step 0, "
            f"{summary['test_acc'][-1]:.4f} after {self.steps} steps; training clients "
            f"{train_acc:.4f} (round {summary['train_clients_round']}), gap {summary['gap']:+.4f}"
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

    def evaluate_novel(self, method: FederatedMethod, adaptation: NovelAdaptation) -> Tensor:
        """Per-novel-client test accuracy (NaN without test samples), their mean over clients
        with samples and the pooled accuracy, concatenated ``[m + 2]`` (on device)."""
        clients = self.novel_ids(method)
        if adaptation.params is None:
            correct, total, _ = method.evaluate(clients, "test")
        else:
            correct, total, _ = method.evaluate_clients(clients, "test", adaptation.params())
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
                *per_client, mean, pooled = self.evaluate_novel(method, adaptation).tolist()
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
        ``train_clients_test_acc`` (acc_train), ``gap`` (``test_acc[-1] - acc_train``),
        ``tv_distance`` (mean over the novel clients), and ``clients``: per novel client its
        ``id``, ``tv_distance`` to the nearest training client (``nearest_train_client``), its
        test accuracy at step 0 (``test_acc_start``) and at the end (``test_acc_end``) and its
        ``gap`` (``test_acc_end - acc_train``). The callback adds ``train_clients_round`` (the
        round acc_train is taken at) and ``train_clients_test_acc_last`` (the final round's).
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
            "gap": history["acc"][-1] - train_acc,
            "tv_distance": float(tv.mean()),
            "clients": [
                {
                    "id": i,
                    "tv_distance": d,
                    "nearest_train_client": j,
                    "test_acc_start": a0,
                    "test_acc_end": a1,
                    "gap": a1 - train_acc,
                }
                for i, d, j, a0, a1 in rows
            ],
        }


def gap_vs_distance_figure(series: Mapping[str, tuple[Sequence[float], Sequence[float]]]) -> Any:
    """The paper's Figure 2: per novel client, its generalization gap (test accuracy minus the
    training clients') against its TV distance to the nearest training client; one series
    (label: ``(distances, gaps)``) per method or run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.5))
    for label, (distance, gap) in series.items():
        ax.scatter(distance, gap, label=label, s=14)
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel("TV distance to the nearest training client")
    ax.set_ylabel("acc(novel) - acc(training clients)")
    ax.set_title("novel clients")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def main(argv: Sequence[str] | None = None) -> None:
    """Draw Figure 2 from runs' ``results.json``: one series per method, pooling the novel
    clients of all its files (as the paper's figure pools its four novel alphas)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("output", type=Path, help="the image to write (e.g. figure2.png)")
    parser.add_argument("results", type=Path, nargs="+", help="results.json of NovelClients runs")
    args = parser.parse_args(argv)
    series: dict[str, tuple[list[float], list[float]]] = {}
    for path in args.results:
        result = json.loads(path.read_text())
        rows = result["novel_clients"]["clients"]
        method = str(result.get("config", {}).get("model", {}).get("class_path", "")).split(".")[-1]
        distances, gaps = series.setdefault(method or path.parent.name, ([], []))
        distances += [c["tv_distance"] for c in rows]
        gaps += [c["gap"] for c in rows]
    gap_vs_distance_figure(series).savefig(args.output, dpi=150)


__all__ = [
    "NovelClients",
    "gap_vs_distance_figure",
    "requiring_grad",
    "total_variation_to_nearest",
]

if __name__ == "__main__":
    main()
