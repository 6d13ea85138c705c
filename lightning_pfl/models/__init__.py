"""Target networks and hypernetworks, with a registry of target networks by name."""

from lightning_pfl.models.hypernetwork import HyperNetwork
from lightning_pfl.models.targets import (
    NETWORKS,
    CNNTarget,
    DigitsCNN,
    LeNet5,
    MLPTarget,
    SmallCNN,
    SmallTransformer,
    build_network,
)

__all__ = [
    "NETWORKS",
    "CNNTarget",
    "DigitsCNN",
    "HyperNetwork",
    "LeNet5",
    "MLPTarget",
    "SmallCNN",
    "SmallTransformer",
    "build_network",
]
