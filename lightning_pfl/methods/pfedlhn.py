"""pFedLHN (Zhu et al., Neural Processing Letters 2023): one hypernetwork per target layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_pfl.methods.pfedhn import PFedHN
from lightning_pfl.models import HyperNetwork
from lightning_pfl.models.hypernetwork import BaseHyperNetwork
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
    v_i; ``num_embeddings``), so a :class:`~lightning_pfl.models.HyperNetwork` can use it.
    """

    def __init__(self, basis: nn.Embedding, num_clients: int, std: float) -> None:
        super().__init__()
        self.basis = basis
        self.coefficients = nn.Parameter(torch.randn(num_clients, basis.num_embeddings) * std)

    @property
    def weight(self) -> Tensor:
        return self.coefficients @ self.basis.weight

    @property
    def num_embeddings(self) -> int:
        return len(self.coefficients)

    def forward(self, clients: Tensor) -> Tensor:
        return self.coefficients[clients] @ self.basis.weight


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


class PFedLHN(PFedHN):
    """pFedHN whose hypernetwork is split into layer-wise modules.

    theta_i = {h_l(v_i; phi_l)}_l: a small hypernetwork per target layer l generates exactly
    that layer's weights, so each module specializes in one layer's role. The round is
    pFedHN's: clients train theta_i for K local steps and upload delta_i = theta_i - theta~_i;
    the server sets grad(phi, v) = (1/C) sum_i (d theta_i / d(phi, v))^T delta_i, the gradient
    of the surrogate (1/C) sum_i <theta_i(phi, v), delta_i>, and steps its optimizer.

    Args:
        hidden_dim: width of every layer hypernetwork (default 128: the public code's
            (tianyuzeke/pFedLHN, not confirmed as the authors') ``--hdim`` 128, ``utils.py``
            l. 32, the width of its ``fc1`` in ``models.py`` l. 24; the README's commands keep it;
            pFedHN's 100 before).
        n_hidden: hidden layers of every layer hypernetwork after the first (default 0: the
            public code's ``CNNHyper`` maps the embedding through one ``Linear(embed_dim,
            hdim)`` and no activation straight into the heads, ``models.py`` l. 24 and 51-60;
            its ``--n-hidden`` 3, ``utils.py`` l. 46, is never read; 1 before).
        embed_dim: client embedding size E (default 40: the code's ``--embed-dim``,
            ``utils.py`` l. 19, which the README's commands keep; None: pFedHN's
            floor(1 + n / 4), as before).
        shared_embedding: one client embedding v_i read by all layer modules (True), or one
            per layer v_i^l (default False: with ``n_embeds`` the public code gives every
            generated tensor its own coefficients c_i^k, its ``--layer-wise`` True, ``utils.py``
            l. 30, ``models.py`` l. 43-44; True was the default before).
        n_embeds: M, the number of basis embeddings E shared by all clients and layers; v_i^l =
            c_i^l E (:class:`MixedEmbedding`). Default 5: the code's ``--n-embeds``
            (``utils.py`` l. 18), which the README's commands keep. None: one free embedding per
            client (pFedHN's table; the default before).
        coefficient_std: standard deviation of the initial coefficients c_i^l (default 0.002:
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

    def build_hypernetwork(self) -> LayerwiseHyperNetwork:
        h = self.hp
        n = h.num_clients
        return LayerwiseHyperNetwork(
            n,
            self.generated_shapes(),
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
