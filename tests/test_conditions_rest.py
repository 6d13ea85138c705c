"""Unreliable clients for more methods (docs/conditions.md, "Which methods honour them"): each
row's method leaves a reliable run bit for bit as it was, keeps a dropped client's state, reads
only the uploads that arrived and leaves the server alone in a round where none did."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pfl.conditions import Conditions, Stragglers, straggler_steps
from lightning_pfl.methods import FederatedMethod, fedfomo
from lightning_pfl.methods.apple import APPLE
from lightning_pfl.methods.cfl import CFL
from lightning_pfl.methods.fedakt import FedAKT
from lightning_pfl.methods.fedamp import FedAMP
from lightning_pfl.methods.fedfomo import FedFomo
from lightning_pfl.methods.fedgen import FedGen
from lightning_pfl.methods.fedgh import FedGH
from lightning_pfl.methods.fedmgda_plus import FedMGDAPlus
from lightning_pfl.methods.fedpac import FedPAC
from lightning_pfl.methods.fedproto import FedProto
from lightning_pfl.methods.fedu import FedU
from lightning_pfl.methods.floco import Floco
from lightning_pfl.methods.hypcluster import HypCluster
from lightning_pfl.methods.local_zoo import HeterogeneousLocal
from lightning_pfl.methods.pfedla import PFedLA
from tests.conftest import build, digits_data, fit
from tests.helpers import CONF, assert_resume_is_exact
from tests.test_conditions import (
    DROP,
    STRAGGLE,
    arrivals,
    assert_every_row_honours_the_conditions,
    assert_store_unchanged,
    garbled_dropped_uploads,
    one_round,
    round_with_drops,
    server_state,
    state,
    store_copy,
    trained,
)

# method -> (class, arguments beyond tests.conftest.build's)
ROWS: dict[str, tuple[type[FederatedMethod], dict[str, Any]]] = {
    "HeterogeneousLocal": (HeterogeneousLocal, {}),
    "FedAKT": (FedAKT, {}),
    "FedGH": (FedGH, {}),
    "FedProto": (FedProto, {"local_epochs": None, "client_momentum": "kept"}),
    "FedProto-split": (FedProto, {"local_epochs": None, "prototypes": "training_split"}),
    "FedMGDAPlus": (FedMGDAPlus, {}),
    "Floco": (Floco, {"endpoints": 3, "tau": 1}),  # the projection in the first fitted rounds
    "FedGen": (FedGen, {"generator_steps": 2}),
    # splits from the first round on (bounds every round meets), decayed lr: every state
    "CFL": (CFL, {"eps_1": 1e6, "eps_2": 0.0, "split_from_round": 0, "min_cluster_size": 1}),
    # no honest update's norm exceeds eps_2 (digits, 3 steps): only a dropped one could split
    "CFL-eps_2": (CFL, {"eps_1": 1e6, "eps_2": 20.0, "split_from_round": 0}),
    "HypCluster": (HypCluster, {"server_momentum": 0.5}),
    "FedAMP": (FedAMP, {"alpha": 5.0}),
    "APPLE": (APPLE, {"decay_rounds": 4}),
    "FedFomo": (FedFomo, {"models_per_client": 2}),
    "FedU": (FedU, {}),
    "FedPAC": (FedPAC, {"local_epochs": None, "head_epochs": 1}),
    "FedPAC-round": (FedPAC, {"local_epochs": None, "global_centroids": "round"}),
    "PFedLA": (PFedLA, {"embed_dim": 8, "hidden_dim": 8, "hn_momentum": 0.5}),
}
# the rows whose server holds something (every row but the ones that never communicate)
SERVED = [n for n in ROWS if n != "HeterogeneousLocal"]
# store fields that a client that arrived leaves as they were (set once, at Floco's round tau)
SET_ONCE = {"Floco": {"subregion"}}
# the methods whose server holds every client's latest model (in the client store)
SERVER_KEEPS_MODELS = (FedAMP, APPLE, FedFomo, FedU, PFedLA)


def keeps_models(method: FederatedMethod) -> bool:
    return isinstance(method, SERVER_KEEPS_MODELS)


TRAINED = 2  # rounds before the one under test
FEW_DROPS = {"drop_rate": 0.3}  # Floco's round 0: 3 of the 6 clients' signatures arrive


def built(name: str, clients_per_round: int, **kwargs: Any) -> FederatedMethod:
    cls, arguments = ROWS[name]
    return build(cls, digits_data(6), clients_per_round=clients_per_round, **arguments, **kwargs)


def store_clients(method: FederatedMethod, field: str) -> list[int]:
    """The client of each row of a store field (the groups' members for ``model.<group>``)."""
    groups = getattr(method, "groups", None)
    kind = field.split(".", 1)[-1]
    if groups is not None and kind in groups.archs:
        return groups.members(kind).tolist()
    return list(range(len(next(iter(method.store.fields[field].values())))))


def test_every_row_honours_the_conditions() -> None:
    assert_every_row_honours_the_conditions(cls for cls, _ in ROWS.values())


@pytest.mark.parametrize("name", ROWS)
def test_reliable_conditions_equal_a_run_without_them_bit_for_bit(name: str) -> None:
    cls, arguments = ROWS[name]
    today = state(trained(cls, **arguments))
    masked = trained(cls, conditions=Conditions(stragglers=Stragglers(rate=0.0)), **arguments)
    got = state(masked)
    assert got.keys() == today.keys()
    for key, tensor in got.items():
        assert torch.equal(tensor, today[key]), key


@pytest.mark.parametrize("name", ROWS)
def test_a_dropped_clients_state_is_untouched(name: str) -> None:
    """Every per-client tensor of a client that did not report back ends the round as it
    began; some tensor of every sampled client that arrived changed."""
    method = built(name, 4, conditions=Conditions(**DROP))
    unreliable, method.unreliable = method.unreliable, None
    fit(method, method.data, rounds=TRAINED)  # every client sampled has a state of its own
    method.unreliable = unreliable
    r = next(r for r in range(TRAINED, 50) if 0 < int(arrivals(method, r).sum()) < 4)
    before = store_copy(method)
    clients, _ = one_round(method, r)
    arrived = method.arrived(clients, r)
    for field, tensors in method.store.fields.items():
        ids = store_clients(method, field)
        for client, came in zip(clients.tolist(), arrived.tolist(), strict=True):
            if client not in ids:
                continue
            row = ids.index(client)
            same = [torch.equal(t[row], before[field][k][row]) for k, t in tensors.items()]
            if not came:
                assert all(same), (field, client)
            elif field not in SET_ONCE.get(name, set()):
                assert not all(same), (field, client)


def test_fedgens_label_prior_counts_the_labels_of_the_steps_taken() -> None:
    """The server's p(y) after a round: the labels of the batches the clients that arrived
    trained on (a straggler's cut steps and a dropped client's steps not counted)."""
    method = built("FedGen", 4, conditions={**DROP, **STRAGGLE})
    r = round_with_drops(method)
    clients = method.sample_clients(r)
    batches = method.draw_batches(clients, r)
    assert (batches.active.sum(1) > 0).any() and not batches.active.all()
    _, labels = method.data.fetch(batches.index)
    taken = batches.weight * batches.active.unsqueeze(-1)
    counts = torch.bincount(labels.flatten(), taken.flatten(), minlength=method.hp.num_classes)
    one_round(method, r)
    label_prior = method.get_buffer("label_prior")
    torch.testing.assert_close(label_prior, (counts / counts.sum()).to(label_prior))


def test_fedfomos_affinity_adds_only_the_weights_that_arrived(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P_ij grows by w_ij for the clients that reported back; a dropped client's row of P
    stays as it was (every w_ij made 1/M, so that every client has some)."""
    monkeypatch.setattr(
        fedfomo, "fomo_weights", lambda own, candidate, d: torch.full_like(candidate, 0.5)
    )
    method = built("FedFomo", 4, conditions=Conditions(**DROP))
    r = round_with_drops(method)
    before = method.get_buffer("affinity").clone()
    clients, _ = one_round(method, r)
    after = method.get_buffer("affinity")
    for client, came in zip(clients.tolist(), method.arrived(clients, r).tolist(), strict=True):
        assert torch.equal(after[client], before[client]) != came, client


@pytest.mark.parametrize("name", SERVED)
def test_the_server_reads_only_the_uploads_that_arrived(name: str) -> None:
    """The same round, once with the dropped clients' results garbled: the server ends it the
    same (and not as it began)."""
    honest, garbled = (built(name, 4, conditions=Conditions(**DROP)) for _ in range(2))
    r = round_with_drops(honest)
    initial = server_state(honest, keeps_models(honest))
    garbled_dropped_uploads(garbled, r)
    for method in (honest, garbled):
        one_round(method, r)
    expected, got = (
        server_state(honest, keeps_models(honest)),
        server_state(garbled, keeps_models(garbled)),
    )
    assert expected.keys() == got.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=key)
    assert expected.keys() != initial.keys() or any(
        not torch.equal(t, initial[k]) for k, t in expected.items()
    )
    # what the clients that arrived keep (FedPAC's combined heads, trained models) too
    clients = honest.sample_clients(r)
    came = clients[honest.arrived(clients, r)].tolist()
    for field, tensors in honest.store.fields.items():
        rows = [i for i, c in enumerate(store_clients(honest, field)) if c in came]
        for key, tensor in tensors.items():
            torch.testing.assert_close(
                garbled.store.fields[field][key][rows], tensor[rows], rtol=0, atol=0
            )


@pytest.mark.parametrize("name", ROWS)
def test_a_round_where_nothing_arrives_leaves_the_server_alone(name: str) -> None:
    method = built(name, 1, conditions=Conditions(**DROP))
    fit(method, method.data, rounds=TRAINED)
    r = next(r for r in range(TRAINED, 80) if not arrivals(method, r).any())
    method.zero_grad()  # the last fitted round's gradients
    before, stored = server_state(method, keeps_models(method)), store_copy(method)
    one_round(method, r)
    assert all(p.grad is None for p in method.parameters())
    after = server_state(method, keeps_models(method))
    assert after.keys() == before.keys()
    for key, tensor in after.items():
        assert torch.equal(tensor, before[key]), key
    assert_store_unchanged(method, stored)


def test_flocos_projection_places_only_the_clients_whose_signature_arrived() -> None:
    """Round tau: a training client whose signature did not arrive keeps the simplex center;
    every other gets a center of its own."""
    method = build(
        Floco, digits_data(6), clients_per_round=2, endpoints=3, tau=0, conditions=FEW_DROPS
    )
    everyone = torch.arange(method.num_training_clients)
    arrived = method.arrived(everyone, 0)
    assert 3 <= int(arrived.sum()) < len(everyone)
    before = method.store.fields["subregion"]["subregion"].clone()
    one_round(method, 0)
    after = method.store.fields["subregion"]["subregion"]
    for client, came in enumerate(arrived.tolist()):
        assert torch.equal(after[client], before[client]) != came, client


@pytest.mark.parametrize("name", [n for n in ROWS if ROWS[n][0] is not FedPAC])
def test_a_straggler_takes_exactly_its_drawn_steps(name: str) -> None:
    """Every local training of the round (FedPAC, whose head phase runs epochs, aside) takes
    ceil(f * S) of its S = local_steps steps."""
    steps = 7
    conditions = Conditions(stragglers=Stragglers(rate=0.7, fraction=0.9, min_fraction=0.1))
    method = built(name, 5, local_steps=steps, conditions=conditions)
    assert method.unreliable is not None
    clients, captured = one_round(method, 0)
    fraction = method.unreliable.draws(0).fraction[clients]
    assert (fraction < 1).any() and captured
    expected = [straggler_steps(float(f), steps) for f in fraction]
    for result in captured:
        assert result.steps.tolist() == expected, name


@pytest.mark.parametrize("config", ["fedgh.yaml", "fedproto.yaml"])
def test_resume_with_conditions_is_exact(config: str, tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / config,
        tmp_path,
        "--model.init_args.conditions.drop_rate=0.5",
        "--model.init_args.conditions.stragglers.min_fraction=0.2",
    )
