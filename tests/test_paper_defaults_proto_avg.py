"""FedProto's server average of the clients' prototypes (issue 43, item 3): the paper's
sample-weighted average (eq. 5, eq. 6's weights) by default, the authors' code's unweighted one
(``uniform``) and eq. 6 as printed (``eq6_as_printed``) as values of ``prototype_average``."""

from __future__ import annotations

import pytest
import torch

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedproto import FedProto
from lightning_pfl.partition import Dirichlet
from tests.conftest import argument_default, build, digits_data

# three clients' class-k prototypes C_ik (every feature equal to the number) and their class
# counts n_ik; a client with n_ik = 0 has no prototype of class k (its row is ignored)
PROTOTYPE = [[2.0, 3.0, 0.0], [6.0, -50.0, 0.0], [100.0, 7.0, -4.0]]
COUNTS = [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 6.0, 5.0]]
# classes 0-2 by hand; class 3: no client has it, it keeps its previous prototype 9
EXPECTED = {
    # sum_i n_ik C_ik / sum_i n_ik
    "samples": [(1 * 2 + 3 * 6) / 4, (2 * 3 + 6 * 7) / 8, -4.0, 9.0],
    # 1/|N_k| sum_i C_ik over the clients i in N_k that have class k
    "uniform": [(2 + 6) / 2, (3 + 7) / 2, -4.0, 9.0],
    # 1/|N_k| sum_i n_ik / N_k C_ik, N_k = sum_i n_ik
    "eq6_as_printed": [
        (1 / 4 * 2 + 3 / 4 * 6) / 2,
        (2 / 8 * 3 + 6 / 8 * 7) / 2,
        (5 / 5 * -4) / 1,
        9.0,
    ],
}


def test_fedproto_defaults_to_the_papers_sample_weighted_average() -> None:
    assert argument_default(FedProto, "prototype_average") == "samples"


@pytest.mark.parametrize("average", ["samples", "uniform", "eq6_as_printed"])
def test_global_prototypes_by_hand(average: str) -> None:
    method = build(FedProto, digits_data(4), prototype_average=average)
    assert isinstance(method, FedProto)
    k, d = method.prototypes.shape
    local = torch.zeros(3, k, d)
    local[:, :3] = torch.tensor(PROTOTYPE).unsqueeze(-1)
    counts = torch.zeros(3, k)
    counts[:, :3] = torch.tensor(COUNTS)
    method.prototypes[3] = 9.0
    method.has_prototype[3] = 1.0
    new, present = method.global_prototypes(local, counts)
    expected = torch.zeros(k, d)
    expected[:4] = torch.tensor(EXPECTED[average]).unsqueeze(-1)
    torch.testing.assert_close(new, expected)
    assert present.tolist() == [1.0] * 4 + [0.0] * (k - 4)


def test_round_averages_the_clients_prototypes_unweighted_with_uniform() -> None:
    """One round of three clients that share classes, ``training_split`` prototypes (the
    eval-mode means over each client's training split, taken here by hand from the trained
    models): the server's C_k is their plain mean over the clients that have class k."""
    dm = digits_data(3, partition=Dirichlet(0.5, min_samples=20))
    method = build(
        FedProto,
        dm,
        clients_per_round=3,
        prototypes="training_split",
        prototype_average="uniform",
    )
    assert isinstance(method, FedProto)
    clients = torch.arange(3)
    method.run_round(0, clients)
    sums = torch.zeros_like(method.prototypes)
    holders = torch.zeros(dm.num_classes)
    sizes = []
    for client in clients.tolist():
        params = {n: t[client] for n, t in method.store.fields["params"].items()}
        x, y = dm.fetch(torch.as_tensor(dm._parts["train"][client]))
        with torch.no_grad():
            z = method.arch.features(params, x)
        sizes.append(torch.bincount(y, minlength=dm.num_classes))
        for label in y.unique().tolist():
            sums[label] += z[y == label].mean(0)
            holders[label] += 1
    shared = holders > 1
    counts = torch.stack(sizes)[:, shared]
    assert (counts.amax(0) != counts.amin(0)).any(), "the test needs unequal n_ik"
    present = holders > 0
    torch.testing.assert_close(
        method.prototypes[present],
        sums[present] / holders[present].unsqueeze(-1),
        rtol=1e-4,
        atol=1e-5,
    )


def test_unknown_prototype_average_names_the_argument() -> None:
    with pytest.raises(ConfigError, match="prototype_average"):
        build(FedProto, digits_data(4), prototype_average="median")
