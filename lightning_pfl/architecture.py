"""A network's structure without its weights: :class:`Architecture`, called with tensor dicts."""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.flop_counter import FlopCounterMode

from lightning_pfl.params import Params


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
