"""Tiny-ImageNet-200 from Stanford's ``tiny-imagenet-200`` folder."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from lightning_pfl.datasets.files import DatasetArrays, DatasetNotFoundError, corrupt

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
            raise corrupt(path, str(error)) from error
        if image.shape != images.shape[1:]:
            raise corrupt(path, f"shape {tuple(image.shape)}, expected (3, 64, 64)")
        images[i] = image
    return images


def load_tiny_imagenet(root: str, download: bool, **_: Any) -> DatasetArrays:
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
        raise corrupt(annotations_file, f"wnids {unknown[:5]} are not in {wnids_file}")
    return DatasetArrays(
        train_x=_decode_rgb([path for path, _ in train.samples]),
        train_y=torch.tensor(train.targets, dtype=torch.int64),
        test_x=_decode_rgb([os.path.join(folder, "val", "images", f) for f, _ in annotations]),
        test_y=torch.tensor([train.class_to_idx[w] for _, w in annotations], dtype=torch.int64),
    )
