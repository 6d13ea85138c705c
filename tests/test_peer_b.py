"""FedBABU, FedLC, FedALA, FedAMP and APPLE (issue 46): their distinguishing math on hand
examples, vectorized == one by one == threads (exact resume: tests/test_cli.py, RESUMED)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_pfl.engine import ParamGroup, SGDConfig, TrainResult, train_clients
from lightning_pfl.errors import ConfigError
from lightning_pfl.execution import Executor, TrainJob
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.methods.apple import APPLE, regularization_weight
from lightning_pfl.methods.fedala import FedALA
from lightning_pfl.methods.fedamp import FedAMP, attention_weights
from lightning_pfl.methods.fedavg_ft import FINETUNE_PHASE
from lightning_pfl.methods.fedbabu import FedBABU
from lightning_pfl.methods.fedlc import FedLC, calibrated_cross_entropy
from tests.conftest import build, digits_data
from tests.helpers import (
    assert_vectorized_equals_sequential,
    capture_local_training,
)


def server_round(method: FederatedMethod, clients: list[int], round_idx: int = 0) -> None:
    optimizer = method.configure_server_optimizer()
    if optimizer is not None:
        optimizer.zero_grad()
    method.run_round(round_idx, torch.tensor(clients))
    if optimizer is not None:
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
        context={n: t.expand(2, *t.shape) for n, t in head.items()},
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
    h, clip = method.hp, method.hp.local_max_grad_norm
    expected = train_clients(
        method.cross_entropy,
        {n: model[n].clone() for n in names},
        [ParamGroup(names, SGDConfig(0.02, h.finetune_momentum, h.local_weight_decay, clip))],
        method.draw_batches(clients, 0, 5, FINETUNE_PHASE),  # tau = 5 epochs by default
        dm.fetch,
        context={n: t for n, t in model.items() if n not in names},
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


# ----------------------------------------------------------------------------- FedALA
def build_fedala(**kwargs: Any) -> FedALA:
    dm = digits_data(4)
    kwargs = {"batch_size": 64, "ala_max_epochs": 3, **kwargs}  # 4 ALA steps per epoch
    method = build(FedALA, dm, clients_per_round=2, **kwargs)
    assert isinstance(method, FedALA)
    return method


def test_fedala_one_weight_step_on_hand_numbers() -> None:
    # a batch holds a client's whole s% subset: one epoch is one step
    method = build_fedala(eta=0.5, rand_percent=50.0, batch_size=512)
    assert method.top == ("fc2.weight", "fc2.bias")  # p = 1: the classifier layer
    clients = torch.tensor([0, 2])
    received = {n: t.expand(2, *t.shape).clone() for n, t in method.global_state().items()}
    g = torch.Generator().manual_seed(0)
    local = {n: t + 0.3 * torch.randn(t.shape, generator=g) for n, t in received.items()}
    start, weights = method.adaptive_local_aggregation(
        0, clients, received, local, torch.tensor([False, False])
    )
    batches = method.ala_batches(clients, 0)
    n = method.data.num_samples("train")[clients]
    assert batches.active.shape[1] == 1
    assert batches.weight.sum((1, 2)).tolist() == (n * 0.5).floor().tolist()
    for row in range(2):
        x, y = method.data.fetch(batches.index[row, 0])
        # W = 1 at first: the mixed model is the global model; its gradient by autograd
        theta = {k: t[row].clone().requires_grad_() for k, t in received.items()}
        loss = F.cross_entropy(method.arch(theta, x, train=True), y, reduction="none")
        loss = (loss * batches.weight[row, 0]).sum() / batches.weight[row, 0].sum()
        grads = dict(zip(theta, torch.autograd.grad(loss, list(theta.values())), strict=True))
        for name in received:
            if name in method.top:
                diff = received[name][row] - local[name][row]
                w = (1 - 0.5 * grads[name] * diff).clamp(0, 1)
                torch.testing.assert_close(weights["ala." + name][row], w, msg=name)
                expected = local[name][row] + diff * w
            else:
                expected = received[name][row]  # lower layers: the global model
            torch.testing.assert_close(start[name][row], expected, msg=name)
    assert bool((weights["ala.fc2.weight"] < 1).any())


@pytest.mark.parametrize(("threshold", "epochs"), [(1e9, 11), (0.0, 14)])
def test_fedala_first_ala_trains_until_the_epoch_losses_settle(
    threshold: float, epochs: int
) -> None:
    method = build_fedala(convergence_threshold=threshold, ala_max_epochs=14)
    calls = capture_local_training(method)
    clients = torch.tensor([1, 3])
    state = method.global_state()
    received = {n: t.expand(2, *t.shape).clone() for n, t in state.items()}
    local = {n: t + 0.1 for n, t in received.items()}
    # client 1's first ALA runs to convergence; client 3's (a later one) one epoch
    method.adaptive_local_aggregation(0, clients, received, local, torch.tensor([True, False]))
    # the window of 10 epoch losses is full after 11 epochs; a huge threshold stops there, and
    # with every client converged the idle epochs left are not run
    assert len(calls) == epochs
    # the first epoch trains both clients, the later ones client 1 alone (client 3 is done)
    assert calls[0].steps.tolist()[1] > 0
    per_epoch = calls[0].steps.tolist()[0]
    assert per_epoch > 0
    assert [c.steps.tolist() for c in calls[1:]] == [[per_epoch]] * (epochs - 1)


class MarkedRecorded(Executor):
    """A CPU executor that says it records rounds (``graphs`` set) and trains eagerly."""

    def __init__(self, own: Executor) -> None:
        super().__init__(own.settings, own.data, own.device, None, own.world)
        self.own, self.graphs = own, object()  # type: ignore[assignment]

    def train(self, job: TrainJob) -> TrainResult:
        return self.own.train(job)


def test_fedala_epochs_of_the_clients_still_learning_equal_masked_epochs_of_all() -> None:
    """Without recorded rounds the epochs after the first train only the clients whose first
    ALA goes on; with them (fixed shapes) every client's steps are masked: the same weights."""
    outcomes, rows_per_epoch = [], []
    for recorded in (False, True):
        method = build_fedala(convergence_threshold=0.1, ala_max_epochs=30, batch_size=16)
        if recorded:
            method.executor = MarkedRecorded(method.executor)
        calls = capture_local_training(method)
        clients = torch.tensor([0, 1, 2, 3])
        received = {n: t.expand(4, *t.shape).clone() for n, t in method.global_state().items()}
        g = torch.Generator().manual_seed(1)
        local = {n: t + 0.2 * torch.randn(t.shape, generator=g) for n, t in received.items()}
        first = torch.tensor([True, False, True, False])
        outcomes.append(method.adaptive_local_aggregation(0, clients, received, local, first))
        rows_per_epoch.append([len(c.steps) for c in calls])
    (compact_start, compact), (masked_start, masked) = outcomes
    rows, masked_rows = rows_per_epoch
    assert masked_rows == [4] * len(rows)  # as many epochs, every client in each
    # epoch 0: all; then clients 0 and 2; after a window's sync only the one still learning
    assert rows[0] == 4 and rows[1] == 2 and rows[-1] == 1
    assert rows[1:] == sorted(rows[1:], reverse=True)
    for name in masked_start:
        torch.testing.assert_close(compact_start[name], masked_start[name], msg=name)
    for name in ("ala.fc2.weight", "ala.fc2.bias"):
        torch.testing.assert_close(compact[name], masked[name], msg=name)
    assert (compact["ala.fc2.weight"] != 1).any()


