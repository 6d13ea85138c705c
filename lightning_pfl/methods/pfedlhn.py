"""pFedLHN (Zhu et al., Neural Processing Letters 2023): layer-wise hypernetwork modules."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm as add_spectral_norm

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.pfedhn import PFedHN
from lightning_pfl.models import HyperNetwork
from lightning_pfl.models.hypernetwork import BaseHyperNetwork, FeatureScale, match_target_init
from lightning_pfl.validation import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt


def layers_of(shapes: Mapping[str, tuple[int, ...]]) -> dict[str, dict[str, tuple[int, ...]]]:
    """Target tensors grouped by the layer (module) that owns them, in network order."""
    layers: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        layers.setdefault(name.rsplit(".", 1)[0], {})[name] = shape
    return layers


class MixedEmbedding(nn.Module):
    """v_i = c_i E: client i's embedding mixes M basis embeddings E (shared by every client).

    The public pFedLHN code's client input (``models.py`` l. 18 and 43-48): the basis E is an
    ``nn.Embedding(M, embed_dim)`` (N(0, 1) at initialization), the coefficients c_i in R^M are
    N(0, ``std``^2). Reads like ``nn.Embedding`` (``weight``: the [n, embed_dim] table of every
    v_i; ``num_embeddings``), so a :class:`~lightning_pfl.models.HyperNetwork` can use it. With
    ``rows`` R, c_i is an [R, M] matrix (the code's ``coeff[i]``, one row c_i^k per generated
    tensor) and v_i = c_i E is [R, embed_dim].
    """

    def __init__(
        self, basis: nn.Embedding, num_clients: int, std: float, rows: int | None = None
    ) -> None:
        super().__init__()
        self.basis = basis
        shape = (
            (num_clients, basis.num_embeddings)
            if rows is None
            else (num_clients, rows, basis.num_embeddings)
        )
        self.coefficients = nn.Parameter(torch.randn(shape) * std)

    @property
    def weight(self) -> Tensor:
        return self.coefficients @ self.basis.weight

    @property
    def num_embeddings(self) -> int:
        return len(self.coefficients)

    def forward(self, clients: Tensor) -> Tensor:
        return self.coefficients[clients] @ self.basis.weight


def without_bases(module: nn.Module, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
    """``parameters`` less the basis E of every :class:`MixedEmbedding` in ``module``: every
    client's v_i = c_i E reads E, so only the coefficients c_i are a client's own."""
    bases = {id(m.basis.weight) for m in module.modules() if isinstance(m, MixedEmbedding)}
    return [p for p in parameters if id(p) not in bases]


class LayerwiseHyperNetwork(BaseHyperNetwork):
    """h_l(v_i; phi_l) for every layer l of the target: one small pFedHN hypernetwork per layer.

    Each layer's HN is a :class:`~lightning_pfl.models.HyperNetwork` (MLP and one head per
    tensor of that layer) that generates that layer's tensors only. With ``shared_embedding``
    the layer HNs read one client embedding table v (the parameter sharing across layer
    modules); otherwise each layer has its own embeddings v_i^l. ``target_init`` and
    ``feature_scale`` as in :class:`~lightning_pfl.models.HyperNetwork` (PFedLHN passes pFedHN's
    ``hn_head_init`` and ``hn_feature_scale``). With ``n_embeds`` M, v_i (or each v_i^l) is a
    :class:`MixedEmbedding` c_i E (or c_i^l E) of one basis E of M embeddings that every layer
    reads, its coefficients drawn with standard deviation ``coefficient_std``.
    """

    def __init__(
        self,
        num_clients: int,
        target_shapes: Mapping[str, tuple[int, ...]],
        embed_dim: int,
        hidden_dim: int,
        n_hidden: int,
        spectral_norm: bool,
        target_init: Mapping[str, Tensor] | None,
        shared_embedding: bool = True,
        feature_scale: bool = False,
        n_embeds: int | None = None,
        coefficient_std: float = 0.002,
    ) -> None:
        super().__init__()
        self.layer_names = list(layers_of(target_shapes))
        self.layers = nn.ModuleList(
            HyperNetwork(
                num_clients,
                shapes,
                embed_dim,
                hidden_dim,
                n_hidden,
                spectral_norm,
                target_init,
                feature_scale=feature_scale,
            )
            for shapes in layers_of(target_shapes).values()
        )
        if n_embeds is not None:
            basis = nn.Embedding(n_embeds, embed_dim)
            for layer in self.layer_modules():
                # duck-typed nn.Embedding (weight, num_embeddings, forward)
                layer.embeddings = MixedEmbedding(basis, num_clients, coefficient_std)  # type: ignore[assignment]
        if shared_embedding:  # every layer reads the first layer's embedding table
            shared = self.layer(self.layer_names[0]).embeddings
            for name in self.layer_names[1:]:
                self.layer(name).embeddings = shared
        if n_embeds is not None:  # the initial features changed: redo what was fitted to them
            for layer in self.layer_modules():
                if feature_scale:
                    layer.feature_scale.calibrate(layer.mlp(layer.embeddings.weight))
                if target_init is not None:
                    layer.heads = layer.new_heads(layer.target_shapes, target_init)

    def layer(self, name: str) -> HyperNetwork:
        """The hypernetwork of layer ``name`` (a module name of the target)."""
        module = self.layers[self.layer_names.index(name)]
        assert isinstance(module, HyperNetwork)
        return module

    def layer_modules(self) -> list[HyperNetwork]:
        """The hypernetwork of every layer, in network order."""
        return [self.layer(name) for name in self.layer_names]

    def forward(self, clients: Tensor) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for layer in self.layers:
            out |= layer(clients)
        return out

    def embedding_parameters(self) -> list[nn.Parameter]:
        unique = {
            id(p): p for name in self.layer_names for p in self.layer(name).embedding_parameters()
        }
        return list(unique.values())

    def personal_parameters(self) -> list[nn.Parameter]:
        return without_bases(self, self.embedding_parameters())


class SharedBodyHyperNetwork(BaseHyperNetwork):
    """theta_i^k = W_k f(v_i^{g(k)}) + b_k: one body f shared by every target tensor k, one head
    (W_k, b_k) per tensor, and client i's input row v_i^{g(k)} chosen per tensor.

    The public pFedLHN code's ``CNNHyper`` (tianyuzeke/pFedLHN ``models.py`` l. 24-60, with its
    default ``--use-fc`` True): ``fc1`` = Linear(embed_dim, hdim) (the body f, here
    Linear(embed_dim, ``hidden_dim``) then ``n_hidden`` x [ReLU, Linear]) reads row k of
    ``ft = coeff[i] @ E`` for tensor k, and the per-tensor heads (``c1_weights``, ``c1_bias``,
    ...) are the only weights a layer has of its own. ``groups`` [K] gives the row g(k) each
    tensor reads (the code's ``--layer-wise`` True: k itself, one row per tensor; False: row 0
    for every tensor). Client i's rows v_i in R^{G x embed_dim} are a :class:`MixedEmbedding`
    c_i E with c_i in R^{G x M} drawn N(0, ``coefficient_std``^2) and a basis E of ``n_embeds``
    M embeddings shared by every client, or, without ``n_embeds``, a free table
    (``nn.Embedding(n, G * embed_dim)``, N(0, 1)). ``feature_scale`` and ``target_init`` as in
    :class:`~lightning_pfl.models.HyperNetwork`, over the features of every client's rows (each
    head over those of the row it reads).
    """

    def __init__(
        self,
        num_clients: int,
        target_shapes: Mapping[str, tuple[int, ...]],
        groups: Sequence[int],
        embed_dim: int,
        hidden_dim: int,
        n_hidden: int,
        spectral_norm: bool,
        target_init: Mapping[str, Tensor] | None,
        feature_scale: bool = False,
        n_embeds: int | None = None,
        coefficient_std: float = 0.002,
    ) -> None:
        super().__init__()
        self.target_shapes = {name: tuple(shape) for name, shape in target_shapes.items()}
        self.groups = list(groups)
        self.embed_dim = embed_dim
        self.spectral_norm = spectral_norm
        rows = max(self.groups) + 1
        self.embeddings: nn.Module = (
            nn.Embedding(num_clients, rows * embed_dim)
            if n_embeds is None
            else MixedEmbedding(
                nn.Embedding(n_embeds, embed_dim), num_clients, coefficient_std, rows
            )
        )
        layers: list[nn.Module] = [self.linear(embed_dim, hidden_dim)]
        for _ in range(n_hidden):
            layers += [nn.ReLU(), self.linear(hidden_dim, hidden_dim)]
        self.mlp = nn.Sequential(*layers)
        self.feature_scale = FeatureScale()
        clients = torch.arange(num_clients)
        if feature_scale:
            with torch.no_grad():
                self.feature_scale.calibrate(self.mlp(self.inputs(clients)).flatten(0, 1))
        self.heads = nn.ModuleList(
            self.linear(hidden_dim, math.prod(shape)) for shape in self.target_shapes.values()
        )
        if target_init is not None and not spectral_norm:
            with torch.no_grad():
                features = self.features(clients)
            for name, group, head in zip(self.target_shapes, self.groups, self.heads, strict=True):
                match_target_init([head], features[:, group], [target_init[name]])

    def linear(self, i: int, o: int) -> nn.Module:
        """A Linear(i, o) layer, spectrally normalized with ``spectral_norm``."""
        layer = nn.Linear(i, o)
        return add_spectral_norm(layer) if self.spectral_norm else layer

    def inputs(self, clients: Tensor) -> Tensor:
        """The input rows v_i of ``clients`` ``[C]``: ``[C, G, embed_dim]``."""
        return self.embeddings(clients).view(len(clients), -1, self.embed_dim)

    def features(self, clients: Tensor) -> Tensor:
        """f(v_i^g) of every row g: ``[C, G, hidden_dim]`` (scaled with ``feature_scale``)."""
        return self.feature_scale(self.mlp(self.inputs(clients)))

    def forward(self, clients: Tensor) -> dict[str, Tensor]:
        """Every target tensor of ``clients`` stacked ``[C, *shape]``, float32 (the clients'
        master weights, also under autocast)."""
        features = self.features(clients)
        return {
            name: head(features[:, group]).float().view(len(clients), *shape)
            for (name, shape), group, head in zip(
                self.target_shapes.items(), self.groups, self.heads, strict=True
            )
        }

    def embedding_parameters(self) -> list[nn.Parameter]:
        return list(self.embeddings.parameters())

    def personal_parameters(self) -> list[nn.Parameter]:
        return without_bases(self, self.embedding_parameters())


class PFedLHN(PFedHN):
    """pFedHN whose hypernetwork is split into layer-wise modules.

    theta_i = {h_k(v_i^k; phi)}_k: by default (``layer_modules: shared_body``, the public code's
    ``CNNHyper``) one body f shared by every target tensor and one head per tensor,
    theta_i^k = W_k f(c_i^k E) + b_k, each tensor k reading its own coefficient row c_i^k;
    ``layer_modules: per_layer`` gives each target layer l its own small hypernetwork
    h_l(v_i^l; phi_l) that generates exactly that layer's weights. The round is pFedHN's:
    clients train theta_i for K local steps and upload delta_i = theta_i - theta~_i; the server
    sets grad(phi, v) = (1/C) sum_i (d theta_i / d(phi, v))^T delta_i, the gradient of the
    surrogate (1/C) sum_i <theta_i(phi, v), delta_i>, and steps its optimizer.

    Args:
        layer_modules: ``shared_body`` (default): one body (Linear(``embed_dim``,
            ``hidden_dim``) and ``n_hidden`` more layers) shared by every generated tensor, the
            per-tensor heads being each layer's only weights of its own (the public code
            tianyuzeke/pFedLHN, not confirmed as the authors', ``models.py`` l. 24-60: its
            ``fc1`` feeds every head; :class:`SharedBodyHyperNetwork`); ``per_layer``: one
            pFedHN hypernetwork (body and heads) per target layer, a layer being an
            ``nn.Module`` owning parameters (:class:`LayerwiseHyperNetwork`; the default before).
        coefficients: the granularity of the client input rows c_i^k (v_i^k without
            ``n_embeds``): ``per_tensor`` (default: one row per generated tensor, weight and
            bias apart, the code's ``--layer-wise`` True, ``models.py`` l. 43-60) or
            ``per_layer`` (one row per layer module, read by its weight and bias; the default
            before). ``per_tensor`` needs ``layer_modules: shared_body``; unused with
            ``shared_embedding``.
        hidden_dim: width of the body (default 128: the public code's ``--hdim`` 128,
            ``utils.py`` l. 32, the width of its ``fc1`` in ``models.py`` l. 24; the README's
            commands keep it; pFedHN's 100 before).
        n_hidden: hidden layers of the body after the first (default 0: the public code's
            ``CNNHyper`` maps the embedding through one ``Linear(embed_dim, hdim)`` and no
            activation straight into the heads, ``models.py`` l. 24 and 51-60; its
            ``--n-hidden`` 3, ``utils.py`` l. 46, is never read; 1 before).
        embed_dim: client embedding size E (default 40: the code's ``--embed-dim``,
            ``utils.py`` l. 19, which the README's commands keep; None: pFedHN's
            floor(1 + n / 4), as before).
        shared_embedding: one client input row v_i read by every tensor (True, the code's
            ``--layer-wise False``), or one per ``coefficients`` granularity (default False:
            the code's ``--layer-wise`` True, ``utils.py`` l. 30, ``models.py`` l. 43-44; True
            was the default before).
        n_embeds: M, the number of basis embeddings E shared by all clients and rows; v_i^k =
            c_i^k E (:class:`MixedEmbedding`). Default 5: the code's ``--n-embeds``
            (``utils.py`` l. 18), which the README's commands keep. None: free input rows per
            client (pFedHN's table; the default before).
        coefficient_std: standard deviation of the initial coefficients c_i^k (default 0.002:
            the code's ``--norm-var``, ``utils.py`` l. 17, which ``models.py`` l. 43 passes to
            ``torch.normal`` as the standard deviation); unused without ``n_embeds``.
        hn_optimizer: the server optimizer of (phi, v). Default ``adamw``: the public code's
            (tianyuzeke/pFedLHN, not confirmed as the authors') README runs every experiment
            with ``--optim adamw --lr 3e-4`` (PyTorch's AdamW, betas 0.9 / 0.999); ``sgd`` with
            ``hn_lr`` 1e-2, ``hn_momentum`` 0.9, ``hn_weight_decay`` 1e-3 is the code's
            argparse default and pFedHN's optimizer; ``adam`` as in pFedHN.
        hn_lr: server learning rate (the README's 3e-4).
        hn_weight_decay: server weight decay (default 1e-2: AdamW's own, which the code's
            AdamW keeps; its SGD: 1e-3).
        hn_max_grad_norm: clip of the hypernetwork gradient norm (the code's ``--grad-clip``
            30, applied with every optimizer; pFedHN's 50).
        **kwargs: see :class:`~lightning_pfl.methods.pfedhn.PFedHN` (``embed_lr``,
            ``hn_momentum`` and the inner loop).
    """

    honours_conditions = True

    def __init__(
        self,
        layer_modules: Literal["shared_body", "per_layer"] = "shared_body",
        coefficients: Literal["per_tensor", "per_layer"] = "per_tensor",
        hidden_dim: PositiveInt = 128,
        n_hidden: NonNegativeInt = 0,
        embed_dim: PositiveInt | None = 40,
        shared_embedding: bool = False,
        n_embeds: PositiveInt | None = 5,
        coefficient_std: PositiveFloat = 0.002,
        hn_optimizer: Literal["sgd", "adam", "adamw"] = "adamw",
        hn_lr: PositiveFloat = 3e-4,
        hn_weight_decay: NonNegativeFloat = 1e-2,
        hn_max_grad_norm: PositiveFloat | None = 30.0,
        **kwargs: Any,
    ) -> None:
        if layer_modules == "per_layer" and coefficients == "per_tensor" and not shared_embedding:
            raise ConfigError(
                "model.init_args.coefficients: per_tensor gives every generated tensor its own "
                "input row, which needs one body for all of them (layer_modules: shared_body); "
                "with layer_modules: per_layer set coefficients: per_layer (one row per layer "
                "module)."
            )
        super().__init__(
            hidden_dim=hidden_dim,
            n_hidden=n_hidden,
            embed_dim=embed_dim,
            hn_optimizer=hn_optimizer,
            hn_lr=hn_lr,
            hn_weight_decay=hn_weight_decay,
            hn_max_grad_norm=hn_max_grad_norm,
            **kwargs,
        )

    def build_hypernetwork(self) -> SharedBodyHyperNetwork | LayerwiseHyperNetwork:
        h = self.hp
        n = h.num_clients
        shapes = self.generated_shapes()
        if h.layer_modules == "shared_body":
            layer_of = {t: i for i, ts in enumerate(layers_of(shapes).values()) for t in ts}
            groups = [
                0 if h.shared_embedding else k if h.coefficients == "per_tensor" else layer_of[t]
                for k, t in enumerate(shapes)
            ]
            return SharedBodyHyperNetwork(
                n,
                shapes,
                groups,
                h.embed_dim or int(1 + n / 4),
                h.hidden_dim,
                h.n_hidden,
                h.spectral_norm,
                self.head_target_init(),
                h.hn_feature_scale,
                h.n_embeds,
                h.coefficient_std,
            )
        return LayerwiseHyperNetwork(
            n,
            shapes,
            h.embed_dim or int(1 + n / 4),
            h.hidden_dim,
            h.n_hidden,
            h.spectral_norm,
            self.head_target_init(),
            h.shared_embedding,
            h.hn_feature_scale,
            h.n_embeds,
            h.coefficient_std,
        )
