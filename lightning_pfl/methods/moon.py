"""MOON (Li, He & Song, CVPR 2021): model-contrastive federated learning."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pfl.engine import Architecture, Params, TrainResult, weighted_cross_entropy
from lightning_pfl.losses import weighted_mean
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.params import prefixed, split_prefixed
from lightning_pfl.validation import Momentum, NonNegativeFloat, PositiveFloat, PositiveInt

PROJ = "projection."
OUT = "output."
ClassifierInput = Literal["projection", "features"]


def model_contrastive_loss(
    z: Tensor, positive: Tensor, negative: Tensor, temperature: float, weight: Tensor
) -> Tensor:
    """-log( e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}) ).

    ``sim`` is the cosine similarity; the weighted mean over the batch is returned.
    """
    sims = torch.stack(
        [F.cosine_similarity(z, positive, dim=-1), F.cosine_similarity(z, negative, dim=-1)], -1
    )
    return weighted_mean(-F.log_softmax(sims.float() / temperature, -1)[..., 0], weight)


class MOON(FedAvg):
    """MOON: FedAvg whose clients add a model-contrastive term to the cross-entropy.

    The model is the paper's three parts: the base encoder (the network up to its
    representation, ``Architecture.features``, of size D), the projection head (Linear(D, D),
    ReLU, Linear(D, ``projection_dim``)) and the output layer, a single linear layer from the
    projection's output to the classes (``classifier_input: projection``, as the authors'
    ``ModelFedCon``); the network's own classifier is then not part of the model (neither sent,
    trained nor evaluated). All three parts are the global model: sent, trained, averaged,
    counted in the communication and evaluated together.

    Client i on a batch: z = proj(features(x)) of the model being trained, z_glob of the
    received global model (positive), z_prev of client i's model after its previous round
    (negative, kept in the client store; the initial model before its first round); loss =
    CE + mu * l_con with :func:`model_contrastive_loss` at temperature tau. Evaluation uses the
    global model, as in the paper.

    Args:
        mu: weight mu of the model-contrastive loss (paper: 5 on CIFAR-10, 1 on CIFAR-100 and
            Tiny-ImageNet).
        temperature: tau (paper: 0.5).
        projection_dim: output size of the projection head (paper: 256).
        classifier_input: what the classifier reads. ``projection`` (the paper's network and
            the authors' code): a new output layer Linear(``projection_dim``, classes) reads z.
            ``features``: the network's own classifier reads the representation and the
            projection head only feeds l_con (the evaluated model is the network alone); the
            digits benchmark uses it (the paper's composition collapsed there at its local lr
            0.05: docs/methods.md, MOON).
        local_momentum: client SGD momentum (paper: 0.9).
        local_weight_decay: client SGD weight decay (paper: 1e-5).
        local_max_grad_norm: client gradient clip (paper: none).
        local_lr: client SGD learning rate (paper: 0.01).
        batch_size: local batch size B (paper: 64).
        local_epochs: local epochs E per round (paper: 10; null trains ``local_steps``).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        mu: NonNegativeFloat = 1.0,
        temperature: PositiveFloat = 0.5,
        projection_dim: PositiveInt = 256,
        classifier_input: ClassifierInput = "projection",
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 1e-5,
        local_max_grad_norm: PositiveFloat | None = None,
        local_lr: PositiveFloat = 1e-2,
        batch_size: PositiveInt = 64,
        local_epochs: PositiveInt | None = 10,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_max_grad_norm=local_max_grad_norm,
            local_lr=local_lr,
            batch_size=batch_size,
            local_epochs=local_epochs,
            **kwargs,
        )
        self.refuse_batch_norm("MOON reads representations")
        weight = next(n for n in self.arch.head_names if n.endswith("weight"))
        dim = self.arch.shapes[weight][1]
        self.output: nn.Linear | None = None
        with self.seeded_init():
            self.projection = nn.Sequential(
                nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, projection_dim)
            )
            if classifier_input == "projection":
                self.output = nn.Linear(projection_dim, self.hp.num_classes)
        self.projection_arch = Architecture(self.projection)  # weightless, safe in threads
        self.store.add_field("previous", self.global_state())
        # one object for every round: a recorded round (CUDA graph) is keyed by the loss
        self.client_loss = self.moon_loss

    def shared_extras(self) -> dict[str, nn.Parameter]:
        """The projection head and the output layer, by the prefix of their tensors."""
        modules = {PROJ: self.projection} | ({} if self.output is None else {OUT: self.output})
        return {prefix + n: p for prefix, m in modules.items() for n, p in m.named_parameters()}

    def dropped_names(self) -> tuple[str, ...]:
        """The network's tensors outside the model: its classifier when the output layer
        replaces it."""
        return () if self.output is None else self.arch.head_names

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        dropped = self.dropped_names()
        params = [p for n, p in self.net.named_parameters() if n not in dropped]
        params += self.shared_extras().values()
        return torch.optim.SGD(params, lr=h.server_lr, momentum=h.server_momentum)

    def global_state(self) -> Params:
        dropped = self.dropped_names()
        return {n: t for n, t in super().global_state().items() if n not in dropped}

    def represent(self, params: Params, x: Tensor, train: bool = False) -> tuple[Tensor, Tensor]:
        """Projected representation z and logits of one model (its network, projection and
        output tensors)."""
        net = {n: t for n, t in params.items() if not n.startswith((PROJ, OUT))}
        proj = {n[len(PROJ) :]: t for n, t in params.items() if n.startswith(PROJ)}
        features = self.arch.features(net, x, train=train)
        z = self.projection_arch(proj, features)
        if self.output is None:
            return z, self.arch.classify(net, features)
        return z, F.linear(z, params[OUT + "weight"], params[OUT + "bias"])

    def moon_loss(self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        z, logits = self.represent(params, x, train=True)
        glob, previous = split_prefixed(context, "global", "previous")
        z_glob = self.represent(glob, x)[0].detach()
        z_prev = self.represent(previous, x)[0].detach()
        contrastive = model_contrastive_loss(z, z_glob, z_prev, self.hp.temperature, w)
        return weighted_cross_entropy(logits, y, w) + self.hp.mu * contrastive

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        previous = self.store.gather("previous", clients, self.device)
        context = prefixed("global", start) | prefixed("previous", previous)
        result = self.local_train(
            {n: t.clone() for n, t in start.items()},
            clients,
            round_idx,
            loss_fn=self.client_loss,
            context=context,
        )
        self.store.scatter(
            "previous", clients, self.where_arrived(clients, round_idx, result.params, previous)
        )
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        params = super().personalized_params(clients)
        if self.output is None:  # the evaluated model is the network alone
            return {n: t for n, t in params.items() if not n.startswith(PROJ)}
        return params

    def predict(self, params: Params, x: Tensor) -> Tensor:
        if self.output is None:
            return super().predict(params, x)
        return self.represent(params, x)[1]