def test_fedala_round_starts_new_clients_from_the_global_model_and_mixes_later() -> None:
    method = build_fedala()
    trained = capture_local_training(method)
    server_round(method, [0, 1], round_idx=0)
    assert len(trained) == 1  # no ALA at a first participation
    assert method.visits.tolist() == [1, 1, 0, 0]
    local = method.store.gather("local", torch.tensor([0, 1]), method.device)
    for name in local:
        torch.testing.assert_close(local[name], trained[0].params[name])
    personal = method.personalized_params(torch.arange(4))
    for name, tensor in method.global_state().items():
        torch.testing.assert_close(personal[name][:2], local[name])
        assert torch.equal(personal[name][2], tensor)  # never sampled: the global model
    server_round(method, [1, 2], round_idx=1)
    assert len(trained) > 2  # client 1's first ALA (several epochs), then training
    assert method.visits.tolist() == [1, 2, 1, 0]
    weights = method.store.fields["weights"]["ala.fc2.weight"]
    assert (weights[1] != 1).any() and (weights[2] == 1).all()


def test_fedala_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedALA, ala_max_epochs=3, batch_size=64)


# ----------------------------------------------------------------------------- FedAMP
def test_fedamp_attention_weights_on_hand_numbers() -> None:
    distance = torch.tensor([[0.0, 2.0, 4.0], [2.0, 0.0, 6.0]], dtype=torch.float64)
    own = torch.tensor([[True, False, False], [False, True, False]])
    xi = attention_weights(distance, own, alpha=0.5, sigma=2.0)
    a01, a02, a12 = (0.25 * math.exp(-v / 2) for v in (2.0, 4.0, 6.0))
    expected = [[1 - a01 - a02, a01, a02], [a01, 1 - a01 - a12, a12]]
    torch.testing.assert_close(xi, torch.tensor(expected, dtype=torch.float64))
    assert torch.allclose(xi.sum(1), torch.ones(2, dtype=torch.float64))


