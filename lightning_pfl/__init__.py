"""lightning-pfl: personalized federated learning on PyTorch Lightning."""

from lightning_pfl.callbacks import GradientInversion, NovelClients, RoundCheckpoint
from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.methods import (
    FedAvg,
    FederatedMethod,
    FedSimSup,
    Local,
    PFedHN,
    PFedHNPC,
    PFedKT,
)
from lightning_pfl.partition import IID, ClassesPerClient, Dirichlet, Pachinko, Partitioner, Shards

__version__ = "0.1.0"

__all__ = [
    "IID",
    "ClassesPerClient",
    "Dirichlet",
    "FedAvg",
    "FederatedDataModule",
    "FederatedMethod",
    "FedSimSup",
    "GradientInversion",
    "Local",
    "NovelClients",
    "PFedHN",
    "PFedHNPC",
    "PFedKT",
    "Pachinko",
    "Partitioner",
    "RoundCheckpoint",
    "Shards",
]
