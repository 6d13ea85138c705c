"""Functional client training: architectures as parameter dicts, SGD as tensor ops.

All of a round's clients share one architecture, so their parameters are stacked along a
leading client dimension and trained together with ``torch.func`` (``functional_call`` inside
``grad`` inside ``vmap``). The sequential path runs the very same per-client step in a Python
loop; it is the reference the vectorized path is tested against and the fallback for methods
whose client step cannot be vmapped. On CPUs the threaded loop (:func:`_threaded_rounds`)
trains several clients at once, one per worker thread, for networks whose steps are large
enough that vmap's grouped convolutions cost more than they save.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap
from torch.utils.flop_counter import FlopCounterMode

from lightning_pfl.graphs import RoundGraphs
from lightning_pfl.losses import weighted_mean

Params = dict[str, Tensor]
T = TypeVar("T")
LossFn = Callable[[Params, Params, Tensor, Tensor, Tensor], Tensor | tuple[Tensor, Params]]


def derive_seed(*keys: int) -> int:
    """A 63-bit seed derived from integer keys (seed, round, stream): same keys, same seed."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0] >> 1)


def prefixed(prefix: str, params: Params) -> Params:
    """``params`` renamed ``prefix.<name>`` (several models in one tensor dict)."""
    return {f"{prefix}.{n}": t for n, t in params.items()}


def split_prefixed(params: Params, *prefixes: str) -> tuple[Params, ...]:
    """The tensors of ``params`` under each ``prefix.``, with the prefix removed."""
    return tuple(
        {n[len(p) + 1 :]: t for n, t in params.items() if n.startswith(p + ".")} for p in prefixes
    )


def client_mean(stacked: Tensor, weights: Tensor) -> Tensor:
    """``sum_i weights_i * stacked[i]`` over the leading client dimension, accumulated in float64
    so that the average of many clients does not depend on their order."""
    w = weights.to(stacked.device, torch.float64).view(-1, *([1] * (stacked.dim() - 1)))
    return (w * stacked.double()).sum(0)


def drop_batch_counters(net: nn.Module) -> nn.Module:
    """Remove batch norm's integer ``num_batches_tracked`` (unused with a momentum), in place.

    Every remaining buffer is then a float tensor that can be stacked, averaged and vmapped.
    """
    for module in net.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            if module.momentum is None:
                raise ValueError(
                    "batch norm with momentum=None (cumulative averages) is not supported; "
                    "give the layer a momentum such as 0.1."
                )
            module.register_buffer("num_batches_tracked", None)
    return net


