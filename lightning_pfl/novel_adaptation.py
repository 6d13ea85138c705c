"""What a held-out novel client adapts after training (pFedHN section 5.3's protocol).

A method says it in :meth:`~NovelAdaptationHooks.novel_adaptation`, returning a
:class:`NovelAdaptation`; the :class:`~lightning_pfl.novel.NovelClients` callback runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning import LightningModule
from torch import Tensor
from torch.func import vmap

from lightning_pfl.engine import Params, weighted_cross_entropy
from lightning_pfl.errors import ConfigError

if TYPE_CHECKING:
    from lightning_pfl.datamodule import FederatedDataModule

# The methods whose novel_adaptation adapts a new client (named in the callback's refusals).
ADAPTS_NOVEL_CLIENTS = (
    "PFedHN, PFedHNPC, MHPFedHN, MHPFedHNG, MHPFedHNGD, FedAvg, FedPer, LGFedAvg, PerFedAvg or "
    "Local"
)


@dataclass
class NovelAdaptation:
    """What held-out novel clients adapt after training (returned by
    :meth:`NovelAdaptationHooks.novel_adaptation`, run by
    :class:`~lightning_pfl.novel.NovelClients`).

    Attributes:
        tensors: the method's own tensors that plain SGD updates in place (whole tensors, e.g.
            the embedding table: the gradient of ``loss`` is zero outside the novel clients'
            parts, so only those change). They need not require grad: the callback switches
            it on while it differentiates.
        loss: ``loss(index, weight)``: the sum over the novel clients of their mean training
            loss on one batch each (sample indices and 0/1 weights ``[m, B]``, rows in the
            order of the clients), differentiable w.r.t. ``tensors``.
        buffers: tensors ``loss`` updates in place (e.g. the novel clients' batch-norm running
            statistics); restored with ``tensors`` when the callback undoes the adaptation.
        params: the novel clients' personalized models (stacked ``[m, ...]``) when they are
            not what :meth:`~lightning_pfl.methods.base.FederatedMethod.personalized_params`
            returns (a baseline that fine-tunes its own copies of the global model); None:
            that method.
    """

    tensors: list[Tensor]
    loss: Callable[[Tensor, Tensor], Tensor]
    buffers: list[Tensor] = field(default_factory=list)
    params: Callable[[], Params] | None = None


class NovelAdaptationHooks(LightningModule):
    """The novel-client hooks of :class:`~lightning_pfl.methods.base.FederatedMethod` (a base
    class of it): a method overrides :meth:`novel_adaptation` to adapt a new client."""

    if TYPE_CHECKING:  # FederatedMethod's

        @property
        def data(self) -> FederatedDataModule: ...

        def predict(self, params: Params, x: Tensor) -> Tensor: ...

    def novel_adaptation(self, clients: Tensor) -> NovelAdaptation:
        """What the held-out novel ``clients`` adapt after training, and on which loss
        (pFedHN section 5.3's protocol). A method that keeps this default cannot adapt a new
        client, and the callback is refused."""
        raise ConfigError(
            f"trainer.callbacks NovelClients: {type(self).__name__} does not say how a new "
            f"client adapts, so novel clients cannot be evaluated; use {ADAPTS_NOVEL_CLIENTS}, "
            "or remove the callback."
        )

    def novel_loss(self, params: Callable[[], Params]) -> Callable[[Tensor, Tensor], Tensor]:
        """A :class:`NovelAdaptation` loss: the sum over the novel clients of the mean
        cross-entropy of :meth:`predict` with ``params()`` (their models, stacked in the order
        of the batch's rows)."""

        def loss(index: Tensor, weight: Tensor) -> Tensor:
            x, y = self.data.fetch(index)
            logits = vmap(self.predict)(params(), x)
            return vmap(weighted_cross_entropy)(logits, y, weight).sum()

        return loss
