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


class LayerwiseHyperNetwork(BaseHyperNetwork):
    """h_l(v_i; phi_l) for every layer l of the target: one small pFedHN hypernetwork per layer.

    Each layer's HN is a :class:`~lightning_pfl.models.HyperNetwork` (MLP and one head per
    tensor of that layer) that generates that layer's tensors only. With ``shared_embedding``
    the layer HNs read one client embedding table v (the parameter sharing across layer
    modules); otherwise each layer has its own embeddings v_i^l. ``target_init`` and
    ``feature_scale`` as in :class:`~lightning_pfl.models.HyperNetwork` (PFedLHN passes pFedHN's
    ``hn_head_init`` and ``hn_feature_scale``).
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
        if shared_embedding:  # every layer reads the first layer's embedding table
            shared = self.layer(self.layer_names[0]).embeddings
            for name in self.layer_names[1:]:
                self.layer(name).embeddings = shared

    def layer(self, name: str) -> HyperNetwork:
        """The hypernetwork of layer ``name`` (a module name of the target)."""
        module = self.layers[self.layer_names.index(name)]
        assert isinstance(module, HyperNetwork)
        return module

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
            per layer.
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
        shared_embedding: bool = True,
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
            hn_optimizer=hn_optimizer,  # type: ignore[arg-type]
            hn_lr=hn_lr,
            hn_weight_decay=hn_weight_decay,
            hn_max_grad_norm=hn_max_grad_norm,
            **kwargs,
        )

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        if h.hn_optimizer != "adamw":
            return super().configure_server_optimizer()
        groups = [
            {"params": self.hnet.body_parameters()},
            {"params": self.hnet.embedding_parameters(), "lr": h.embed_lr or h.hn_lr},
        ]
        return torch.optim.AdamW(groups, lr=h.hn_lr, weight_decay=h.hn_weight_decay)

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
        )
