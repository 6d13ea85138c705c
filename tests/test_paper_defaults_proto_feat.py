"""FedProto's uploaded prototypes as the authors' code computes them (issue 43, item 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_pfl.methods.fedproto import FedProto
from lightning_pfl.partition import Dirichlet
from tests.conftest import build, digits_data
from tests.helpers import CONF, assert_resume_is_exact, assert_vectorized_equals_sequential


def _by_hand(
    method: FedProto, clients: torch.Tensor, epochs: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each client's prototypes and counts as yuetan031/FedProto ``update_weights_het`` makes
    them: a plain loop of torch SGD (momentum 0.5, a fresh optimizer) over the round's batches,
    collecting the training-mode features of every batch's forward pass (before its step),
    the collection restarted at every epoch."""
    batches = method.draw_batches(clients, 0, drop_last=True)
    k, d = method.prototypes.shape
    sums, counts = torch.zeros(len(clients), k, d), torch.zeros(len(clients), k)
    for row, client in enumerate(clients.tolist()):
        params = {
            n: t[client].clone().requires_grad_() for n, t in method.store.fields["params"].items()
        }
        sgd = torch.optim.SGD(params.values(), lr=method.hp.local_lr, momentum=0.5)
        steps = batches.active[row].nonzero().flatten().tolist()
        per_epoch = len(steps) // epochs
        for taken, step in enumerate(steps):
            if taken % per_epoch == 0:  # a new epoch: the authors' agg_protos_label = {}
                sums[row].zero_()
                counts[row].zero_()
            x, y = method.data.fetch(batches.index[row, step])
            z = method.arch.features(params, x, train=True)
            loss = F.cross_entropy(method.arch.classify(params, z), y)  # no prototypes yet
            for sample in range(len(y)):
                sums[row, y[sample]] += z[sample].detach()
                counts[row, y[sample]] += 1
            sgd.zero_grad()
            loss.backward()
            sgd.step()
    return sums, counts


@pytest.mark.parametrize("epochs", [1, 2])
def test_prototypes_are_the_last_epochs_training_features_of_each_batch(epochs: int) -> None:
    dm = digits_data(3, partition=Dirichlet(0.5, min_samples=20))  # clients share classes
    method = build(FedProto, dm, clients_per_round=2, local_epochs=epochs, batch_size=16)
    assert isinstance(method, FedProto)
    assert not method.arch.stochastic, "the loop by hand needs a deterministic forward pass"
    clients = torch.tensor([0, 2])
    sums, counts = _by_hand(method, clients, epochs)
    assert (counts.sum(1) < torch.as_tensor(dm.num_samples("train"))[clients]).all(), (
        "the test needs samples outside the last epoch's batches (drop_last)"
    )
    method.run_round(0, clients)
    # the server's n_ik: the client's class-k training samples, where it has a prototype
    labels = [dm.fetch(torch.as_tensor(dm._parts["train"][c]))[1] for c in clients.tolist()]
    n = torch.stack([torch.bincount(y, minlength=dm.num_classes) for y in labels]).float()
    n = n * (counts > 0)
    present = n.sum(0) > 0
    mean = sums / counts.clamp_min(1).unsqueeze(-1)
    expected = (n.unsqueeze(-1) * mean).sum(0)[present] / n.sum(0)[present].unsqueeze(-1)
    torch.testing.assert_close(method.prototypes[present], expected, rtol=1e-4, atol=1e-5)
    assert torch.equal(method.has_prototype, present.float())


def test_training_split_keeps_the_eval_mode_means_over_every_training_sample() -> None:
    dm = digits_data(4)
    method = build(FedProto, dm, clients_per_round=1, prototypes="training_split")
    assert isinstance(method, FedProto)
    client = torch.tensor([1])
    method.run_round(0, client)
    params = {n: t[1] for n, t in method.store.fields["params"].items()}
    x, y = dm.fetch(torch.as_tensor(dm._parts["train"][1]))
    z = method.arch.features(params, x)
    for label in y.unique():
        torch.testing.assert_close(
            method.prototypes[label], z[y == label].mean(0), rtol=1e-4, atol=1e-5
        )


def test_last_epoch_prototypes_are_vectorized_equal_to_client_by_client() -> None:
    assert_vectorized_equals_sequential(FedProto, local_epochs=2, batch_size=16)


def test_last_epoch_prototypes_resume_exactly(tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / "fedproto.yaml",
        tmp_path,
        "--model.init_args.prototypes=last_epoch",
        "--model.init_args.local_epochs=1",
        "--model.init_args.local_steps=50",
        "--model.init_args.batch_size=32",
    )
