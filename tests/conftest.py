from typing import Any

import pytest
import torch
from lightning import Trainer

from lightning_pfl import FederatedDataModule
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.partition import ClassesPerClient


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.use_deterministic_algorithms(True)


def digits_data(num_clients: int = 6, **kwargs: Any) -> FederatedDataModule:
    kwargs.setdefault("partition", ClassesPerClient(2))
    dm = FederatedDataModule("digits", num_clients=num_clients, **kwargs)
    dm.setup("fit")
    return dm


def build(cls: type[FederatedMethod], dm: FederatedDataModule, **kwargs: Any) -> FederatedMethod:
    defaults: dict[str, Any] = {
        "net": "digits_cnn",
        "local_steps": 3,
        "batch_size": 8,
        "local_lr": 0.05,
    }
    method = cls(
        num_clients=dm.num_clients,
        num_classes=dm.num_classes,
        input_shape=dm.input_shape,
        **{**defaults, **kwargs},
    )
    method.attach_data(dm)
    return method


def fit(
    method: FederatedMethod, dm: FederatedDataModule, rounds: int, **trainer_kwargs: Any
) -> Trainer:
    trainer = Trainer(
        max_steps=rounds,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(method, datamodule=dm)
    return trainer
