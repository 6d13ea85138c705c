"""FedTP (Li et al., "FedTP: Federated Learning by Transformer Personalization", TNNLS 2023).

A server hypernetwork generates every client's self-attention (the bias-free qkv projection of
each transformer block); everything else is FedAvg'd. Variants combine it with FedPer (a local
classifier), FedRoD (a balanced generic head plus a personal head) and kNN-Per (a local memory
of features).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from lightning import Callback
from torch import Tensor, nn
from torch.func import vmap

from lightning_pfl.attention_maps import AttentionMaps
from lightning_pfl.engine import Params, TrainResult, weighted_cross_entropy
from lightning_pfl.errors import ConfigError
from lightning_pfl.losses import (
    balanced_softmax_cross_entropy,
    interpolate_with_knn,
    knn_probabilities,
)
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.models import HyperNetwork
from lightning_pfl.models.hypernetwork import HeadInit, set_delta_gradients
from lightning_pfl.models.transformers import qkv_names
from lightning_pfl.privacy import (
    private_uploads,
    privatizes,
    set_private_delta_gradients,
    squared_norms,
)
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    UnitInterval,
)


class FedTP(FedAvg):
    """Federated learning by transformer personalization.

    Round (FedTP's Algorithm 1): W_i = h(v_i; phi) for every sampled client i in one batched
    hypernetwork forward (the qkv projection of every block); client i trains the global model
    with its own W_i for ``local_epochs`` epochs and uploads the shared tensors and W~_i. The
    server averages the shared tensors (sample-weighted, as FedAvg; server_lr 1) and sets
    grad(phi, v) = sum_i p_i (dW_i / d(phi, v))^T (W_i - W~_i) with p_i proportional to client
    i's training samples, the gradient of sum_i p_i 0.5 ||h(v_i; phi) - W~_i||^2, then steps.

    A client's personalized model is the global model with its generated W_i.

    Client-level DP (``client_dp``, z and clip norm S): DP-FedAvg on client i's whole release,
    its shared tensors' update Delta x_i and its contribution c_i = (dW_i / d phi)^T (W_i -
    W~_i) to the gradient of the shared hypernetwork phi, clipped as one vector to norm S; both
    sums divide by the fixed qN and carry N(0, z^2 S^2 I) / qN (one release a round), the
    shared tensors' weights are 1 / qN for every client. The embedding v_i is client i's
    personal parameter (only its W_i reads it): its gradient is the one without DP.

    Args:
        embed_dim: client embedding size (paper: 32; reference code: 128).
        hidden_dim: hypernetwork MLP width (150).
        n_hidden: hidden layers after the first (3: the paper's four FC layers).
        hn_lr: hypernetwork learning rate (default ``local_lr``, as the reference code).
        hn_momentum: hypernetwork SGD momentum.
        hn_weight_decay: hypernetwork weight decay.
        hn_max_grad_norm: clip of the hypernetwork gradient norm (None: off, as the paper and
            its reference code).
        hn_feature_scale: scale the features the heads read to a mean square of 0.5
            (``FeatureScale`` of ``lightning_pfl.models.hypernetwork``, pFedHN's option of the
            same name; False: unscaled, as the reference code; the paper does not say).
        hn_head_init: ``pytorch``: the heads keep ``nn.Linear``'s default initialization (the
            reference code); ``target``: they are rescaled so that generated qkv weights start
            at the ViT's own initialization scale (``match_target_init``, pFedHN's option of the
            same name). Both on: this library's remedy for pFedHN at 100 clients.
        net: a transformer with named qkv projections (``vit`` or ``char_transformer``).
        local_lr: client SGD learning rate (0.01).
        local_momentum: client SGD momentum (0.9, reference code).
        local_weight_decay: client weight decay (1e-5, reference code).
        local_epochs: local epochs E (5); batch size B = ``batch_size`` (64).
        local_max_grad_norm: client gradient clip (None: off, as FedTP).
        picture_clients: at every validation, log to TensorBoard the attention-rollout maps of
            4 test images of each of the first ``picture_clients`` clients (``vit`` only) and
            the PCA projection of the client embeddings (0: neither; see
            :class:`~lightning_pfl.attention_maps.AttentionMaps`).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        embed_dim: PositiveInt = 32,
        hidden_dim: PositiveInt = 150,
        n_hidden: NonNegativeInt = 3,
        hn_lr: PositiveFloat | None = None,
        hn_momentum: Momentum = 0.9,
        hn_weight_decay: NonNegativeFloat = 1e-3,
        hn_max_grad_norm: PositiveFloat | None = None,
        hn_feature_scale: bool = False,
        hn_head_init: HeadInit = "pytorch",
        net: str = "vit",
        local_lr: PositiveFloat = 1e-2,
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 1e-5,
        local_epochs: PositiveInt | None = 5,
        local_max_grad_norm: PositiveFloat | None = None,
        picture_clients: NonNegativeInt = 4,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            net=net,
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_epochs=local_epochs,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        generated = self.generated_names()
        if not generated:
            raise ConfigError(
                f"model.init_args.net '{net}' has no attention qkv projections to personalize; "
                f"{type(self).__name__} needs a transformer: vit or char_transformer."
            )
        with self.seeded_init():
            self.hnet = HyperNetwork(
                self.hp.num_clients,
                {n: self.arch.shapes[n] for n in generated},
                embed_dim,
                hidden_dim,
                n_hidden,
                target_init=self.arch.initial_params() if hn_head_init == "target" else None,
                feature_scale=hn_feature_scale,
            )

    def generated_names(self) -> tuple[str, ...]:
        """The tensors the hypernetwork generates: every block's qkv projection."""
        return qkv_names(tuple(self.arch.shapes))

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        generated = set(self.generated_names())
        shared = [p for n, p in self.net.named_parameters() if n not in generated]
        return torch.optim.SGD(
            [
                {"params": shared, "lr": h.server_lr, "momentum": h.server_momentum},
                {
                    "params": list(self.hnet.parameters()),
                    "lr": h.hn_lr or h.local_lr,
                    "momentum": h.hn_momentum,
                    "weight_decay": h.hn_weight_decay,
                },
            ],
            lr=h.server_lr,
        )

    def shared_payload(self, clients: Tensor) -> Params:
        """The global model's tensors every client receives (all but the generated ones)."""
        generated = set(self.generated_names())
        return {n: t for n, t in super().payload(clients).items() if n not in generated}

    def payload(self, clients: Tensor) -> Params:
        """The shared tensors with each client's generated qkv projections in place."""
        with torch.no_grad():
            return self.shared_payload(clients) | self.hnet(clients)

    @privatizes(
        "each client's update of the shared tensors and its contribution J_i^T (W_i - W~_i) "
        "to the gradient of the shared hypernetwork phi, clipped together as one vector; the "
        "embedding v_i is client i's personal parameter and is updated from its unclipped delta"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        generated = self.hnet(clients)  # W_i = h(v_i; phi), one forward for all clients
        personalized = {n: t.detach() for n, t in generated.items()}
        sent = self.shared_payload(clients)
        start = {n: t.clone() for n, t in (sent | personalized).items()}
        result = self.train_with_personal(round_idx, clients, start)
        uploaded = {n: result.params[n] for n in sent}
        trained = {n: result.params[n] for n in generated}
        deltas = [personalized[n] - trained[n] for n in generated]
        if self.client_dp is not None:
            self.set_private_server_gradients(round_idx, clients, generated, deltas, sent, uploaded)
        elif not self.nothing_arrived(clients, round_idx):
            weights = self.client_weights(clients, round_idx)
            self.aggregate(uploaded, weights)
            # grad(phi, v) = sum_i p_i J_i^T (W_i - W~_i), clipped to hn_max_grad_norm
            set_delta_gradients(
                list(self.hnet.parameters()),
                list(generated.values()),
                deltas,
                [weights] * len(generated),
                self.hp.hn_max_grad_norm,
            )
        self.record_communication(down=sent | personalized, up=uploaded | trained)
        return result.loss

    def set_private_server_gradients(
        self,
        round_idx: int,
        clients: Tensor,
        generated: Params,
        deltas: list[Tensor],
        sent: Params,
        uploaded: Params,
    ) -> None:
        """DP-FedAvg on the round's one release, the pair (Delta x_i, c_i) of every client:
        f_i = min(1, S / sqrt(||Delta x_i||^2 + ||c_i||^2)) with c_i = J_i^T (W_i - W~_i) the
        gradient of the shared hypernetwork phi (every parameter but the embeddings), the
        shared tensors' mean update sum_i f_i Delta x_i / qN and phi's gradient
        sum_i f_i c_i / qN, each with N(0, z^2 S^2 I) / qN
        (:func:`~lightning_pfl.privacy.set_private_delta_gradients`, then
        :func:`~lightning_pfl.privacy.private_uploads` with its f_i); the embeddings' gradient
        as without DP (weights p_i over the clients that reported back). A dropped client's
        Delta x_i and W_i - W~_i are zero: it adds nothing to the sums, which divide by qN."""
        dp = self.client_dp
        assert dp is not None, "client_dp is not set"
        embeddings = [p for p in self.hnet.personal_parameters() if p.requires_grad]
        personal = {id(p) for p in embeddings}
        shared = [p for p in self.hnet.parameters() if p.requires_grad and id(p) not in personal]
        expected = self.hp.clients_per_round  # qN: the simulation samples exactly that many
        generator = self.client_dp_generator(round_idx)
        every = torch.arange(len(clients), device=deltas[0].device)  # every client's row
        factors = set_private_delta_gradients(
            shared,
            embeddings,
            list(generated.values()),
            deltas,
            [every] * len(deltas),
            len(clients),
            dp,
            expected,
            generator,
            self.hp.hn_max_grad_norm,
            other_squares=squared_norms({n: u - sent[n] for n, u in uploaded.items()}),
            personal_weights=self.client_weights(clients, round_idx),
        )
        private = private_uploads(sent, uploaded, dp, generator, factors)
        self.aggregate(private, torch.full((len(clients),), 1.0 / expected, dtype=torch.float64))

    def network_tensors(self, tensors: Params) -> Params:
        """The target network's own tensors among ``tensors`` (without a variant's extras)."""
        shapes = self.arch.shapes.keys() | self.arch.buffer_shapes.keys()
        return {n: t for n, t in tensors.items() if n in shapes}

    def configure_callbacks(self) -> list[Callback]:
        if not self.hp.picture_clients:
            return []
        return [AttentionMaps(self.hp.picture_clients, lambda: self.hnet.embeddings.weight)]


class FedTPPer(FedTP):
    """FedTP+FedPer: generated attention and a classifier each client keeps locally."""

    honours_conditions = True

    def personal_names(self) -> tuple[str, ...]:
        return self.arch.head_names


class FedTPRoD(FedTP):
    """FedTP+FedRoD: a generic head shared by all and a personal head per client.

    The body (with the generated attention) and the generic head, FedAvg'd, are trained with
    the balanced softmax loss on the client's class counts; the personal head, kept locally,
    reads the detached features and is trained with cross-entropy on the sum of the detached
    generic logits and its own. Prediction: generic + personal logits.

    Args:
        **kwargs: see :class:`FedTP`.
    """

    honours_conditions = True
    PERSONAL_HEAD = "rod_head"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        classes, width = self.arch.shapes[f"{self.arch.head_module}.weight"]
        with self.seeded_init():
            head = nn.Linear(width, classes)
        self.store.add_field(
            "rod_head", {f"{self.PERSONAL_HEAD}.{n}": p for n, p in head.named_parameters()}
        )

    def _logits(self, tensors: Params, x: Tensor, train: bool) -> tuple[Tensor, Tensor]:
        z = self.arch.features(self.network_tensors(tensors), x, train)
        generic = self.arch.classify(tensors, z)
        h = self.PERSONAL_HEAD
        personal = F.linear(z.detach(), tensors[f"{h}.weight"], tensors[f"{h}.bias"])
        return generic, personal

    def rod_loss(
        self, params: Params, context: Params, x: Tensor, y: Tensor, weight: Tensor
    ) -> Tensor:
        generic, personal = self._logits({**context, **params}, x, True)
        balanced = balanced_softmax_cross_entropy(generic, y, context["class_counts"], weight)
        return balanced + weighted_cross_entropy(generic.detach() + personal, y, weight)

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        counts = torch.as_tensor(self.data.partition_counts()["train"], device=self.device)
        heads = self.store.gather("rod_head", clients, self.device)
        result = self.local_train(
            start | heads,
            clients,
            round_idx,
            loss_fn=self.rod_loss,
            context={"class_counts": counts[clients].float()},
        )
        self.store.scatter("rod_head", clients, {n: result.params[n] for n in heads})
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        return super().personalized_params(clients) | self.store.gather(
            "rod_head", clients, self.device
        )

    def predict(self, params: Params, x: Tensor) -> Tensor:
        generic, personal = self._logits(params, x, False)
        return generic + personal


class FedTPKNN(FedTP):
    """FedTP+kNN (after kNN-Per, Marfoq et al. 2022): a local memory of training features.

    Training is FedTP's. At evaluation each client stores the features of its own training
    samples under its personalized model; a prediction interpolates the model's softmax with
    the class distribution of the ``knn_k`` nearest stored features:
    lambda p_kNN + (1 - lambda) softmax(logits).

    Args:
        knn_k: neighbours k (reference code: 10).
        knn_weight: interpolation weight lambda of the kNN distribution (reference code: 0.6).
        knn_temperature: temperature T of the distance softmax over neighbours (squared
            Euclidean distances); None: the feature dimension, as the reference code.
        **kwargs: see :class:`FedTP`.
    """

    honours_conditions = True
    MEMORY = ("knn.memory", "knn.labels", "knn.mask")

    def __init__(
        self,
        knn_k: PositiveInt = 10,
        knn_weight: UnitInterval = 0.6,
        knn_temperature: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)

    @torch.no_grad()
    def personalized_params(self, clients: Tensor) -> Params:
        params = super().personalized_params(clients)
        features, labels, masks = [], [], []
        for index, weight in self.data.eval_blocks(clients, "train", self.hp.eval_batch_size):
            x, y = self.data.fetch(index)
            features.append(vmap(self.arch.features)(params, x).float())
            labels.append(y)
            masks.append(weight > 0)
        memory = (torch.cat(features, 1), torch.cat(labels, 1), torch.cat(masks, 1))
        return params | dict(zip(self.MEMORY, memory, strict=True))

    def predict(self, params: Params, x: Tensor) -> Tensor:
        h = self.hp
        z = self.arch.features(self.network_tensors(params), x)
        logits = self.arch.classify(params, z)
        probs = knn_probabilities(
            z,
            params["knn.memory"],
            params["knn.labels"],
            params["knn.mask"],
            h.num_classes,
            h.knn_k,
            h.knn_temperature or z.shape[-1],
        )
        return interpolate_with_knn(logits, probs, h.knn_weight)
