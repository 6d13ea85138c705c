"""Whole-round CUDA graphs: a round's local training recorded once, replayed every round.

On a GPU the engine is bound by Python and kernel-launch overhead: one local step of the
pFedHN CIFAR CNN launches hundreds of small kernels. :class:`RoundGraphs` captures a whole
call of a pure function (the local training of a round: every step of every client) as one
CUDA graph the first time it sees a given *key* (everything that changes shapes or code:
architecture, loss, clients in the round, steps, batch size, precision), keeps the graph's
static input and output buffers, and afterwards only copies the round's inputs (starting
parameters, momentum, batch indices) into the static buffers and replays the graph.

The function must be free of host synchronization (no ``.item()``, no Python branches on tensor
values): that is why the engine draws batches beforehand and masks idle steps with
``torch.where``. A function that cannot be captured (capture raises, e.g. because it syncs)
runs eagerly from then on, after a one-line warning that says why.

The capture mechanism is a :class:`Recorder`: :class:`CudaGraphRecorder` on GPUs, and
:class:`EagerRecorder` (replay = call the function again on the static buffers) wherever there
is no CUDA, so the buffer and cache bookkeeping is the same code on every device and is tested
on CPU.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

Leaves = list[Tensor]


class Recorder(Protocol):
    """Records ``fn(static inputs) -> static outputs`` and returns a function that replays it."""

    def record(
        self, fn: Callable[[Leaves], Leaves], inputs: Leaves
    ) -> tuple[Callable[[], None], Leaves]: ...


class EagerRecorder:
    """Replays by calling ``fn`` again on the static inputs and copying into static outputs."""

    def record(
        self, fn: Callable[[Leaves], Leaves], inputs: Leaves
    ) -> tuple[Callable[[], None], Leaves]:
        outputs = [t.clone() for t in fn(inputs)]

        def replay() -> None:
            for static, fresh in zip(outputs, fn(inputs), strict=True):
                static.copy_(fresh)

        return replay, outputs


class CudaGraphRecorder:
    """Captures ``fn`` as a CUDA graph after warm-up runs on a side stream."""

    def __init__(self, warmup: int = 2) -> None:
        self.warmup = warmup

    def record(
        self, fn: Callable[[Leaves], Leaves], inputs: Leaves
    ) -> tuple[Callable[[], None], Leaves]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):  # cuBLAS workspaces, autograd and compile caches
                fn(inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = fn(inputs)
        return graph.replay, list(outputs)


class _Entry:
    def __init__(
        self, replay: Callable[[], None], inputs: Leaves, outputs: Leaves, spec: Any, owner: Any
    ) -> None:
        self.replay = replay
        self.inputs = inputs
        self.outputs = outputs
        self.spec = spec  # how to rebuild the output structure from ``outputs``
        self.owner = owner  # keeps the objects whose identity is in the key alive


class RoundGraphs:
    """A least-recently-used cache of recorded calls, keyed by code identity and shapes.

    Args:
        recorder: how a call is recorded (CUDA graphs on GPUs, eager replay elsewhere).
        capacity: recorded calls kept (each holds its static buffers and graph memory).
        max_new_keys: if this many calls in a row have a new key (shapes change every round),
            stop recording and run eagerly, with a warning.
    """

    def __init__(self, recorder: Recorder, capacity: int = 8, max_new_keys: int = 8) -> None:
        self.recorder = recorder
        self.capacity = capacity
        self.max_new_keys = max_new_keys
        self.entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self.failed: set[Hashable] = set()
        self.disabled: str | None = None
        self.recorded = 0
        self.replayed = 0
        self._new_in_a_row = 0

    def __call__(self, fn: Callable[..., Any], code_key: Hashable, owner: Any, *args: Any) -> Any:
        """``fn(*args)``, replayed from a recording when ``code_key`` and the shapes match.

        ``fn`` must be pure in its tensor arguments (it reads them and returns new tensors, in
        dicts, lists or tuples); ``code_key`` identifies everything else it depends on, and
        ``owner`` holds the objects named in ``code_key`` so that their ids stay unique.
        """
        leaves, spec = tree_flatten(args)
        if self.disabled is not None or not all(isinstance(x, Tensor) for x in leaves):
            return fn(*args)
        key = (
            code_key,
            str(spec),
            tuple((tuple(t.shape), t.dtype, t.device) for t in leaves),
            torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"),
        )
        if key in self.failed:
            return fn(*args)
        entry = self.entries.get(key)
        if entry is None:
            entry = self._record(fn, key, owner, leaves, spec)
            if entry is None:
                return fn(*args)
        else:
            self.entries.move_to_end(key)
            self._new_in_a_row = 0
            for static, fresh in zip(entry.inputs, leaves, strict=True):
                static.copy_(fresh)
        entry.replay()
        self.replayed += 1
        return tree_unflatten([t.clone() for t in entry.outputs], entry.spec)

    def _record(
        self, fn: Callable[..., Any], key: Hashable, owner: Any, leaves: Leaves, spec: Any
    ) -> _Entry | None:
        self._new_in_a_row += 1
        if self._new_in_a_row > self.max_new_keys:
            self.disabled = (
                f"{self.max_new_keys} rounds in a row had new shapes (clients per round, steps or "
                "batch sizes change every round)"
            )
            warnings.warn(f"cuda_graphs: running eagerly: {self.disabled}.", stacklevel=3)
            return None
        static = [t.clone() for t in leaves]
        output_spec: list[Any] = [None]

        def flat(inputs: Leaves) -> Leaves:
            outputs, output_spec[0] = tree_flatten(fn(*tree_unflatten(list(inputs), spec)))
            if not all(isinstance(x, Tensor) for x in outputs):
                raise TypeError("a recorded function must return only tensors")
            return outputs

        try:
            replay, outputs = self.recorder.record(flat, static)
        except Exception as error:  # capture refused: e.g. a host sync inside the round
            self.failed.add(key)
            text = str(error).strip()
            reason = text.splitlines()[0] if text else type(error).__name__
            warnings.warn(
                f"cuda_graphs: this round could not be recorded ({reason}); it runs eagerly.",
                stacklevel=3,
            )
            return None
        entry = _Entry(replay, static, outputs, output_spec[0], owner)
        self.entries[key] = entry
        self.recorded += 1
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return entry
