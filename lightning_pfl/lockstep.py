"""Runs that take turns in one process and train their local-training jobs together.

:class:`Lockstep` runs each run of a job (``lightning_pfl.jobs``) in its own thread, one at a
time; a run hands over the turn where its method calls local training
(:class:`LockstepExecutor`). When every unfinished run has handed in its :class:`TrainJob`, the
jobs that are the same computation on different tensors (:func:`signature` of the loss, the
architecture, which tensors train together, path; data that differs only by its split,
:class:`SharedFetch`) are concatenated along the client axis and trained as one, and each run
gets its rows back. Runs that differ by their SGD numbers (a learning-rate grid) share too:
each client then steps with its own run's values (``sgd.sgd_rates``), the same arithmetic.
Only one run executes at a time and each run's random-number state is swapped in with its
turn, so a run computes what it computes alone; on the vmap and threaded paths its clients are
trained in a larger batch, which changes float rounding only.
"""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_pfl.engine import Architecture, ClientBatches, Params, TrainResult
from lightning_pfl.execution import Executor, TrainJob
from lightning_pfl.sgd import sgd_rates

if TYPE_CHECKING:
    from lightning_pfl.datamodule import FederatedDataModule


class Opaque(Exception):
    """A value :func:`signature` can only compare by identity."""