class Architecture:
    """A network's structure without its weights: call it with any tensor dict.

    The template module lives on the ``meta`` device, so it holds no memory; parameters (and
    buffers, e.g. batch-norm running statistics) are passed in: one client's, or stacked for
    many clients under ``vmap``. A *state* dict holds both, by their ``state_dict`` names.

    Networks built on :class:`~lightning_pfl.models.targets.TargetNetwork` name their
    classifier layer (``head_names``) and expose the representation it reads
    (:meth:`features`); for other modules the last ``nn.Linear`` is taken as the head.
    Batch-norm layers need a ``momentum`` (running averages, not cumulative ones); their
    ``num_batches_tracked`` counter is dropped, so every buffer is a float tensor.
    """

    def __init__(self, net: nn.Module) -> None:
        drop_batch_counters(net)
        self.shapes = {name: tuple(p.shape) for name, p in net.named_parameters()}
        self.buffer_shapes = {name: tuple(b.shape) for name, b in net.named_buffers()}
        self.batch_norm_momentum: dict[str, float] = {}
        for name, module in net.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.momentum:
                for stat in ("running_mean", "running_var"):
                    self.batch_norm_momentum[f"{name}.{stat}"] = module.momentum
        head = getattr(net, "classifier_name", None)
        if head is None:
            head = [name for name, m in net.named_modules() if isinstance(m, nn.Linear)][-1]
        self.head_module = head
        self.head_names = tuple(n for n in self.shapes if n.rsplit(".", 1)[0] == head)
        self._initial = {name: t.detach().clone() for name, t in net.state_dict().items()}
        self._template = copy.deepcopy(net).to("meta")
        self._worker_templates: dict[int, nn.Module] = {}
        # whether training-mode forwards draw random numbers (dropout)
        self.stochastic = any(
            isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in net.modules()
        )

    @property
    def template(self) -> nn.Module:
        """The weightless module for this thread: ``functional_call`` swaps tensors into it, so
        each worker thread of the threaded client loop has its own copy. (A compiled step runs
        on the calling thread only, and ``torch.compile`` cannot trace ``threading``.)"""
        if torch.compiler.is_compiling() or threading.current_thread() is threading.main_thread():
            return self._template
        ident = threading.get_ident()
        module = self._worker_templates.get(ident)
        if module is None:
            module = self._worker_templates.setdefault(ident, copy.deepcopy(self._template))
        return module

    def step_flops(self, example: Tensor) -> int:
        """FLOPs of a training-mode forward and backward on a batch shaped like ``example``
        (counted on the meta device: nothing is computed; also under evaluation's inference
        mode)."""
        with torch.inference_mode(False), torch.enable_grad():
            tensors = {
                name: torch.empty(shape, device="meta", requires_grad=name in self.shapes)
                for name, shape in {**self.shapes, **self.buffer_shapes}.items()
            }
            x = torch.empty_like(example, device="meta")
            with FlopCounterMode(display=False) as counter:
                self(tensors, x, train=True).float().logsumexp(-1).sum().backward()
        return int(counter.get_total_flops())

    @property
    def stateful(self) -> bool:
        """Whether the network has buffers that training updates (batch-norm statistics)."""
        return bool(self.buffer_shapes)

    def __call__(self, tensors: Mapping[str, Tensor], x: Tensor, train: bool = False) -> Tensor:
        """Logits for ``x``; ``train`` selects training mode (dropout on, batch statistics).

        In training mode the buffers in ``tensors`` are not updated: use :meth:`forward_train`.
        """
        if train and self.stateful:
            return self.forward_train(tensors, x)[0]
        module = self.template
        module.train(train)
        return functional_call(module, dict(tensors), (x,))

    def forward_train(self, tensors: Mapping[str, Tensor], x: Tensor) -> tuple[Tensor, Params]:
        """Training-mode logits and the updated buffers (running statistics) of ``tensors``."""
        module = self.template
        module.train(True)
        buffers = {n: tensors[n].clone() for n in self.buffer_shapes}
        logits = functional_call(module, {**tensors, **buffers}, (x,))
        return logits, buffers

    def batch_statistics(self, tensors: Mapping[str, Tensor], x: Tensor) -> Params:
        """Every batch norm's statistics of batch ``x`` (mean, unbiased variance), by buffer name.

        A training-mode forward from zero running statistics leaves momentum times the batch's
        statistics in them; ``tensors`` holds parameters and buffers (whose values are unused).
        """
        others = set(self.buffer_shapes) - set(self.batch_norm_momentum)
        if others:
            raise ValueError(f"buffers other than batch-norm statistics: {sorted(others)}")
        zeros = {n: torch.zeros_like(tensors[n]) for n in self.buffer_shapes}
        _, updated = self.forward_train({**tensors, **zeros}, x)
        return {n: t / self.batch_norm_momentum[n] for n, t in updated.items()}

    def features(self, tensors: Mapping[str, Tensor], x: Tensor, train: bool = False) -> Tensor:
        """The representation the classifier reads (needs a ``TargetNetwork``)."""
        module = self.template
        module.train(train)
        return functional_call(module, dict(tensors), (x,), {"features_only": True})

    def classify(self, tensors: Mapping[str, Tensor], z: Tensor) -> Tensor:
        """The classifier applied to representations ``z`` (reads only the head tensors)."""
        prefix = self.head_module + "."
        head = {n[len(prefix) :]: tensors[n] for n in self.head_names}
        return functional_call(self.template.get_submodule(self.head_module), head, (z,))

    def initial_params(self) -> Params:
        """The parameters of the network this architecture was built from (a copy)."""
        return {name: self._initial[name].clone() for name in self.shapes}

    def initial_buffers(self) -> Params:
        """The buffers (e.g. batch-norm running statistics) of the original network (a copy)."""
        return {name: self._initial[name].clone() for name in self.buffer_shapes}

    def initial_state(self) -> Params:
        """Parameters and buffers of the original network (a copy)."""
        return {**self.initial_params(), **self.initial_buffers()}


