"""LEAF Shakespeare and FEMNIST from LEAF's JSON files, as natural client splits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_pfl import FederatedDataModule
from lightning_pfl.datasets import load_dataset
from lightning_pfl.datasets.files import DatasetNotFoundError
from lightning_pfl.datasets.leaf import LEAF_LETTERS
from lightning_pfl.errors import ConfigError
from tests.data.leaf import write_leaf


@pytest.mark.parametrize("layout", ["split", "all_data"])
def test_shakespeare_one_client_per_user(tmp_path: Path, layout: str) -> None:
    counts = write_leaf(tmp_path, "shakespeare", users=6, layout=layout)  # type: ignore[arg-type]
    d = load_dataset("shakespeare", str(tmp_path), num_clients=6, seed=0)
    assert d.train_x.dtype == torch.int64 and d.train_x.shape == (sum(counts), 80)
    assert d.train_clients is not None
    assert sorted(torch.bincount(d.train_clients).tolist()) == sorted(counts)
    assert int(d.train_x.max()) < 80 and int(d.train_y.max()) < 80
    # the label is the character after the line: the next line's last character
    first = d.train_clients == 0
    x, y = d.train_x[first], d.train_y[first]
    assert torch.equal(x[1:, -1], y[:-1])
    assert LEAF_LETTERS[int(y[0])] in LEAF_LETTERS


def test_femnist_images_and_sampled_users(tmp_path: Path) -> None:
    counts = write_leaf(tmp_path, "femnist", users=5)
    a = load_dataset("femnist", str(tmp_path), num_clients=3, seed=1)
    b = load_dataset("femnist", str(tmp_path), num_clients=3, seed=1)
    assert a.train_x.dtype == torch.uint8 and a.train_x.shape[1:] == (1, 28, 28)
    assert torch.equal(a.train_x, b.train_x)  # the user sample is seeded
    assert a.train_clients is not None and set(a.train_clients.tolist()) == {0, 1, 2}
    assert set(torch.bincount(a.train_clients).tolist()) <= set(counts)
    with pytest.raises(ConfigError, match="5 users"):
        load_dataset("femnist", str(tmp_path), num_clients=6)


def test_missing_leaf_files_name_the_layout(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError, match=r"leaf/shakespeare/data/all_data/\*\.json"):
        load_dataset("shakespeare", str(tmp_path), num_clients=2)


def test_leaf_clients_are_split_80_20(tmp_path: Path) -> None:
    counts = write_leaf(tmp_path, "shakespeare", users=4)
    dm = FederatedDataModule(
        "shakespeare",
        num_clients=4,
        eval_split="holdout",
        val_fraction=0.0,
        test_fraction=0.2,
        root=str(tmp_path),
    )
    dm.setup("fit")
    train, test = dm.num_samples("train"), dm.num_samples("test")
    assert sorted((train + test).tolist()) == sorted(counts)
    assert torch.equal(test, torch.round((train + test) * 0.2).long())
    x, y = dm.fetch(dm.index["train"].flat[:3])
    assert x.dtype == torch.int64 and x.shape == (3, 80)


def test_fedtp_trains_the_char_transformer_on_shakespeare(tmp_path: Path) -> None:
    from lightning_pfl.methods.fedtp import FedTP
    from tests.conftest import build, fit

    write_leaf(tmp_path, "shakespeare", users=4)
    dm = FederatedDataModule(
        "shakespeare", num_clients=4, eval_split="holdout", test_fraction=0.2, root=str(tmp_path)
    )
    dm.setup("fit")
    method = build(
        FedTP,
        dm,
        net="char_transformer",
        net_args={"dim": 16, "heads": 2, "mlp_dim": 32},
        local_epochs=1,
        clients_per_round=2,
    )
    assert isinstance(method, FedTP)
    assert set(method.hnet.target_shapes) == {f"blocks.{i}.attn.qkv.weight" for i in (0, 1)}
    fit(method, dm, rounds=2)
    correct, total, _ = method.evaluate(torch.arange(4), "test")
    assert torch.equal(total, dm.num_samples("test").float())
