import numpy as np
import pytest
import torch

from lightning_pfl import FederatedDataModule
from lightning_pfl.eval_blocks import _worthwhile_ends
from lightning_pfl.partition import Dirichlet, PartitionError
from tests.conftest import digits_data


def test_matched_split_gives_test_and_val_the_training_classes() -> None:
    dm = digits_data(5, val_fraction=0.2)
    counts = dm.partition_counts()
    assert np.array_equal(counts["train"] > 0, counts["test"] > 0)
    assert np.array_equal(counts["train"] > 0, counts["val"] > 0)
    pooled = [np.concatenate(dm._parts[s]) for s in ("train", "val", "test")]
    everything = np.concatenate(pooled)
    assert len(everything) == len(np.unique(everything)), "splits overlap"
    assert len(pooled[0]) + len(pooled[1]) + len(pooled[2]) == 1797


def test_holdout_split_fractions_per_client() -> None:
    dm = digits_data(4, eval_split="holdout", val_fraction=0.1, test_fraction=0.25)
    for i in range(4):
        sizes = [len(dm._parts[s][i]) for s in ("train", "val", "test")]
        total = sum(sizes)
        assert abs(sizes[2] - 0.25 * total) <= 1 and abs(sizes[1] - 0.1 * total) <= 1


def test_natural_clients_come_from_the_dataset() -> None:
    dm = FederatedDataModule(
        "synthetic",
        num_clients=6,
        eval_split="holdout",
        dataset_options={"alpha": 0.5, "beta": 0.5},
    )
    dm.setup()
    assert dm.input_shape == (60,) and len(dm.num_samples("train")) == 6
    x, _ = dm.fetch(dm.index["train"].flat[:4])
    assert x.dtype == torch.float32 and x.shape == (4, 60)
    with pytest.raises(ValueError, match="holdout"):
        FederatedDataModule("synthetic", eval_split="matched")


def test_same_seed_same_clients_different_seed_different_clients() -> None:
    a, b, c = digits_data(5, seed=1), digits_data(5, seed=1), digits_data(5, seed=2)
    assert all(
        np.array_equal(x, y) for x, y in zip(a._parts["train"], b._parts["train"], strict=True)
    )
    assert not all(
        np.array_equal(x, y) for x, y in zip(a._parts["train"], c._parts["train"], strict=True)
    )


def test_clients_without_test_samples_are_an_error() -> None:
    with pytest.raises(PartitionError, match="no test samples"):
        digits_data(200, partition=Dirichlet(0.01, min_samples=3), val_fraction=0.0)


def test_step_batches_are_distinct_samples_of_the_client() -> None:
    dm = digits_data(5)
    clients = torch.tensor([0, 3])
    batches = dm.client_batches(clients, 16, torch.Generator().manual_seed(0), steps=4)
    assert batches.index.shape == (2, 4, 16) and bool(batches.active.all())
    for c, client in enumerate(clients.tolist()):
        own = set(dm._parts["train"][client].tolist())
        for s in range(4):
            drawn = batches.index[c, s].tolist()
            assert len(set(drawn)) == 16 and set(drawn) <= own


