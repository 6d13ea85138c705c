import numpy as np
import pytest

from lightning_pfl.partition import (
    IID,
    ClassesPerClient,
    ClientDirichlet,
    Dirichlet,
    Pachinko,
    Partitioner,
    PartitionError,
    Shards,
    count_matrix,
    split_by_shares,
)

LABELS = np.repeat(np.arange(10), 100)  # 1000 samples, 10 balanced classes
NUM_CLASSES = 10


def split(p: Partitioner, n: int, seed: int = 0, labels: np.ndarray = LABELS, coarse=None):  # type: ignore[no-untyped-def]
    return p.split(
        labels,
        n,
        NUM_CLASSES if coarse is None else int(labels.max()) + 1,
        np.random.default_rng(seed),
        coarse,
    )


def assert_disjoint(parts: list[np.ndarray]) -> np.ndarray:
    everything = np.concatenate(parts)
    assert len(everything) == len(np.unique(everything)), "clients share samples"
    return everything


@pytest.mark.parametrize("partitioner", [IID(), Dirichlet(0.3, 5), ClassesPerClient(2), Shards(2)])
def test_disjoint_full_coverage_and_seeded(partitioner: Partitioner) -> None:
    parts = split(partitioner, 20)
    assert len(assert_disjoint(parts)) == len(LABELS)  # these partitioners deal every sample
    again = split(partitioner, 20)
    other = split(partitioner, 20, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_classes_per_client_gives_exactly_c_classes() -> None:
    parts = split(ClassesPerClient(3), 20)
    counts = count_matrix(LABELS, parts, NUM_CLASSES)
    assert ((counts > 0).sum(1) == 3).all()
    # every class is dealt to ceil(3 * 20 / 10) = 6 clients
    assert ((counts > 0).sum(0) == 6).all()


def test_classes_per_client_proportions_apply_to_other_splits() -> None:
    p = ClassesPerClient(2, 0.4, 0.6)
    rng = np.random.default_rng(0)
    shares = p.shares(10, NUM_CLASSES, rng)
    assert np.allclose(shares.sum(0), 1.0)
    train = count_matrix(LABELS, split_by_shares(LABELS, shares, rng), NUM_CLASSES)
    test_labels = np.repeat(np.arange(10), 20)
    test = count_matrix(test_labels, split_by_shares(test_labels, shares, rng), NUM_CLASSES)
    assert np.array_equal(train > 0, test > 0)
    nonzero = shares > 0
    # each (client, class) weight is a / sum_j a_j with a in [0.4, 0.6] and 2 holders per class
    assert (
        shares[nonzero].min() >= 0.4 / (0.4 + 0.6) - 1e-9
        and shares[nonzero].max() <= 0.6 / 1.0 + 1e-9
    )


def test_dirichlet_min_samples_by_construction_for_10000_clients() -> None:
    labels = np.random.default_rng(0).integers(0, 10, 60_000)
    parts = split(Dirichlet(alpha=0.1, min_samples=5), 10_000, labels=labels)
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 5 and sizes.sum() == len(labels)
    assert_disjoint(parts)


def test_dirichlet_small_alpha_is_skewed() -> None:
    counts = count_matrix(LABELS, split(Dirichlet(0.05, 0), 10), NUM_CLASSES)
    top_share = counts.max(1) / np.maximum(counts.sum(1), 1)
    assert np.median(top_share) > 0.6


def test_shards_are_label_sorted_chunks() -> None:
    parts = split(Shards(2), 50)  # 100 shards of 10 samples of a single class each
    counts = count_matrix(LABELS, parts, NUM_CLASSES)
    assert ((counts > 0).sum(1) <= 2).all() and (counts.sum(1) == 20).all()


def test_pachinko_draws_fine_labels_inside_drawn_coarse_labels() -> None:
    fine = np.repeat(np.arange(20), 30)  # 20 fine classes, 4 per coarse class
    coarse = fine // 4
    parts = split(Pachinko(alpha=0.1, beta=10.0), 6, labels=fine, coarse=coarse)
    assert_disjoint(parts)
    assert all(len(p) == len(fine) // 6 for p in parts)
    assert all(np.array_equal(fine[p] // 4, coarse[p]) for p in parts)
    coarse_counts = np.stack([np.bincount(coarse[p], minlength=5) for p in parts])
    assert np.median(coarse_counts.max(1) / coarse_counts.sum(1)) > 0.4  # alpha=0.1: concentrated


@pytest.mark.parametrize(
    ("make", "n", "message"),
    [
        (lambda: ClassesPerClient(11), 5, "only 10 classes"),
        (lambda: Dirichlet(0.0), 5, "partition.init_args.alpha = 0.0 must be > 0"),
        (lambda: Dirichlet(0.5, min_samples=200), 10, "min_samples"),
        (lambda: Shards(30), 50, "shards"),
        (lambda: Pachinko(), 5, "coarse labels"),
        (lambda: IID(), 2000, "lower num_clients"),
    ],
)
def test_impossible_requests_raise_clear_errors(make, n: int, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PartitionError, match=message):
        split(make(), n)


def test_rounding_does_not_starve_the_last_clients() -> None:
    labels = np.repeat(np.arange(10), 2)  # 2 samples per class, 3 clients: 1/3 share each
    parts = split_by_shares(labels, np.full((3, 10), 1 / 3), np.random.default_rng(0))
    sizes = [len(p) for p in parts]
    assert sum(sizes) == 20 and min(sizes) >= 5


def test_iid_gives_equal_sizes_even_with_more_clients_than_samples_per_class() -> None:
    labels = np.random.default_rng(0).integers(0, 10, 50_000)
    sizes = [len(p) for p in split(IID(), 10_000, labels=labels)]
    assert min(sizes) == max(sizes) == 5


def dirichlet_purity(alpha: float, classes: int) -> float:
    """E[sum_c q_c^2] for q ~ Dir(alpha 1_C)."""
    return (alpha + 1) / (classes * alpha + 1)


def test_client_dirichlet_draws_each_clients_proportions_with_its_alpha() -> None:
    """pFedHN section 5.3: every client draws its own class proportions, the training clients
    from Dir(alpha), the last novel_clients from Dir(novel_alpha). Each client's counts are its
    drawn proportions times the common size (largest-remainder rounding), and the mean purity
    sum_c p_c^2 of each group matches its alpha's expectation."""
    labels = np.repeat(np.arange(10), 20_000)
    partitioner = ClientDirichlet(alpha=0.1, novel_alpha=1.0, novel_clients=200)
    parts = split(partitioner, 400, labels=labels)
    assert_disjoint(parts)
    counts = count_matrix(labels, parts, NUM_CLASSES)
    size = counts.sum(1)
    assert (size == size[0]).all()
    q, _ = partitioner.proportions(400, NUM_CLASSES, np.random.default_rng(0))
    assert np.abs(counts - size[0] * q).max() < 1  # rounding only: the drawn proportions
    p = counts / size[:, None]
    purity = (p**2).sum(1)
    for group, alpha in ((purity[:200], 0.1), (purity[200:], 1.0)):
        error = 4 * group.std() / np.sqrt(len(group))
        assert abs(group.mean() - dirichlet_purity(alpha, NUM_CLASSES)) < error
    assert purity[:200].mean() > purity[200:].mean() + 0.2


def test_client_dirichlet_is_seeded_and_keeps_the_training_clients_across_novel_alphas() -> None:
    labels = np.repeat(np.arange(10), 2_000)
    make = lambda novel_alpha: ClientDirichlet(0.1, novel_alpha, 5, samples_per_client=100)  # noqa: E731
    parts = split(make(0.25), 50, labels=labels)
    again = split(make(0.25), 50, labels=labels)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other_seed = split(make(0.25), 50, seed=1, labels=labels)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other_seed, strict=True))
    other_novel = split(make(1.0), 50, labels=labels)
    assert all(np.array_equal(a, b) for a, b in zip(parts[:45], other_novel[:45], strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(parts[45:], other_novel[45:], strict=True))
    assert [len(p) for p in parts] == [100] * 50


def test_client_dirichlet_size_is_the_largest_every_class_allows() -> None:
    """s = floor(min_c (N_c - n) / sum_i q_ic): every class suffices whatever the rounding."""
    labels = np.repeat(np.arange(10), np.arange(1, 11) * 100)
    partitioner = ClientDirichlet(0.3, 2.0, 4)
    parts = split(partitioner, 30, labels=labels)
    q, _ = partitioner.proportions(30, NUM_CLASSES, np.random.default_rng(0))
    totals = np.bincount(labels, minlength=NUM_CLASSES)
    expected = int(np.floor(((totals - 30) / q.sum(0)).min()))
    assert [len(p) for p in parts] == [expected] * 30
    assert sum(len(p) for p in parts) <= len(labels)


def test_client_dirichlet_refuses_impossible_splits() -> None:
    with pytest.raises(PartitionError, match="novel_clients"):
        split(ClientDirichlet(0.1, 1.0, novel_clients=21), 20)
    with pytest.raises(PartitionError, match="cannot give"):
        split(ClientDirichlet(0.1), 1000)
    with pytest.raises(PartitionError, match="novel_alpha"):
        ClientDirichlet(0.1, novel_alpha=0.0)