def test_fedamp_cloud_models_proximal_loss_and_round() -> None:
    dm = digits_data(4)
    method = build(FedAMP, dm, clients_per_round=2, alpha=0.4, sigma=3.0, lam=0.2)
    assert isinstance(method, FedAMP)
    store = method.store.fields["params"]
    g = torch.Generator().manual_seed(0)
    for tensor in store.values():
        tensor += 0.02 * torch.randn(tensor.shape, generator=g)
    models = {n: t.clone() for n, t in store.items()}
    flat = torch.cat([t.flatten(1) for t in models.values()], 1).double()
    clients = torch.tensor([1, 3])
    distance = ((flat[clients].unsqueeze(1) - flat.unsqueeze(0)) ** 2).sum(-1)
    xi = attention_weights(distance, clients.view(-1, 1) == torch.arange(4), 0.4, 3.0)
    cloud = method.cloud_models(clients)
    for name, tensor in models.items():
        expected = torch.einsum("cj,j...->c...", xi, tensor.double()).float()
        torch.testing.assert_close(cloud[name], expected, msg=name)
    # the local objective: F_i(w) + lambda / (2 alpha) ||w - u_i||^2
    x, y = dm.fetch(dm.index["train"].flat[:12])
    weight = torch.ones(12)
    w = {n: t[0] + 0.01 for n, t in cloud.items()}
    anchor_u = {"anchor." + n: t[0] for n, t in cloud.items()}
    value = method.prox_loss(w, anchor_u, x, y, weight)
    squared = sum(float(((w[n] - cloud[n][0]) ** 2).sum()) for n in w)
    ce = F.cross_entropy(method.arch(w, x, train=True), y)
    torch.testing.assert_close(value, ce + 0.2 / (2 * 0.4) * squared)
    trained = capture_local_training(method)
    method.run_round(0, clients)
    after = method.store.fields["params"]
    for name, tensor in models.items():
        assert torch.equal(after[name][[0, 2]], tensor[[0, 2]]), name  # others untouched
        torch.testing.assert_close(after[name][[1, 3]], trained[0].params[name])
    assert method.record.round_bytes[0] == method.record.round_bytes[1]  # u_i down, w_i up


def test_fedamp_refuses_a_negative_self_attention() -> None:
    with pytest.raises(ConfigError, match="alpha"):
        build(FedAMP, digits_data(4), alpha=1.0, sigma=2.0)  # 1 * 3 / 2 > 1


def test_fedamp_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedAMP)


