"""FedAvg (McMahan et al., 2017) with an optional server optimizer (FedAvgM, Hsu et al.)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_pfl.architecture import drop_batch_counters
from lightning_pfl.engine import Params, TrainResult
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.models import build_network
from lightning_pfl.novel_adaptation import NovelAdaptation
from lightning_pfl.params import client_mean
from lightning_pfl.privacy import privatizes
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat


class FedAvg(FederatedMethod):
    """Federated averaging of a global model, the base of every partially shared method.

    Round: the server sends the shared tensors of the global model; each client joins them with
    the tensors it keeps (:meth:`personal_names`, none for FedAvg) and trains the whole model
    (:meth:`train_clients`); it keeps its personal tensors and uploads the shared ones; the
    server applies the pseudo-gradient ``w - sum_i p_i w_i`` (p_i proportional to client i's
    training samples) with SGD; ``server_lr=1, server_momentum=0`` is exactly FedAvg's
    sample-weighted average. Buffers (batch-norm running statistics) are averaged the same way.

    A client's personalized model is the global model with its personal tensors.

    A novel client (:class:`~lightning_pfl.novel.NovelClients`) does what a new client of the
    method does (:meth:`novel_adaptation`): FedAvg fine-tunes its own copy of the global model;
    a method with personal tensors trains its own from their initialization on the frozen
    global rest.

    Subclasses change what is kept (:meth:`personal_names`: FedPer the head, FedBN the batch
    norms, LG-FedAvg the body) and how clients train (:meth:`train_clients`: a proximal term,
    a contrastive loss, per-tensor SGD settings, ...).

    Args:
        server_lr: server learning rate (1 = plain FedAvg).
        server_momentum: server momentum (0 = plain FedAvg; > 0 = FedAvgM).
        local_momentum: client SGD momentum; 0 as FedAvg's ClientUpdate (plain SGD, McMahan et
            al., Algorithm 1), which the methods built on FedAvg share unless their paper says
            otherwise. The base class's 0.9 is pFedHN's inner loop.
        local_weight_decay: client SGD weight decay (0: ClientUpdate has none).
        local_max_grad_norm: per-step gradient-norm clip of the clients (null: ClientUpdate
            has none).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    honours_conditions = True

    def __init__(
        self,
        server_lr: PositiveFloat = 1.0,
        server_momentum: Momentum = 0.0,
        local_momentum: Momentum = 0.0,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        h = self.hp
        net = build_network(h.net, h.input_shape, h.num_classes, **(h.net_args or {}))
        self.net = drop_batch_counters(net)
        initial = self.arch.initial_state()
        with torch.no_grad():
            for name, tensor in self.net.state_dict(keep_vars=True).items():
                tensor.copy_(initial[name])
        personal = self.personal_names()
        if personal:
            self.store.add_field("personal", {n: initial[n] for n in personal})
        shared_buffers = set(self.arch.buffer_shapes) - set(personal)
        if self.client_dp is not None and shared_buffers:
            raise ConfigError(
                f"model.init_args.client_dp: {type(self).__name__} would upload the batch-norm "
                f"statistics {sorted(shared_buffers)}, whose noisy mean can be a negative "
                "variance; use a network without batch norm, or FedBN (keeps them local)."
            )

    # ----------------------------------------------------------------- hooks for subclasses
    def personal_names(self) -> tuple[str, ...]:
        """Names of the tensors each client keeps and never uploads (FedAvg: none)."""
        return ()

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        """Local training of the round's clients from ``start`` (global + personal tensors)."""
        return self.local_train(start, clients, round_idx)

    # ----------------------------------------------------------------- the round
    def shared_extras(self) -> dict[str, nn.Parameter]:
        """Server parameters beyond the network that belong to the global model, by their name
        in it (a projection head, a kernel, a policy network): sent, trained and averaged with
        the network's tensors and stepped by the server optimizer. Default: none."""
        return {}

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        params = [*self.net.parameters(), *self.shared_extras().values()]
        return torch.optim.SGD(params, lr=h.server_lr, momentum=h.server_momentum)

    def global_state(self) -> Params:
        """The server's model: parameters and buffers by name, then :meth:`shared_extras`
        (detached)."""
        state = {n: t.detach() for n, t in self.net.state_dict(keep_vars=True).items()}
        return state | {n: p.detach() for n, p in self.shared_extras().items()}

    def payload(self, clients: Tensor) -> Params:
        """What the server sends to ``clients``: the shared tensors, expanded ``[C, ...]``."""
        personal = set(self.personal_names())
        return {
            n: t.expand(len(clients), *t.shape)
            for n, t in self.global_state().items()
            if n not in personal
        }

    @privatizes("the update of every shared tensor (the whole upload), clipped as one vector")
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        sent = self.payload(clients)
        result = self.train_with_personal(
            round_idx, clients, {n: t.clone() for n, t in sent.items()}
        )
        uploaded = {n: result.params[n] for n in sent}
        dp = self.client_dp
        if dp is None:
            if not self.nothing_arrived(clients, round_idx):
                self.aggregate(uploaded, self.client_weights(clients, round_idx))
        else:
            self.aggregate(*self.dp_uploads(round_idx, sent, uploaded))
        self.record_communication(down=sent, up=uploaded)
        return result.loss

    def train_with_personal(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        """:meth:`train_clients` from ``start`` plus each client's stored personal tensors; the
        trained personal tensors go back to the store."""
        personal = self.personal_names()
        if personal:
            start = start | self.store.gather("personal", clients, self.device)
        result = self.train_clients(round_idx, clients, start)
        if personal:
            self.store.scatter("personal", clients, {n: result.params[n] for n in personal})
        return result

    def aggregate(self, trained: Params, weights: Tensor) -> None:
        """Pseudo-gradient ``w - sum_i weights_i * trained_i`` of every shared parameter;
        shared buffers are set to the weighted mean."""
        for name, p in self.net.named_parameters():
            if name in trained:
                p.grad = p.detach() - client_mean(trained[name], weights).to(p.dtype)
        for name, b in self.net.named_buffers():
            if name in trained:
                b.copy_(client_mean(trained[name], weights))
        for name, p in self.shared_extras().items():
            p.grad = p.detach() - client_mean(trained[name], weights).to(p.dtype)

    def personalized_params(self, clients: Tensor) -> Params:
        params = self.payload(clients)
        if self.personal_names():
            params |= self.store.gather("personal", clients, self.device)
        return params

    # ----------------------------------------------------------------- novel clients
    def novel_adaptation(self, clients: Tensor) -> NovelAdaptation:
        """What a new client does: with :meth:`personal_names` (FedPer's head, LG-FedAvg's
        local layers, FedBN's batch norms, ...) it trains its own personal parameters, which
        a never-sampled client holds at their initialization (LG-FedAvg after
        ``init_from_fedavg_rounds``: the FedAvg model's), on the frozen global rest; without
        (FedAvg, FedProx), it fine-tunes its own copy of the global model
        (:meth:`fine_tune_adaptation`). Batch-norm statistics are not adapted (the loss is
        the evaluation-mode forward). A subclass whose personalized model is more than the
        global model with personal tensors (it overrides :meth:`personalized_params`,
        :meth:`payload` or :meth:`predict`) is refused unless it overrides this hook."""
        cls = type(self)
        if (
            cls.personalized_params is not FedAvg.personalized_params
            or cls.payload is not FedAvg.payload
            or cls.predict is not FederatedMethod.predict
        ):
            raise ConfigError(
                f"trainer.callbacks NovelClients: {cls.__name__}'s personalized model is not "
                "the global model with personal tensors, and it defines no novel-client "
                "adaptation; use PFedHN, PFedHNPC, FedAvg, FedPer, LGFedAvg, PerFedAvg or "
                "Local, or remove the callback."
            )
        personal = self.personal_names()
        if not personal:
            return self.fine_tune_adaptation(clients)
        stored = self.store.fields["personal"]
        tensors = [t for n, t in stored.items() if n in personal and n in self.arch.shapes]
        return NovelAdaptation(tensors, self.novel_loss(lambda: self.personalized_params(clients)))

    def fine_tune_adaptation(self, clients: Tensor) -> NovelAdaptation:
        """Each novel client fine-tunes its own copy of the global model's parameters (the
        global model itself is not touched); its buffers stay the global model's."""
        state = self.global_state()
        copies = {
            n: state[n].expand(len(clients), *state[n].shape).clone() for n in self.arch.shapes
        }
        buffers = {n: t.expand(len(clients), *t.shape) for n, t in state.items() if n not in copies}

        def params() -> Params:
            return buffers | copies

        return NovelAdaptation(list(copies.values()), self.novel_loss(params), params=params)
