"""Seeded writers of tiny dataset files in the real on-disk formats torchvision reads.

MNIST-family: IDX files (big-endian magic, dims, uint8 payload), raw or gzipped, in
``<root>/<Name>/raw``. CIFAR: pickled dicts with ``data`` (N x 3072 uint8), ``labels`` /
``fine_labels`` + ``coarse_labels``, and the meta file, in ``<root>/cifar-*-py``.
Tiny-ImageNet: Stanford's ``<root>/tiny-imagenet-200`` tree of 64x64 JPEGs with ``wnids.txt``,
per-class ``<wnid>_boxes.txt`` and ``val/val_annotations.txt``.
Run as a script to write them under ``tests/data/files``.
"""

from __future__ import annotations

import gzip
import hashlib
import pickle
import struct
import sys
from pathlib import Path

import numpy as np
from PIL import Image

SEED = 0


def _idx_bytes(array: np.ndarray) -> bytes:
    magic = struct.pack(">HBB", 0, 0x08, array.ndim)
    dims = b"".join(struct.pack(">I", d) for d in array.shape)
    return magic + dims + array.astype(np.uint8).tobytes()


def write_mnist(
    root: Path,
    folder: str = "MNIST",
    n_train: int = 60,
    n_test: int = 20,
    num_classes: int = 10,
    gz: bool = False,
    prefix: str = "",
) -> dict[str, str]:
    """Write MNIST-style IDX files (``prefix`` e.g. ``emnist-byclass-`` for EMNIST).

    Returns {file stem: md5 of the written file} (of the ``.gz`` file when ``gz``), the form of
    torchvision's ``resources`` checksums.
    """
    rng = np.random.default_rng(SEED)
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    md5 = {}
    for part, n in (("train", n_train), ("t10k" if not prefix else "test", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = np.arange(n) % num_classes
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            name = f"{prefix}{part}-{kind}-ubyte"
            payload = _idx_bytes(array)
            path = raw / (f"{name}.gz" if gz else name)
            if gz:
                with gzip.GzipFile(path, "wb", mtime=0) as f:
                    f.write(payload)
            else:
                path.write_bytes(payload)
            md5[name] = hashlib.md5(path.read_bytes()).hexdigest()
    return md5


def mnist_resources(md5: dict[str, str]) -> list[tuple[str, str]]:
    """torchvision-style ``resources`` (url, md5) for files written by :func:`write_mnist`."""
    return [(f"https://example.invalid/{stem}.gz", digest) for stem, digest in md5.items()]


def write_cifar(root: Path, hundred: bool = False, per_batch: int = 20) -> dict[str, str]:
    """Write CIFAR-10 (or CIFAR-100) pickles; return {filename: md5} for the integrity check."""
    rng = np.random.default_rng(SEED)
    folder = root / ("cifar-100-python" if hundred else "cifar-10-batches-py")
    folder.mkdir(parents=True, exist_ok=True)
    batches = (
        ["train", "test"] if hundred else [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    )
    md5 = {}
    for name in batches:
        data = rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8)
        if hundred:
            coarse = np.arange(per_batch) % 20
            fine = coarse * 5 + (np.arange(per_batch) // 20) % 5
            entry = {"data": data, "fine_labels": fine.tolist(), "coarse_labels": coarse.tolist()}
        else:
            entry = {"data": data, "labels": (np.arange(per_batch) % 10).tolist()}
        path = folder / name
        with open(path, "wb") as f:
            pickle.dump(entry, f)
        md5[name] = hashlib.md5(path.read_bytes()).hexdigest()
    meta_name, key = ("meta", "fine_label_names") if hundred else ("batches.meta", "label_names")
    with open(folder / meta_name, "wb") as f:
        pickle.dump({key: [f"class_{i}" for i in range(100 if hundred else 10)]}, f)
    md5[meta_name] = hashlib.md5((folder / meta_name).read_bytes()).hexdigest()
    return md5


# wnids.txt lists the classes unsorted; the loader's label c is the c-th wnid in sorted order.
TINY_IMAGENET_WNIDS = ("n04067472", "n01443537", "n02124075")


def tiny_imagenet_color(wnid: str) -> tuple[int, int, int]:
    """The flat RGB colour of the images of class ``wnid`` (:func:`write_tiny_imagenet`)."""
    k = TINY_IMAGENET_WNIDS.index(wnid)
    return (40 + 60 * k, 200 - 50 * k, 90 + 70 * k)


def write_tiny_imagenet(root: Path, per_class: int = 4, n_val: int = 12) -> list[str]:
    """Write a tiny ``tiny-imagenet-200`` tree; return the wnid of each ``val_<i>.JPEG``.

    Every image of a class is its flat :func:`tiny_imagenet_color` plus seeded noise of +-3;
    the first training image of wnids.txt's first class is a grayscale JPEG (its colour's
    luma), as some of the real dataset's are. The unlabelled ``test`` folder holds one image.
    """
    rng = np.random.default_rng(SEED)
    base = root / "tiny-imagenet-200"

    def save(path: Path, wnid: str, gray: bool = False) -> None:
        color = np.array(tiny_imagenet_color(wnid), dtype=np.int64)
        pixels = np.clip(color + rng.integers(-3, 4, (64, 64, 3)), 0, 255).astype(np.uint8)
        path.parent.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray(pixels)
        (image.convert("L") if gray else image).save(path, quality=95)

    base.mkdir(parents=True, exist_ok=True)
    (base / "wnids.txt").write_text("".join(f"{w}\n" for w in TINY_IMAGENET_WNIDS))
    for wnid in TINY_IMAGENET_WNIDS:
        boxes = []
        for i in range(per_class):
            name = f"{wnid}_{i}.JPEG"
            gray = i == 0 and wnid == TINY_IMAGENET_WNIDS[0]
            save(base / "train" / wnid / "images" / name, wnid, gray)
            boxes.append(f"{name}\t0\t0\t63\t63\n")
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("".join(boxes))
    val_wnids = [TINY_IMAGENET_WNIDS[k] for k in rng.integers(0, 3, n_val)]
    lines = []
    for i, wnid in enumerate(val_wnids):
        save(base / "val" / "images" / f"val_{i}.JPEG", wnid)
        lines.append(f"val_{i}.JPEG\t{wnid}\t0\t5\t60\t62\n")
    (base / "val" / "val_annotations.txt").write_text("".join(lines))
    save(base / "test" / "images" / "test_0.JPEG", TINY_IMAGENET_WNIDS[0])
    return val_wnids


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "files")
    write_mnist(out)
    write_mnist(out, "FashionMNIST", gz=True)
    write_mnist(out, "EMNIST", num_classes=62, prefix="emnist-byclass-")
    write_cifar(out)
    write_cifar(out, hundred=True)
    write_tiny_imagenet(out)
    print(f"wrote fake datasets under {out}")
