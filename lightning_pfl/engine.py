"""Functional client training: architectures as parameter dicts, SGD as tensor ops.

All of a round's clients share one architecture, so their parameters are stacked along a
leading client dimension and trained together with ``torch.func`` (``functional_call`` inside
``grad`` inside ``vmap``). The sequential path runs the very same per-client step in a Python
loop; it is the reference the vectorized path is tested against and the fallback for methods
whose client step cannot be vmapped. On CPUs the threaded loop
(:func:`~lightning_pfl.client_threads._threaded_rounds`) trains several clients at once, one per
worker thread, for networks whose steps are large enough that vmap's grouped convolutions cost
more than they save.

The parts live in their own modules: :mod:`lightning_pfl.params` (tensor dicts),
:mod:`lightning_pfl.architecture` (networks as functions of them), :mod:`lightning_pfl.sgd` (the
SGD arithmetic), :mod:`lightning_pfl.client_threads` (the threaded path) and
:mod:`lightning_pfl.client_state` (per-client state between rounds); this module holds the
batches, the loss and :func:`train_clients`, which runs the vmapped, sequential or threaded path.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import grad_and_value, vmap

from lightning_pfl.architecture import Architecture as Architecture
from lightning_pfl.client_threads import _threaded_rounds
from lightning_pfl.graphs import RoundGraphs
from lightning_pfl.losses import weighted_mean
from lightning_pfl.params import Params as Params
from lightning_pfl.params import client_row
from lightning_pfl.sgd import ParamGroup as ParamGroup
from lightning_pfl.sgd import SGDConfig as SGDConfig
from lightning_pfl.sgd import _foreach_sgd_step, _sgd_step

LossFn = Callable[[Params, Params, Tensor, Tensor, Tensor], Tensor | tuple[Tensor, Params]]


def derive_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys (seed, round, stream): same keys, same seed."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0] >> 1)


@dataclass
class ClientBatches:
    """Local-training batches of a round's clients, as indices into the pooled inputs.

    Attributes:
        index: ``[C, S, B]`` sample indices (entries with weight 0 are padding).
        weight: ``[C, S, B]`` 1.0 for real samples, 0.0 for padding.
        active: ``[C, S]`` whether client c takes an optimizer step at step s. Clients with
            fewer local steps than the round's longest (epochs over smaller datasets) idle.
    """

    index: Tensor
    weight: Tensor
    active: Tensor

    def pad_steps(self, steps: int) -> ClientBatches:
        """The same batches followed by idle steps up to ``steps`` (no-ops for every client)."""
        extra = steps - self.active.shape[1]
        if extra <= 0:
            return self
        clients, _, batch = self.index.shape
        return ClientBatches(
            torch.cat([self.index, self.index.new_zeros(clients, extra, batch)], 1),
            torch.cat([self.weight, self.weight.new_zeros(clients, extra, batch)], 1),
            torch.cat([self.active, self.active.new_zeros(clients, extra)], 1),
        )

    def select(self, rows: Tensor) -> ClientBatches:
        """The batches of clients ``rows`` only, without the steps none of them takes."""
        active = self.active[rows]
        taken = active.any(0)  # steps where all of these clients idle change nothing
        return ClientBatches(
            self.index[rows][:, taken], self.weight[rows][:, taken], active[:, taken]
        )


@dataclass
class TrainResult:
    params: Params
    momentum: Params
    loss: Tensor  # [C] mean training loss over each client's active steps
    steps: Tensor = field(default_factory=lambda: torch.zeros(0))  # [C] optimizer steps taken
    state: Params = field(default_factory=dict)  # updated per-client state (e.g. BN statistics)


def weighted_cross_entropy(logits: Tensor, y: Tensor, weight: Tensor) -> Tensor:
    """Mean cross-entropy over the samples with weight 1 (padding has weight 0)."""
    return weighted_mean(F.cross_entropy(logits.float(), y, reduction="none"), weight)


def cross_entropy_loss(arch: Architecture) -> LossFn:
    """Weighted mean cross-entropy of ``arch`` on one client's batch, in training mode.

    For a network with buffers (batch norm) the loss returns ``(loss, updated buffers)``, the
    form :func:`train_clients` expects when it is given ``state``.
    """

    def loss(
        params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        logits, buffers = arch.forward_train({**context, **params}, x)
        ce = weighted_cross_entropy(logits, y, weight)
        return (ce, buffers) if buffers else ce

    return loss


def _normal_tensor(tensor: Tensor) -> Tensor:
    return tensor.clone() if tensor.is_inference() else tensor


def _normal(tensors: Params) -> Params:
    """``tensors`` with each inference tensor replaced by a normal copy (autograd can save it)."""
    return {n: _normal_tensor(t) for n, t in tensors.items()}


def train_clients(
    loss_fn: LossFn,
    params: Params,
    groups: Sequence[ParamGroup],
    batches: ClientBatches,
    fetch: Callable[[Tensor], tuple[Tensor, Tensor]],
    context: Params | None = None,
    momentum: Params | None = None,
    vectorize: bool = True,
    compile_step: bool = False,
    state: Params | None = None,
    graphs: RoundGraphs | None = None,
    fetch_key: Hashable = None,
    threads: int = 1,
    rates: Params | None = None,
) -> TrainResult:
    """Run local SGD for every client of the round.

    Args:
        loss_fn: ``loss(params, context, x, y, weight)`` of one client on one batch; with
            ``state`` it returns ``(loss, new_state)``.
        params: trainable tensors, stacked ``[C, ...]``; every name must be in one group.
        groups: SGD configuration per set of names.
        batches: the clients' batches (see :class:`ClientBatches`).
        fetch: maps an index tensor to ``(inputs, labels)`` on the device.
        context: per-client tensors the loss reads without training them (anchors, class counts,
            a received global model), stacked ``[C, ...]``.
        momentum: initial momentum buffers (zeros = a fresh optimizer), stacked like params.
        vectorize: train all clients at once with ``vmap`` (else one by one, same math).
        compile_step: run the step (vmapped or per client) through ``torch.compile``. The
            first round compiles (tens of seconds); later rounds reuse it as long as
            ``loss_fn`` is the same object.
        state: per-client tensors the loss reads and updates without gradients (batch-norm
            running statistics), stacked ``[C, ...]``; passed to the loss inside ``context``
            and replaced by the loss's returned state after every active step.
        graphs: record the whole call once per shape and replay it (CUDA graphs); the
            recording is keyed by ``loss_fn``, ``groups``, ``fetch_key`` (what identifies the
            data ``fetch`` reads), the flags and every tensor's shape.
        fetch_key: identity of the data behind ``fetch`` (needed with ``graphs``).
        threads: with ``vectorize=False`` on a CPU, train this many clients at once, each
            client's whole local training in one worker thread with one intra-op thread and
            channels-last images (:func:`~lightning_pfl.client_threads._threaded_rounds`); 1 is
            the sequential loop.
        rates: per-client SGD values ``[C]`` replacing the groups' numbers
            (:func:`~lightning_pfl.sgd.sgd_rates`; the groups then only say which tensors train
            together and whether they are clipped): clients of runs that differ only by their
            SGD settings train as one.
    """
    if torch.is_inference_mode_enabled():
        # torch.func differentiates to zeros under inference mode in torch 2.11
        # (pytorch/pytorch#177318), and autograd cannot run there: train outside it, on
        # normal copies of the caller's inference tensors (autograd cannot save those).
        with torch.inference_mode(False):
            return train_clients(
                loss_fn,
                _normal(params),
                groups,
                ClientBatches(
                    *map(_normal_tensor, (batches.index, batches.weight, batches.active))
                ),
                fetch,
                context=context and _normal(context),
                momentum=momentum and _normal(momentum),
                vectorize=vectorize,
                compile_step=compile_step,
                state=state and _normal(state),
                graphs=graphs,
                fetch_key=fetch_key,
                threads=threads,
                rates=rates and _normal(rates),
            )
    context = context or {}
    state = state or {}
    rates = rates or {}
    momentum = (
        momentum if momentum is not None else {n: torch.zeros_like(p) for n, p in params.items()}
    )
    trained = {n for g in groups for n in g.names}
    if trained != set(params):
        raise ValueError(
            f"every trainable tensor needs a group; got {sorted(trained ^ set(params))}"
        )
    value_and_grad = grad_and_value(loss_fn, has_aux=bool(state))

    def step(
        p: Params,
        m: Params,
        st: Params,
        fr: Params,
        r: Params,
        x: Tensor,
        y: Tensor,
        w: Tensor,
        active: Tensor,
    ) -> tuple[Params, Params, Params, Tensor]:
        grads, out = value_and_grad(p, {**fr, **st}, x, y, w)
        loss, new_st = out if state else (out, {})
        new_p, new_m = _sgd_step(p, grads, m, groups, r)
        keep = {n: torch.where(active, new_p[n], p[n]) for n in p}
        keep_m = {n: torch.where(active, new_m[n], m[n]) for n in m}
        keep_st = {n: torch.where(active, new_st[n].detach(), st[n]) for n in st}
        return keep, keep_m, keep_st, loss.detach()

    def taken_step(
        p: Params,
        m: Params,
        st: Params,
        fr: Params,
        client_groups: Sequence[ParamGroup],
        x: Tensor,
        y: Tensor,
        w: Tensor,
    ) -> tuple[Params, Params, Params, Tensor]:
        """``step`` of a client that takes it (no masks), differentiated by PyTorch's autograd,
        which costs less Python per call than ``torch.func`` (worker threads share the
        interpreter)."""
        leaves = {n: t.detach().requires_grad_() for n, t in p.items()}
        with torch.enable_grad():
            out = loss_fn(leaves, {**fr, **st}, x, y, w)
            loss, new_st = out if isinstance(out, tuple) else (out, {})
            differentiated = torch.autograd.grad(
                loss,
                list(leaves.values()),
                allow_unused=True,
                materialize_grads=True,
            )
        grads = dict(zip(leaves, differentiated, strict=True))
        new_p, new_m = _foreach_sgd_step(p, grads, m, client_groups)
        return new_p, new_m, {n: t.detach() for n, t in new_st.items()}, loss.detach()

    batched_step = vmap(step, randomness="different") if vectorize else None
    if compile_step:
        if batched_step is not None:
            batched_step = torch.compile(batched_step, dynamic=False)
        else:
            step = torch.compile(step, dynamic=False)

    def rounds(
        params: Params,
        momentum: Params,
        state: Params,
        context: Params,
        rates: Params,
        index: Tensor,
        weight: Tensor,
        active: Tensor,
    ) -> tuple[Params, Params, Params, Tensor]:
        """Every local step of every client: a pure function of its tensors (recordable)."""
        if batched_step is None and threads > 1:
            args = (params, momentum, state, context, rates, index, weight, active)
            return _threaded_rounds(taken_step, groups, fetch, threads, *args)
        num_clients, num_steps = active.shape
        loss_sum = torch.zeros(num_clients, device=weight.device)
        for s in range(num_steps):
            x, y = fetch(index[:, s])
            if batched_step is not None:
                params, momentum, state, loss = batched_step(
                    params, momentum, state, context, rates, x, y, weight[:, s], active[:, s]
                )
            else:
                outs = [
                    step(
                        client_row(params, c),
                        client_row(momentum, c),
                        client_row(state, c),
                        client_row(context, c),
                        client_row(rates, c),
                        x[c],
                        y[c],
                        weight[c, s],
                        active[c, s],
                    )
                    for c in range(num_clients)
                ]
                params = {n: torch.stack([o[0][n] for o in outs]) for n in params}
                momentum = {n: torch.stack([o[1][n] for o in outs]) for n in momentum}
                state = {n: torch.stack([o[2][n] for o in outs]) for n in state}
                loss = torch.stack([o[3] for o in outs])
            loss_sum = loss_sum + loss.float() * active[:, s]
        return params, momentum, state, loss_sum

    inputs = (
        params,
        momentum,
        state,
        context,
        rates,
        batches.index,
        batches.weight,
        batches.active,
    )
    if graphs is None:
        params, momentum, state, loss_sum = rounds(*inputs)
    else:
        # A bound method (``self.some_loss``) is a new object at every access: key it by its
        # function and instance so that a method's rounds replay one recording.
        loss_key = (
            id(getattr(loss_fn, "__func__", loss_fn)),
            id(getattr(loss_fn, "__self__", None)),
        )
        code_key = (loss_key, tuple(groups), fetch_key, vectorize, compile_step)
        params, momentum, state, loss_sum = graphs(rounds, code_key, (loss_fn, fetch), *inputs)
    steps = batches.active.sum(1)
    return TrainResult(params, momentum, loss_sum / steps.clamp_min(1), steps, state)
