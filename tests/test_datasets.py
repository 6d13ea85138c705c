import shutil
from pathlib import Path

import pytest
import torch
import torchvision.datasets as tvd
from PIL import Image

from lightning_pfl import FederatedDataModule
from lightning_pfl.datasets import DATASETS, load_dataset
from lightning_pfl.datasets.files import CorruptDatasetError, DatasetNotFoundError
from lightning_pfl.datasets.registry import shared_loads
from lightning_pfl.partition import Shards
from tests.data.fake_datasets import (
    TINY_IMAGENET_WNIDS,
    mnist_resources,
    tiny_imagenet_color,
    write_cifar,
    write_mnist,
    write_tiny_imagenet,
)


def test_digits_is_bundled_and_split() -> None:
    d = load_dataset("digits")
    assert d.train_x.dtype == torch.uint8 and d.train_x.shape[1:] == (1, 8, 8)
    assert len(d.train_y) + len(d.test_y) == 1797
    assert int(d.train_x.max()) == 255 and set(d.test_y.tolist()) == set(range(10))


def test_a_job_loads_each_dataset_once_and_a_run_alone_afresh() -> None:
    """Inside ``shared_loads`` (a job's runs) equal loading arguments give the same arrays; the
    options a loader names (synthetic's seed) still make different ones; outside, no sharing."""
    with shared_loads():
        first = load_dataset("digits", seed=0, num_clients=4)
        assert load_dataset("digits", seed=1, num_clients=9) is first  # digits ignores both
        a = load_dataset("synthetic", seed=0, num_clients=5)
        assert load_dataset("synthetic", seed=0, num_clients=5) is a
        assert load_dataset("synthetic", seed=1, num_clients=5) is not a
    assert load_dataset("digits") is not load_dataset("digits")


def test_synthetic_is_seeded_with_natural_clients() -> None:
    a = load_dataset("synthetic", num_clients=5, seed=3, alpha=0.5, beta=0.5)
    b = load_dataset("synthetic", num_clients=5, seed=3, alpha=0.5, beta=0.5)
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.train_y, b.train_y)
    assert a.train_x.shape[1] == 60 and a.train_clients is not None
    sizes = torch.bincount(a.train_clients)
    assert len(sizes) == 5 and int(sizes.min()) >= 50


@pytest.mark.parametrize(
    ("name", "folder", "gz", "prefix", "classes"),
    [
        ("mnist", "MNIST", False, "", 10),
        ("fashion_mnist", "FashionMNIST", True, "", 10),
        ("emnist", "EMNIST", False, "emnist-byclass-", 62),
    ],
)
def test_mnist_family_reads_idx_files(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    folder: str,
    gz: bool,
    prefix: str,
    classes: int,
) -> None:
    md5 = write_mnist(
        tmp_path, folder, n_train=60, n_test=20, num_classes=classes, gz=gz, prefix=prefix
    )
    if gz:
        monkeypatch.setattr(getattr(tvd, folder), "resources", mnist_resources(md5))
    d = load_dataset(name, str(tmp_path))
    assert d.train_x.shape == (60, 1, 28, 28) and d.test_x.shape == (20, 1, 28, 28)
    assert d.train_y.tolist() == [i % classes for i in range(60)]
    assert DATASETS[name].input_shape == (1, 28, 28)


def test_gz_only_files_are_read_without_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    md5 = write_mnist(tmp_path, "FashionMNIST", gz=True)
    monkeypatch.setattr(tvd.FashionMNIST, "resources", mnist_resources(md5))
    raw = tmp_path / "FashionMNIST" / "raw"
    before = sorted(p.name for p in raw.iterdir())
    raw.chmod(0o555)
    try:
        load_dataset("fashion_mnist", str(tmp_path))
    finally:
        raw.chmod(0o755)
    assert sorted(p.name for p in raw.iterdir()) == before


