"""Loaders for every dataset the library ships, selected by name."""

from __future__ import annotations

import gzip
import inspect
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_pfl.datasets.files import (
    DatasetArrays,
    DatasetSpec,
    missing_files_error,
    verify_idx,
    verify_md5,
)
from lightning_pfl.datasets.leaf import leaf_loader
from lightning_pfl.datasets.tiny_imagenet import load_tiny_imagenet
from lightning_pfl.errors import ConfigError


def _load_digits(root: str, download: bool, **_: Any) -> DatasetArrays:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)[:, None]
    labels = digits.target.astype(np.int64)
    # Fixed, seed-independent 75/25 split so that "digits test set" always means the same images.
    order = np.random.default_rng(0).permutation(len(labels))
    n_test = len(labels) // 4
    test, train = order[:n_test], order[n_test:]
    return DatasetArrays(
        train_x=torch.from_numpy(images[train]),
        train_y=torch.from_numpy(labels[train]),
        test_x=torch.from_numpy(images[test]),
        test_y=torch.from_numpy(labels[test]),
    )


def _load_synthetic(
    root: str,
    download: bool,
    num_clients: int = 30,
    seed: int = 0,
    alpha: float = 1.0,
    beta: float = 1.0,
    dimension: int = 60,
    num_classes: int = 10,
    **_: Any,
) -> DatasetArrays:
    """Synthetic(alpha, beta) of FedProx (Li et al., 2020), natural split by generating client.

    Client k draws u_k ~ N(0, alpha), W_k, b_k ~ N(u_k, 1), B_k ~ N(0, beta), v_k ~ N(B_k, 1),
    x ~ N(v_k, diag(j^-1.2)), y = argmax(W_k x + b_k). Client sizes follow FedProx's power law:
    floor(lognormal(4, 2)) + 50.
    """
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_clients).astype(np.int64) + 50
    cov_diag = np.arange(1, dimension + 1, dtype=np.float64) ** -1.2
    xs, ys, owners = [], [], []
    for k in range(num_clients):
        u_k = rng.normal(0, np.sqrt(alpha))
        b_k = rng.normal(0, np.sqrt(beta))
        weights = rng.normal(u_k, 1, (dimension, num_classes))
        bias = rng.normal(u_k, 1, num_classes)
        mean = rng.normal(b_k, 1, dimension)
        x = rng.normal(mean, np.sqrt(cov_diag), (sizes[k], dimension))
        xs.append(x.astype(np.float32))
        ys.append(np.argmax(x @ weights + bias, axis=1))
        owners.append(np.full(sizes[k], k))
    return DatasetArrays(
        train_x=torch.from_numpy(np.concatenate(xs)),
        train_y=torch.from_numpy(np.concatenate(ys).astype(np.int64)),
        test_x=torch.empty(0, dimension),
        test_y=torch.empty(0, dtype=torch.int64),
        train_clients=torch.from_numpy(np.concatenate(owners)),
    )


def _load_random_images(
    root: str,
    download: bool,
    seed: int = 0,
    train_size: int = 50_000,
    test_size: int = 10_000,
    **_: Any,
) -> DatasetArrays:
    """Random CIFAR-shaped uint8 images with random labels: for timing, not for learning."""
    g = torch.Generator().manual_seed(seed)
    n = train_size + test_size
    x = torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (n,), generator=g)
    return DatasetArrays(x[:train_size], y[:train_size], x[train_size:], y[train_size:])


def _read_idx_gz(path: str) -> Tensor:
    """Read a gzipped IDX file with torchvision's reader (without writing next to it)."""
    from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, "idx")
        with gzip.open(path, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read())
        return read_sn3_pascalvincent_tensor(target, strict=False)


def _mnist_family(cls_name: str, name: str, **kwargs: Any) -> Callable[..., DatasetArrays]:
    def load(root: str, download: bool, **_: Any) -> DatasetArrays:
        import torchvision.datasets as tvd

        cls = getattr(tvd, cls_name)
        probe = cls.__new__(cls)
        probe.root = root
        for key, value in kwargs.items():
            setattr(probe, key, value)
        if cls_name == "EMNIST":
            probe.split = kwargs["split"]
            stems = [
                f"emnist-{kwargs['split']}-{part}-{kind}-idx{n}-ubyte"
                for part in ("train", "test")
                for kind, n in (("images", 3), ("labels", 1))
            ]
        else:
            stems = [os.path.splitext(os.path.basename(url))[0] for url, _ in cls.resources]
        raw = probe.raw_folder
        md5 = {
            os.path.splitext(os.path.basename(url))[0]: digest
            for url, digest in getattr(cls, "resources", [])
        }
        if not download and not all(os.path.exists(os.path.join(raw, s)) for s in stems):
            gz = [os.path.join(raw, s + ".gz") for s in stems]
            if cls_name != "EMNIST" and all(os.path.exists(p) for p in gz):
                for stem, path in zip(stems, gz, strict=True):
                    verify_md5(path, md5[stem])
                tensors = [_read_idx_gz(p) for p in gz]
                by_stem = dict(zip(stems, tensors, strict=True))
                return _mnist_arrays(by_stem, stems)
        for stem in stems:
            if os.path.exists(os.path.join(raw, stem)):
                verify_idx(os.path.join(raw, stem))
        try:
            train = cls(root, train=True, download=download, **kwargs)
            test = cls(root, train=False, download=download, **kwargs)
        except Exception as error:  # torchvision raises RuntimeError / URLError
            raise missing_files_error(name, root, raw, stems, error) from error
        return DatasetArrays(
            train_x=train.data[:, None].contiguous(),
            train_y=train.targets.long(),
            test_x=test.data[:, None].contiguous(),
            test_y=test.targets.long(),
        )

    return load


