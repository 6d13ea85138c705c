"""Federated methods, each a LightningModule whose training step is one round."""

from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedsimsup import FedSimSup
from lightning_pfl.methods.local import Local
from lightning_pfl.methods.pfedhn import PFedHN
from lightning_pfl.methods.pfedhn_pc import PFedHNPC
from lightning_pfl.methods.pfedkt import PFedKT

__all__ = ["FedAvg", "FedSimSup", "FederatedMethod", "Local", "PFedHN", "PFedHNPC", "PFedKT"]
