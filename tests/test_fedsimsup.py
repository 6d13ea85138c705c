import math
from typing import Any

import numpy as np
import pytest
import torch

from lightning_pfl.methods import FedSimSup
from lightning_pfl.methods.fedsimsup import mix_non_participants
from lightning_pfl.models import build_network
from tests.conftest import build, digits_data, fit

MIXED = {
    "cnn": {"net": "digits_cnn", "net_args": {"width": 4, "hidden": 40}, "share": 0.5},
    "small": {"net": "small_cnn", "net_args": {"width": 4}, "share": 0.25},
    "vit": {"net": "transformer", "net_args": {"patch": 2, "dim": 8, "heads": 2}, "share": 0.25},
}


def build_simsup(num_clients: int = 8, **kwargs: Any) -> FedSimSup:
    dm = digits_data(num_clients)
    defaults: dict[str, Any] = {
        "supervisors": MIXED,
        "supervisor_epochs": 1,
        "model_epochs": 1,
        "batch_size": 16,
        "clients_per_round": 4,
    }
    method = build(FedSimSup, dm, **{**defaults, **kwargs})
    assert isinstance(method, FedSimSup)
    return method


def test_non_participant_update_matches_a_hand_computed_example() -> None:
    # Clients 0 and 1 did not take part; participants 2 and 3 trained theta = 10 and 20.
    own_labels = torch.tensor([[3.0, 0.0], [1.0, 1.0]])
    trained_labels = torch.tensor([[4.0, 0.0], [0.0, 2.0]])
    own = {"w": torch.tensor([[1.0], [2.0]])}
    trained = {"w": torch.tensor([[10.0], [20.0]])}
    # sum_j m_j = 6. Client 0: m=3, a = 2*3/(6+2*3) = 1/2; s = (cos 0, cos 90deg) = (1, 0),
    # so theta_0 = 0.5*1 + 0.5*10 = 5.5. Client 1: m=2, a = 4/10; s = (1/sqrt2, 1/sqrt2),
    # weights (1/2, 1/2), so theta_1 = 0.4*2 + 0.6*15 = 9.8.
    mixed = mix_non_participants(own, trained, own_labels, trained_labels, self_weight=2.0)
    torch.testing.assert_close(mixed["w"], torch.tensor([[5.5], [9.8]]))
    # uniform: weights (1/2, 1/2) for both, so theta_0 = 0.5*1 + 0.5*15 = 8.
    uniform = mix_non_participants(own, trained, own_labels, trained_labels, 2.0, "uniform")
    torch.testing.assert_close(uniform["w"], torch.tensor([[8.0], [9.8]]))


def test_k_is_the_number_of_clients_per_round_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The example above run through a round of FedSimSup(self_weight=None) with 4 clients, 2 per
    # round: clients 2 and 3 take part with theta = 10 and 20 (no epochs, so that stays their
    # trained theta), clients 0 and 1 hold 1 and 2. K = 2 gives 5.5 and 9.8; K = 4 (the number of
    # clients) would give a_0 = 4*3/(6+12) = 2/3, theta_0 = 4.0, and a_1 = 8/14, theta_1 = 7.57.
    method = build_simsup(4, clients_per_round=2, supervisor_epochs=0, model_epochs=0)
    assert method.hp.self_weight is None
    counts = np.zeros((4, method.hp.num_classes), dtype=np.int64)
    counts[:, :2] = [[3, 0], [1, 1], [4, 0], [0, 2]]
    monkeypatch.setattr(method.data, "partition_counts", lambda: {"train": counts})
    for tensor in method.store.fields["theta"].values():
        for client, value in enumerate([1.0, 2.0, 10.0, 20.0]):
            tensor[client] = value
    method.run_round(0, torch.tensor([2, 3]))
    for tensor in method.store.fields["theta"].values():
        expected = torch.tensor([5.5, 9.8, 10.0, 20.0]).view(-1, *[1] * (tensor.dim() - 1))
        torch.testing.assert_close(tensor, expected.expand_as(tensor).to(tensor.dtype))


def test_a_client_sharing_no_class_with_the_participants_keeps_its_model() -> None:
    own = {"w": torch.tensor([[1.0, -1.0]])}
    mixed = mix_non_participants(
        own,
        {"w": torch.tensor([[5.0, 5.0]])},
        torch.tensor([[0.0, 4.0]]),
        torch.tensor([[3.0, 0.0]]),
        1.0,
    )
    torch.testing.assert_close(mixed["w"], own["w"])