@dataclass(frozen=True)
class SGDConfig:
    """torch.optim.SGD semantics (dampening 0, no Nesterov) plus optional norm clipping.

    Clipping follows ``torch.nn.utils.clip_grad_norm_`` on the group's gradients and happens
    before weight decay is added, as when clipping precedes ``optimizer.step()``.
    """

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float | None = None


@dataclass(frozen=True)
class ParamGroup:
    """A set of parameter names trained with one SGD configuration."""

    names: tuple[str, ...]
    sgd: SGDConfig


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


SGD_FIELDS = ("lr", "momentum", "weight_decay", "max_grad_norm")


def sgd_rates(groups: Sequence[ParamGroup], num_clients: int, device: torch.device) -> Params:
    """The groups' SGD values as per-client tensors ``[C]`` (``"<group index>.<field>"``; no
    entry for a clip that is off), for clients trained together under different settings
    (:func:`train_clients`'s ``rates``)."""
    rates = {}
    for i, group in enumerate(groups):
        for name in SGD_FIELDS:
            value = getattr(group.sgd, name)
            if value is not None:
                rates[f"{i}.{name}"] = torch.full((num_clients,), float(value), device=device)
    return rates


def _client_groups(groups: Sequence[ParamGroup], rates: Params) -> tuple[ParamGroup, ...]:
    """One client's groups with its own SGD values (``rates`` of that client, 0-dim); a value
    ``rates`` lacks is the group's, as :func:`_sgd_step` reads it under vmap."""
    if not rates:
        return tuple(groups)
    return tuple(
        ParamGroup(
            group.names,
            SGDConfig(
                **{
                    name: float(rates[f"{i}.{name}"])
                    if f"{i}.{name}" in rates
                    else getattr(group.sgd, name)
                    for name in SGD_FIELDS
                }
            ),
        )
        for i, group in enumerate(groups)
    )


def _sgd_step(
    params: Params,
    grads: Params,
    momentum: Params,
    groups: Sequence[ParamGroup],
    rates: Params | None = None,
) -> tuple[Params, Params]:
    """One SGD step of every group; ``rates`` (this client's, 0-dim): its values instead of the
    groups' numbers (the same arithmetic in the parameters' dtype)."""
    new_params, new_momentum = {}, {}
    for i, group in enumerate(groups):
        cfg = group.sgd
        lr, momentum_factor, weight_decay, max_grad_norm = (
            rates.get(f"{i}.{name}", getattr(cfg, name)) if rates else getattr(cfg, name)
            for name in SGD_FIELDS
        )
        scale: Tensor | float = 1.0
        if max_grad_norm is not None:
            norm = torch.sqrt(sum((grads[n].float() ** 2).sum() for n in group.names))  # type: ignore[arg-type]
            scale = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
        for n in group.names:
            d = grads[n] * scale + weight_decay * params[n]
            buf = momentum_factor * momentum[n] + d
            new_momentum[n] = buf
            new_params[n] = params[n] - lr * buf
    return new_params, new_momentum


