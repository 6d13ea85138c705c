"""Vanilla Personalized-T (Li et al., FedTP paper): each client keeps its own attention."""

from __future__ import annotations

from typing import Any

from lightning import Callback

from lightning_pfl.attention_maps import AttentionMaps
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.models.transformers import qkv_names
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)


class VanillaPersonalizedT(FedAvg):
    """FedAvg of a transformer in which every client keeps its own qkv projections.

    The baseline FedTP improves on: the self-attention (each block's bias-free qkv projection)
    is trained locally and never uploaded; every other tensor is FedAvg'd (sample-weighted).
    Use it with ``net: vit`` or ``net: char_transformer``.

    Args:
        picture_clients: at every validation, log to TensorBoard the attention-rollout maps of
            4 test images of each of the first ``picture_clients`` clients (``vit`` only; as
            FedTP, see :class:`~lightning_pfl.attention_maps.AttentionMaps`; 0: off).
        local_lr, local_momentum, local_weight_decay, local_epochs, local_max_grad_norm:
            client SGD as FedTP's (its paper's) experimental setup: eta 0.01, momentum 0.9 and
            weight decay 1e-5 (reference code), E = 5 local epochs, no clipping.
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(
        self,
        picture_clients: NonNegativeInt = 4,
        local_lr: PositiveFloat = 1e-2,
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 1e-5,
        local_epochs: PositiveInt | None = 5,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_epochs=local_epochs,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )

    def personal_names(self) -> tuple[str, ...]:
        names = qkv_names(tuple(self.arch.shapes))
        if not names:
            raise ConfigError(
                f"model.init_args.net '{self.hp.net}' has no attention qkv projections; "
                "VanillaPersonalizedT needs a transformer: vit or char_transformer."
            )
        return names

    def configure_callbacks(self) -> list[Callback]:
        return [AttentionMaps(self.hp.picture_clients)] if self.hp.picture_clients else []