def test_round_trains_supervisors_locally_and_mixes_the_others() -> None:
    method = build_simsup(8)
    theta_before = {n: t.clone() for n, t in method.store.fields["theta"].items()}
    sup_before = {k: {n: t.clone() for n, t in f.items()} for k, f in method.store.fields.items()}
    clients = torch.tensor([1, 2, 5, 6])
    method.run_round(0, clients)
    for kind in method.supervisors.names:
        field = method.store.fields[f"supervisor.{kind}"]
        members = method.supervisors.members(kind)
        for n, t in field.items():
            changed = (t != sup_before[f"supervisor.{kind}"][n]).flatten(1).any(1)
            assert changed.tolist() == [int(c) in clients.tolist() for c in members], kind
    changed = (method.store.fields["theta"]["fc2.weight"] != theta_before["fc2.weight"]).flatten(1)
    labels = torch.as_tensor(method.data.partition_counts()["train"])
    shares_a_class = (labels @ labels[clients].T).sum(1) > 0
    participant = torch.isin(torch.arange(8), clients)
    assert changed.any(1).tolist() == (participant | shares_a_class).tolist()
    assert (shares_a_class & ~participant).any()  # some non-participant was mixed

    none = build_simsup(8, aggregation="none")
    none.run_round(0, clients)
    kept = none.store.fields["theta"]["fc2.weight"] == theta_before["fc2.weight"]
    assert kept.flatten(1).all(1).tolist() == [c not in clients.tolist() for c in range(8)]


@pytest.mark.parametrize("frozen_phase", ["supervisor", "model"])
def test_each_phase_trains_only_its_model(frozen_phase: str) -> None:
    epochs = {"supervisor_epochs": 0} if frozen_phase == "supervisor" else {"model_epochs": 0}
    method = build_simsup(8, aggregation="none", **epochs)
    before = {k: {n: t.clone() for n, t in f.items()} for k, f in method.store.fields.items()}
    method.run_round(0, torch.arange(8))
    for field, tensors in method.store.fields.items():
        same = all(torch.equal(t, before[field][n]) for n, t in tensors.items())
        assert same == field.startswith(frozen_phase if frozen_phase == "supervisor" else "theta")


def test_prediction_is_the_sum_of_both_models_logits() -> None:
    method = build_simsup(8)
    vit = method.supervisors.names.index("vit")
    clients = (method.supervisors.group_of == vit).nonzero()[:2, 0]
    params = method.personalized_params(clients)
    x, _ = method.data.fetch(torch.arange(5))
    theta = method.store.gather("theta", clients[:1], torch.device("cpu"))
    sup = method.store.gather(
        "supervisor.vit", method.supervisors.row_of[clients[:1]], torch.device("cpu")
    )
    expected = method.arch({n: t[0] for n, t in theta.items()}, x) + method.supervisors.archs[
        "vit"
    ]({n: t[0] for n, t in sup.items()}, x)
    torch.testing.assert_close(method.predict({n: t[0] for n, t in params.items()}, x), expected)


def test_supervisor_types_are_assigned_in_exact_seeded_proportions() -> None:
    method = build_simsup(8)
    counts = torch.bincount(method.supervisors.group_of, minlength=3).tolist()
    assert dict(zip(method.supervisors.names, counts, strict=True)) == {
        "cnn": 4,
        "small": 2,
        "vit": 2,
    }
    assert torch.equal(build_simsup(8).supervisors.group_of, method.supervisors.group_of)
    assert not torch.equal(
        build_simsup(8, seed=1).supervisors.group_of, method.supervisors.group_of
    )
    with pytest.raises(ValueError, match="'net'"):
        build_simsup(8, supervisors={"a": {"net_args": {}}})
    with pytest.raises(ValueError, match="local_epochs"):
        build_simsup(8, local_epochs=2)


def test_default_supervisor_is_about_a_sixth_of_lenet5() -> None:
    def size(**kw: Any) -> int:
        return sum(p.numel() for p in build_network("lenet5", (3, 32, 32), 10, **kw).parameters())

    assert size() == 62006  # LeNet-5 on 32x32x3
    assert 5 < size() / size(width=0.4) < 7
    assert math.isclose(size() / size(width=0.4), 6.0, rel_tol=0.1)


def test_vectorized_and_sequential_rounds_agree_across_supervisor_types() -> None:
    states = []
    for vectorize in (True, False):
        method = build_simsup(8, vectorize=vectorize)
        fit(method, method.data, rounds=2)
        states.append(method.store.state_dict())
    fast, slow = states
    for field, tensors in fast.items():
        for name in tensors:
            torch.testing.assert_close(
                tensors[name], slow[field][name], rtol=1e-4, atol=1e-5, msg=f"{field}.{name}"
            )


def test_accuracy_is_reported_per_supervisor_type() -> None:
    method = build_simsup(8)
    groups = method.client_groups()
    assert sorted(groups) == ["supervisor_cnn", "supervisor_small", "supervisor_vit"]
    assert sorted(torch.cat(list(groups.values())).tolist()) == list(range(8))
    correct, total, _ = method.evaluate(torch.arange(8), "test")
    assert (total > 0).all() and (correct <= total).all()


def test_phases_draw_their_own_batches_and_select_trims_idle_steps() -> None:
    method = build_simsup(8)
    clients = torch.tensor([0, 3, 5])
    first = method.draw_batches(clients, 4, epochs=2, phase=1)
    assert torch.equal(first.index, method.draw_batches(clients, 4, epochs=2, phase=1).index)
    assert not torch.equal(first.index, method.draw_batches(clients, 4, epochs=2, phase=2).index)
    rows = torch.tensor([first.active.sum(1).argmin()])  # the client with the fewest steps
    subset = first.select(rows)
    assert subset.active.shape[1] == int(first.active[rows].sum()) and subset.active.all()
    torch.testing.assert_close(subset.index, first.index[rows][:, first.active[rows][0]])
