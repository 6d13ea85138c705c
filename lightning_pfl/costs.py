"""What a round costs: bytes per client, FLOPs of local training and of the server
(docs/conditions.md, "What a round costs")."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from copy import deepcopy
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from lightning import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

if TYPE_CHECKING:
    from lightning_pfl.methods.base import FederatedMethod


def payload_bytes(tensors: Mapping[str, Tensor]) -> int:
    """Bytes of ``tensors`` on the wire (from their shapes and dtypes: no host sync)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def hypernetwork_flops(hnet: nn.Module, clients: int, device: torch.device) -> int:
    """FLOPs of the server's hypernetwork for a round of ``clients`` clients: one forward for
    all of them and one backward (the vector-Jacobian product every update computes). Counted
    by FlopCounterMode (matrix products and convolutions; elementwise operations count 0)."""
    ids = torch.arange(clients, device=device)
    # A copy takes the backward: FlopCounterMode's module hooks fail under autograd.grad with
    # parametrized layers (spectral norm), and .backward() would leave gradients on the server.
    copy = deepcopy(hnet)
    with (
        torch.random.fork_rng(devices=[]),
        torch.enable_grad(),
        FlopCounterMode(display=False) as counter,
    ):
        out = copy(ids)
        tensors = list(out.values()) if isinstance(out, dict) else [out]
        torch.stack([t.float().sum() for t in tensors]).sum().backward()
    return int(counter.get_total_flops())


def takes_client_ids(module: Any) -> TypeGuard[nn.Module]:
    """Whether ``module`` is a network whose only input is a tensor of client ids."""
    if not isinstance(module, nn.Module):
        return False
    parameters = list(inspect.signature(module.forward).parameters)
    return parameters == ["clients"]


class RoundCosts(Callback):
    """Logs what every round costs and totals it in ``results.json`` (``costs``).

    Per round (TensorBoard, at the round's step): ``comm/bytes_down_per_client`` and
    ``comm/bytes_up_per_client`` (the round's bytes over the clients contacted / that reported
    back), ``clients/reported`` (clients whose upload arrived), ``clients/local_steps`` (local
    optimizer steps the round's clients took, stragglers' cut steps and dropped clients'
    excluded), ``cost/flops_local`` (``Architecture.step_flops`` of the method's network, one
    forward and backward on a batch, counted once, times those steps) and ``cost/flops_server``
    (methods with a hypernetwork of the client ids: its forward and backward for the round's
    clients, counted once per number of clients); each with a ``_total`` since round 0.

    Local FLOPs are not counted for methods whose clients train several networks
    (``network_groups``: FedSimSup, FedGH, FedAKT, MH-pFedHN, pFedHN-Budgets, heterogeneous
    Local): ``flops_local_total`` is then null. A loss that runs more than one forward of the
    network per step (MOON, distillation) is counted as one forward and backward.
    """

    def __init__(self) -> None:
        self.totals = {
            "local_steps": 0.0,
            "flops_local": 0.0,
            "flops_server": 0.0,
            "clients_reported": 0.0,
        }
        self._server_flops: dict[int, int] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.totals = dict(state_dict["totals"])

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        pl_module.local_steps_drawn = 0  # type: ignore[assignment]

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        method: FederatedMethod = pl_module  # type: ignore[assignment]
        round_idx = int(batch)
        sampled = contacted = reported = int(method.hp.clients_per_round)
        if method.unreliable is not None and method.round_reach[0] == round_idx:
            _, sampled, contacted, reported = method.round_reach
        drawn = method.local_steps_drawn
        steps = float(drawn.item() if isinstance(drawn, Tensor) else drawn)
        method.local_steps_drawn = 0
        down, up = method.record.round_bytes
        step_flops = self.step_flops(method)
        server = self.server_flops(method, sampled)
        metrics = {
            "comm/bytes_down_per_client": down / max(contacted, 1),
            "comm/bytes_up_per_client": up / max(reported, 1),
            "clients/reported": float(reported),
            "clients/local_steps": steps,
        }
        self.totals["local_steps"] += steps
        self.totals["clients_reported"] += reported
        if step_flops is not None:
            metrics["cost/flops_local"] = step_flops * steps
            self.totals["flops_local"] += step_flops * steps
            metrics["cost/flops_local_total"] = self.totals["flops_local"]
        if server is not None:
            metrics["cost/flops_server"] = float(server)
            self.totals["flops_server"] += server
            metrics["cost/flops_server_total"] = self.totals["flops_server"]
        method._log_at_round(metrics)
        method.record.extra_results["costs"] = self.summary(method)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        method: FederatedMethod = pl_module  # type: ignore[assignment]
        method.record.extra_results["costs"] = self.summary(method)

    def summary(self, method: FederatedMethod) -> dict[str, float | None]:
        """The ``costs`` entry of ``results.json``."""
        step_flops = self.step_flops(method)
        server = self.server_flops(method, int(method.hp.clients_per_round))
        return {
            "local_steps_total": self.totals["local_steps"],
            "flops_per_local_step": None if step_flops is None else float(step_flops),
            "flops_local_total": None if step_flops is None else self.totals["flops_local"],
            "flops_server_total": None if server is None else self.totals["flops_server"],
            "clients_reported_total": self.totals["clients_reported"],
        }

    @staticmethod
    def step_flops(method: FederatedMethod) -> int | None:
        if method.network_groups() is not None:
            return None
        return method.executor.step_flops(method.arch)

    def server_flops(self, method: FederatedMethod, clients: int) -> int | None:
        hnet = getattr(method, "hnet", None)
        if not takes_client_ids(hnet):
            return None
        if clients not in self._server_flops:
            self._server_flops[clients] = hypernetwork_flops(hnet, clients, method.device)
        return self._server_flops[clients]
