"""Loaders for every dataset the library ships, selected by name."""

from __future__ import annotations

import gzip
import os
import pickle
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_pfl.errors import ConfigError, DatasetError


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


def _corrupt(path: str, why: str) -> CorruptDatasetError:
    return CorruptDatasetError(
        f"Dataset file {path} is corrupt ({why}). Delete it and download it again "
        "(data.init_args.download: true on a machine with internet access)."
    )


def _verify_md5(path: str, md5: str) -> None:
    from torchvision.datasets.utils import check_md5

    if not check_md5(path, md5):
        raise _corrupt(path, f"its md5 is not torchvision's {md5}")


def _verify_idx(path: str) -> None:
    """Check that an uncompressed IDX file holds as many bytes as its header announces."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(4)
        if len(header) < 4 or header[:2] != b"\x00\x00":
            raise _corrupt(path, "not an IDX file")
        ndim = header[3]
        dims = f.read(4 * ndim)
    if len(dims) < 4 * ndim:
        raise _corrupt(path, "truncated header")
    shape = [int.from_bytes(dims[4 * i : 4 * i + 4], "big") for i in range(ndim)]
    expected = 4 + 4 * ndim + int(np.prod(shape, dtype=np.int64))
    if size != expected:
        raise _corrupt(path, f"{size} bytes, its header announces {expected}")


def _missing_files_error(
    name: str, root: str, folder: str, files: list[str], cause: Exception
) -> Exception:
    listing = "\n".join(f"  {os.path.join(folder, f)}" for f in files)
    return DatasetNotFoundError(
        f"Dataset '{name}' not found under root '{root}'. Expected these files:\n{listing}\n"
        "Place them there, set `data.init_args.root` to the folder that holds them, or set "
        "`data.init_args.download: true` on a machine with internet access. "
        f"(torchvision said: {cause})"
    )


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
                    _verify_md5(path, md5[stem])
                tensors = [_read_idx_gz(p) for p in gz]
                by_stem = dict(zip(stems, tensors, strict=True))
                return _mnist_arrays(by_stem, stems)
        for stem in stems:
            if os.path.exists(os.path.join(raw, stem)):
                _verify_idx(os.path.join(raw, stem))
        try:
            train = cls(root, train=True, download=download, **kwargs)
            test = cls(root, train=False, download=download, **kwargs)
        except Exception as error:  # torchvision raises RuntimeError / URLError
            raise _missing_files_error(name, root, raw, stems, error) from error
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
                _verify_md5(path, digest)
        try:
            train = cls(root, train=True, download=download)
            test = cls(root, train=False, download=download)
        except Exception as error:
            raise _missing_files_error(name, root, folder, files, error) from error
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


TINY_IMAGENET_URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
TINY_IMAGENET_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"
TINY_IMAGENET_LAYOUT = (
    "wnids.txt",
    "train/<wnid>/images/<wnid>_<i>.JPEG",
    "val/images/val_<i>.JPEG",
    "val/val_annotations.txt",
)


def _tiny_imagenet_not_found(root: str, folder: str, why: str) -> DatasetNotFoundError:
    listing = "\n".join(f"  {os.path.join(folder, f)}" for f in TINY_IMAGENET_LAYOUT)
    return DatasetNotFoundError(
        f"Dataset 'tiny_imagenet' not found under root '{root}' ({why}). Expected Stanford's "
        f"tiny-imagenet-200 layout:\n{listing}\nUnzip tiny-imagenet-200.zip in `root`, set "
        "`data.init_args.root` to the folder that holds tiny-imagenet-200, or set "
        "`data.init_args.download: true` on a machine with internet access to fetch and "
        f"extract {TINY_IMAGENET_URL}."
    )


def _decode_rgb(paths: list[str]) -> Tensor:
    """Decode 64x64 images into one uint8 tensor ``[N, 3, 64, 64]`` (grayscale made RGB)."""
    from torchvision.io import ImageReadMode, decode_image

    images = torch.empty(len(paths), 3, 64, 64, dtype=torch.uint8)
    for i, path in enumerate(paths):
        try:
            image = decode_image(path, mode=ImageReadMode.RGB)
        except RuntimeError as error:  # torchvision's error for missing or truncated files
            raise _corrupt(path, str(error)) from error
        if image.shape != images.shape[1:]:
            raise _corrupt(path, f"shape {tuple(image.shape)}, expected (3, 64, 64)")
        images[i] = image
    return images


def _load_tiny_imagenet(root: str, download: bool, **_: Any) -> DatasetArrays:
    """Tiny-ImageNet-200 from Stanford's ``tiny-imagenet-200`` folder under ``root``.

    Train is the ``train`` folder (500 images per class), test the labelled ``val`` folder
    (50 per class, labels from ``val/val_annotations.txt``: file, wnid, bounding box, tab
    separated); the unlabelled ``test`` folder is not read. Class ``c`` is the ``c``-th wnid of
    ``wnids.txt`` in sorted order (torchvision's ``ImageFolder`` order). Images are decoded
    once, grayscale ones converted to RGB, into uint8 ``[N, 3, 64, 64]``.
    """
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.utils import download_and_extract_archive

    folder = os.path.join(root, "tiny-imagenet-200")
    wnids_file = os.path.join(folder, "wnids.txt")
    annotations_file = os.path.join(folder, "val", "val_annotations.txt")
    required = (wnids_file, os.path.join(folder, "train"), annotations_file)
    if download and not all(os.path.exists(path) for path in required):
        try:
            download_and_extract_archive(TINY_IMAGENET_URL, root, md5=TINY_IMAGENET_MD5)
        except (OSError, RuntimeError) as error:  # URLError, or torchvision's md5 mismatch
            raise _tiny_imagenet_not_found(root, folder, f"download failed: {error}") from error
    missing = [path for path in required if not os.path.exists(path)]
    if missing:
        raise _tiny_imagenet_not_found(root, folder, f"missing {', '.join(missing)}")
    try:
        train = ImageFolder(os.path.join(folder, "train"))
    except FileNotFoundError as error:  # torchvision: no class folders or no images in one
        raise _tiny_imagenet_not_found(root, folder, f"torchvision said: {error}") from error
    with open(wnids_file) as f:
        wnids = sorted(f.read().split())
    if wnids != train.classes:
        raise _tiny_imagenet_not_found(
            root,
            folder,
            f"the {len(train.classes)} class folders of train/ are not the {len(wnids)} wnids "
            "of wnids.txt",
        )
    with open(annotations_file) as f:
        annotations = [line.split("\t")[:2] for line in f if line.strip()]
    unknown = sorted({wnid for _, wnid in annotations} - set(wnids))
    if unknown:
        raise _corrupt(annotations_file, f"wnids {unknown[:5]} are not in {wnids_file}")
    return DatasetArrays(
        train_x=_decode_rgb([path for path, _ in train.samples]),
        train_y=torch.tensor(train.targets, dtype=torch.int64),
        test_x=_decode_rgb([os.path.join(folder, "val", "images", f) for f, _ in annotations]),
        test_y=torch.tensor([train.class_to_idx[w] for _, w in annotations], dtype=torch.int64),
    )


# LEAF's Shakespeare alphabet (its ``language_utils.ALL_LETTERS``): 80 characters, ids 0..79.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
LEAF_SPLITS = ("all_data", "train", "test")


def _leaf(name: str) -> Callable[..., DatasetArrays]:
    """Loader of LEAF's ``name`` (shakespeare, femnist) JSON files: one client per user.

    Reads every ``*.json`` under ``{root}/leaf/{name}/data/all_data`` (LEAF's preprocessing
    without ``--split``), else under ``.../data/train`` and ``.../data/test`` together (each
    user's samples are pooled; the DataModule's ``holdout`` split then deals them 80/20 with
    ``test_fraction: 0.2``). Each file is LEAF's ``{"users": [...], "num_samples": [...],
    "user_data": {user: {"x": [...], "y": [...]}}}``. ``num_clients`` users with at least
    ``min_samples`` samples are drawn at random (seeded), LEAF's sampling of a fraction of its
    users. Shakespeare inputs are the 80 character ids of each line (int64), the label the next
    character's id; FEMNIST inputs are 28x28 uint8 images, labels 0..61.
    """

    def load(
        root: str,
        download: bool,
        num_clients: int = 10,
        seed: int = 0,
        min_samples: int = 2,
        **_: Any,
    ) -> DatasetArrays:
        import json

        base = os.path.join(root, "leaf", name, "data")
        folders = [os.path.join(base, "all_data")]
        if not os.path.isdir(folders[0]):
            folders = [os.path.join(base, "train"), os.path.join(base, "test")]
        files = [
            os.path.join(f, n)
            for f in folders
            if os.path.isdir(f)
            for n in sorted(os.listdir(f))
            if n.endswith(".json")
        ]
        if not files:
            raise DatasetNotFoundError(
                f"Dataset '{name}' (LEAF) not found under root '{root}'. Expected LEAF's JSON "
                f'files ({{"users", "num_samples", "user_data"}}) in\n  {base}/all_data/'
                f"*.json\nor in\n  {base}/train/*.json and {base}/test/*.json\n(run LEAF's "
                f"data/{name}/preprocess.sh and copy its data/ folder there)."
            )
        users: dict[str, tuple[list[Any], list[Any]]] = {}
        for path in files:
            with open(path) as f:
                content = json.load(f)
            for user, data in content["user_data"].items():
                xs, ys = users.setdefault(user, ([], []))
                xs.extend(data["x"])
                ys.extend(data["y"])
        names = sorted(u for u, (_, ys) in users.items() if len(ys) >= min_samples)
        if num_clients > len(names):
            raise ConfigError(
                f"LEAF '{name}' under '{base}' has {len(names)} users with at least "
                f"{min_samples} samples; data.init_args.num_clients = {num_clients} is more."
            )
        chosen = sorted(np.random.default_rng(seed).choice(len(names), num_clients, False))
        xs, ys, owners = [], [], []
        for client, i in enumerate(chosen):
            x, y = users[names[i]]
            xs.extend(x)
            ys.extend(y)
            owners.extend([client] * len(y))
        if name == "shakespeare":
            ids = {c: i for i, c in enumerate(LEAF_LETTERS)}
            inputs = torch.tensor([[ids.get(c, 0) for c in line] for line in xs])
            labels = torch.tensor([ids.get(c, 0) for c in ys])
        else:
            pixels = np.asarray(xs, dtype=np.float32).reshape(-1, 1, 28, 28)
            inputs = torch.from_numpy(np.rint(np.clip(pixels, 0, 1) * 255).astype(np.uint8))
            labels = torch.tensor(ys, dtype=torch.int64)
        return DatasetArrays(
            train_x=inputs,
            train_y=labels.long(),
            test_x=inputs[:0],
            test_y=labels[:0].long(),
            train_clients=torch.tensor(owners, dtype=torch.int64),
        )

    return load


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
        DatasetSpec("tiny_imagenet", 200, (3, 64, 64), _load_tiny_imagenet),
        DatasetSpec("shakespeare", 80, (80,), _leaf("shakespeare"), natural_clients=True),
        DatasetSpec("femnist", 62, (1, 28, 28), _leaf("femnist"), natural_clients=True),
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


def load_dataset(
    name: str, root: str = "data", download: bool = False, **options: Any
) -> DatasetArrays:
    """Load dataset ``name`` into memory (see :data:`DATASETS` for the names)."""
    return dataset_spec(name).loader(root, download, **options)
