"""FedBABU, FedLC, FedALA, FedAMP and APPLE (issue 46): their distinguishing math on hand
examples, vectorized == one by one == threads, exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_pfl.engine import ParamGroup, SGDConfig, train_clients
from lightning_pfl.methods import FedBABU, FedLC
from lightning_pfl.methods.fedavg_ft import FINETUNE_PHASE
from lightning_pfl.methods.fedlc import calibrated_cross_entropy
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    capture_local_training,
)


def server_round(method: FedBABU | FedLC, clients: list[int], round_idx: int = 0) -> None:
    optimizer = method.configure_server_optimizer()
    optimizer.zero_grad()
    method.run_round(round_idx, torch.tensor(clients))
    optimizer.step()


# ----------------------------------------------------------------------------- FedBABU
def test_fedbabu_trains_and_averages_the_body_with_the_initial_head_frozen() -> None:
    dm = digits_data(4)
    method = build(FedBABU, dm, clients_per_round=2)
    assert isinstance(method, FedBABU)
    head = {n: method.global_state()[n].clone() for n in method.arch.head_names}
    body_before = {n: t.clone() for n, t in method.payload(torch.tensor([0])).items()}
    trained = capture_local_training(method)
    clients = torch.tensor([1, 3])
    server_round(method, [1, 3])
    result = trained[0]
    assert set(result.params) == set(body_before)  # the head is not trained ...
    assert not set(method.arch.head_names) & set(body_before)  # ... nor sent
    for name, tensor in head.items():
        assert torch.equal(method.global_state()[name], tensor), name  # never changes
    # the body is the sample-weighted mean of the clients' bodies
    weights = method.client_weights(clients).double()
    for name, tensor in method.payload(clients).items():
        mean = (weights.view(-1, *[1] * tensor[0].dim()) * result.params[name].double()).sum(0)
        torch.testing.assert_close(tensor[0], mean.float(), msg=name)
        assert not torch.equal(tensor[0], body_before[name][0]), name
    # each client's local training saw the frozen initial head: redo it by hand
    expected = train_clients(
        method.cross_entropy,
        {n: t.expand(2, *t.shape[1:]).clone() for n, t in body_before.items()},
        [ParamGroup(tuple(body_before), method.local_sgd())],
        method.draw_batches(clients, 0),
        dm.fetch,
        frozen={n: t.expand(2, *t.shape) for n, t in head.items()},
    )
    for name, tensor in result.params.items():
        torch.testing.assert_close(tensor, expected.params[name], msg=name)


@pytest.mark.parametrize("part", ["full", "head", "body"])
def test_fedbabu_personalized_model_is_the_global_model_fine_tuned_for_tau_epochs(
    part: str,
) -> None:
    dm = digits_data(4)
    method = build(FedBABU, dm, clients_per_round=2, finetune_part=part, finetune_lr=0.02)
    assert isinstance(method, FedBABU)
    server_round(method, [0, 2])
    clients = torch.arange(4)
    state = method.global_state()
    tuned = method.personalized_params(clients)
    head = method.arch.head_names
    names = {"full": tuple(state), "head": head}.get(part, tuple(n for n in state if n not in head))
    model = {n: t.expand(4, *t.shape) for n, t in state.items()}
    expected = train_clients(
        method.cross_entropy,
        {n: model[n].clone() for n in names},
        [ParamGroup(names, SGDConfig(0.02, 0.9, 5e-5, 50.0))],
        method.draw_batches(clients, 0, 5, FINETUNE_PHASE),  # tau = 5 epochs by default
        dm.fetch,
        frozen={n: t for n, t in model.items() if n not in names},
    )
    for name, tensor in tuned.items():
        if name in names:
            torch.testing.assert_close(tensor, expected.params[name], msg=name)
            assert (tensor[0] != tensor[1]).any(), name  # each client on its own data
        else:
            assert torch.equal(tensor, model[name]), name
    for name, tensor in method.global_state().items():
        assert torch.equal(tensor, state[name]), name  # fine-tuning is not kept


def test_fedbabu_vectorized_equals_sequential() -> None:
    # a small fine-tuning rate: the 1e-7 differences of vmapped and per-client steps grow with
    # it (at 0.05: 4e-4 relative in one client's evaluation loss)
    assert_vectorized_equals_sequential(FedBABU, finetune_epochs=1, finetune_lr=0.005)


def test_fedbabu_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "fedbabu.yaml", tmp_path)


# ----------------------------------------------------------------------------- FedLC
def test_fedlc_calibrated_loss_on_hand_numbers() -> None:
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]])
    y = torch.tensor([0, 2])
    counts = torch.tensor([16.0, 1.0, 0.0])  # class 2 absent: counts as 1e-8
    tau = 0.5
    margin = [0.5 * 16**-0.25, 0.5, 0.5 * 1e-8**-0.25]  # 0.25, 0.5, 50
    a = [[2.0 - margin[0], 0.5 - margin[1], -1.0 - margin[2]]]
    a.append([0.0 - margin[0], 1.0 - margin[1], 3.0 - margin[2]])
    # all: -log(e^{a_y} / sum_y' e^{a_y'}); others: -log(e^{a_y} / sum_{y' != y} e^{a_y'})
    full = [-a[0][0] + math.log(sum(math.exp(v) for v in a[0]))]
    full.append(-a[1][2] + math.log(sum(math.exp(v) for v in a[1])))
    others = [-a[0][0] + math.log(math.exp(a[0][1]) + math.exp(a[0][2]))]
    others.append(-a[1][2] + math.log(math.exp(a[1][0]) + math.exp(a[1][1])))
    weight = torch.ones(2)
    for form, per_sample in (("all", full), ("others", others)):
        loss = calibrated_cross_entropy(logits, y, counts, tau, weight, form)  # type: ignore[arg-type]
        torch.testing.assert_close(loss, torch.tensor(sum(per_sample) / 2), msg=form)
        padded = calibrated_cross_entropy(logits, y, counts, tau, torch.tensor([1.0, 0.0]), form)  # type: ignore[arg-type]
        torch.testing.assert_close(padded, torch.tensor(per_sample[0]), msg=form)
    # tau = 0 with the full denominator is the plain cross-entropy
    plain = calibrated_cross_entropy(logits, y, counts, 0.0, weight, "all")
    torch.testing.assert_close(plain, F.cross_entropy(logits, y))


def test_fedlc_clients_train_on_their_own_label_counts() -> None:
    dm = digits_data(4)
    method = build(FedLC, dm, clients_per_round=2, tau=0.7)
    assert isinstance(method, FedLC)
    clients = torch.tensor([0, 3])
    counts = method.class_counts(clients)
    table = torch.as_tensor(dm.partition_counts()["train"], dtype=torch.float32)
    assert torch.equal(counts, table[[0, 3]])
    assert (counts > 0).sum(1).tolist() == [2, 2]  # 2 classes per client
    # one local step by hand: SGD on the calibrated loss of the client's own counts
    single = build(FedLC, dm, clients_per_round=2, tau=0.7, local_steps=1, local_momentum=0.0)
    assert isinstance(single, FedLC)
    trained = capture_local_training(single)
    start = {n: t.clone() for n, t in single.global_state().items()}
    server_round(single, [0, 3])
    batches = single.draw_batches(clients, 0)
    for row in range(2):
        x, y = dm.fetch(batches.index[row, 0])
        params = {n: t.clone().requires_grad_() for n, t in start.items()}
        loss = calibrated_cross_entropy(
            single.arch(params, x, train=True), y, counts[row], 0.7, batches.weight[row, 0]
        )
        grads = torch.autograd.grad(loss, list(params.values()))
        for (name, p), g in zip(params.items(), grads, strict=True):
            clip = min(1.0, 50.0 / (math.sqrt(sum(float((gg**2).sum()) for gg in grads)) + 1e-6))
            step = p.detach() - 0.05 * (g * clip + 5e-5 * p.detach())
            torch.testing.assert_close(trained[0].params[name][row], step, msg=name)


def test_fedlc_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedLC)


def test_fedlc_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "fedlc.yaml", tmp_path)