# ----------------------------------------------------------------------------- APPLE
def test_apple_regularization_schedule_on_hand_numbers() -> None:
    assert regularization_weight("cosine", 0, 8) == 1.0
    assert regularization_weight("cosine", 2, 8) == pytest.approx((math.cos(math.pi / 4) + 1) / 2)
    assert regularization_weight("cosine", 4, 8) == pytest.approx(0.5)
    assert regularization_weight("exponential", 4, 8) == pytest.approx(1e-3**0.5)
    assert regularization_weight("cosine", 8, 8) == 0.0
    assert regularization_weight("exponential", 9, 8) == 0.0


def test_apple_gradients_of_the_core_model_and_the_relationships() -> None:
    dm = digits_data(4)
    method = build(APPLE, dm, clients_per_round=2)
    assert isinstance(method, APPLE)
    cores = {n: t.clone() for n, t in method.store.fields["core"].items()}
    assert not torch.equal(cores["fc2.weight"][0], cores["fc2.weight"][1])  # independent inits
    i = 2
    p = torch.tensor([0.1, 0.3, 0.4, 0.2], requires_grad=True)
    p0 = torch.full((4,), 0.25)
    own = {n: t[i].clone().requires_grad_() for n, t in cores.items()}
    context = {"cores." + n: t for n, t in cores.items()}
    context |= {"self": F.one_hot(torch.tensor(i), 4).float(), "p0": p0, "coef": torch.tensor(0.7)}
    x, y = dm.fetch(dm.index["train"].flat[:12])
    loss = method.apple_loss({**own, "p": p}, context, x, y, torch.ones(12))
    grads = torch.autograd.grad(loss, [*own.values(), p])
    # by hand: the personalized model as a leaf, its cross-entropy gradient g
    mixed = {
        n: torch.stack(
            [p[j].detach() * (cores[n][j] if j != i else own[n].detach()) for j in range(4)]
        ).sum(0)
        for n in cores
    }
    leaf = {n: t.clone().requires_grad_() for n, t in mixed.items()}
    ce = F.cross_entropy(method.arch(leaf, x, train=True), y)
    g = dict(zip(leaf, torch.autograd.grad(ce, list(leaf.values())), strict=True))
    for (name, _), grad in zip(own.items(), grads[:-1], strict=True):
        torch.testing.assert_close(grad, 0.4 * g[name], msg=name)  # p_ii dL/dw_p
    inner = torch.stack(
        [torch.stack([(g[n] * cores[n][j]).sum() for n in cores]).sum() for j in range(4)]
    )
    expected = inner + 2 * 0.7 * (p.detach() - p0)
    torch.testing.assert_close(grads[-1], expected, rtol=1e-4, atol=1e-6)


def test_apple_round_updates_the_own_core_model_and_relationships() -> None:
    dm = digits_data(4)
    method = build(APPLE, dm, clients_per_round=2, dr_lr=0.01)
    assert isinstance(method, APPLE)
    before = {n: t.clone() for n, t in method.store.fields["core"].items()}
    trained = capture_local_training(method)
    method.run_round(0, torch.tensor([0, 3]))
    after = method.store.fields["core"]
    p0 = method.initial_relationships()
    for name, tensor in before.items():
        assert torch.equal(after[name][[1, 2]], tensor[[1, 2]]), name
        torch.testing.assert_close(after[name][[0, 3]], trained[0].params[name])
    p = trained[0].params["p"]
    torch.testing.assert_close(method.store.fields["p_shift"]["p"][[0, 3]], p - p0)
    assert not torch.allclose(p, p0.expand(2, -1))
    personal = method.personalized_params(torch.tensor([3]))
    for name, tensor in after.items():
        expected = torch.einsum("j,j...->...", p[1], tensor)
        torch.testing.assert_close(personal[name][0], expected, msg=name)
    model_bytes = sum(t[0].numel() * 4 for t in before.values())
    assert method.record.round_bytes == [2 * 4 * model_bytes, 2 * model_bytes]


def test_apple_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(APPLE)