def _foreach_sgd_step(
    params: Params, grads: Params, momentum: Params, groups: Sequence[ParamGroup]
) -> tuple[Params, Params]:
    """:func:`_sgd_step` with multi-tensor kernels: a few calls per group instead of a few per
    tensor (one client at a time; vmap has no batching rules for them)."""
    new_params: Params = {}
    new_momentum: Params = {}
    for group in groups:
        cfg = group.sgd
        p = tuple(params[n] for n in group.names)
        d = tuple(grads[n] for n in group.names)
        if cfg.max_grad_norm is not None:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(d)))
            d = torch._foreach_mul(d, torch.clamp(cfg.max_grad_norm / (norm + 1e-6), max=1.0))
        if cfg.weight_decay:
            d = torch._foreach_add(d, p, alpha=cfg.weight_decay)
        if cfg.momentum:
            d = torch._foreach_add(
                torch._foreach_mul(tuple(momentum[n] for n in group.names), cfg.momentum), d
            )
        new_params.update(zip(group.names, torch._foreach_add(p, d, alpha=-cfg.lr), strict=True))
        new_momentum.update(zip(group.names, d, strict=True))
    return new_params, new_momentum


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
            channels-last images (see :func:`_threaded_rounds`); 1 is the sequential loop.
        rates: per-client SGD values ``[C]`` replacing the groups' numbers (:func:`sgd_rates`;
            the groups then only say which tensors train together and whether they are
            clipped): clients of runs that differ only by their SGD settings train as one.
    """
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
        interpreter); under inference mode (evaluation), where autograd cannot run, by
        ``torch.func`` as ``step``."""
        if torch.is_inference_mode_enabled():
            grads, out = value_and_grad(p, {**fr, **st}, x, y, w)
        else:
            leaves = {n: t.detach().requires_grad_() for n, t in p.items()}
            with torch.enable_grad():
                out = loss_fn(leaves, {**fr, **st}, x, y, w)
                objective = out[0] if isinstance(out, tuple) else out
                differentiated = torch.autograd.grad(
                    objective,
                    list(leaves.values()),
                    allow_unused=True,
                    materialize_grads=True,
                )
            grads = dict(zip(leaves, differentiated, strict=True))
        loss, new_st = out if state else (out, {})
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
                        _row(params, c),
                        _row(momentum, c),
                        _row(state, c),
                        _row(context, c),
                        _row(rates, c),
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


def _row(tensors: Params, c: int) -> Params:
    return {n: t[c] for n, t in tensors.items()}


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
        return predict(_row(params, c), _channels_last(x[c]))

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
        p, m, st, fr = _row(params, c), _row(momentum, c), _row(state, c), _row(context, c)
        client_groups = _client_groups(groups, _row(rates, c))
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


class ClientStateStore:
    """Per-client state (personal layers, embeddings, kept momentum) for all clients.

    Each *field* is a dict of tensors shaped ``[num_clients, ...]``. Only the round's clients
    are gathered onto the compute device; with ``offload=True`` the store itself stays in
    (pinned) CPU memory, so device memory grows with clients per round, not with clients.
    """

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients
        self.fields: dict[str, Params] = {}
        self.device = torch.device("cpu")

    def add_field(
        self, name: str, per_client_init: Mapping[str, Tensor], rows: int | None = None
    ) -> None:
        """Give every client (or ``rows`` rows, for state only some clients have) a copy."""
        rows = self.num_clients if rows is None else rows
        self.fields[name] = {
            k: v.detach().unsqueeze(0).repeat(rows, *([1] * v.dim())).to(self.device)
            for k, v in per_client_init.items()
        }

    def gather(self, name: str, clients: Tensor, device: torch.device) -> Params:
        ids = clients.to(self.device)
        return {k: v[ids].to(device, non_blocking=True) for k, v in self.fields[name].items()}

    def scatter(self, name: str, clients: Tensor, values: Mapping[str, Tensor]) -> None:
        ids = clients.to(self.device)
        for k, v in values.items():
            self.fields[name][k][ids] = v.detach().to(self.device, self.fields[name][k].dtype)

    def to(self, device: torch.device, offload: bool = False) -> None:
        """Place the store on ``device``, or in pinned CPU memory when ``offload`` is set."""
        target = torch.device("cpu") if offload else device
        pin = offload and device.type == "cuda"
        for fld in self.fields.values():
            for k, v in fld.items():
                moved = v.to(target)
                fld[k] = moved.pin_memory() if pin and not moved.is_pinned() else moved
        self.device = target

    def state_dict(self) -> dict[str, dict[str, Tensor]]:
        return {name: {k: v.cpu() for k, v in fld.items()} for name, fld in self.fields.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        if set(state) != set(self.fields):
            raise KeyError(f"client state fields {sorted(state)} != expected {sorted(self.fields)}")
        self.fields = {
            name: {k: v.to(self.device) for k, v in fld.items()} for name, fld in state.items()
        }

    def nbytes(self) -> int:
        return sum(
            v.numel() * v.element_size() for fld in self.fields.values() for v in fld.values()
        )