@pytest.mark.parametrize("hundred", [False, True])
def test_cifar_reads_pickles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hundred: bool
) -> None:
    md5 = write_cifar(tmp_path, hundred=hundred, per_batch=20)
    cls = tvd.CIFAR100 if hundred else tvd.CIFAR10
    monkeypatch.setattr(cls, "train_list", [[f, md5[f]] for f, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[f, md5[f]] for f, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5[cls.meta["filename"]]})
    d = load_dataset("cifar100" if hundred else "cifar10", str(tmp_path))
    assert d.train_x.shape[1:] == (3, 32, 32) and d.train_x.dtype == torch.uint8
    if hundred:
        assert d.train_coarse is not None and d.test_coarse is not None
        assert torch.equal(d.train_y // 5, d.train_coarse)
    else:
        assert len(d.train_y) == 100 and d.train_coarse is None


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mnist", "MNIST/raw/train-images-idx3-ubyte"),
        ("cifar10", "cifar-10-batches-py/data_batch_1"),
        ("cifar100", "cifar-100-python/train"),
    ],
)
def test_missing_files_name_the_expected_paths(tmp_path: Path, name: str, expected: str) -> None:
    with pytest.raises(DatasetNotFoundError, match="download") as info:
        load_dataset(name, str(tmp_path))
    assert str(tmp_path / expected) in str(info.value)


def test_truncated_idx_file_is_named_with_advice(tmp_path: Path) -> None:
    write_mnist(tmp_path)
    images = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-100])
    with pytest.raises(CorruptDatasetError, match="Delete it and download it again") as info:
        load_dataset("mnist", str(tmp_path))
    assert str(images) in str(info.value) and "header announces" in str(info.value)


def test_gz_file_with_a_wrong_checksum_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    md5 = write_mnist(tmp_path, "FashionMNIST", gz=True)
    monkeypatch.setattr(tvd.FashionMNIST, "resources", mnist_resources(md5))
    labels = tmp_path / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(labels.read_bytes()[:-5])  # a download cut short
    with pytest.raises(CorruptDatasetError, match="md5") as info:
        load_dataset("fashion_mnist", str(tmp_path))
    assert str(labels) in str(info.value)


def test_corrupt_cifar_pickle_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    md5 = write_cifar(tmp_path)
    cls = tvd.CIFAR10
    monkeypatch.setattr(cls, "train_list", [[f, md5[f]] for f, _ in cls.train_list])
    monkeypatch.setattr(cls, "test_list", [[f, md5[f]] for f, _ in cls.test_list])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5[cls.meta["filename"]]})
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[:50])
    with pytest.raises(CorruptDatasetError, match="Delete it") as info:
        load_dataset("cifar10", str(tmp_path))
    assert str(batch) in str(info.value)


def test_unknown_dataset_lists_choices() -> None:
    with pytest.raises(ValueError, match="cifar10"):
        load_dataset("imagenet")


def test_random_timing_images_are_seeded_and_sized() -> None:
    a = load_dataset("random_cifar10", seed=1, train_size=40, test_size=8)
    b = load_dataset("random_cifar10", seed=1, train_size=40, test_size=8)
    assert a.train_x.shape == (40, 3, 32, 32) and a.test_x.shape == (8, 3, 32, 32)
    assert torch.equal(a.train_x, b.train_x) and a.train_x.dtype == torch.uint8


def test_tiny_imagenet_reads_the_stanford_layout(tmp_path: Path) -> None:
    val_wnids = write_tiny_imagenet(tmp_path, per_class=4, n_val=12)
    d = load_dataset("tiny_imagenet", str(tmp_path))
    assert DATASETS["tiny_imagenet"].input_shape == (3, 64, 64)
    assert DATASETS["tiny_imagenet"].num_classes == 200
    assert d.train_x.shape == (12, 3, 64, 64) and d.test_x.shape == (12, 3, 64, 64)
    assert d.train_x.dtype == torch.uint8 and d.test_x.dtype == torch.uint8
    classes = sorted(TINY_IMAGENET_WNIDS)
    assert d.train_y.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # Val labels follow the annotations file, val_10 after val_9 (not file-name order).
    assert d.test_y.tolist() == [classes.index(w) for w in val_wnids]
    for x, y in [*zip(d.train_x, d.train_y, strict=True), *zip(d.test_x, d.test_y, strict=True)]:
        if not torch.equal(x[0], x[1]):  # the grayscale image has no colour to compare
            color = torch.tensor(tiny_imagenet_color(classes[int(y)])).float()
            assert torch.allclose(x.float().mean((1, 2)), color, atol=2)


