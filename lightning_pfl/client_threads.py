"""The threaded per-client path on CPUs: clients spread over worker threads.

Each worker runs whole clients with one intra-op thread on channels-last images; for networks
whose steps are large enough, this beats vmap's grouped convolutions (docs/performance.md).
:func:`_threaded_rounds` is training's loop, :func:`predict_clients` evaluation's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from torch import Tensor

from lightning_pfl.params import Params, client_row
from lightning_pfl.sgd import ParamGroup, _client_groups

T = TypeVar("T")


def _channels_last(x: Tensor) -> Tensor:
    """Image batches ``[B, C, H, W]`` with channels-last strides (same values; CPU convolutions
    and pooling run faster on them). Set explicitly: for one channel, ``contiguous(memory_format=
    torch.channels_last)`` keeps the NCHW strides, and the convolution then runs NCHW."""
    if x.dim() != 4:
        return x
    _, c, h, w = x.shape
    strides = (c * h * w, 1, w * c, c)
    if x.stride() == strides:
        return x
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)


_WORKER_POOLS: dict[int, ThreadPoolExecutor] = {}


def _worker_pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``threads`` workers, each limited to one intra-op thread."""
    pool = _WORKER_POOLS.get(threads)
    if pool is None:
        pool = ThreadPoolExecutor(
            threads, "pfl-client", initializer=torch.set_num_threads, initargs=(1,)
        )
        _WORKER_POOLS[threads] = pool
    return pool


def map_clients(fn: Callable[[int], T], num_clients: int, threads: int) -> list[T]:
    """``[fn(0), ..., fn(num_clients - 1)]`` spread over ``threads`` worker threads (CPU).

    Each worker runs whole calls with one intra-op thread, so a call's result does not depend on
    scheduling; small convolutions run several times faster per core this way than split
    across cores, and the kernels release the GIL. Autocast, grad and inference mode are
    thread-local: the caller's are entered in every worker. One client (or one thread) runs on
    the calling thread, which keeps its intra-op threads.
    """
    if num_clients == 1 or threads == 1:
        return [fn(c) for c in range(num_clients)]
    autocast = torch.is_autocast_enabled("cpu")
    dtype = torch.get_autocast_dtype("cpu")
    inference = torch.is_inference_mode_enabled()
    grad = torch.is_grad_enabled()

    def in_callers_modes(c: int) -> T:
        with (
            torch.inference_mode(inference),
            torch.set_grad_enabled(grad),
            torch.autocast("cpu", dtype=dtype, enabled=autocast),
        ):
            return fn(c)

    return list(_worker_pool(min(threads, num_clients)).map(in_callers_modes, range(num_clients)))


def predict_clients(
    predict: Callable[[Params, Tensor], Tensor], params: Params, x: Tensor, threads: int
) -> Tensor:
    """``vmap(predict)(params, x)`` client by client on channels-last images, spread over
    ``threads`` workers (:func:`map_clients`): evaluation's counterpart of the threaded loop."""

    def one(c: int) -> Tensor:
        return predict(client_row(params, c), _channels_last(x[c]))

    return torch.stack(map_clients(one, len(x), threads))


def _threaded_rounds(
    step: Callable[..., tuple[Params, Params, Params, Tensor]],
    groups: Sequence[ParamGroup],
    fetch: Callable[[Tensor], tuple[Tensor, Tensor]],
    threads: int,
    params: Params,
    momentum: Params,
    state: Params,
    context: Params,
    rates: Params,
    index: Tensor,
    weight: Tensor,
    active: Tensor,
) -> tuple[Params, Params, Params, Tensor]:
    """The sequential loop's math with clients spread over worker threads (:func:`map_clients`).

    A client's steps run in order in one thread, and only the steps it takes are computed (idle
    steps change nothing).
    """
    taken = active.cpu()

    def train_one(c: int) -> tuple[Params, Params, Params, Tensor]:
        p, m, st, fr = (
            client_row(params, c),
            client_row(momentum, c),
            client_row(state, c),
            client_row(context, c),
        )
        client_groups = _client_groups(groups, client_row(rates, c))
        loss_sum = torch.zeros((), device=weight.device)
        for s in taken[c].nonzero().flatten().tolist():
            x, y = fetch(index[c, s])
            p, m, st, loss = step(p, m, st, fr, client_groups, _channels_last(x), y, weight[c, s])
            loss_sum = loss_sum + loss.float()
        return p, m, st, loss_sum

    outs = map_clients(train_one, active.shape[0], threads)
    return (
        {n: torch.stack([o[0][n] for o in outs]) for n in params},
        {n: torch.stack([o[1][n] for o in outs]) for n in momentum},
        {n: torch.stack([o[2][n] for o in outs]) for n in state},
        torch.stack([o[3] for o in outs]),
    )
