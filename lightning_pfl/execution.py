"""How a round's local training runs: the executors behind ``FederatedMethod.local_train``.

A method describes one call of local training as a :class:`TrainJob` (what to train, on which
batches, with which loss); an :class:`Executor`, chosen once per method and device by
:func:`choose_executor`, decides how: all clients through one ``vmap``, the threaded per-client
loop on a CPU, one by one, compiled, recorded as a CUDA graph, or shared between DDP ranks. A
job of several runs trained together (``lightning_pfl.jobs``) is one more executor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_pfl.engine import (
    Architecture,
    ClientBatches,
    LossFn,
    ParamGroup,
    Params,
    TrainResult,
    train_clients,
)
from lightning_pfl.errors import ConfigError
from lightning_pfl.graphs import CudaGraphRecorder, RoundGraphs

if TYPE_CHECKING:
    from lightning_pfl.datamodule import FederatedDataModule

# ``vectorize: null`` on a CPU: vmap when one client step (forward + backward of a batch) costs
# less, else the threaded per-client loop. Measured on 2 cores, 20 clients per round
# (benchmarks/results/speed_cpu_crossover): vmap 2.2x faster at 4 MFLOP and 1.3x at 17; the
# threaded loop 1.14x faster at 34 and 1.23x at 68 (1.8x on LeNet-5 at 145, docs/performance.md).
VMAP_CPU_MAX_STEP_FLOPS = 24e6

Fetch = Callable[[Tensor], tuple[Tensor, Tensor]]


def usable_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass
class TrainJob:
    """One call of local training: the clients' tensors stacked ``[C, ...]`` and how to train them.

    Attributes:
        loss_fn: ``loss(params, context, x, y, weight)`` of one client on one batch (with
            ``state``: returns ``(loss, new_state)``).
        params: the trainable tensors.
        groups: the SGD configuration of each set of names in ``params``.
        batches: the clients' local-training batches.
        arch: the network the loss trains (its step cost picks the CPU path).
        context: per-client tensors the loss reads without training them (anchors, class
            counts, a received global model).
        momentum: initial momentum buffers (None: a fresh optimizer).
        state: per-client buffers the loss updates without gradients (batch-norm statistics).
        rates: per-client SGD values replacing the groups' numbers (``sgd.sgd_rates``; empty:
            the groups' own), for the clients of runs that differ only by SGD settings.
    """

    loss_fn: LossFn
    params: Params
    groups: tuple[ParamGroup, ...]
    batches: ClientBatches
    arch: Architecture
    context: Params = field(default_factory=dict)
    momentum: Params | None = None
    state: Params = field(default_factory=dict)
    rates: Params = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return int(self.batches.active.shape[0])


@dataclass(frozen=True)
class ExecutionSettings:
    """The method arguments that choose the path (``FederatedMethod``'s docstring)."""

    vectorize: bool | None = None
    compile_step: bool = False
    cuda_graphs: bool | None = None
    client_threads: int | None = None
    batch_size: int = 64


def check_threadable(settings: ExecutionSettings, arch: Architecture, net: str) -> None:
    """Refuse an explicit ``client_threads > 1`` where clients cannot train concurrently."""
    threads = settings.client_threads
    if threads is None or threads <= 1:
        return
    if arch.stochastic:
        raise ConfigError(
            f"model.init_args.client_threads = {threads} trains clients concurrently, which "
            f"needs a client step without random numbers, and net '{net}' has dropout; use "
            "client_threads 1 or null (null: one by one here)."
        )
    if settings.compile_step:
        raise ConfigError(
            f"model.init_args.client_threads = {threads} with compile_step: true; a compiled "
            "step runs one client at a time: use client_threads 1 or null."
        )


def make_round_graphs(settings: ExecutionSettings, device: torch.device) -> RoundGraphs | None:
    """The CUDA-graph recorder of the rounds (None: rounds run eagerly)."""
    wanted = settings.cuda_graphs if settings.cuda_graphs is not None else device.type == "cuda"
    if not wanted:
        return None
    if device.type != "cuda":
        from lightning.pytorch.utilities import rank_zero_warn

        rank_zero_warn("cuda_graphs: true needs a CUDA device; the rounds run eagerly.")
        return None
    return RoundGraphs(CudaGraphRecorder())


class Executor:
    """Trains jobs in this process: vmap, the threaded loop or one by one; compiled and
    recorded as the settings say.

    Args:
        settings: the path arguments.
        data: the client data (``fetch`` of sample indices).
        device: where the method trains.
        graphs: the recorder of rounds (:func:`make_round_graphs`), or None.
        world: processes sharing the round (DDP); threads need one.
    """

    def __init__(
        self,
        settings: ExecutionSettings,
        data: FederatedDataModule,
        device: torch.device,
        graphs: RoundGraphs | None = None,
        world: int = 1,
    ) -> None:
        self.settings = settings
        self.data = data
        self.device = device
        self.graphs = graphs
        self.world = world
        self._step_flops: dict[int, int] = {}

    def serves(self, data: FederatedDataModule, device: torch.device, world: int) -> bool:
        """Whether this executor was chosen for this data, device and world size."""
        return self.data is data and self.device == device and self.world == world

    @property
    def fetch(self) -> Fetch:
        return self.data.fetch

    @property
    def fetch_key(self) -> Hashable:
        """What identifies the data tensors ``fetch`` reads (a recorded round reads them)."""
        data = self.data
        return (id(data), data.inputs.data_ptr(), data.labels.data_ptr(), data.mean.data_ptr())

    def path(self, arch: Architecture) -> tuple[bool, int]:
        """``(vectorize, threads)`` for local training of ``arch`` on this device.

        ``vectorize`` True: vmap. False: the loop, with ``client_threads`` threads (default 1).
        None: on a CPU, the loop with ``client_threads`` (default: every usable core) when
        one step of ``arch`` costs at least ``VMAP_CPU_MAX_STEP_FLOPS``, else vmap; vmap on
        other devices. Threads need a CPU, one process and a deterministic, uncompiled step.
        """
        s = self.settings
        if s.vectorize:
            return True, 1
        threadable = (
            self.device.type == "cpu"
            and self.world == 1
            and not s.compile_step
            and not arch.stochastic
        )
        if s.vectorize is None:
            threads = (s.client_threads or usable_cores()) if threadable else 1
            if threads == 1 or self.step_flops(arch) < VMAP_CPU_MAX_STEP_FLOPS:
                return True, 1
            return False, threads
        return False, (s.client_threads or 1) if threadable else 1

    def step_flops(self, arch: Architecture) -> int:
        """FLOPs of one local step of ``arch`` on a batch of ``batch_size`` (counted once)."""
        flops = self._step_flops.get(id(arch))
        if flops is None:
            index = torch.zeros(self.settings.batch_size, dtype=torch.long, device=self.data.device)
            example, _ = self.data.fetch(index)
            flops = self._step_flops[id(arch)] = arch.step_flops(example)
        return flops

    def train(self, job: TrainJob) -> TrainResult:
        vectorize, threads = self.path(job.arch)
        return train_clients(
            job.loss_fn,
            job.params,
            job.groups,
            job.batches,
            self.fetch,
            job.context,
            job.momentum,
            vectorize,
            self.settings.compile_step,
            job.state,
            self.graphs,
            self.fetch_key,
            threads,
            job.rates,
        )


class ShardedExecutor(Executor):
    """Each DDP rank trains a contiguous share of the round's clients; results are all-gathered.

    Batches were drawn for the whole round on every rank, so a client's batches do not depend on
    which rank trains it, and every rank ends with the full round result and runs the identical
    server update: the outcome equals the single-process run up to float rounding (CPU kernels
    round differently with different thread counts, and Lightning gives each rank a share of
    the cores).
    """

    def __init__(
        self,
        settings: ExecutionSettings,
        data: FederatedDataModule,
        device: torch.device,
        graphs: RoundGraphs | None,
        world: int,
        rank: int,
        all_gather: Callable[[Params], Params],
    ) -> None:
        super().__init__(settings, data, device, graphs, world)
        self.rank = rank
        self.all_gather = all_gather

    def train(self, job: TrainJob) -> TrainResult:
        num_clients = job.num_clients
        per_rank = -(-num_clients // self.world)
        batches = job.batches
        slots = torch.arange(per_rank * self.world, device=batches.active.device)
        mine = slots.view(self.world, per_rank)[self.rank]
        real = mine < num_clients  # padding slots repeat the last client and never step
        rows = mine.clamp(max=num_clients - 1)

        def take(tensors: Params) -> Params:
            return {n: t[rows.to(t.device)] for n, t in tensors.items()}

        local = super().train(
            TrainJob(
                job.loss_fn,
                take(job.params),
                job.groups,
                ClientBatches(
                    batches.index[rows], batches.weight[rows], batches.active[rows] & real[:, None]
                ),
                job.arch,
                take(job.context),
                take(job.momentum) if job.momentum is not None else None,
                take(job.state),
                take(job.rates),
            )
        )

        def gather(tensors: Params) -> Params:
            full = self.all_gather(tensors)
            return {n: t.flatten(0, 1)[:num_clients] for n, t in full.items()}

        merged = gather({"loss": local.loss, "steps": local.steps})
        return TrainResult(
            gather(local.params),
            gather(local.momentum),
            merged["loss"],
            merged["steps"],
            gather(local.state),
        )


def choose_executor(
    settings: ExecutionSettings,
    data: FederatedDataModule,
    device: torch.device,
    world: int = 1,
    rank: int = 0,
    all_gather: Callable[[Params], Params] | None = None,
) -> Executor:
    """The executor of a method's local training on ``device`` among ``world`` processes."""
    graphs = make_round_graphs(settings, device)
    if world == 1:
        return Executor(settings, data, device, graphs)
    assert all_gather is not None
    return ShardedExecutor(settings, data, device, graphs, world, rank, all_gather)
