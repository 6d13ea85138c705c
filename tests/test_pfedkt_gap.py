"""The variants of benchmarks/pfedkt_gap.py start where they say, and record what they say."""

from typing import Any

import torch

from benchmarks.pfedkt_gap import LastPMStart, Omega0Start, RecordedLocal, RecordedPFedKT
from lightning_pfl.engine import Params
from lightning_pfl.methods import PFedKT
from tests.conftest import build, digits_data

FAST: dict[str, Any] = {"local_epochs": None, "clients_per_round": 2}


def capture_starts(method: Any) -> list[Params]:
    starts: list[Params] = []
    original = method.local_train

    def wrapped(params: Params, *args: Any, **kwargs: Any) -> Any:
        starts.append({n: t.clone() for n, t in params.items()})
        return original(params, *args, **kwargs)

    method.local_train = wrapped
    return starts


def second_visit_start(cls: type[PFedKT]) -> tuple[Params, Params, Params, Params]:
    """Client 1's start at its second visit, its PM after the first, its HN's output then,
    and omega^0."""
    method = build(cls, digits_data(6), **FAST)
    assert isinstance(method, PFedKT)
    omega0 = {n: t.detach().clone() for n, t in method.net.named_parameters()}
    starts = capture_starts(method)
    method.run_round(0, torch.tensor([1, 4]))
    trained = {n: t[0].clone() for n, t in method.personalized_params(torch.tensor([1])).items()}
    hn = {k: v[torch.tensor([1])] for k, v in method.store.fields["hn"].items()}
    generated = method._hn_template[0].unflatten(torch.vmap(method.generate)(hn))
    method.run_round(1, torch.tensor([1, 2]))
    start = {n: t[0] for n, t in starts[1].items()}
    return start, trained, {n: t[0] for n, t in generated.items()}, omega0


def test_pfedkt_restarts_later_visits_from_the_hn_output_not_the_trained_pm() -> None:
    start, trained, generated, _ = second_visit_start(RecordedPFedKT)
    for name, t in start.items():
        torch.testing.assert_close(t, generated[name], msg=name)
        assert not torch.equal(t, trained[name]), name


def test_last_pm_start_continues_the_trained_pm() -> None:
    start, trained, _, _ = second_visit_start(LastPMStart)
    for name, t in start.items():
        assert torch.equal(t, trained[name]), name


def test_omega0_start_restarts_from_the_global_init() -> None:
    start, trained, _, omega0 = second_visit_start(Omega0Start)
    for name, t in start.items():
        assert torch.equal(t, omega0[name]), name
        assert not torch.equal(t, trained[name]), name


def test_recorded_accuracy_is_the_start_and_the_evaluated_personalized_model() -> None:
    """The trained accuracy a visit records is what the method's own evaluation gives its
    personalized model (pFedKT: the trained PM); Local's next start is its last trained model."""
    for cls in (RecordedPFedKT, RecordedLocal):
        method: Any = build(cls, digits_data(6), **FAST)
        clients = torch.tensor([1, 4])
        method.run_round(0, clients)
        method.run_round(1, clients)
        (_, seen, start, trained) = method.visits[-1]
        assert torch.equal(seen, clients)
        for column, split in enumerate(("test", "val")):
            correct, total, _ = method.evaluate_clients(clients, split)
            torch.testing.assert_close(trained[:, column], correct / total)
        if cls is RecordedLocal:
            torch.testing.assert_close(start, method.visits[0][3])


def test_mu_zero_trains_as_case_b() -> None:
    """With mu = 0 pFedKT's loss is CE alone, Table 11's case B (HN only): the same PMs."""
    dm = digits_data(6)
    pms = []
    for options in ({"mu": 0.0}, {"ablation": "B"}):
        method = build(PFedKT, dm, **FAST, **options)
        for r, clients in enumerate(([1, 4], [1, 2], [4, 1])):
            method.run_round(r, torch.tensor(clients))
        pms.append(method.personalized_params(torch.arange(6)))
    for name, t in pms[0].items():
        torch.testing.assert_close(t, pms[1][name], rtol=0, atol=0, msg=name)
