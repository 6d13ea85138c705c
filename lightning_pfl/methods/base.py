"""The federated round loop shared by every method: :class:`FederatedMethod`.

It holds the method API (the hooks a method implements and the helpers it calls) and the
Lightning plumbing of a round; its base classes hold the rest of what every method shares:
:class:`~lightning_pfl.local_training.LocalTraining` (batches, local SGD, the executor),
:class:`~lightning_pfl.participation.Participation` (client sampling, who reported back, weights,
bytes), :class:`~lightning_pfl.evaluation.Evaluation` (per-client evaluation, Lightning's
validation and test hooks) and :class:`~lightning_pfl.novel_adaptation.NovelAdaptationHooks`
(novel clients). The run record is :class:`~lightning_pfl.run_record.RunRecord`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Annotated, Any, Literal, cast

import torch
from lightning import LightningModule
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn

from lightning_pfl.client_state import ClientStateStore
from lightning_pfl.conditions import Conditions, unreliable_clients
from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.engine import Architecture, Params, cross_entropy_loss, derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.evaluation import Evaluation
from lightning_pfl.execution import ExecutionSettings, Executor, check_threadable
from lightning_pfl.local_training import LocalTraining
from lightning_pfl.metrics import ClientAccuracy
from lightning_pfl.models import build_network
from lightning_pfl.novel_adaptation import NovelAdaptationHooks
from lightning_pfl.participation import Participation
from lightning_pfl.privacy import EPSILON_KEY, ClientDP, PrivacyAccountant, private_uploads
from lightning_pfl.reporting import report_partition
from lightning_pfl.run_record import PendingLoss, RunRecord, hparams_table, log_hparams_table
from lightning_pfl.streams import DROPOUT_STREAM, INIT_STREAM, NOISE_STREAM, SERVER_INIT_STREAM
from lightning_pfl.trainer_settings import precision_problem
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
    Seed,
    argument_default,
    check_arguments,
)


class FederatedMethod(
    LocalTraining, Participation, Evaluation, NovelAdaptationHooks, LightningModule, ABC
):
    """Base class: one ``training_step`` is one federated round.

    A round: sample ``clients_per_round`` clients (seeded by round, so the same after resume),
    call :meth:`run_round` (the method's algorithm box: payloads, local training through
    :meth:`local_train`, server update by setting ``.grad`` of server parameters), then the
    base class steps the server optimizer once. ``trainer.max_steps`` is the number of rounds.

    A method implements :meth:`run_round` and :meth:`personalized_params`, and optionally
    :meth:`configure_server_optimizer`, :meth:`predict` and :meth:`client_groups`.

    Validation runs before the first round (round 0), every ``trainer.val_check_interval``
    rounds and after the final round; the round with the best validation ``select_metric`` is
    the "best round", whose test accuracy is reported as ``test_best/*``. Each of these rounds
    also evaluates the test split (``eval_history``); without a validation split (the data's
    ``val_fraction: 0``) they evaluate only the test split and no round is selected.

    Args:
        num_clients: number of clients n (linked from the DataModule).
        num_classes: number of classes (linked from the DataModule).
        input_shape: shape of one input (linked from the DataModule).
        net: target network name (see ``lightning_pfl.models.NETWORKS``: ``cnn``, ``kt_cnn``,
            ``mlp``, ``digits_cnn``, ``lenet5``, ``small_cnn``, ``transformer``).
        net_args: extra arguments of the target network (e.g. ``n_kernels`` of ``cnn``).
        clients_per_round: clients sampled uniformly without replacement per round.
        local_steps: local SGD steps per round, each on a fresh random batch (pFedHN's K).
        local_epochs: local epochs per round (E); when set, overrides ``local_steps``.
        batch_size: local batch size (B).
        local_lr: client SGD learning rate (eta, pFedHN's inner lr).
        local_momentum: client SGD momentum.
        local_weight_decay: client SGD weight decay.
        local_max_grad_norm: per-client gradient-norm clip of local steps (None: off).
        vectorize: train the round's clients together with vmap (False: client by client, same
            math). None: vmap on GPUs; on CPUs vmap for networks whose local step costs under
            24 MFLOP and the threaded loop (``client_threads``) above that, where vmap's grouped
            convolutions are slower (measurements: docs/performance.md).
        compile_step: compile the local SGD step with ``torch.compile`` (first round slower).
        cuda_graphs: record each round's local training as a CUDA graph and replay it (None:
            on when training on a CUDA device; see ``lightning_pfl.graphs``).
        client_threads: on a CPU, clients the loop (no vmap) trains at once, each in its own
            worker thread with one intra-op thread and channels-last images; same results as
            one by one up to float rounding. None: every usable core when ``vectorize`` is
            None, 1 when it is False. Used only where the client step is deterministic (no
            dropout), not compiled and in one process; elsewhere, and with 1, clients train
            one by one (``vectorize: false, client_threads: 1`` is the reference path).
        eval_batch_size: most samples per client per evaluation block (clients of unequal
            size are grouped by sample count, :meth:`FederatedDataModule.ragged_eval_blocks`).
        select_metric: validation metric that picks the best round: ``acc`` (mean over
            clients, the pFedHN paper's formula) or ``acc_weighted`` (pooled, its code's).
            Without a validation split only the default is accepted (the CLI refuses
            ``acc_weighted``: nothing is selected).
        last_evals: how many of the final evaluations ``test_last_evals`` averages (FedTP's
            mean +- std over evaluations every 5 rounds in the last 200 rounds: 40 with
            ``trainer.val_check_interval: 5``). Reporting only: it may change on resume.
        offload_client_state: keep per-client state in pinned CPU memory.
        log_figures: draw the run's matplotlib figures into TensorBoard (the partition
            heatmaps, per-client accuracy at every evaluation, the novel-client gap). False:
            scalars, histograms and the partition files only; a short run then spends about
            half as long on logging. Reporting only: it may change on resume.
        seed: seed of initialization, client sampling, batches and dropout.
        novel_clients: the last this many client ids are held out of training (never sampled)
            and of the validation and test metrics, for the novel-client generalization
            protocol (pFedHN section 5.3, :class:`~lightning_pfl.novel.NovelClients`).
        client_dp: client-level differential privacy of the uploaded updates (DP-FedAvg:
            clip to ``clip_norm``, Gaussian noise with ``noise_multiplier``; epsilon at
            ``delta`` logged every round as ``privacy/epsilon`` and in ``results.json``,
            :class:`~lightning_pfl.privacy.ClientDP`, docs/privacy.md). None: off. A method
            whose round does not privatize its uploads refuses it.
        conditions: unreliable clients (:class:`~lightning_pfl.conditions.Conditions`: a
            ``drop_rate``, ``stragglers``, ``availability``; docs/conditions.md), drawn per
            round and client as masks of the round. None: every sampled client completes its
            local work and reports back. Methods whose aggregation weighs only the clients
            that reported back declare ``honours_conditions = True``; the others refuse it.
    """

    def __init__(
        self,
        num_clients: PositiveInt,
        num_classes: Annotated[int, Range(ge=2)],
        input_shape: Sequence[int],
        net: str = "cnn",
        net_args: dict[str, Any] | None = None,
        clients_per_round: PositiveInt = 1,
        local_steps: PositiveInt = 50,
        local_epochs: PositiveInt | None = None,
        batch_size: PositiveInt = 64,
        local_lr: PositiveFloat = 5e-3,
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 5e-5,
        local_max_grad_norm: PositiveFloat | None = 50.0,
        vectorize: bool | None = None,
        compile_step: bool = False,
        cuda_graphs: bool | None = None,
        client_threads: PositiveInt | None = None,
        eval_batch_size: PositiveInt = 512,
        select_metric: Literal["acc", "acc_weighted"] = "acc",
        last_evals: PositiveInt = 10,
        offload_client_state: bool = False,
        log_figures: bool = True,
        seed: Seed = 0,
        novel_clients: NonNegativeInt = 0,
        client_dp: ClientDP | None = None,
        conditions: Conditions | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_arguments(self, dict(self.hparams), "model")
        default_epochs = argument_default(type(self), "local_epochs")
        if (
            local_epochs is not None
            and local_epochs == default_epochs
            and local_steps != argument_default(type(self), "local_steps")
        ):  # a config's local_steps that the class's own epochs would silently override
            raise ConfigError(
                f"model.init_args.local_steps = {local_steps} would be ignored: "
                f"{type(self).__name__} trains local_epochs = {local_epochs} epochs a round by "
                f"default; set local_epochs: null to train {local_steps} steps a round, or "
                "remove local_steps."
            )
        self.automatic_optimization = False
        if clients_per_round > num_clients:
            raise ConfigError(
                f"model.init_args.clients_per_round = {clients_per_round} exceeds the "
                f"{num_clients} clients of the data; use 1..{num_clients}."
            )
        if clients_per_round > num_clients - novel_clients:
            raise ConfigError(
                f"model.init_args.clients_per_round = {clients_per_round} exceeds the "
                f"{num_clients - novel_clients} training clients left when "
                f"model.init_args.novel_clients = {novel_clients} of the {num_clients} are held "
                f"out; lower one of them (clients_per_round + novel_clients <= {num_clients})."
            )
        self.unreliable = unreliable_clients(type(self), conditions, num_clients, seed)
        # Local steps of every round's batches (draw_batches), read by the RoundCosts callback.
        self.local_steps_drawn: Tensor | int = 0
        # (round, sampled, contacted, reported back) of the last sample_clients, with conditions
        self.round_reach = (-1, 1, 1, 1)
        with self.seeded_init(INIT_STREAM):
            try:
                network = build_network(net, input_shape, num_classes, **(net_args or {}))
            except ConfigError as error:
                raise ConfigError(f"model.init_args.net / net_args: {error}") from None
            self.arch = Architecture(network)
        self.execution = ExecutionSettings(
            vectorize, compile_step, cuda_graphs, client_threads, batch_size
        )
        check_threadable(self.execution, self.arch, net)
        self.store = ClientStateStore(num_clients)
        self.cross_entropy = cross_entropy_loss(self.arch)  # one object: a compiled step reuses it
        # Lightning's DDP wrapper refuses modules without trainable parameters (Local,
        # FedSimSup keep everything in the client store); this empty one never trains.
        self.ddp_anchor = nn.Parameter(torch.zeros(0))
        self.val_metric = ClientAccuracy(num_clients)
        self.test_metric = ClientAccuracy(num_clients)
        self.round_test_metric = ClientAccuracy(num_clients)  # the test at evaluated rounds
        self._data: FederatedDataModule | None = None
        self.record = RunRecord(select_metric, last_evals)
        self.server_optimizer: torch.optim.Optimizer | None = None  # set by configure_optimizers
        self._executor: Executor | None = None
        self._executor_pinned = False
        # The object itself: under the CLI, hparams hold the config's dict instead.
        self.client_dp = client_dp
        self.privacy: PrivacyAccountant | None = None
        self.privatized = ""  # what the DP round privatizes (the method's own words)
        if client_dp is not None:
            self.privatized = client_dp.check(self)
            self.privacy = PrivacyAccountant(
                client_dp, self.num_training_clients, clients_per_round
            )

    # ----------------------------------------------------------------- hooks for methods
    @abstractmethod
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        """Run one round for ``clients``; set ``.grad`` of server parameters; return losses [C]."""

    @abstractmethod
    def personalized_params(self, clients: Tensor) -> Params:
        """The personalized model of ``clients`` (parameters and buffers), stacked ``[C, ...]``."""

    def configure_server_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer of the server parameters (None: the method has none)."""
        return None

    def predict(self, params: Params, x: Tensor) -> Tensor:
        """Logits of one client's personalized model (vmapped over clients in evaluation).

        With :meth:`network_groups`, ``params`` are keyed by group (``NetworkGroups.tagged``).
        """
        groups = self.network_groups()
        return self.arch(params, x) if groups is None else groups.predict(params, x)

    def client_groups(self) -> dict[str, Tensor]:
        """Named groups of client ids whose accuracy is also reported separately (default: the
        :meth:`network_groups`, as ``arch_<name>``)."""
        groups = self.network_groups()
        return {} if groups is None else groups.client_groups("arch")

    # ----------------------------------------------------------------- helpers for methods
    def refuse_batch_norm(self, reason: str, arch: Architecture | None = None) -> None:
        """For methods whose math needs a network without batch-norm state: raise a ConfigError
        ``"<reason>: use a network without batch norm."`` when ``arch`` (default: the method's
        target) has some."""
        if (arch or self.arch).stateful:
            raise ConfigError(f"{reason}: use a network without batch norm.")

    @property
    def hp(self) -> AttributeDict:
        """The saved ``__init__`` arguments (``self.hparams``), typed for attribute access."""
        return cast(AttributeDict, self.hparams)

    @property
    def data(self) -> FederatedDataModule:
        """The client data: the attached DataModule, else the trainer's."""
        if self._data is not None:
            return self._data
        return self.trainer.datamodule  # type: ignore[attr-defined]

    def attach_data(self, data: FederatedDataModule) -> None:
        """Use ``data`` without a Trainer (to call :meth:`run_round` directly, e.g. to time it)."""
        self._data = data

    @contextmanager
    def seeded_init(self, stream: int = SERVER_INIT_STREAM) -> Iterator[None]:
        """Create modules inside this block to initialize them from the method's seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.hp.seed, stream))
            yield

    def dp_uploads(self, round_idx: int, sent: Params, uploaded: Params) -> tuple[Params, Tensor]:
        """DP-FedAvg's uploads of round ``round_idx`` (``client_dp``: clipped updates, the
        round's noise in their mean) and their weights: w_k = 1 over the fixed denominator qN,
        exactly ``clients_per_round`` here (the simulation samples that many)."""
        assert self.client_dp is not None, "client_dp is not set"
        generator = self.client_dp_generator(round_idx)
        private = private_uploads(sent, uploaded, self.client_dp, generator)
        count = len(next(iter(uploaded.values())))
        return private, torch.full((count,), 1.0 / self.hp.clients_per_round, dtype=torch.float64)

    def client_dp_generator(self, round_idx: int) -> torch.Generator:
        """The seeded generator of round ``round_idx``'s DP noise (``client_dp``); records the
        privacy spent once the round is done (``results.json``'s ``privacy``) and logs its
        epsilon (``privacy/epsilon``, at the step the round's other scalars use)."""
        assert self.privacy is not None, "client_dp is not set"
        spent = self.privacy.summary(round_idx + 1, self.privatized)
        self.record.extra_results["privacy"] = spent
        for logger in self.loggers if self._trainer is not None else []:
            logger.log_metrics({EPSILON_KEY: spent["epsilon"]}, step=round_idx + 1)
        seed = derive_seed(self.hp.seed, round_idx, NOISE_STREAM)
        return torch.Generator(self.device).manual_seed(seed)

    # ----------------------------------------------------------------- Lightning plumbing
    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = self.configure_server_optimizer()
        # A parameterless optimizer lets Lightning count one step per round for every method.
        self.server_optimizer = optimizer or torch.optim.SGD([{"params": []}], lr=0.0)
        return self.server_optimizer

    def setup(self, stage: str) -> None:
        # The CLI refuses both before anything is written; this catches a Trainer built in Python.
        problem = precision_problem(self.trainer.precision)
        if problem is not None:
            raise ConfigError(f"trainer.precision = {self.trainer.precision!r}: {problem}.")
        # Evaluation trains (fine-tuning, adaptation). Lightning runs `validate` and `test`
        # under inference mode, where torch.func differentiates to zeros in torch 2.11
        # (pytorch/pytorch#177318): run them under no_grad, as fit's own validation runs.
        for loop in (self.trainer.validate_loop, self.trainer.test_loop):
            loop.inference_mode = False
        self.check_data(self.data)

    def check_data(self, data: FederatedDataModule) -> None:
        """Raise a ConfigError for split data this method cannot run on (e.g. no validation
        split where it reads one). Called once the data is split, before the CLI writes
        anything; the default accepts any."""

    def _place_state(self) -> None:
        self.store.to(self.device, offload=self.hp.offload_client_state)
        groups = self.client_groups()
        self.val_metric.groups = self.test_metric.groups = self.round_test_metric.groups = groups

    def on_fit_start(self) -> None:
        if not self._executor_pinned:
            self._executor = None  # chosen again for the trainer's device and world size
        self._place_state()
        log_dir = self.trainer.log_dir  # a collective under DDP: every rank must ask
        if self.trainer.is_global_zero and self.logger is not None and log_dir is not None:
            report_partition(self.data, log_dir, self.logger, figures=self.hp.log_figures)

    def on_train_start(self) -> None:
        if self.global_step == 0:
            if self.trainer.is_global_zero and isinstance(self.logger, TensorBoardLogger):
                log_hparams_table(
                    self.logger, hparams_table(type(self).__name__, self.hparams, self.data)
                )
            if self._validation_enabled():
                *val, test = self._evaluate_all(self._round_splits())
                self._record_validation(test[0], val[0] if val else None)

    def _validation_enabled(self) -> bool:
        return bool(self.data.val_dataloader()) and self.trainer.limit_val_batches != 0

    def on_validation_start(self) -> None:
        self._settle_loss()
        self._place_state()

    def on_train_end(self) -> None:
        self._settle_loss()

    def on_test_start(self) -> None:
        self._place_state()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        round_idx = self.global_step
        if int(batch) != round_idx:
            raise RuntimeError(
                f"round index {int(batch)} from the dataloader != global step {round_idx}"
            )
        start = time.perf_counter()
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)
        optimizer.zero_grad()
        clients = self.sample_clients(round_idx)
        self.record.round_bytes = [0.0, 0.0]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # dropout: seeded by round, resumable
            seed = derive_seed(self.hp.seed, round_idx, DROPOUT_STREAM)
            if self.device.type in ("cpu", "cuda"):
                # what torch.manual_seed seeds here, without queueing a seed and a formatted
                # stack trace for each backend not in use (~0.3 ms a round, in every run)
                torch.default_generator.manual_seed(seed)
                if devices:
                    torch.cuda.manual_seed_all(seed)
            else:
                torch.manual_seed(seed)
            losses = self.run_round(round_idx, clients)
        if self.unreliable is None:
            mean_loss = losses.mean()
        else:  # a client that did not report back took no step: its loss is not a loss
            reported = self.arrived(clients, round_idx).to(losses)
            mean_loss = (losses * reported).sum() / reported.sum().clamp_min(1)
        finite = torch.isfinite(losses)
        summary = torch.stack([finite.all().float(), mean_loss.float()])
        pending = PendingLoss(round_idx, clients, finite, summary)
        previous = self._settle_loss()  # the device goes on with this round meanwhile
        self.record.pending_loss = pending
        optimizer.step()
        self._log_at_round(self.record.end_round(time.perf_counter() - start))
        self.log("round", float(self.global_step), prog_bar=True, logger=False)
        if previous is not None:
            self.log("loss", previous, prog_bar=True, logger=False)

    def _settle_loss(self) -> float | None:
        """Check and log the pending round's loss (``RunRecord.settle``): the previous round's in
        each round, and the last round's before any checkpoint, validation or the end of fit."""
        settled = self.record.settle()
        if settled is None:
            return None
        rounds, loss = settled
        self._log_at_round({"train/loss": loss}, rounds)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.max_steps > 0 and self.global_step >= self.trainer.max_steps:
            self.record.stopped_by = "max_steps"
            self.trainer.should_stop = True  # Lightning then validates this final round
        elif self.trainer.should_stop and self.record.stopped_by is None:
            self.record.stopped_by = "max_time or a callback"

    def _log_at_round(self, metrics: Mapping[str, float], rounds: int | None = None) -> None:
        """Log scalars at step = rounds completed (the step every key and figure uses): now,
        or ``rounds``."""
        for logger in self.loggers:
            logger.log_metrics(dict(metrics), step=self.global_step if rounds is None else rounds)

    # ----------------------------------------------------------------- state and results
    @property
    def current_round(self) -> int:
        """Rounds trained so far (a loaded checkpoint's round when testing it)."""
        return max(int(self.global_step), self.record.checkpoint_round)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._settle_loss()  # a non-finite round's state is never saved
        checkpoint["pfl"] = {
            "client_state": self.store.state_dict(),
            "round": int(self.global_step),
            **self.record.state_dict(),
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["pfl"]
        self.store.load_state_dict(state["client_state"])
        self.record.load_state_dict(state)

    def results(self) -> dict[str, Any]:
        """Summary written to ``results.json``: metrics, rounds, speed, communication."""
        return self.record.results(
            type(self).__name__, self.current_round, self.data.has_validation, self.hp.seed
        )
