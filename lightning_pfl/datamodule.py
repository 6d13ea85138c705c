"""The federated DataModule: a dataset split into clients, held on the device as tensors.

Which samples each client holds is decided in :mod:`lightning_pfl.client_split`; the clients'
index and batch sampling are :mod:`lightning_pfl.client_index`, the evaluation blocks
:mod:`lightning_pfl.eval_blocks`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import numpy as np
import torch
from jsonargparse import lazy_instance
from lightning import LightningDataModule
from torch import Tensor

from lightning_pfl.client_index import ClientIndex, draw_batches
from lightning_pfl.client_split import check_splits, split_clients
from lightning_pfl.datasets import dataset_spec, load_dataset
from lightning_pfl.engine import ClientBatches
from lightning_pfl.errors import ConfigError
from lightning_pfl.eval_blocks import ClientsBySize, eval_blocks, ragged_eval_blocks
from lightning_pfl.partition import ClassesPerClient, IndexLists, Partitioner, count_matrix
from lightning_pfl.validation import (
    NonNegativeFloat,
    OpenUnitInterval,
    PositiveInt,
    Range,
    Seed,
    check_arguments,
)

Split = Literal["train", "val", "test"]


class RoundIndices:
    """The training "dataloader": yields round indices from the trainer's current round on.

    One item is one federated round; it never ends (``trainer.max_steps`` is the number of
    rounds) and restarts at the resumed round after a checkpoint is loaded.
    """

    def __init__(self, datamodule: FederatedDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[int]:
        trainer = self.datamodule.trainer
        round_idx = trainer.global_step if trainer is not None else 0
        while True:
            yield round_idx
            round_idx += 1


class ClientChunks:
    """An evaluation "dataloader": chunks of client ids (one Lightning batch each)."""

    def __init__(self, chunks: list[Tensor]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.chunks)

    def __len__(self) -> int:
        return len(self.chunks)


class FederatedDataModule(LightningDataModule):
    """A dataset from the registry, split into ``num_clients`` clients.

    Args:
        dataset: registry name (digits, synthetic, mnist, fashion_mnist, emnist, cifar10,
            cifar100, tiny_imagenet).
        num_clients: number of clients n.
        partition: how training samples are dealt to clients (ignored for datasets with natural
            clients, e.g. synthetic).
        eval_split: ``matched``: validation and test sets are split with the same per-class
            shares as each client's training data (pFedHN, FedTP); ``holdout``: the official
            train and test sets are pooled, partitioned, and each client's own samples are split
            into train / val / test by ``val_fraction`` and ``test_fraction``.
        val_fraction: ``matched``: fraction of the training set held out for validation before
            partitioning, a uniformly random sample (not stratified by class; as the pFedHN
            code; pFedHN on CIFAR: 0.2 = 10,000 images); each client's validation set then
            takes its training class shares of it. ``holdout``: fraction of each client's
            samples. 0: no validation split (as FedTP); the test split is still evaluated
            every ``trainer.val_check_interval`` rounds, but no round is selected by
            validation.
        test_fraction: ``holdout`` only: fraction of each client's samples used for testing.
        root: folder holding the dataset files (torchvision layout).
        download: let torchvision download missing files.
        seed: seed of the split (the same seed gives the same clients for every method).
        dataset_options: extra loader options (synthetic: alpha, beta, dimension).
        eval_clients_per_batch: clients evaluated together in one validation/test step.
        noise_sigma: FedTP's noise-based feature imbalance (section IV-C), sigma_M: client i's
            images get Gaussian noise of standard deviation sigma_M * i / (n - 1) (in [0, 1]
            pixel units, before normalization), added on the fly whenever they are fetched.
            The noise of a sample is fixed: a seeded bank of ``NOISE_BANK`` standard normal
            images, sample j reading entry j mod ``NOISE_BANK``. 0 disables it.
    """

    NOISE_BANK = 4096

    def __init__(
        self,
        dataset: str = "digits",
        num_clients: PositiveInt = 10,
        partition: Partitioner = lazy_instance(ClassesPerClient, classes=2),  # noqa: B008
        eval_split: Literal["matched", "holdout"] = "matched",
        val_fraction: Annotated[float, Range(ge=0, lt=1)] = 0.1,
        test_fraction: OpenUnitInterval = 0.25,
        root: str = "data",
        download: bool = False,
        seed: Seed = 0,
        dataset_options: dict[str, Any] | None = None,
        eval_clients_per_batch: PositiveInt = 64,
        noise_sigma: NonNegativeFloat = 0.0,
    ) -> None:
        super().__init__()
        check_arguments(
            self,
            {
                "num_clients": num_clients,
                "val_fraction": val_fraction,
                "test_fraction": test_fraction,
                "seed": seed,
                "eval_clients_per_batch": eval_clients_per_batch,
                "noise_sigma": noise_sigma,
            },
            "data",
        )
        self.spec = dataset_spec(dataset)
        if self.spec.natural_clients and eval_split != "holdout":
            raise ConfigError(
                f"'{dataset}' has natural clients and no test set; set "
                "data.init_args.eval_split: holdout"
            )
        self.dataset = dataset
        self._num_clients = num_clients
        self.partition = partition
        self.eval_split = eval_split
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.root = root
        self.download = download
        self.seed = seed
        self.dataset_options = dataset_options or {}
        self.eval_clients_per_batch = eval_clients_per_batch
        self.noise_sigma = noise_sigma
        self.noise_std = torch.zeros(0)  # [pooled samples] std of each sample's noise
        self.noise_bank = torch.zeros(0)
        self.index: dict[str, ClientIndex] = {}
        self._parts: dict[str, IndexLists] = {}
        self.counts: dict[str, np.ndarray] = {}
        self.inputs = torch.zeros(0)
        self.labels = torch.zeros(0, dtype=torch.int64)
        self.mean = torch.zeros(0)
        self.std = torch.ones(0)

    @property
    def num_clients(self) -> int:
        return self._num_clients

    @property
    def num_classes(self) -> int:
        return self.spec.num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.spec.input_shape

    @property
    def device(self) -> torch.device:
        return self.inputs.device

    @property
    def has_validation(self) -> bool:
        """Whether the clients have a validation split (``val_fraction > 0``)."""
        return self.val_fraction > 0

    def describe(self) -> dict[str, Any]:
        """The settings that define the clients' data (for HParams and run records)."""
        return {
            "dataset": self.dataset,
            "num_clients": self.num_clients,
            "partition": type(self.partition).__name__,
            **{f"partition.{k}": v for k, v in vars(self.partition).items()},
            "eval_split": self.eval_split,
            "val_fraction": self.val_fraction,
            "test_fraction": self.test_fraction,
            "seed": self.seed,
            **{f"dataset_options.{k}": v for k, v in self.dataset_options.items()},
            **({"noise_sigma": self.noise_sigma} if self.noise_sigma else {}),
        }

    def setup(self, stage: str | None = None) -> None:
        """Load and split the data once; move it to the trainer's device when there is one."""
        if not self._parts:
            self._load_and_split()
        device = self.trainer.strategy.root_device if self.trainer else torch.device("cpu")
        if not self.index or self.device != device:
            self.to(device)

    def _load_and_split(self) -> None:
        arrays = load_dataset(
            self.dataset,
            self.root,
            self.download,
            num_clients=self.num_clients,
            seed=self.seed,
            **self.dataset_options,
        )
        rng = np.random.default_rng(self.seed)
        parts = split_clients(
            arrays,
            self.partition,
            self.num_clients,
            self.num_classes,
            self.eval_split,
            self.val_fraction,
            self.test_fraction,
            rng,
        )
        inputs = torch.cat([arrays.train_x, arrays.test_x])
        self.labels = torch.cat([arrays.train_y, arrays.test_y])
        self.counts = {
            s: count_matrix(self.labels.numpy(), p, self.num_classes) for s, p in parts.items()
        }
        check_splits(parts, self.val_fraction, self.dataset)
        self.mean, self.std = _channel_stats(
            inputs, torch.from_numpy(np.concatenate(parts["train"]))
        )
        self.inputs = inputs
        self._parts = parts
        if self.noise_sigma:
            self._make_noise(parts)

    def _make_noise(self, parts: dict[str, IndexLists]) -> None:
        """Per-sample noise std sigma_M * i / (n - 1) of client i's samples, and the bank."""
        if self.inputs.dtype != torch.uint8:
            raise ConfigError(
                f"data.init_args.noise_sigma adds noise to images; '{self.dataset}' has no images."
            )
        owner = torch.zeros(len(self.inputs))
        for split_parts in parts.values():
            for client, part in enumerate(split_parts):
                owner[torch.as_tensor(part, dtype=torch.int64)] = float(client)
        self.noise_std = self.noise_sigma * owner / max(self.num_clients - 1, 1)
        generator = torch.Generator().manual_seed(self.seed)
        self.noise_bank = torch.randn(self.NOISE_BANK, *self.inputs.shape[1:], generator=generator)

    def to(self, device: torch.device) -> None:
        """Move the pooled data and the client index to ``device``."""
        self.inputs = self.inputs.to(device)
        self.labels = self.labels.to(device)
        self.mean, self.std = self.mean.to(device), self.std.to(device)
        self.noise_std, self.noise_bank = self.noise_std.to(device), self.noise_bank.to(device)
        self.index = {s: ClientIndex.from_lists(p, device) for s, p in self._parts.items()}

    def partition_counts(self) -> dict[str, np.ndarray]:
        """Client x class sample counts of each split (train, val, test)."""
        return self.counts

    def num_samples(self, split: Split = "train") -> Tensor:
        """Samples per client in ``split`` (on the data device)."""
        return self.index[split].counts

    def fetch(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """Inputs (normalized float) and labels of pooled sample indices of any shape."""
        x = self.inputs[index]
        if x.dtype == torch.uint8:
            shape = (-1,) + (1,) * (len(self.input_shape) - 1)
            x = x.float().div_(255.0)
            if self.noise_sigma:
                std = self.noise_std[index].view(*index.shape, *([1] * len(self.input_shape)))
                x = x + std * self.noise_bank[index % self.NOISE_BANK]
            x = (x - self.mean.view(shape)) / self.std.view(shape)
        return x, self.labels[index]

    def client_batches(
        self,
        clients: Tensor,
        batch_size: int,
        generator: torch.Generator,
        steps: int | None = None,
        epochs: int | None = None,
        split: Split = "train",
        drop_last: bool = False,
    ) -> ClientBatches:
        """Draw the local-training batches of ``clients`` in ``split`` by index, on the data
        device (:func:`~lightning_pfl.client_index.draw_batches`)."""
        index = self.index[split]
        return draw_batches(index, clients, batch_size, generator, steps, epochs, drop_last)

    def eval_blocks(
        self, clients: Tensor, split: Split, block: int
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """Yield ``(index [C, b], weight [C, b])`` blocks covering every sample of ``clients``
        (:func:`~lightning_pfl.eval_blocks.eval_blocks`)."""
        return eval_blocks(self.index[split], clients, block)

    def ragged_eval_blocks(
        self,
        clients: Tensor,
        split: Split,
        block: int,
        levels: int = 16,
        min_saving: int = 32,
    ) -> Iterator[tuple[int, Tensor, Tensor]]:
        """:meth:`eval_blocks` without most of the padding of unequal clients, for clients in
        descending order of samples (:func:`~lightning_pfl.eval_blocks.ragged_eval_blocks`)."""
        return ragged_eval_blocks(self.index[split], clients, block, levels, min_saving)

    def by_size(self, clients: Tensor, split: Split) -> ClientsBySize:
        """``clients`` in descending order of their samples in ``split``, for passes over
        their data in :meth:`ragged_eval_blocks`."""
        return ClientsBySize(self, clients, split)

    def client_chunks(self) -> list[Tensor]:
        """This rank's share of all clients, in chunks of ``eval_clients_per_batch``."""
        rank, world = 0, 1
        if self.trainer is not None:
            rank, world = self.trainer.global_rank, self.trainer.world_size
        mine = torch.arange(self.num_clients)[rank::world]
        return list(mine.split(self.eval_clients_per_batch))

    def train_dataloader(self) -> RoundIndices:
        return RoundIndices(self)

    def val_dataloader(self) -> ClientChunks:
        # Without a validation split the loop still runs at the same rounds: it is what
        # evaluates the test split periodically (FederatedMethod.validation_step).
        return ClientChunks(self.client_chunks())

    def test_dataloader(self) -> ClientChunks:
        return ClientChunks(self.client_chunks())


def _channel_stats(x: Tensor, index: Tensor, chunk: int = 8192) -> tuple[Tensor, Tensor]:
    """Per-channel mean and std of the uint8 images ``x[index]`` in [0, 1] units.

    From each channel's histogram of the 256 levels, counted over chunks of ``index``: exact
    integer counts, and no float copy of the images (several times faster than summing them).
    Empty for float features.
    """
    if x.dtype != torch.uint8:
        return torch.zeros(0), torch.ones(0)
    channels = x.shape[1]
    histogram = torch.zeros(channels, 256, dtype=torch.int64)
    for ids in index.split(chunk):
        images = x[ids]
        for c in range(channels):
            histogram[c] += torch.bincount(images[:, c].flatten(), minlength=256)
    levels = torch.arange(256, dtype=torch.float64) / 255.0
    count = len(index) * x[0, 0].numel()
    mean = (histogram * levels).sum(1) / count
    squares = (histogram * levels**2).sum(1)
    std = (squares / count - mean**2).clamp_min(0).sqrt() * math.sqrt(count / max(count - 1, 1))
    return mean.float(), std.float().clamp_min(1e-6)
