import torch

from lightning_pfl.metrics import ClientAccuracy


def test_mean_over_clients_and_sample_weighted_differ_as_defined() -> None:
    metric = ClientAccuracy(num_clients=3)
    # client 0: 9/10, client 1: 1/2, client 2 in a second update: 30/40
    metric.update(
        torch.tensor([0, 1]),
        torch.tensor([9.0, 1.0]),
        torch.tensor([10.0, 2.0]),
        torch.tensor([1.0, 2.0]),
    )
    metric.update(
        torch.tensor([2]), torch.tensor([30.0]), torch.tensor([40.0]), torch.tensor([4.0])
    )
    out = metric.compute()
    per_client = torch.tensor([0.9, 0.5, 0.75], dtype=torch.float64)
    torch.testing.assert_close(out["acc"], per_client.mean())
    torch.testing.assert_close(out["acc_weighted"], torch.tensor(40 / 52, dtype=torch.float64))
    torch.testing.assert_close(out["acc_std"], per_client.std(unbiased=False))
    torch.testing.assert_close(out["acc_min"], torch.tensor(0.5, dtype=torch.float64))
    torch.testing.assert_close(
        out["loss"], torch.tensor([0.1, 1.0, 0.1], dtype=torch.float64).mean()
    )
    torch.testing.assert_close(out["loss_weighted"], torch.tensor(7 / 52, dtype=torch.float64))


def test_clients_without_samples_are_left_out() -> None:
    metric = ClientAccuracy(num_clients=4)
    metric.update(
        torch.tensor([0, 2]), torch.tensor([1.0, 3.0]), torch.tensor([2.0, 4.0]), torch.zeros(2)
    )
    assert float(metric.compute()["acc"]) == 0.625
    assert torch.isnan(metric.per_client()[1])


def test_group_accuracies_cover_only_their_clients() -> None:
    groups = {"a": torch.tensor([0, 2]), "b": torch.tensor([1])}
    metric = ClientAccuracy(num_clients=3, groups=groups)
    metric.update(
        torch.tensor([0, 1, 2]),
        torch.tensor([9.0, 1.0, 30.0]),
        torch.tensor([10.0, 2.0, 40.0]),
        torch.zeros(3),
    )
    out = metric.compute()
    torch.testing.assert_close(out["a/acc"], torch.tensor((0.9 + 0.75) / 2, dtype=torch.float64))
    torch.testing.assert_close(out["a/acc_weighted"], torch.tensor(39 / 50, dtype=torch.float64))
    torch.testing.assert_close(out["b/acc"], torch.tensor(0.5, dtype=torch.float64))
