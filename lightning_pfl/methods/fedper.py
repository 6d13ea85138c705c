"""FedPer (Arivazhagan et al., 2019): shared base layers, personalization layers per client."""

from __future__ import annotations

from typing import Any

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.lg_fedavg import weighted_layers
from lightning_pfl.validation import PositiveInt


class FedPer(FedAvg):
    """FedAvg with personalization layers: each client keeps the top K_P layers of the network.

    Round: the server sends the base layers (every tensor but the personalization layers); the
    client joins them with its own personalization layers, trains the whole model jointly for
    the local steps (or epochs), keeps the trained personalization layers and uploads the base;
    the server averages the bases (sample-weighted). The personalization layers never leave
    the client, so the server's copy of them stays at the initialization. Personalized model:
    the global base with the client's personalization layers.

    The personalization layers are the last K_P layers with weights (linear / convolution,
    counted as LG-FedAvg's ``global_layers``: :func:`~lightning_pfl.methods.lg_fedavg.
    weighted_layers`) with every tensor the network registers after the first of them (the
    batch norms that follow them); K_P = 1 is the classifier alone (``Architecture.
    head_names`` on every registered network).

    Args:
        personal_layers: K_P, the number of personalization layers, at most the network's
            layers with weights minus one (the base must keep a layer). Default 2: the
            paper's CIFAR-10 experiments (a CNN on clients with a few classes each, the closest
            to our digits and FashionMNIST benchmarks) keep the last two layers of MobileNet-v1
            and of ResNet-34 (their final block and the classifier), and its FLICKR-AES
            experiments also keep two; Figure 4 varies K_P over 1-4. Source: the Flower
            baseline that reproduces Figures 2, 4, 7 and 8 (``adap/flower``,
            ``baselines/fedper``: ``num_head_layers: 2``); the paper's text was not in our
            sources. Here: the last hidden layer and the classifier (``fc1``, ``fc2`` of
            ``digits_cnn``; ``fc2``, ``fc3`` of ``cnn``); ``mlp`` (two layers) needs 1.
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(self, personal_layers: PositiveInt = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def personal_names(self) -> tuple[str, ...]:
        layers = weighted_layers(self.arch)
        k = self.hp.personal_layers
        if k >= len(layers):
            raise ConfigError(
                f"model.init_args.personal_layers = {k}: the network "
                f"({self.hp.net}) has {len(layers)} layers with weights ({', '.join(layers)}) "
                f"and FedPer shares at least one of them as its base; use 1..{len(layers) - 1}."
            )
        modules = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in self.arch.shapes))
        personal = set(modules[modules.index(layers[-k]) :])
        names = (*self.arch.shapes, *self.arch.buffer_shapes)
        return tuple(n for n in names if n.rsplit(".", 1)[0] in personal)
