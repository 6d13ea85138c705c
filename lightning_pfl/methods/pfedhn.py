"""pFedHN (Shamsian et al., ICML 2021): a server hypernetwork generates each client's model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_pfl.engine import Architecture, Params
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.models import HyperNetwork
from lightning_pfl.models.hypernetwork import (
    DEFAULT_FEATURE_SCALE,
    DEFAULT_HEAD_INIT,
    BaseHyperNetwork,
    HeadInit,
    set_delta_gradients,
    steps_in_turn,
)
from lightning_pfl.novel_adaptation import ADAPTS_NOVEL_CLIENTS, NovelAdaptation
from lightning_pfl.privacy import privatizes, set_private_delta_gradients
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)


class PFedHN(FederatedMethod):
    """Personalized federated hypernetworks.

    Round (the paper's Algorithm 1, with ``clients_per_round`` clients at once):
    theta_i = h(v_i; phi) for all sampled i in one forward; each client runs K local SGD steps
    from theta_i (a fresh inner optimizer every round) to theta~_i and uploads
    delta_i = theta_i - theta~_i. The server then, by ``hn_update``:

    - ``mean``: sets grad(phi, v) = (1/C) sum_i (grad_{phi,v} theta_i)^T delta_i, the gradient of
      (1/C) sum_i 0.5 ||h(v_i; phi) - theta~_i||^2, clips it and takes one step;
    - ``per_client``: takes one clipped step per client in turn with
      (grad_{phi,v} theta_i)^T delta_i (the Jacobian at the round's starting phi, as all clients
      trained from it), as FL-bench's pFedHN does; C steps of full size per round.

    The two are the same with one client per round (the paper's setting). The pFedHN paper
    describes one client per round; FL-bench, which users compare against, steps per client.

    The hypernetwork is the paper's (its code's ``CNNHyper``: ``nn.Embedding`` and ``nn.Linear``
    layers at PyTorch's default initialization) unless one of two options that are not in the
    paper is set: ``hn_feature_scale`` and ``hn_head_init: target`` (their defaults live in
    :mod:`lightning_pfl.models.hypernetwork`, ``DEFAULT_FEATURE_SCALE`` and
    ``DEFAULT_HEAD_INIT``).

    Args:
        embed_dim: client embedding size (default floor(1 + n / 4)).
        hidden_dim: hypernetwork MLP width.
        n_hidden: hypernetwork hidden layers after the first (3 for CIFAR, 0 for MNIST).
        spectral_norm: spectral normalization on every hypernetwork layer.
        hn_optimizer: server optimizer of (phi, v): ``sgd`` (the paper's code), ``adam`` or
            ``adamw`` (PyTorch's, with ``hn_weight_decay`` as its decoupled decay).
        hn_lr: server learning rate (paper: 1e-2; pFedHN-PC 5e-2).
        embed_lr: learning rate of the embeddings v (default ``hn_lr``).
        hn_momentum: server SGD momentum.
        hn_weight_decay: server weight decay.
        hn_max_grad_norm: clip of the hypernetwork gradient norm (None: off).
        hn_update: ``mean`` (one server step with the mean over the round's clients) or
            ``per_client`` (one server step per client in turn, FL-bench's pFedHN).
        hn_feature_scale: multiply the features the heads read by a constant that sets their
            mean square E||h||^2 over the initial embeddings to 0.5, the value of the paper's
            CIFAR HN (:class:`~lightning_pfl.models.hypernetwork.FeatureScale`). A server step
            moves client i's generated weights by about hn_lr * ||h_i||^2 / (1 - hn_momentum)
            times its delta, so this makes ``hn_lr`` mean the same for every HN depth (the
            one-hidden-layer MNIST HN has E||h||^2 ~ 36). Not in the paper nor its code
            (False: the paper's unscaled features).
        hn_head_init: ``pytorch``: every output head keeps ``nn.Linear``'s default
            initialization (the paper's code); ``target``: the heads are rescaled so that the
            generated tensors start with the mean and standard deviation of the target
            network's own initialization
            (:func:`~lightning_pfl.models.hypernetwork.match_target_init`; not in the paper).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`; the pFedHN inner
            loop defaults (K=50 steps, batch 64, lr 5e-3, momentum 0.9, wd 5e-5, clip 50) are
            the base defaults.
    """

    honours_conditions = True

    def __init__(
        self,
        embed_dim: PositiveInt | None = None,
        hidden_dim: PositiveInt = 100,
        n_hidden: NonNegativeInt = 3,
        spectral_norm: bool = False,
        hn_optimizer: Literal["sgd", "adam", "adamw"] = "sgd",
        hn_lr: PositiveFloat = 1e-2,
        embed_lr: PositiveFloat | None = None,
        hn_momentum: Momentum = 0.9,
        hn_weight_decay: NonNegativeFloat = 1e-3,
        hn_max_grad_norm: PositiveFloat | None = 50.0,
        hn_update: Literal["mean", "per_client"] = "mean",
        hn_feature_scale: bool = DEFAULT_FEATURE_SCALE,
        hn_head_init: HeadInit = DEFAULT_HEAD_INIT,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm(f"{type(self).__name__} generates whole models")
        if self.client_dp is not None and hn_update != "mean":
            raise ConfigError(
                f"model.init_args.client_dp: {type(self).__name__} privatizes the mean update "
                f"of the hypernetwork; hn_update = '{hn_update}' steps once per client; use "
                "hn_update: mean."
            )
        with self.seeded_init():
            self.hnet = self.build_hypernetwork()

    def build_hypernetwork(self) -> BaseHyperNetwork:
        """The server hypernetwork ``hnet`` (called once, seeded, in ``__init__``): pFedHN's
        embedding table, MLP and one head per tensor of :meth:`generated_shapes`."""
        h = self.hp
        n = h.num_clients
        return HyperNetwork(
            n,
            self.generated_shapes(),
            h.embed_dim or int(1 + n / 4),
            h.hidden_dim,
            h.n_hidden,
            h.spectral_norm,
            self.head_target_init(),
            feature_scale=h.hn_feature_scale,
        )

    def head_target_init(self, arch: Architecture | None = None) -> dict[str, Tensor] | None:
        """What the hypernetwork's heads start at: the initial tensors of ``arch`` (default the
        method's target) with ``hn_head_init: target``, None (PyTorch's default) otherwise."""
        if self.hp.hn_head_init != "target":
            return None
        return (arch or self.arch).initial_params()

    def generated_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Shapes of the tensors the hypernetwork generates (all target tensors)."""
        return self.arch.shapes

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        groups = [
            {"params": self.hnet.body_parameters()},
            {"params": self.hnet.embedding_parameters(), "lr": h.embed_lr or h.hn_lr},
        ]
        if h.hn_optimizer == "adam":
            return torch.optim.Adam(groups, lr=h.hn_lr, weight_decay=h.hn_weight_decay)
        if h.hn_optimizer == "adamw":
            return torch.optim.AdamW(groups, lr=h.hn_lr, weight_decay=h.hn_weight_decay)
        return torch.optim.SGD(
            groups, lr=h.hn_lr, momentum=h.hn_momentum, weight_decay=h.hn_weight_decay
        )

    @privatizes(
        "each client's contribution J_i^T delta_i to the gradient of the shared hypernetwork "
        "(every parameter but the embeddings), clipped as one vector; the embedding v_i is "
        "client i's personal parameter and is updated from its unclipped delta"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        generated = self.hnet(clients)
        start = {n: t.detach() for n, t in generated.items()}
        result = self.local_train({n: t.clone() for n, t in start.items()}, clients, round_idx)
        delta = {n: start[n] - result.params[n] for n in start}
        if self.client_dp is not None:
            generator = self.client_dp_generator(round_idx)
            self.set_private_gradients(
                generated, delta, generator, self.embedding_weights(clients, round_idx)
            )
        else:
            self.update_from_arrived(generated, delta, clients, round_idx)
        self.record_communication(down=start, up=delta)
        return result.loss

    def update_from_arrived(
        self, generated: Params, delta: Params, clients: Tensor, round_idx: int
    ) -> None:
        """:meth:`update_hypernetwork` from the clients that reported back (with equal
        weights); a round in which none did sets no gradient."""
        if self.unreliable is None:
            self.update_hypernetwork(generated, delta)
        elif not self.nothing_arrived(clients, round_idx):
            arrived = self.arrived(clients, round_idx)
            weights = self.client_weights(clients, round_idx, uniform=True)
            weights = weights.to(next(iter(delta.values())))
            self.update_hypernetwork(generated, delta, weights, arrived.nonzero().flatten())

    def update_hypernetwork(
        self,
        generated: Params,
        delta: Params,
        weights: Tensor | None = None,
        rows: Tensor | None = None,
    ) -> None:
        """Set the server gradient from the clients' deltas (``hn_update: mean``, weighted by
        ``weights``, default 1/C), or step per client (``per_client``: each client's
        J_i^T delta_i of the ``rows`` that reported back (default all), all at the round's
        starting phi, applied one optimizer step at a time; the base class takes the last)."""
        if self.hp.hn_update == "mean":
            self.set_hypernetwork_gradients(generated, delta, weights=weights)
            return
        optimizer = self.server_optimizer
        assert optimizer is not None, "configure_optimizers() sets the server optimizer"
        params = [p for p in self.hnet.parameters() if p.requires_grad]
        count = len(next(iter(delta.values())))
        per_client = []
        for i in range(count) if rows is None else rows.tolist():
            self.set_hypernetwork_gradients(
                generated, {n: d[i : i + 1] for n, d in delta.items()}, rows=slice(i, i + 1)
            )
            per_client.append([p.grad for p in params])
        steps_in_turn(optimizer, params, per_client)

    def set_hypernetwork_gradients(
        self,
        generated: Params,
        delta: Params,
        rows: slice | None = None,
        weights: Tensor | None = None,
    ) -> None:
        """grad(phi, v) = sum_i w_i J_i^T delta_i over ``delta``'s clients (``generated[rows]``),
        the gradient of sum_i w_i <h(v_i; phi), delta_i>, then clip to ``hn_max_grad_norm``.

        ``weights`` are the w_i ``[C]`` (default 1/C each: the mean over the clients).
        """
        outputs = {n: t[rows] if rows is not None else t for n, t in generated.items()}
        first = next(iter(delta.values()))
        if weights is None:
            weights = torch.full((len(first),), 1.0 / len(first), device=first.device)
        set_delta_gradients(
            [p for p in self.hnet.parameters() if p.requires_grad],
            list(outputs.values()),
            [delta[n] for n in outputs],
            [weights] * len(outputs),
            self.hp.hn_max_grad_norm,
            retain_graph=rows is not None,
        )

    def embedding_weights(self, clients: Tensor, round_idx: int) -> Tensor | None:
        """The weights of the personal parameters' gradients under DP: as without DP, equal
        over the clients that reported back (None: 1/C, every client reported back). A
        dropped client took no step, so its delta, and its share of the clipped sum, is 0."""
        if self.unreliable is None:
            return None
        return self.client_weights(clients, round_idx, uniform=True)

    def set_private_gradients(
        self,
        generated: Params,
        delta: Params,
        generator: torch.Generator,
        personal_weights: Tensor | None = None,
    ) -> None:
        """DP-FedAvg on the shared hypernetwork phi, every parameter but the personal ones
        (``personal_parameters``: the embeddings v_i, or a mixed embedding's coefficients c_i,
        whose basis every client reads): :func:`~lightning_pfl.privacy.set_private_delta_gradients`,
        every generated tensor holding one row per client; the personal parameters' gradients
        weigh client i by ``personal_weights[i]`` (default 1/C)."""
        dp = self.client_dp
        assert dp is not None, "client_dp is not set"
        embeddings = [p for p in self.hnet.personal_parameters() if p.requires_grad]
        personal = {id(p) for p in embeddings}
        body = [p for p in self.hnet.parameters() if p.requires_grad and id(p) not in personal]
        outputs = list(generated.values())
        count = len(outputs[0])
        every = torch.arange(count, device=outputs[0].device)  # each tensor has every client's row
        set_private_delta_gradients(
            body,
            embeddings,
            outputs,
            list(delta.values()),
            [every] * len(outputs),
            count,
            dp,
            self.hp.clients_per_round,  # qN: the simulation samples exactly that many
            generator,
            self.hp.hn_max_grad_norm,
            personal_weights=personal_weights,
        )

    def novel_adaptation(self, clients: Tensor) -> NovelAdaptation:
        """Section 5.3: a novel client adapts only its embedding v_i (the hypernetwork phi is
        fixed); the other personalized tensors are read from :meth:`personalized_params` at
        every step, and the loss is each client's mean cross-entropy."""
        embeddings = getattr(self.hnet, "embeddings", None)
        if (
            not isinstance(embeddings, nn.Embedding)
            or embeddings.num_embeddings != self.hp.num_clients
            or not embeddings.weight.requires_grad
        ):
            raise ConfigError(
                f"trainer.callbacks NovelClients: {type(self).__name__}'s hypernetwork has no "
                "trainable embedding per client (``hnet.embeddings``), so novel clients cannot "
                f"adapt; use {ADAPTS_NOVEL_CLIENTS}, or remove the callback."
            )
        with torch.no_grad():
            unknown = sorted(set(self.hnet(clients)) - set(self.personalized_params(clients)))
        if unknown:
            raise ConfigError(
                f"NovelClients: {type(self).__name__}'s hypernetwork generates {unknown}, which "
                "are not among its personalized parameters; it cannot adapt novel clients."
            )
        return NovelAdaptation(
            [embeddings.weight],
            self.novel_loss(lambda: {**self.personalized_params(clients), **self.hnet(clients)}),
        )

    def personalized_params(self, clients: Tensor) -> Params:
        with torch.no_grad():
            return self.hnet(clients)
