"""TensorBoard pictures of ViT methods: attention-rollout maps and FedTP's client embeddings.

:class:`AttentionMaps` logs, at every validation, 4 test images of each of the first clients
with the attention rollout of that client's personalized model over them; FedTP and Vanilla
Personalized-T add it themselves (``picture_clients``), any other method with ``net: vit``
(Local-T, FedAvg-T, ...) gets it under ``trainer.callbacks``. FedTP's also draws the PCA
projection of its hypernetwork's client embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from lightning import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from lightning_pfl.errors import ConfigError
from lightning_pfl.models import build_network
from lightning_pfl.models.transformers import ViT
from lightning_pfl.validation import NonNegativeInt

if TYPE_CHECKING:  # the methods import this module
    from lightning_pfl.methods.base import FederatedMethod


@torch.no_grad()
def attention_pictures(method: FederatedMethod, clients: Tensor, images: int = 4) -> Tensor:
    """Test images of ``clients`` over their attention rollout (``[C, images, 3, H, W]``).

    Works for any method whose ``net`` is a :class:`ViT` (FedTP, Vanilla Personalized-T,
    Local-T, FedAvg-T, ...): the map (max over heads, lowest 30% dropped, see
    ``ViT.attention_rollout``) of each client's personalized model
    (``method.personalized_params``) is upsampled to the image and shown in red over it.
    """
    data = method.data
    params = method.personalized_params(clients)
    index, _ = next(data.eval_blocks(clients, "test", images))
    x, _ = data.fetch(index)
    h = method.hp
    net = build_network(h.net, tuple(h.input_shape), h.num_classes, **(h.net_args or {}))
    if not isinstance(net, ViT):
        raise ConfigError(f"attention maps need model.init_args.net: vit, got '{method.hp.net}'.")
    net = net.to(method.device).eval()
    pictures = []
    for c in range(len(clients)):
        net.load_state_dict({n: t[c] for n, t in params.items()}, strict=False)
        mask = net.attention_rollout(x[c])[:, None]  # [b, 1, h, w]
        mask = F.interpolate(mask, size=x.shape[-2:], mode="nearest")
        shape = (1, -1, 1, 1)
        image = x[c] * data.std.view(shape) + data.mean.view(shape) if len(data.mean) else x[c]
        gray = image.clamp(0, 1).mean(1, keepdim=True)
        red = torch.cat([mask, torch.zeros_like(mask), torch.zeros_like(mask)], 1)
        pictures.append(0.5 * gray.expand(-1, 3, -1, -1) + 0.5 * red)
    return torch.stack(pictures)


def log_attention_maps(method: FederatedMethod, count: int) -> bool:
    """Log the attention-rollout pictures of the first ``count`` clients to TensorBoard.

    Tags ``attention_rollout/client_<c>`` (4 test images each, see :func:`attention_pictures`),
    at the current round. Returns whether anything could be logged: False during the sanity
    check, off rank 0, without a TensorBoard logger or with ``count`` 0; the pictures
    themselves need a ``vit`` (other nets log nothing).
    """
    count = min(count, method.hp.num_clients)
    logger = method.logger
    trainer = method.trainer
    if trainer.sanity_checking or not count or not isinstance(logger, TensorBoardLogger):
        return False
    if not trainer.is_global_zero:
        return False
    if method.hp.net == "vit":
        pictures = attention_pictures(method, torch.arange(count, device=method.device))
        for c, grid in enumerate(pictures.cpu()):
            logger.experiment.add_images(f"attention_rollout/client_{c}", grid, method.global_step)
    return True


@torch.no_grad()
def embedding_projection(embeddings: Tensor) -> Tensor:
    """Client embeddings ``[n, d]`` projected on their first two principal axes ``[n, 2]``."""
    v = embeddings.detach().float()
    centered = v - v.mean(0)
    axes = torch.linalg.svd(centered, full_matrices=False).Vh[:2]
    return centered @ axes.T


def embedding_figure(points: Tensor) -> Any:
    """A scatter plot of 2-D client embeddings, each point labelled with its client id."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(5, 5))
    axes.scatter(points[:, 0].numpy(), points[:, 1].numpy(), s=12)
    if len(points) <= 100:
        for i, (a, b) in enumerate(points.tolist()):
            axes.annotate(str(i), (a, b), fontsize=7)
    axes.set_xlabel("principal axis 1")
    axes.set_ylabel("principal axis 2")
    axes.set_title("FedTP client embeddings (PCA)")
    return figure


class AttentionMaps(Callback):
    """Attention-rollout maps of any ViT method's personalized models, at every validation.

    FedTP and Vanilla Personalized-T add it themselves (``picture_clients``); this callback
    gives the same pictures for the other "-T" methods of the FedTP paper (Local-T, FedAvg-T,
    ...: any method with ``net: vit``). Add it under ``trainer.callbacks``.

    Args:
        clients: the first ``clients`` clients are pictured (4 test images each).
        embeddings: the client embeddings ``[n, d]`` whose PCA projection is also logged as
            ``fedtp/client_embeddings_pca`` (FedTP passes its hypernetwork's; None: none).
    """

    def __init__(
        self, clients: NonNegativeInt = 4, embeddings: Callable[[], Tensor] | None = None
    ) -> None:
        self.clients = clients
        self.embeddings = embeddings

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from lightning_pfl.methods.base import FederatedMethod

        if not isinstance(pl_module, FederatedMethod):
            raise ConfigError("AttentionMaps needs a federated method (model.class_path).")
        if not log_attention_maps(pl_module, self.clients) or self.embeddings is None:
            return
        logger = pl_module.logger
        assert isinstance(logger, TensorBoardLogger)
        points = embedding_projection(self.embeddings()).cpu()
        figure = embedding_figure(points)
        logger.experiment.add_figure("fedtp/client_embeddings_pca", figure, pl_module.global_step)
