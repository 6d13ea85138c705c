"""FedSimSup: a local supervisor beside each personalized model, similarity-weighted mixing."""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.assignment import GroupShare, NetworkGroups
from lightning_pfl.engine import Architecture, LossFn, Params, weighted_cross_entropy
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)

Aggregation = Literal["similarity", "uniform", "none"]
DEFAULT_SUPERVISORS = {"lenet": {"net": "lenet5", "net_args": {"width": 0.4}}}


def mix_non_participants(
    own: Params,
    trained: Params,
    own_labels: Tensor,
    trained_labels: Tensor,
    self_weight: float,
    aggregation: Aggregation = "similarity",
) -> Params:
    """theta_i <- a_i theta_i + (1 - a_i) sum_j (s_ij / sum_j s_ij) theta_j for each client i.

    Args:
        own: the models theta_i of the clients that did not take part, ``[I, ...]``.
        trained: this round's trained models theta_j of the participants, ``[J, ...]``.
        own_labels: label counts of the clients i, ``[I, num_classes]`` (m_i = row sum).
        trained_labels: label counts of the participants j, ``[J, num_classes]``.
        self_weight: K in a_i = K m_i / (sum_j m_j + K m_i) (the paper: clients per round).
        aggregation: ``similarity``: s_ij = cosine similarity of the label counts;
            ``uniform``: s_ij = 1.

    A client whose labels share no class with any participant (sum_j s_ij = 0) keeps theta_i.
    """
    own_labels, trained_labels = own_labels.double(), trained_labels.double()
    m_i, m_j = own_labels.sum(1), trained_labels.sum(1)
    a = self_weight * m_i / (m_j.sum() + self_weight * m_i)
    if aggregation == "similarity":
        s = F.normalize(own_labels, dim=1) @ F.normalize(trained_labels, dim=1).T
    else:
        s = own_labels.new_ones(len(own_labels), len(trained_labels))
    total = s.sum(1, keepdim=True)
    weights = s / total.clamp_min(1e-300)
    a = torch.where(total[:, 0] > 0, a, torch.ones_like(a)).view(-1, 1)
    mixed = {}
    for name, theta in own.items():
        others = trained[name].flatten(1).to(weights)
        update = a * theta.flatten(1).to(weights) + (1 - a) * (weights @ others)
        mixed[name] = update.view_as(theta).to(theta.dtype)
    return mixed


