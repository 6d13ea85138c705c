"""Federated methods, each a LightningModule whose training step is one round.

Every module of this package is imported, so a config can name any method by its short class
name (``class_path: FedAvg``).
"""

import importlib
import inspect
import pkgutil

from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedsimsup import FedSimSup
from lightning_pfl.methods.local import Local
from lightning_pfl.methods.pfedhn import PFedHN
from lightning_pfl.methods.pfedhn_pc import PFedHNPC
from lightning_pfl.methods.pfedkt import PFedKT

__all__ = ["FedAvg", "FedSimSup", "FederatedMethod", "Local", "PFedHN", "PFedHNPC", "PFedKT"]

for _module in pkgutil.iter_modules(__path__):
    _loaded = importlib.import_module(f"{__name__}.{_module.name}")
    for _name, _cls in inspect.getmembers(_loaded, inspect.isclass):
        if issubclass(_cls, FederatedMethod) and _cls.__module__ == _loaded.__name__:
            globals()[_name] = _cls
            if _name not in __all__:
                __all__.append(_name)


def method_classes() -> dict[str, type[FederatedMethod]]:
    """Every method class of the package by its short name (abstract ones included)."""
    return {name: globals()[name] for name in __all__}
