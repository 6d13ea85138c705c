"""Target networks and hypernetworks, with a registry of target networks by name."""

from lightning_pfl.models.hypernetwork import HyperNetwork
from lightning_pfl.models.targets import NETWORKS, CNNTarget, DigitsCNN, MLPTarget, build_network

__all__ = ["NETWORKS", "CNNTarget", "DigitsCNN", "HyperNetwork", "MLPTarget", "build_network"]