class FedSimSup(FederatedMethod):
    """FedSimSup: personalized model theta_i (kept by the server) plus local supervisor s_i.

    A client predicts with the sum of both models' logits. Round: each sampled client trains
    s_i for tau_s epochs with theta_i frozen, then theta_i for tau_theta epochs with s_i frozen
    (on the summed-logits cross-entropy, fresh SGD per phase), keeps s_i and uploads theta_i.
    The server keeps the participants' theta as trained and moves every other client toward
    them: theta_i <- a_i theta_i + (1 - a_i) sum_j (s_ij / sum_j s_ij) theta_j with
    a_i = K m_i / (sum_j m_j + K m_i), m the training-sample counts and s_ij the cosine
    similarity of the label counts of clients i and j (see :func:`mix_non_participants`).

    Unreliable clients (``conditions``): the participants j are the sampled clients that
    reported back; a sampled client that did not keeps its theta_i and s_i as they were (it is
    neither stored as trained nor mixed), and a round in which none arrived moves nothing.

    Supervisor types are assigned to clients once, from the seed, in exact proportions; clients
    of one type train together (one vmap per type) and the accuracy of each type's clients is
    reported under ``<split>/supervisor_<type>/acc`` and ``acc_weighted``.

    Args:
        supervisors: supervisor types by name: ``{"net": registry name, "net_args": {...},
            "share": proportion}`` (default: LeNet-5 at width 0.4, about 1/6 of LeNet-5).
        supervisor_epochs: tau_s, local epochs of the supervisor per round (paper: 2).
        model_epochs: tau_theta, local epochs of the personalized model per round (paper: 3).
        aggregation: ``similarity`` (paper), ``uniform`` (s_ij = 1, the Figure 3 ablation
            without similarity) or ``none`` (non-participants keep their theta).
        self_weight: K of a_i; None: the number of clients per round, K as the paper defines
            it (section 3.3).
        net: the personalized model (paper: LeNet-5).
        local_lr: SGD learning rate of both phases (paper: 0.1).
        local_momentum: SGD momentum (paper: plain SGD).
        local_weight_decay: SGD weight decay (paper: none).
        local_max_grad_norm: gradient clip (paper: none).
        batch_size: local batch size (paper: 32).
        local_epochs: unused; must stay None (set ``supervisor_epochs`` and ``model_epochs``).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod` (``local_steps`` is
            unused; paper participation: ``clients_per_round`` = 10% of the clients).
    """

    honours_conditions = True

    def __init__(
        self,
        supervisors: dict[str, dict[str, Any]] | None = None,
        supervisor_epochs: NonNegativeInt = 2,
        model_epochs: NonNegativeInt = 3,
        aggregation: Aggregation = "similarity",
        self_weight: PositiveFloat | None = None,
        net: str = "lenet5",
        local_lr: PositiveFloat = 0.1,
        local_momentum: Momentum = 0.0,
        local_weight_decay: NonNegativeFloat = 0.0,
        local_max_grad_norm: PositiveFloat | None = None,
        batch_size: PositiveInt = 32,
        local_epochs: PositiveInt | None = None,
        **kwargs: Any,
    ) -> None:
        if local_epochs is not None:
            raise ConfigError(
                "FedSimSup trains supervisor_epochs (tau_s) then model_epochs (tau_theta) epochs "
                "per round; remove model.init_args.local_epochs and set those two instead."
            )
        super().__init__(
            net=net,
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            batch_size=batch_size,
            **kwargs,
        )
        h = self.hp
        self.store.add_field("theta", self.arch.initial_params())
        with self.seeded_init():
            self.supervisors = NetworkGroups(
                supervisors or DEFAULT_SUPERVISORS,
                h.num_clients,
                tuple(h.input_shape),
                h.num_classes,
                h.seed,
                "model.init_args.supervisors",
            )
        for kind, arch in self.supervisors.archs.items():
            if arch.stateful or self.arch.stateful:
                raise ConfigError(
                    f"FedSimSup mixes models across clients: supervisor '{kind}' and the "
                    "personalized model must be networks without batch norm."
                )
            members = self.supervisors.members(kind)
            self.store.add_field(f"supervisor.{kind}", arch.initial_params(), len(members))
        self.joint_losses = {kind: self.joint_loss(kind) for kind in self.supervisors.names}

    def client_groups(self) -> dict[str, Tensor]:
        return self.supervisors.client_groups("supervisor")

    def joint_loss(self, kind: str) -> LossFn:
        """Cross-entropy of the summed logits q_theta(x) + q_s(x) of a type-``kind`` client."""
        supervisor = self.supervisors.archs[kind]

        def loss(params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
            logits = self.predict({**params, **context}, x, supervisor, train=True)
            return weighted_cross_entropy(logits, y, w)

        return loss

    def predict(
        self,
        params: Params,
        x: Tensor,
        supervisor: Architecture | None = None,
        train: bool = False,
    ) -> Tensor:
        if supervisor is None:  # evaluation: keys "sup.<type>.<name>" name the type
            kind = next(n.split(".")[1] for n in params if n.startswith("sup."))
            supervisor = self.supervisors.archs[kind]
        theta = {n[6:]: t for n, t in params.items() if n.startswith("theta.")}
        sup = {n.split(".", 2)[2]: t for n, t in params.items() if n.startswith("sup.")}
        return self.arch(theta, x, train) + supervisor(sup, x, train)

    # ----------------------------------------------------------------- the round
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        h = self.hp
        theta = self.store.gather("theta", clients, self.device)
        supervisor_batches = self.draw_batches(clients, round_idx, h.supervisor_epochs, phase=1)
        model_batches = self.draw_batches(clients, round_idx, h.model_epochs, phase=2)
        trained = {n: t.clone() for n, t in theta.items()}

        def train(group: GroupShare) -> Tensor:
            kind, rows, members = group.name, group.rows, group.members
            loss_fn = self.joint_losses[kind]
            model = {f"theta.{n}": t[rows] for n, t in theta.items()}
            kept = self._gather_supervisors(kind, members)
            sup = {f"sup.{kind}.{n}": t for n, t in kept.items()}
            loss_sum = torch.zeros(len(rows), device=self.device)
            steps = torch.zeros_like(loss_sum)
            for phase, batches in ((sup, supervisor_batches), (model, model_batches)):
                context = model if phase is sup else sup
                result = self.local_train(
                    {n: t.clone() for n, t in phase.items()},
                    members,
                    round_idx,
                    loss_fn=loss_fn,
                    context=context,
                    batches=batches.select(rows),
                )
                phase.update(result.params)
                loss_sum += result.loss * result.steps
                steps += result.steps
            prefix = len(f"sup.{kind}.")
            trained_sup = {n[prefix:]: t for n, t in sup.items()}
            self.store.scatter(
                f"supervisor.{kind}",
                self.supervisors.row_of[members.cpu()],
                self.where_arrived(members, round_idx, trained_sup, kept),
            )
            for n in trained:
                trained[n][rows] = model[f"theta.{n}"]
            return loss_sum / steps.clamp_min(1)

        losses = self.supervisors.train_groups(clients, train)
        self.store.scatter("theta", clients, self.where_arrived(clients, round_idx, trained, theta))
        if h.aggregation != "none":
            self._mix_others(clients, round_idx, trained)
        self.record_communication(down=theta, up=trained)
        return losses

    def _gather_supervisors(self, kind: str, clients: Tensor) -> Params:
        return self.store.gather(
            f"supervisor.{kind}", self.supervisors.row_of[clients.cpu()], self.device
        )

    def _mix_others(self, clients: Tensor, round_idx: int, trained: Params) -> None:
        """Move every client that was not sampled toward the ``trained`` theta_j of the
        participants j, the sampled ``clients`` that reported back (none: nobody moves). Server
        side: reads the arrival mask on the host."""
        h = self.hp
        labels = torch.as_tensor(self.data.partition_counts()["train"])
        others = torch.ones(h.num_clients, dtype=torch.bool)
        others[clients.cpu()] = False
        arrived = self.arrived(clients, round_idx).cpu()
        if not others.any() or not arrived.any():
            return
        ids = others.nonzero()[:, 0]
        store_device = self.store.device
        mixed = mix_non_participants(
            self.store.gather("theta", ids, store_device),
            {n: t.to(store_device)[arrived.to(store_device)] for n, t in trained.items()},
            labels[ids].to(store_device),
            labels[clients.cpu()[arrived]].to(store_device),
            float(h.self_weight if h.self_weight is not None else len(clients)),
            h.aggregation,
        )
        self.store.scatter("theta", ids, mixed)

    # ----------------------------------------------------------------- evaluation
    def personalized_params(self, clients: Tensor) -> Params:
        kinds = list(self.supervisors.split(clients))
        if len(kinds) != 1:
            raise ValueError("personalized_params takes clients of one supervisor type")
        kind = kinds[0][0]
        theta = self.store.gather("theta", clients, self.device)
        sup = self._gather_supervisors(kind, clients)
        return {f"theta.{n}": t for n, t in theta.items()} | {
            f"sup.{kind}.{n}": t for n, t in sup.items()
        }

    def network_groups(self) -> NetworkGroups:
        return self.supervisors

    def results(self) -> dict[str, Any]:
        def size(arch: Architecture) -> int:
            return sum(math.prod(shape) for shape in arch.shapes.values())

        return super().results() | {
            "model_parameters": size(self.arch),
            "supervisor_parameters": {k: size(a) for k, a in self.supervisors.archs.items()},
            "supervisor_clients": {k: len(ids) for k, ids in self.client_groups().items()},
        }
