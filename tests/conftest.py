import os
from typing import Any

# One intra-op thread, with or without pytest-xdist (`make test` runs a worker per core): the
# tests compare runs bit for bit, and CPU kernels round differently with other thread counts
# (MH-pFedHN's job on the threaded loop did, with two); subprocess runs inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from lightning import Trainer

from lightning_pfl import FederatedDataModule
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.partition import ClassesPerClient
from lightning_pfl.validation import argument_default


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)


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
    if kwargs.get("local_epochs", argument_default(cls, "local_epochs")) is not None:
        del defaults["local_steps"]  # epochs set the local work: a default step count is unused
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
        accelerator=trainer_kwargs.pop("accelerator", "cpu"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(method, datamodule=dm)
    return trainer


@pytest.fixture
def fake_data_root(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> str:
    """Tiny MNIST, FashionMNIST, EMNIST, CIFAR and Tiny-ImageNet files, torchvision's md5s
    patched to them."""
    import torchvision.datasets as tvd

    from tests.data.fake_datasets import (
        mnist_resources,
        write_cifar,
        write_mnist,
        write_tiny_imagenet,
    )

    root = tmp_path_factory.mktemp("datasets")
    write_mnist(root)
    fashion = write_mnist(root, "FashionMNIST", gz=True)
    monkeypatch.setattr(tvd.FashionMNIST, "resources", mnist_resources(fashion))
    write_mnist(root, "EMNIST", num_classes=62, prefix="emnist-byclass-")
    write_tiny_imagenet(root, per_class=8)
    for cls, hundred in ((tvd.CIFAR10, False), (tvd.CIFAR100, True)):
        md5 = write_cifar(root, hundred=hundred)
        monkeypatch.setattr(cls, "train_list", [[f, md5[f]] for f, _ in cls.train_list])
        monkeypatch.setattr(cls, "test_list", [[f, md5[f]] for f, _ in cls.test_list])
        monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5[cls.meta["filename"]]})
    return str(root)
