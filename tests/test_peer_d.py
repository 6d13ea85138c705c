"""FedEM, FedGen and Floco (issue 46): their distinguishing math on hand examples, vmap == one
by one == threads, exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_pfl.methods.fedem import LOG_PI, RECEIVED, WEIGHTS, FedEM
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    capture_local_training,
)


def softmax(z: list[float]) -> list[float]:
    e = [math.exp(v) for v in z]
    return [v / sum(e) for v in e]


def favouring(classes: set[int], strength: float = 3.0) -> list[float]:
    return [strength if c in classes else 0.0 for c in range(10)]


# ----------------------------------------------------------------------------- FedEM
def set_component_biases(method: FedEM, biases: list[list[float]]) -> None:
    """Component m predicts ``biases[m]`` for every input (all its weights zero)."""
    with torch.no_grad():
        for p in method.net.parameters():
            p.zero_()
        for m, bias in enumerate(biases):
            method.net.get_parameter(f"members.{m}.fc2.bias").copy_(torch.tensor(bias))


def test_fedem_e_and_m_steps_update_pi_from_the_stored_pi_and_the_received_components() -> None:
    dm = digits_data(6)
    method = build(FedEM, dm, num_components=3, local_lr=1e-9)
    assert isinstance(method, FedEM)
    counts = dm.partition_counts()["train"]
    classes = [set(counts[i].nonzero()[0].tolist()) for i in range(6)]
    biases = [favouring(classes[0]), favouring(classes[1]), [0.0] * 10]
    set_component_biases(method, biases)
    clients = torch.tensor([0, 1, 4])
    old = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.3, 0.1], [1 / 3, 1 / 3, 1 / 3]])
    method.store.scatter(WEIGHTS, clients, {WEIGHTS: old})
    method.run_round(0, clients)
    expected = torch.zeros(3, 3, dtype=torch.float64)
    for row, client in enumerate(clients.tolist()):
        for c, n in enumerate(counts[client]):
            # q(z = m | sample of class c) = pi_m p_m(c) / sum_m' pi_m' p_m'(c)
            joint = [float(old[row, m]) * softmax(b)[c] for m, b in enumerate(biases)]
            for m in range(3):
                expected[row, m] += n * joint[m] / sum(joint)
        expected[row] /= counts[client].sum()
    pi = method.store.gather(WEIGHTS, clients, method.device)[WEIGHTS]
    torch.testing.assert_close(pi.double(), expected, rtol=1e-5, atol=1e-6)
    assert pi[0].argmax() == 0 and pi[1].argmax() == 1  # each favoured client's own component
    untouched = method.store.gather(WEIGHTS, torch.tensor([2]), method.device)[WEIGHTS]
    torch.testing.assert_close(untouched, torch.full((1, 3), 1 / 3))


def test_fedem_local_objective_weights_each_components_loss_by_the_e_step_q() -> None:
    dm = digits_data(6)
    method = build(FedEM, dm, num_components=2)
    assert isinstance(method, FedEM)
    trained = {n: t.detach().clone().requires_grad_() for n, t in method.global_state().items()}
    biases = [favouring({0, 1}), favouring({2, 3})]
    set_component_biases(method, biases)
    received = {RECEIVED + n: t for n, t in method.global_state().items()}
    log_pi = torch.tensor([0.7, 0.3]).log()
    x, y = dm.fetch(torch.arange(12))
    weight = torch.ones(12)
    weight[-2:] = 0.0  # padding: left out of the sum and of the count
    loss = method.em_loss(trained, received | {LOG_PI: log_pi}, x, y, weight)
    # q from the received components (the biases) and the old pi, CE from the trained ones
    expected = torch.zeros(())
    logits = method.components(trained, x)
    for b in range(10):
        joint = [[0.7, 0.3][m] * softmax(biases[m])[int(y[b])] for m in range(2)]
        for m in range(2):
            ce = F.cross_entropy(logits[m, b], y[b])
            expected = expected + joint[m] / sum(joint) * ce / 10
    torch.testing.assert_close(loss, expected)
    # so component m's gradient is (1/B) sum_b q_bm grad l_m(b), zero across components
    grads = torch.autograd.grad(loss, list(trained.values()), allow_unused=True)
    expected_grads = torch.autograd.grad(expected, list(trained.values()), allow_unused=True)
    for name, g, e in zip(trained, grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e, msg=name)


def test_fedem_predicts_the_pi_weighted_mixture_of_the_components_probabilities() -> None:
    dm = digits_data(6)
    method = build(FedEM, dm, num_components=2)
    assert isinstance(method, FedEM)
    biases = [favouring({0}), favouring({5}, 1.0)]
    set_component_biases(method, biases)
    method.store.scatter(WEIGHTS, torch.tensor([3]), {WEIGHTS: torch.tensor([[0.25, 0.75]])})
    params = {n: t[0] for n, t in method.personalized_params(torch.tensor([3])).items()}
    x, _ = dm.fetch(torch.arange(4))
    out = method.predict(params, x)
    mixture = [0.25 * a + 0.75 * b for a, b in zip(*(softmax(b) for b in biases), strict=True)]
    torch.testing.assert_close(out, torch.tensor(mixture).log().expand(4, 10))


def test_fedem_server_averages_each_component_by_samples_and_clips_each_alone() -> None:
    dm = digits_data(6)
    clip, lr = 1e-3, 0.5
    method = build(
        FedEM,
        dm,
        num_components=3,
        local_steps=1,
        local_lr=lr,
        local_momentum=0.0,
        local_weight_decay=0.0,
        local_max_grad_norm=clip,
    )
    assert isinstance(method, FedEM)
    trained = capture_local_training(method)
    clients = torch.tensor([0, 2, 5])
    before = method.global_state()
    method.run_round(0, clients)
    uploaded = trained[0].params
    n = dm.num_samples("train")[clients].double()
    for name, p in method.net.named_parameters():
        mean = (n.view(-1, *[1] * p.dim()) * uploaded[name].double()).sum(0) / n.sum()
        torch.testing.assert_close(p.detach() - p.grad, mean.float(), msg=name)
    # one clipped step: every component of every client moved by lr * clip (its own norm)
    for m in range(3):
        names = [n for n in uploaded if n.startswith(f"members.{m}.")]
        norms = torch.cat([(uploaded[n] - before[n]).flatten(1) for n in names], 1).norm(dim=1)
        torch.testing.assert_close(norms, torch.full((3,), lr * clip), rtol=1e-3, atol=0)


def test_fedem_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedEM, num_components=2)


def test_fedem_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "fedem.yaml", tmp_path)
