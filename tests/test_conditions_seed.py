"""Unreliable clients for more methods: each row's method honours the conditions
(docs/conditions.md): reliable conditions change no bit, a dropped client's state is untouched,
the server reads only what arrived and a round where nothing arrives leaves it alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pfl.conditions import Conditions, Stragglers, straggler_steps
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.methods.ccvr import CCVR
from lightning_pfl.methods.fedcp import FedCP
from lightning_pfl.methods.fedem import FedEM
from lightning_pfl.methods.fedphp import FedPHP
from lightning_pfl.methods.fedtp import FedTP, FedTPKNN, FedTPPer, FedTPRoD
from lightning_pfl.methods.knn_per import KNNPer
from lightning_pfl.methods.mapper import MAPPER
from lightning_pfl.methods.moon import MOON
from lightning_pfl.methods.partialfed import PartialFed
from lightning_pfl.methods.pfedgp import PFedGP
from lightning_pfl.methods.pfedhn_pc import PFedHNPC
from lightning_pfl.methods.pfedkt import PFedKT
from lightning_pfl.methods.vanilla_pt import VanillaPersonalizedT
from tests.conftest import build, digits_data, fit
from tests.helpers import CONF, assert_resume_is_exact
from tests.test_conditions import (
    DROP,
    arrivals,
    assert_store_unchanged,
    garbled_dropped_uploads,
    one_round,
    round_with_drops,
    state,
    store_copy,
    trained,
)

VIT: dict[str, Any] = {
    "net": "vit",
    "net_args": {"patch": 2, "dim": 16, "depth": 2, "heads": 2, "head_dim": 8, "mlp_dim": 32},
    "local_epochs": None,
}

# method -> (class, arguments); every row runs local_steps (3) unless it says otherwise
ROWS: dict[str, tuple[type[FederatedMethod], dict[str, Any]]] = {
    "PFedHNPC": (PFedHNPC, {}),
    "VanillaPersonalizedT": (VanillaPersonalizedT, VIT),
    "FedTP": (FedTP, VIT),
    "FedTPPer": (FedTPPer, VIT),
    "FedTPRoD": (FedTPRoD, VIT),
    "FedTPKNN": (FedTPKNN, VIT),
    "PFedKT": (PFedKT, {"local_epochs": None}),
    "MOON": (MOON, {"local_epochs": None, "batch_size": 8}),
    "FedPHP": (FedPHP, {}),
    "KNNPer": (KNNPer, {"knn_weight": 0.5}),
    "MAPPER": (MAPPER, {"schedule": "joint"}),
    "PFedGP": (PFedGP, {}),
    "FedEM": (FedEM, {}),
    "FedCP": (FedCP, {}),
    "CCVR": (CCVR, {}),
    "PartialFed": (PartialFed, {"select_steps": 3}),
}
# the local steps of each local_train call of a round, where not local_steps once
PHASE_STEPS = {"PartialFed": [3, None]}  # the selection's select_steps, then local_steps
# the rows whose clients keep state between rounds (client store fields), with the fields
# that a client that arrived may leave as they were (flags already set)
STATEFUL: dict[str, set[str]] = {
    "PFedHNPC": set(),
    "VanillaPersonalizedT": set(),
    "FedTPPer": set(),
    "FedTPRoD": set(),
    "PFedKT": {"visited"},
    "MOON": set(),
    "FedPHP": set(),
    "MAPPER": set(),
    "FedEM": set(),
    "FedCP": set(),
    "PartialFed": {"seen", "select"},  # select: no gradient while its local model is global
}

# the rows whose server update is not the weighted mean of the trained network tensors
NOT_A_MEAN = {"PFedHNPC", "MAPPER", "FedCP"}


def built(name: str, clients_per_round: int, **kwargs: Any) -> FederatedMethod:
    cls, arguments = ROWS[name]
    return build(cls, digits_data(6), clients_per_round=clients_per_round, **arguments, **kwargs)


@pytest.mark.parametrize("name", ROWS)
def test_reliable_conditions_equal_a_run_without_them_bit_for_bit(name: str) -> None:
    cls, arguments = ROWS[name]
    torch.manual_seed(0)  # the ViT's dropout and FedCP's Gumbel noise draw from it
    today = state(trained(cls, **arguments))
    torch.manual_seed(0)
    masked = trained(cls, conditions=Conditions(stragglers=Stragglers(rate=0.0)), **arguments)
    for key, tensor in state(masked).items():
        assert torch.equal(tensor, today[key]), key


TRAINED = 2  # rounds before the one under test


@pytest.mark.parametrize("name", STATEFUL)
def test_a_dropped_clients_state_is_untouched(name: str) -> None:
    """Every per-client tensor of a dropped client ends the round as it began; every one of
    a client that arrived changed (but the flags it had set before)."""
    method = built(name, 4, conditions=Conditions(**DROP))
    fit(method, method.data, rounds=TRAINED)  # so that the kept states differ from the sent
    r = next(r for r in range(TRAINED, 50) if 0 < int(arrivals(method, r).sum()) < 4)
    before = store_copy(method)
    clients, _ = one_round(method, r)
    arrived = method.arrived(clients, r)
    for field, tensors in method.store.fields.items():
        for key, tensor in tensors.items():
            for client, came in zip(clients.tolist(), arrived.tolist(), strict=True):
                same = torch.equal(tensor[client], before[field][key][client])
                if not (came and field in STATEFUL[name]):
                    assert same != came, (field, key, client, came)


def server_update(method: FederatedMethod) -> dict[str, torch.Tensor]:
    """What the round set on the server: every parameter's gradient and every buffer."""
    grads = {n: p.grad for n, p in method.named_parameters() if p.grad is not None}
    return grads | {n: b.clone() for n, b in method.named_buffers()}