def _mnist_arrays(by_stem: dict[str, Tensor], stems: list[str]) -> DatasetArrays:
    def find(part: str, kind: str) -> Tensor:
        return next(t for s, t in by_stem.items() if s.startswith(part) and kind in s)

    return DatasetArrays(
        train_x=find("train", "images")[:, None].contiguous(),
        train_y=find("train", "labels").long(),
        test_x=find("t10k", "images")[:, None].contiguous(),
        test_y=find("t10k", "labels").long(),
    )


def _cifar(cls_name: str, name: str) -> Callable[..., DatasetArrays]:
    def load(root: str, download: bool, **_: Any) -> DatasetArrays:
        import torchvision.datasets as tvd

        cls = getattr(tvd, cls_name)
        folder = os.path.join(root, cls.base_folder)
        files = [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
        for filename, digest in (
            cls.train_list + cls.test_list + [[cls.meta["filename"], cls.meta["md5"]]]
        ):
            path = os.path.join(folder, filename)
            if os.path.exists(path):
                verify_md5(path, digest)
        try:
            train = cls(root, train=True, download=download)
            test = cls(root, train=False, download=download)
        except Exception as error:
            raise missing_files_error(name, root, folder, files, error) from error
        arrays = DatasetArrays(
            train_x=torch.from_numpy(train.data).permute(0, 3, 1, 2).contiguous(),
            train_y=torch.tensor(train.targets, dtype=torch.int64),
            test_x=torch.from_numpy(test.data).permute(0, 3, 1, 2).contiguous(),
            test_y=torch.tensor(test.targets, dtype=torch.int64),
        )
        if cls_name == "CIFAR100":
            # torchvision reads only the fine labels; the coarse ones sit in the same pickles.
            arrays.train_coarse = _cifar100_coarse(folder, cls.train_list)
            arrays.test_coarse = _cifar100_coarse(folder, cls.test_list)
        return arrays

    return load


def _cifar100_coarse(folder: str, file_list: list[list[str]]) -> Tensor:
    labels: list[int] = []
    for filename, _ in file_list:
        with open(os.path.join(folder, filename), "rb") as f:
            entry = pickle.load(f, encoding="latin1")
        labels.extend(entry["coarse_labels"])
    return torch.tensor(labels, dtype=torch.int64)


DATASETS: dict[str, DatasetSpec] = {
    spec.name: spec
    for spec in [
        DatasetSpec("digits", 10, (1, 8, 8), _load_digits),
        DatasetSpec("synthetic", 10, (60,), _load_synthetic, natural_clients=True),
        DatasetSpec("mnist", 10, (1, 28, 28), _mnist_family("MNIST", "mnist")),
        DatasetSpec(
            "fashion_mnist", 10, (1, 28, 28), _mnist_family("FashionMNIST", "fashion_mnist")
        ),
        DatasetSpec("emnist", 62, (1, 28, 28), _mnist_family("EMNIST", "emnist", split="byclass")),
        DatasetSpec("cifar10", 10, (3, 32, 32), _cifar("CIFAR10", "cifar10")),
        DatasetSpec("random_cifar10", 10, (3, 32, 32), _load_random_images),
        DatasetSpec(
            "cifar100", 100, (3, 32, 32), _cifar("CIFAR100", "cifar100"), num_coarse_classes=20
        ),
        DatasetSpec("tiny_imagenet", 200, (3, 64, 64), load_tiny_imagenet),
        DatasetSpec("shakespeare", 80, (80,), leaf_loader("shakespeare"), natural_clients=True),
        DatasetSpec("femnist", 62, (1, 28, 28), leaf_loader("femnist"), natural_clients=True),
    ]
}


def dataset_spec(name: str) -> DatasetSpec:
    """Return the registry entry for ``name`` or raise a ConfigError listing the choices."""
    if name not in DATASETS:
        raise ConfigError(
            f"Unknown dataset '{name}' (data.init_args.dataset). Choose one of: "
            f"{', '.join(DATASETS)}."
        )
    return DATASETS[name]


# Inside :func:`shared_loads`: the datasets loaded so far, by their loading arguments.
_shared: dict[str, DatasetArrays] | None = None


@contextmanager
def shared_loads() -> Iterator[None]:
    """Within it, :func:`load_dataset` loads each dataset once and hands every caller the same
    arrays (the runs of a job read the same files; nobody writes into ``DatasetArrays``).
    Outside, every call loads afresh, so a single run holds no second copy."""
    global _shared
    outer = _shared
    _shared = {} if outer is None else outer
    try:
        yield
    finally:
        _shared = outer


def load_dataset(
    name: str, root: str = "data", download: bool = False, **options: Any
) -> DatasetArrays:
    """Load dataset ``name`` into memory (see :data:`DATASETS` for the names)."""
    loader = dataset_spec(name).loader
    if _shared is None:
        return loader(root, download, **options)
    # the options a loader names (a seed, a client count) make other arrays; the rest it ignores
    named = inspect.signature(loader).parameters
    used = sorted((k, v) for k, v in options.items() if k in named)
    key = repr((name, os.path.abspath(root), download, used))
    if key not in _shared:
        _shared[key] = loader(root, download, **options)
    return _shared[key]
