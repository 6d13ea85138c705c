"""Evaluation of every client's personalized model, and Lightning's validation and test hooks.

:class:`Evaluation` is a base class of :class:`~lightning_pfl.methods.base.FederatedMethod`:
each evaluated round tests every training client on its own test split (and validation split,
when the data has one) and hands the statistics to the run record
(:class:`~lightning_pfl.run_record.RunRecord`), which picks the best round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from lightning import LightningModule
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.func import vmap

from lightning_pfl.client_threads import predict_clients
from lightning_pfl.engine import Architecture, Params
from lightning_pfl.metrics import ClientAccuracy
from lightning_pfl.run_record import RunRecord, log_client_accuracy

if TYPE_CHECKING:
    from lightning_pfl.assignment import NetworkGroups
    from lightning_pfl.datamodule import FederatedDataModule, Split
    from lightning_pfl.execution import Executor


class Evaluation(LightningModule):
    """The evaluation part of :class:`~lightning_pfl.methods.base.FederatedMethod` (a base class
    of it): :meth:`evaluate` and :meth:`evaluate_clients` for methods, the validation and test
    hooks for Lightning."""

    if TYPE_CHECKING:  # FederatedMethod's
        arch: Architecture
        record: RunRecord
        val_metric: ClientAccuracy
        test_metric: ClientAccuracy
        round_test_metric: ClientAccuracy

        @property
        def hp(self) -> AttributeDict: ...

        @property
        def data(self) -> FederatedDataModule: ...

        @property
        def executor(self) -> Executor: ...

        @property
        def current_round(self) -> int: ...

        def personalized_params(self, clients: Tensor) -> Params: ...

        def predict(self, params: Params, x: Tensor) -> Tensor: ...

        def client_groups(self) -> dict[str, Tensor]: ...

        def training_clients_of(self, clients: Tensor) -> Tensor: ...

        def _log_at_round(
            self, metrics: Mapping[str, float], rounds: int | None = None
        ) -> None: ...

    def network_groups(self) -> NetworkGroups | None:
        """Client groups whose networks differ, evaluated one group at a time (default none)."""
        return None

    @torch.no_grad()
    def evaluate(self, clients: Tensor, split: Split) -> tuple[Tensor, Tensor, Tensor]:
        """Correct predictions, sample counts and summed loss of each client's own model, one
        :meth:`network_groups` group at a time."""
        return self.evaluate_splits(clients, (split,))[0]

    @torch.no_grad()
    def evaluate_splits(
        self, clients: Tensor, splits: Sequence[Split]
    ) -> list[tuple[Tensor, Tensor, Tensor]]:
        """:meth:`evaluate` on each of ``splits``, with one :meth:`personalized_params` call
        for them all (a method that fine-tunes for evaluation fine-tunes once, not per split)."""
        groups = self.network_groups()
        if groups is None:
            params = self.personalized_params(clients)
            return [self.evaluate_clients(clients, split, params) for split in splits]
        out = torch.zeros(len(splits), 3, len(clients), device=self.device)
        for _, rows in groups.split(clients):
            params = self.personalized_params(clients[rows])
            for totals, split in zip(out, splits, strict=True):
                totals[:, rows] = torch.stack(self.evaluate_clients(clients[rows], split, params))
        return [(correct, samples, loss) for correct, samples, loss in out]

    def client_logits(self, params: Params, x: Tensor) -> Tensor:
        """Logits (float) of each client's model (``params`` stacked) on its own inputs ``x``
        ``[C, B, ...]``: one vmap, or on a CPU the clients in worker threads where training
        uses the threaded loop."""
        vectorize, threads = (
            (True, 1)
            if self.network_groups() is not None or self.device.type != "cpu"
            else self.executor.path(self.arch)
        )
        if vectorize:
            return vmap(self.predict)(params, x).float()
        return predict_clients(self.predict, params, x, threads).float()

    @torch.no_grad()
    def evaluate_clients(
        self, clients: Tensor, split: Split, params: Params | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`evaluate` for ``clients`` that share one network architecture
        (:meth:`client_logits`). ``params``: their models (stacked), default
        :meth:`personalized_params`."""
        by_size = self.data.by_size(clients, split)
        params = by_size.sort(self.personalized_params(clients) if params is None else params)
        sums = torch.zeros(len(clients), 3, device=self.device)  # correct, samples, loss
        for k, x, y, weight in by_size.blocks(self.hp.eval_batch_size):
            logits = self.client_logits({name: value[:k] for name, value in params.items()}, x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(
                weight
            )
            hits = (logits.argmax(-1) == y).float()
            sums[:k] += torch.stack([hits * weight, weight, loss * weight], -1).sum(1)
        correct, total, loss_sum = by_size.unsort(sums).unbind(1)
        return correct, total, loss_sum

    def validation_step(self, batch: Tensor, batch_idx: int) -> None:
        # The round's test evaluation runs here too, on the same personalized models; without
        # a validation split the loop is only what schedules it.
        clients = self.training_clients_of(batch)
        *val, test = self.evaluate_splits(clients, self._round_splits())
        self.round_test_metric.update(clients, *test)
        if val:
            self.val_metric.update(clients, *val[0])

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        clients = self.training_clients_of(batch)
        self.test_metric.update(clients, *self.evaluate(clients, "test"))

    def _round_splits(self) -> tuple[Split, ...]:
        """The splits an evaluated round measures: validation (if the data has one), then test."""
        return ("val", "test") if self.data.has_validation else ("test",)

    def _evaluate_all(self, splits: Sequence[Split]) -> list[tuple[dict[str, float], Tensor]]:
        """Statistics and per-client accuracies of every training client on each of
        ``splits`` (all ranks call)."""
        groups = self.client_groups()
        metrics = [ClientAccuracy(self.hp.num_clients, groups).to(self.device) for _ in splits]
        for chunk in self.data.client_chunks():
            chunk = self.training_clients_of(chunk.to(self.device))
            for metric, result in zip(metrics, self.evaluate_splits(chunk, splits), strict=True):
                metric.update(chunk, *result)
        return [take(metric) for metric in metrics]

    def _record_validation(
        self, test: dict[str, float], validation: tuple[dict[str, float], Tensor] | None
    ) -> None:
        """Log the test statistics ``test`` of this round; with ``validation`` (statistics and
        per-client accuracies; None: the data has no validation split) also make the round a
        best-round candidate and log the validation."""
        logged, summary = self.record.add_evaluation(
            int(self.global_step), test, None if validation is None else validation[0]
        )
        self._log_at_round(logged)
        if validation is not None:
            self._log_client_accuracy("val", validation[1])
        if self.trainer.is_global_zero and self.trainer.progress_bar_callback is None:
            speed = f"{self.record.seconds_per_round:.3f} s/round"
            rank_zero_info(f"round {self.global_step}/{self.trainer.max_steps}: {summary}, {speed}")

    def _log_client_accuracy(self, prefix: str, per_client: Tensor) -> None:
        if isinstance(self.logger, TensorBoardLogger) and self.trainer.is_global_zero:
            log_client_accuracy(
                self.logger, prefix, per_client, self.global_step, self.hp.log_figures
            )

    def on_validation_epoch_end(self) -> None:
        test = take(self.round_test_metric)[0]
        validation = take(self.val_metric) if self.data.has_validation else None
        if self.trainer.sanity_checking:
            return
        self._record_validation(test, validation)
        if validation is None:
            return
        stats = validation[0]
        key = self.hp.select_metric
        for name, value in (("val/acc", stats["acc"]), ("val/acc_weighted", stats["acc_weighted"])):
            self.log(name, value, prog_bar=True, logger=False, sync_dist=True)
        self.log("val/best_acc", self.record.best["val"][key], logger=False, sync_dist=True)

    def on_test_epoch_end(self) -> None:
        stats, per_client = take(self.test_metric)
        logged = self.record.add_test(self.current_round, stats)
        for name, value in logged.items():
            self.log(name, value, logger=False, sync_dist=True)
        self._log_at_round(logged)
        self._log_client_accuracy("test", per_client)


def take(metric: ClientAccuracy) -> tuple[dict[str, float], Tensor]:
    """``metric``'s statistics and per-client accuracies; the metric is reset."""
    stats = {k: float(v) for k, v in metric.compute().items()}
    per_client = metric.per_client()
    metric.reset()
    return stats, per_client