def test_epoch_batches_visit_every_sample_once_per_epoch() -> None:
    dm = digits_data(5)
    clients = torch.tensor([1, 2, 4])
    batches = dm.client_batches(clients, 32, torch.Generator().manual_seed(0), epochs=2)
    for c, client in enumerate(clients.tolist()):
        n = len(dm._parts["train"][client])
        real = batches.index[c][batches.weight[c] > 0]
        seen = torch.bincount(real, minlength=int(real.max()) + 1)
        assert int(batches.active[c].sum()) == 2 * -(-n // 32)
        assert set(torch.nonzero(seen).flatten().tolist()) == set(
            dm._parts["train"][client].tolist()
        )
        assert (seen[seen > 0] == 2).all()


def test_padding_of_a_partial_batch_repeats_the_clients_own_samples_in_turn() -> None:
    dm = digits_data(5)
    clients = torch.tensor([0, 1, 2])
    counts = [len(dm._parts["train"][c]) for c in clients.tolist()]
    batch = 32
    batches = dm.client_batches(clients, batch, torch.Generator().manual_seed(0), epochs=1)
    for c, client in enumerate(clients.tolist()):
        own = dm._parts["train"][client].tolist()
        last = int(batches.active[c].sum()) - 1  # the client's last (partial) batch
        drawn = batches.index[c, last].tolist()
        real = counts[c] - last * batch
        assert 0 < real < batch, "the test needs a partial last batch"
        # every entry, padding included, is one of the client's samples, as many distinct ones
        # as a batch can hold: padding is not one image repeated (batch-norm statistics)
        assert set(drawn) <= set(own)
        assert len(set(drawn)) == min(batch, counts[c])


def test_inputs_are_normalized_on_the_fly() -> None:
    dm = digits_data(3)
    x, y = dm.fetch(dm.index["train"].flat)
    assert dm.inputs.dtype == torch.uint8
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05
    assert y.dtype == torch.int64


def test_channel_stats_in_chunks_equal_the_direct_computation() -> None:
    from lightning_pfl.datamodule import _channel_stats

    x = torch.randint(
        0, 256, (5000, 3, 4, 4), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
    )
    index = torch.arange(0, 5000, 3)
    mean, std = _channel_stats(x, index, chunk=777)
    xf = x[index].float() / 255
    torch.testing.assert_close(mean, xf.mean([0, 2, 3]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(std, xf.std([0, 2, 3]), rtol=1e-5, atol=1e-5)


def test_ragged_eval_blocks_cover_each_clients_samples_once_with_little_padding() -> None:
    dm = digits_data(8, partition=Dirichlet(0.3, min_samples=5))
    counts = dm.num_samples("test")
    clients = counts.argsort(descending=True, stable=True)
    assert int(counts.max()) > 2 * int(counts.min()), "the test needs unequal clients"
    seen: list[list[int]] = [[] for _ in clients]
    computed = 0
    for k, index, weight in dm.ragged_eval_blocks(
        clients, "test", block=16, levels=4, min_saving=0
    ):
        assert index.shape == weight.shape and index.shape[0] == k and index.shape[1] <= 16
        computed += index.numel()
        for row in range(k):
            seen[row] += index[row][weight[row] > 0].tolist()
    for row, client in enumerate(clients.tolist()):
        assert sorted(seen[row]) == sorted(dm._parts["test"][client].tolist())
    padded = sum(index.numel() for index, _ in dm.eval_blocks(clients, "test", 16))
    assert computed < padded
    with pytest.raises(ValueError, match="descending"):
        next(dm.ragged_eval_blocks(clients.flip(0), "test", 16))


def test_ragged_eval_blocks_drop_block_ends_that_save_less_padding_than_a_network_call() -> None:
    # ending at 8 spares one client 2 positions; ending at 10 spares three clients 90 positions
    assert _worthwhile_ends([100, 10, 9, 8], [8, 10, 100], min_saving=0) == [8, 10, 100]
    assert _worthwhile_ends([100, 10, 9, 8], [8, 10, 100], min_saving=128) == [10, 100]
    assert _worthwhile_ends([100, 10, 9, 8], [8, 10, 100], min_saving=300) == [100]
    dm = digits_data(8, partition=Dirichlet(0.3, min_samples=5))
    clients = dm.num_samples("test").argsort(descending=True, stable=True)
    never_worth = list(dm.ragged_eval_blocks(clients, "test", block=16, min_saving=10**9))
    padded = list(dm.eval_blocks(clients, "test", 16))
    # the same blocks as eval_blocks', less the rows of clients that have run out of samples
    for (k, index, weight), (padded_index, padded_weight) in zip(never_worth, padded, strict=True):
        assert torch.equal(index, padded_index[:k]) and torch.equal(weight, padded_weight[:k])
        assert not padded_weight[k:].any()
