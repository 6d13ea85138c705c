"""Local training of a round's clients as a method asks for it (:meth:`LocalTraining.draw_batches`,
:meth:`LocalTraining.local_train`), run by the method's executor (:mod:`lightning_pfl.execution`:
vmap, threads, one by one, CUDA graphs, DDP shards).

:class:`LocalTraining` is a base class of :class:`~lightning_pfl.methods.base.FederatedMethod`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from lightning import LightningModule
from lightning.fabric.utilities.data import AttributeDict
from torch import Tensor

from lightning_pfl.conditions import UnreliableClients
from lightning_pfl.engine import (
    Architecture,
    ClientBatches,
    LossFn,
    ParamGroup,
    Params,
    SGDConfig,
    TrainResult,
    cross_entropy_loss,
    derive_seed,
)
from lightning_pfl.execution import ExecutionSettings, Executor, TrainJob, choose_executor
from lightning_pfl.streams import BATCH_STREAM

if TYPE_CHECKING:
    from lightning_pfl.datamodule import FederatedDataModule


class LocalTraining(LightningModule):
    """The local-training part of :class:`~lightning_pfl.methods.base.FederatedMethod` (a base
    class of it): :meth:`local_sgd`, :meth:`draw_batches`, :meth:`local_train` and the
    :attr:`executor` that runs it."""

    if TYPE_CHECKING:  # FederatedMethod's
        arch: Architecture
        cross_entropy: LossFn
        execution: ExecutionSettings
        unreliable: UnreliableClients | None
        local_steps_drawn: Tensor | int
        _executor: Executor | None
        _executor_pinned: bool

        @property
        def hp(self) -> AttributeDict: ...

        @property
        def data(self) -> FederatedDataModule: ...

    def local_sgd(self) -> SGDConfig:
        h = self.hp
        return SGDConfig(h.local_lr, h.local_momentum, h.local_weight_decay, h.local_max_grad_norm)

    def draw_batches(
        self,
        clients: Tensor,
        round_idx: int,
        epochs: int | None = None,
        phase: int = 0,
        drop_last: bool = False,
        first_steps: int | None = None,
    ) -> ClientBatches:
        """This round's local-training batches of ``clients`` (seeded by round and ``phase``).

        ``epochs`` overrides the method's ``local_epochs``/``local_steps``; a method that trains
        in several phases per round gives each its own ``phase`` so they draw different batches.
        ``drop_last``: epochs skip their last, smaller batch (PyTorch's ``drop_last=True``).
        ``first_steps``: only the first that many steps of the draw (a straggler then completes
        its fraction of those, and only those count as steps taken).
        """
        h = self.hp
        keys = (h.seed, round_idx, BATCH_STREAM) + ((phase,) if phase else ())
        generator = torch.Generator(self.data.device).manual_seed(derive_seed(*keys))
        epochs = epochs if epochs is not None else h.local_epochs
        batches = self.data.client_batches(
            clients,
            h.batch_size,
            generator,
            steps=None if epochs is not None else h.local_steps,
            epochs=epochs,
            drop_last=drop_last,
        )
        if first_steps is not None:
            first = slice(0, first_steps)
            batches = ClientBatches(
                batches.index[:, first], batches.weight[:, first], batches.active[:, first]
            )
        if self.unreliable is not None:
            batches = self.unreliable.restrict(batches, clients, round_idx)
        self.local_steps_drawn = self.local_steps_drawn + batches.active.sum()
        if epochs is not None and self.executor.graphs is not None:
            # Rounds differ in their largest client; pad to the largest of all clients (idle
            # steps change nothing) so that one recorded round serves every round.
            largest = int(self.data.num_samples("train").max())
            batch = batches.index.shape[-1]
            steps = epochs * math.ceil(largest / batch)
            batches = batches.pad_steps(steps if first_steps is None else min(steps, first_steps))
        return batches

    def local_train(
        self,
        params: Params,
        clients: Tensor,
        round_idx: int,
        groups: Sequence[ParamGroup] | None = None,
        loss_fn: LossFn | None = None,
        context: Params | None = None,
        momentum: Params | None = None,
        batches: ClientBatches | None = None,
        arch: Architecture | None = None,
        rates: Params | None = None,
        tally: Params | None = None,
    ) -> TrainResult:
        """Train ``params`` (stacked over ``clients``) on the clients' own training data.

        Tensors of ``params`` that are buffers of ``arch`` (default: the method's target),
        e.g. batch-norm running statistics, are not trained but updated by the forward passes;
        the returned ``params`` hold them too. ``batches`` defaults to :meth:`draw_batches` of
        ``clients`` for ``round_idx``; ``groups`` to one group with the local SGD settings;
        ``rates``: per-client SGD values replacing the groups' (``sgd.sgd_rates``' keys);
        ``tally``: more state ``loss_fn`` carries through the steps (e.g. per-class feature
        sums, as the buffers), returned in the result's ``state`` only.
        """
        arch = arch or self.arch
        buffers = {n: t for n, t in params.items() if n in arch.buffer_shapes}
        state = buffers | (tally or {})
        trainable = {n: t for n, t in params.items() if n not in buffers}
        batches = batches if batches is not None else self.draw_batches(clients, round_idx)
        groups = groups or [ParamGroup(tuple(trainable), self.local_sgd())]
        loss_fn = loss_fn or (self.cross_entropy if arch is self.arch else cross_entropy_loss(arch))
        result = self.executor.train(
            TrainJob(
                loss_fn,
                trainable,
                tuple(groups),
                batches,
                arch,
                context or {},
                momentum,
                state,
                rates or {},
            )
        )
        result.params = {**result.params, **{n: result.state[n] for n in buffers}}
        return result

    @property
    def executor(self) -> Executor:
        """How local training runs (:mod:`lightning_pfl.execution`): chosen for this device and
        world size at first use, or the one a job of several runs installed."""
        world = self.trainer.world_size if self._trainer is not None else 1
        current = self._executor
        if current is None or not (
            self._executor_pinned or current.serves(self.data, self.device, world)
        ):
            current = self._executor = choose_executor(
                self.execution,
                self.data,
                self.device,
                world,
                self.global_rank,
                self.all_gather,  # type: ignore[arg-type]
            )
        return current

    @executor.setter
    def executor(self, executor: Executor) -> None:
        self._executor = executor
        self._executor_pinned = True