def signature(obj: Any, depth: int = 0) -> Hashable:
    """What decides the values a loss function computes, as a hashable value.

    Functions compare by code and the signatures of their closure's contents, numbers and
    strings by value, architectures by structure. Two losses with equal signatures compute the
    same function of their tensor arguments. Anything else (a method object, a tensor captured
    by a closure) can only be compared by identity: :class:`Opaque` is raised.
    """
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return (type(obj).__name__, obj)
    if depth > 6:
        raise Opaque(type(obj).__name__)
    if isinstance(obj, (tuple, list, frozenset)):
        return (type(obj).__name__, tuple(signature(o, depth + 1) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((k, signature(v, depth + 1)) for k, v in obj.items()))
    if isinstance(obj, types.MethodType):
        return ("method", signature(obj.__func__, depth + 1), signature(obj.__self__, depth + 1))
    if isinstance(obj, types.FunctionType):
        cells: list[Hashable] = []
        for cell in obj.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(("empty",))
                continue
            cells.append(signature(contents, depth + 1))
        return ("function", obj.__code__, tuple(cells), signature(obj.__defaults__, depth + 1))
    if isinstance(obj, Architecture):
        return (
            "arch",
            repr(obj._template),
            tuple(obj.shapes.items()),
            tuple(obj.buffer_shapes.items()),
        )
    raise Opaque(type(obj).__name__)


# What each part of ``Lockstep._key`` holds, in its order, as the job's message names it.
_KEY_PARTS = (
    "their local losses (a constant in the loss, e.g. FedProx's mu, or its code)",
    "their architectures",
    "their trained tensor groups or gradient clipping (on in one run, off in another)",
    "their per-client SGD values' layouts",
    "their parameter shapes",
    "their context tensors",
    "their per-client state tensors",
    "their kept momentum (in one run, not in another)",
    "their batch shapes",
    "their execution paths",
    "their executor settings",
    "their devices",
    "their data",
)


def _tensor_key(tensors: Params) -> Hashable:
    return tuple((n, tuple(t.shape[1:]), t.dtype, t.device) for n, t in sorted(tensors.items()))


def _shared_data_key(data: FederatedDataModule) -> Hashable | None:
    """Runs whose data keys are equal hold the same pooled samples (they may split them
    differently); None: this data cannot be shared (per-run noise)."""
    if data.noise_sigma:
        return None
    return (data.dataset, tuple(data.inputs.shape), data.inputs.dtype, data.inputs.device)


class SharedFetch:
    """``fetch`` of several runs' data at once: sample ``i`` of run ``r`` is ``r * P + i``
    (``P`` pooled samples). The raw samples are read once from the first run's tensors (equal
    in every run) and normalized with each run's own statistics, as that run would."""

    def __init__(self, datas: Sequence[FederatedDataModule]) -> None:
        first = datas[0]
        self.datas = list(datas)
        self.size = len(first.inputs)
        self.inputs, self.labels = first.inputs, first.labels
        self.mean = torch.stack([d.mean for d in datas])
        self.std = torch.stack([d.std for d in datas])
        self.input_dims = len(first.input_shape)

    def __call__(self, index: Tensor) -> tuple[Tensor, Tensor]:
        run, sample = index // self.size, index % self.size
        x = self.inputs[sample]
        if x.dtype == torch.uint8:
            stats = (*index.shape, -1) + (1,) * (self.input_dims - 1)
            x = x.float().div_(255.0)
            x = (x - self.mean[run].view(stats)) / self.std[run].view(stats)
        return x, self.labels[sample]


class SharedExecutor(Executor):
    """The first run's executor, reading the data of every run of a group (:class:`SharedFetch`)."""

    def __init__(self, first: Executor, fetch: SharedFetch) -> None:
        super().__init__(first.settings, first.data, first.device, first.graphs, first.world)
        self._step_flops = first._step_flops
        self._shared_fetch = fetch

    @property
    def fetch(self) -> SharedFetch:
        return self._shared_fetch

    @property
    def fetch_key(self) -> Hashable:
        return ("shared", id(self._shared_fetch))


@dataclass
class _Pending:
    job: TrainJob
    executor: Executor
    result: TrainResult | BaseException | None = None


RngState = tuple[Tensor, Tensor | None]


def get_rng() -> RngState:
    """The process-wide random-number state (CPU, and the current CUDA device's if in use)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def set_rng(state: RngState) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])


class Lockstep:
    """Runs ``N`` callables in threads, one at a time, and trains their jobs together.

    A run holds the turn until it hands in a job (:meth:`submit`) or ends; the turn then passes
    to the next run in index order that has not handed one in. When every unfinished run has,
    the jobs are trained (compatible ones together) and the turn goes back to the first run.
    The process-wide random-number state is swapped with the turn, so each run draws from its
    own stream as it would alone.
    """

    def __init__(self, count: int, rng_states: Sequence[RngState]) -> None:
        self.lock = threading.Lock()
        # one condition per run on the one lock: passing the turn wakes only the run that
        # takes it (a shared condition woke every waiting run at every hand-off)
        self.conds = [threading.Condition(self.lock) for _ in range(count)]
        self.turn: int | None = None
        self.live = set(range(count))
        self.pending: dict[int, _Pending] = {}
        self.rng = list(rng_states)
        self.apart_reasons: set[str] = set()
        self.shared: dict[tuple[int, ...], SharedExecutor] = {}
        self.submissions = 0  # jobs handed in
        self.groups_trained = 0  # computations that trained them
        self.trained_at: list[float] = []  # perf_counter() as each round's jobs start training

    # ----------------------------------------------------------------- turns
    def _give_turn(self, index: int | None) -> None:
        if index is not None:
            set_rng(self.rng[index])
        self.turn = index
        for cond in self.conds if index is None else [self.conds[index]]:
            cond.notify()

    def _await_turn(self, index: int) -> None:
        while self.turn != index:
            self.conds[index].wait()

    def _pass_from(self, index: int) -> None:
        """Called by the run holding the turn when it hands in a job or ends."""
        order = sorted(self.live)
        ready = [i for i in order if i not in self.pending or self.pending[i].result is not None]
        if ready:
            after = [i for i in ready if i > index]
            self._give_turn((after or ready)[0])
            return
        if not order:
            self._give_turn(None)
            return
        self.trained_at.append(time.perf_counter())
        self._train_pending()
        self._give_turn(order[0])

    def run(self, targets: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``targets`` to the end; returns each one's value or the exception it raised."""
        outcomes: list[Any] = [None] * len(targets)
        # A new thread takes the intra-op thread count last set in any thread (the client
        # threads set 1), not this one's: each run computes with the threads it has alone.
        threads_alone = torch.get_num_threads()

        def body(index: int) -> None:
            torch.set_num_threads(threads_alone)
            with self.lock:
                self._await_turn(index)
            try:
                outcomes[index] = targets[index]()
            except BaseException as error:  # reported by the job, never lost
                outcomes[index] = error
            finally:
                with self.lock:
                    self.live.discard(index)
                    self._pass_from(index)

        threads = [
            threading.Thread(target=body, args=(i,), name=f"pfl-run-{i}", daemon=True)
            for i in range(len(targets))
        ]
        for thread in threads:
            thread.start()
        with self.lock:
            self._give_turn(0 if targets else None)
        for thread in threads:
            while thread.is_alive():  # a timeout lets the main thread handle signals
                thread.join(0.2)
        return outcomes

    def submit(self, index: int, job: TrainJob, executor: Executor) -> TrainResult:
        """Hand in run ``index``'s job, wait for the turn to come back, return its result."""
        with self.lock:
            self.rng[index] = get_rng()
            self.pending[index] = _Pending(job, executor)
            self.submissions += 1
            self._pass_from(index)
            self._await_turn(index)
            result = self.pending.pop(index).result
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        return result

    # ----------------------------------------------------------------- training
    def _name_separate_computations(self, keys: list[tuple[Hashable, ...]]) -> None:
        """Say why runs that could share a computation form several: the first part of
        :meth:`_key` in which a group differs from the first group."""
        for key in keys[1:]:
            differing = next(
                part for part, a, b in zip(_KEY_PARTS, keys[0], key, strict=True) if a != b
            )
            self.apart_reasons.add(f"{differing} differ, so they form separate computations")

    def _key(self, index: int, pending: _Pending) -> Hashable | None:
        """Runs whose keys are equal can train as one computation; None: alone."""
        job, executor = pending.job, pending.executor
        if job.arch.stochastic:
            self.apart_reasons.add("a network with dropout draws random numbers per run")
            return None
        data = _shared_data_key(executor.data)
        if data is None:
            self.apart_reasons.add("noisy inputs (data.init_args.noise_sigma) differ per run")
            return None
        try:
            loss = signature(job.loss_fn)
        except Opaque as opaque:
            self.apart_reasons.add(
                f"the method's local loss reads a per-run {opaque} (it is not a function of "
                "its tensors and numbers alone)"
            )
            return None
        return (
            loss,
            signature(job.arch),
            tuple((g.names, g.sgd.max_grad_norm is None) for g in job.groups),
            _tensor_key(job.rates),
            _tensor_key(job.params),
            _tensor_key(job.context),
            _tensor_key(job.state),
            job.momentum is None,
            tuple(job.batches.index.shape[2:]),
            executor.path(job.arch),
            executor.settings,
            executor.device,
            data,
        )

    def _train_pending(self) -> None:
        groups: dict[Hashable, list[int]] = {}
        for index in sorted(i for i, p in self.pending.items() if p.result is None):
            key = self._key(index, self.pending[index])
            groups.setdefault(key if key is not None else ("alone", index), []).append(index)
        self._name_separate_computations(
            [k for k in groups if isinstance(k, tuple) and k[0] != "alone"]
        )
        for members in groups.values():
            try:
                if len(members) == 1:
                    self._train_alone(members[0])
                else:
                    self._train_together(members)
            except BaseException as error:
                for index in members:
                    self.pending[index].result = error
        self.groups_trained += len(groups)

    def _train_alone(self, index: int) -> None:
        pending = self.pending[index]
        set_rng(self.rng[index])
        pending.result = pending.executor.train(pending.job)
        self.rng[index] = get_rng()

    def _train_together(self, members: list[int]) -> None:
        jobs = [self.pending[i].job for i in members]
        executors = [self.pending[i].executor for i in members]
        executor = self.shared.get(tuple(members))
        datas = [e.data for e in executors]
        if executor is None or any(
            a is not b for a, b in zip(executor.fetch.datas, datas, strict=True)
        ):
            executor = SharedExecutor(executors[0], SharedFetch(datas))
            self.shared[tuple(members)] = executor
        fetch = executor.fetch
        steps = max(j.batches.active.shape[1] for j in jobs)
        padded = [j.batches.pad_steps(steps) for j in jobs]
        offsets = [r * fetch.size for r in range(len(jobs))]

        def cat(parts: Sequence[Params]) -> Params:
            return {n: torch.cat([p[n] for p in parts]) for n in parts[0]}

        momentum = None
        if jobs[0].momentum is not None:
            momentum = cat([j.momentum for j in jobs if j.momentum is not None])
        rates = cat([j.rates for j in jobs])
        if not rates and any(j.groups != jobs[0].groups for j in jobs):
            device = jobs[0].batches.active.device
            rates = cat([sgd_rates(j.groups, j.num_clients, device) for j in jobs])
        combined = TrainJob(
            jobs[0].loss_fn,
            cat([j.params for j in jobs]),
            jobs[0].groups,
            ClientBatches(
                torch.cat([b.index + o for b, o in zip(padded, offsets, strict=True)]),
                torch.cat([b.weight for b in padded]),
                torch.cat([b.active for b in padded]),
            ),
            jobs[0].arch,
            cat([j.context for j in jobs]),
            momentum,
            cat([j.state for j in jobs]),
            rates,
        )
        result = executor.train(combined)
        start = 0
        for index, job in zip(members, jobs, strict=True):
            rows = slice(start, start + job.num_clients)
            start = rows.stop

            def part(tensors: Params, rows: slice = rows) -> Params:
                return {n: t[rows] for n, t in tensors.items()}

            self.pending[index].result = TrainResult(
                part(result.params),
                part(result.momentum),
                result.loss[rows],
                result.steps[rows],
                part(result.state),
            )


class LockstepExecutor(Executor):
    """A run's executor inside a job: its jobs go to the :class:`Lockstep` it shares."""

    def __init__(self, lockstep: Lockstep, index: int, own: Executor) -> None:
        super().__init__(own.settings, own.data, own.device, own.graphs, own.world)
        self._step_flops = own._step_flops
        self.lockstep, self.index, self.own = lockstep, index, own

    def train(self, job: TrainJob) -> TrainResult:
        return self.lockstep.submit(self.index, job, self.own)
