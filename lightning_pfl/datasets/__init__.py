"""Dataset registry: every dataset is loaded by name into in-memory tensors.

A loader returns a :class:`DatasetArrays` with uint8 images (normalized on the fly by the
DataModule) or float features, integer labels, and, where the dataset has them, coarse labels
or a natural client id per sample.
"""

from lightning_pfl.datasets.registry import (
    DATASETS,
    DatasetArrays,
    DatasetSpec,
    dataset_spec,
    load_dataset,
)

__all__ = ["DATASETS", "DatasetArrays", "DatasetSpec", "dataset_spec", "load_dataset"]