def test_tiny_imagenet_grayscale_jpeg_becomes_three_channels(tmp_path: Path) -> None:
    write_tiny_imagenet(tmp_path)
    gray = tmp_path / "tiny-imagenet-200" / "train" / "n04067472" / "images" / "n04067472_0.JPEG"
    with Image.open(gray) as image:
        assert image.mode == "L"
    d = load_dataset("tiny_imagenet", str(tmp_path))
    x = d.train_x[sorted(TINY_IMAGENET_WNIDS).index("n04067472") * 4]
    assert x.shape == (3, 64, 64) and torch.equal(x[0], x[1]) and torch.equal(x[1], x[2])


@pytest.mark.parametrize(
    ("remove", "message"),
    [
        ("", "missing"),
        ("tiny-imagenet-200/val/val_annotations.txt", "val_annotations.txt"),
        ("tiny-imagenet-200/train/n01443537/images", "n01443537"),
        ("tiny-imagenet-200/train/n01443537", "the 2 class folders of train/ are not the 3"),
    ],
)
def test_tiny_imagenet_missing_files_name_the_layout(
    tmp_path: Path, remove: str, message: str
) -> None:
    if remove:
        write_tiny_imagenet(tmp_path)
        target = tmp_path / remove
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink()
    with pytest.raises(DatasetNotFoundError, match="download: true") as info:
        load_dataset("tiny_imagenet", str(tmp_path))
    text = str(info.value)
    assert message in text and "cs231n.stanford.edu/tiny-imagenet-200.zip" in text
    folder = tmp_path / "tiny-imagenet-200"
    for path in ("wnids.txt", "train/<wnid>/images/<wnid>_<i>.JPEG", "val/val_annotations.txt"):
        assert str(folder / path) in text


def test_tiny_imagenet_download_fetches_the_official_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str, str | None]] = []

    def fake_download(url: str, download_root: str, md5: str | None = None) -> None:
        calls.append((url, download_root, md5))
        write_tiny_imagenet(Path(download_root))

    monkeypatch.setattr(tvd.utils, "download_and_extract_archive", fake_download)
    d = load_dataset("tiny_imagenet", str(tmp_path), download=True)
    assert calls == [
        (
            "http://cs231n.stanford.edu/tiny-imagenet-200.zip",
            str(tmp_path),
            "90528d7ca1a48142e341f4ef8d21d0de",
        )
    ]
    assert d.train_x.shape == (12, 3, 64, 64)
    load_dataset("tiny_imagenet", str(tmp_path), download=True)
    assert len(calls) == 1  # present files are not fetched again


def test_tiny_imagenet_truncated_jpeg_is_named(tmp_path: Path) -> None:
    write_tiny_imagenet(tmp_path)
    image = tmp_path / "tiny-imagenet-200" / "val" / "images" / "val_3.JPEG"
    image.write_bytes(image.read_bytes()[:200])
    with pytest.raises(CorruptDatasetError, match="Delete it") as info:
        load_dataset("tiny_imagenet", str(tmp_path))
    assert str(image) in str(info.value)


def test_tiny_imagenet_federated_split(tmp_path: Path) -> None:
    write_tiny_imagenet(tmp_path, per_class=8, n_val=12)
    dm = FederatedDataModule(
        "tiny_imagenet",
        num_clients=3,
        partition=Shards(1),  # label-sorted: 3 of the 200 classes exist in the fake tree
        eval_split="holdout",
        val_fraction=0.0,
        test_fraction=0.25,
        root=str(tmp_path),
    )
    dm.setup("fit")
    assert dm.num_classes == 200 and dm.input_shape == (3, 64, 64)
    train, test = dm.counts["train"], dm.counts["test"]
    assert train.shape == (3, 200) and int(train.sum() + test.sum()) == 36
    assert (train[:, 3:] == 0).all() and ((train > 0).sum(1) <= 2).all()
    assert (test.sum(1) > 0).all()
    x, y = dm.fetch(torch.arange(4))
    assert x.shape == (4, 3, 64, 64) and x.dtype == torch.float32 and y.max() < 3
