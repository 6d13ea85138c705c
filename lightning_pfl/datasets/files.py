"""What every dataset loader returns, and the checks of the files loaders read."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from lightning_pfl.errors import DatasetError


@dataclass
class DatasetArrays:
    """A dataset held in memory.

    Attributes:
        train_x: training inputs, uint8 images ``[N, C, H, W]`` or float features ``[N, D]``.
        train_y: training labels ``[N]`` (int64).
        test_x: test inputs (may be empty for datasets without an official test set).
        test_y: test labels.
        train_coarse: coarse labels of the training set (CIFAR-100 superclasses) or None.
        test_coarse: coarse labels of the test set or None.
        train_clients: natural client id of every training sample, or None.
    """

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    train_coarse: Tensor | None = None
    test_coarse: Tensor | None = None
    train_clients: Tensor | None = None


@dataclass(frozen=True)
class DatasetSpec:
    """Static facts about a dataset, known without loading it."""

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    loader: Callable[..., DatasetArrays]
    num_coarse_classes: int = 0
    natural_clients: bool = False


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """Raised when dataset files are missing and cannot be downloaded."""


class CorruptDatasetError(DatasetError):
    """Raised when a dataset file exists but is truncated or has the wrong checksum."""


def corrupt(path: str, why: str) -> CorruptDatasetError:
    return CorruptDatasetError(
        f"Dataset file {path} is corrupt ({why}). Delete it and download it again "
        "(data.init_args.download: true on a machine with internet access)."
    )


def verify_md5(path: str, md5: str) -> None:
    from torchvision.datasets.utils import check_md5

    if not check_md5(path, md5):
        raise corrupt(path, f"its md5 is not torchvision's {md5}")


def verify_idx(path: str) -> None:
    """Check that an uncompressed IDX file holds as many bytes as its header announces."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(4)
        if len(header) < 4 or header[:2] != b"\x00\x00":
            raise corrupt(path, "not an IDX file")
        ndim = header[3]
        dims = f.read(4 * ndim)
    if len(dims) < 4 * ndim:
        raise corrupt(path, "truncated header")
    shape = [int.from_bytes(dims[4 * i : 4 * i + 4], "big") for i in range(ndim)]
    expected = 4 + 4 * ndim + int(np.prod(shape, dtype=np.int64))
    if size != expected:
        raise corrupt(path, f"{size} bytes, its header announces {expected}")


def missing_files_error(
    name: str, root: str, folder: str, files: list[str], cause: Exception
) -> Exception:
    listing = "\n".join(f"  {os.path.join(folder, f)}" for f in files)
    return DatasetNotFoundError(
        f"Dataset '{name}' not found under root '{root}'. Expected these files:\n{listing}\n"
        "Place them there, set `data.init_args.root` to the folder that holds them, or set "
        "`data.init_args.download: true` on a machine with internet access. "
        f"(torchvision said: {cause})"
    )