@pytest.mark.parametrize("name", ROWS)
def test_the_server_reads_only_the_uploads_that_arrived(name: str) -> None:
    """The same round, once with the dropped clients' results garbled: the server's update is
    the same (and not empty)."""
    honest, garbled = (built(name, 4, conditions=Conditions(**DROP)) for _ in range(2))
    r = round_with_drops(honest)
    garbled_dropped_uploads(garbled, r)
    for method in (honest, garbled):
        torch.manual_seed(0)
        one_round(method, r)
    expected, got = server_update(honest), server_update(garbled)
    assert any(p.grad is not None for p in honest.parameters())
    assert expected.keys() == got.keys()
    for key, tensor in expected.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", [n for n in ROWS if n not in NOT_A_MEAN])
def test_the_global_model_is_the_weighted_mean_of_the_uploads_that_arrived(name: str) -> None:
    """Every network tensor the server steps becomes the sample-weighted mean over the
    clients that arrived of what their (last) local training returned."""
    method = built(name, 4, conditions=Conditions(**DROP))
    r = round_with_drops(method)
    torch.manual_seed(0)
    clients, captured = one_round(method, r)
    n = method.data.num_samples("train")[clients].double() * method.arrived(clients, r)
    uploads = captured[-1].params
    net = method.net
    assert isinstance(net, torch.nn.Module)
    checked = [key for key, p in net.named_parameters() if p.grad is not None]
    assert checked and set(checked) <= set(uploads)
    for key, p in net.named_parameters():
        if p.grad is not None:
            expected = torch.einsum("c,c...->...", n / n.sum(), uploads[key].double())
            torch.testing.assert_close(p.detach().double() - p.grad.double(), expected)


@pytest.mark.parametrize("name", ROWS)
def test_a_round_where_nothing_arrives_leaves_the_server_alone(name: str) -> None:
    method = built(name, 1, conditions=Conditions(**DROP))
    r = next(r for r in range(50) if not method.arrived(method.sample_clients(r), r).any())
    before = {n: t.clone() for n, t in method.state_dict().items()}
    stored = store_copy(method)
    one_round(method, r)
    assert all(p.grad is None for p in method.parameters())
    for key, tensor in method.state_dict().items():
        assert torch.equal(tensor, before[key]), key
    assert_store_unchanged(method, stored)


@pytest.mark.parametrize("name", ROWS)
def test_a_straggler_takes_exactly_its_drawn_steps(name: str) -> None:
    steps = 7
    conditions = Conditions(stragglers=Stragglers(rate=0.7, fraction=0.9, min_fraction=0.1))
    method = built(name, 5, local_steps=steps, conditions=conditions)
    assert method.unreliable is not None
    torch.manual_seed(0)
    clients, captured = one_round(method, 0)
    fraction = method.unreliable.draws(0).fraction[clients]
    assert (fraction < 1).any()
    phases = [s or steps for s in PHASE_STEPS.get(name, [None])]
    assert len(captured) == len(phases), name
    for result, phase in zip(captured, phases, strict=True):
        assert result.steps.tolist() == [straggler_steps(float(f), phase) for f in fraction], name


@pytest.mark.parametrize("config", ["pfedhn_pc.yaml", "fedphp.yaml"])
def test_resume_with_conditions_is_exact(config: str, tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / config,
        tmp_path,
        "--model.init_args.conditions.drop_rate=0.5",
        "--model.init_args.conditions.stragglers.min_fraction=0.2",
    )


def test_partialfed_counts_the_selection_steps_it_takes() -> None:
    """The selection trains on the first select_steps of its draw: only those count as local
    steps (clients/local_steps, the FLOPs), not the whole draw of local_steps."""
    method = built("PartialFed", 4, local_steps=7)
    one_round(method, 0)
    assert int(method.local_steps_drawn) == 4 * (3 + 7)
