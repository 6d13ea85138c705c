"""FedEM, FedGen and Floco (issue 46): their distinguishing math on hand examples, vmap == one
by one == threads (exact resume: tests/test_cli.py, RESUMED)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from lightning_pfl.generator import ensemble_cross_entropy, sample_labels, train_generator
from lightning_pfl.methods.fedem import LOG_PI, RECEIVED, WEIGHTS, FedEM
from lightning_pfl.methods.fedgen import GEN_TARGET, GEN_Y, GEN_Z, FedGen
from lightning_pfl.methods.floco import (
    ALPHAS,
    REGION,
    SIGNATURE_PHASE,
    SIMPLEX,
    Floco,
    project_onto_simplex,
    riesz_log_energy,
    simplex_centers,
)
from lightning_pfl.step_inputs import CLOCK
from tests.conftest import build, digits_data
from tests.helpers import (
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


# ----------------------------------------------------------------------------- FedGen
def build_fedgen(**kwargs: Any) -> FedGen:
    method = build(FedGen, digits_data(6), **{"clients_per_round": 3, **kwargs})
    assert isinstance(method, FedGen)
    return method


def test_fedgen_local_loss_reads_the_generated_pairs_of_the_step_the_clock_counts() -> None:
    method = build_fedgen(alpha=0.7, beta=0.3)
    model = {n: t.clone().requires_grad_() for n, t in method.arch.initial_params().items()}
    g = torch.Generator().manual_seed(0)
    d = method.arch.shapes["fc2.weight"][1]
    bank = {
        GEN_Z: torch.randn(2, 5, d, generator=g),
        GEN_Y: torch.randint(0, 10, (2, 5), generator=g),
        GEN_TARGET: torch.randn(2, 8, d, generator=g),
    }
    x, y = method.data.fetch(torch.arange(8))
    weight = torch.ones(8)
    weight[-1] = 0.0
    head = model["fc2.weight"], model["fc2.bias"]
    logits = method.arch(model, x)
    for step in (0, 1):
        clock = torch.tensor(float(step), requires_grad=True)
        loss = method.fedgen_loss(model | {CLOCK: clock}, bank, x, y, weight)
        assert isinstance(loss, torch.Tensor)
        ce = F.cross_entropy(logits[:7], y[:7])
        generated = F.cross_entropy(bank[GEN_Z][step] @ head[0].T + head[1], bank[GEN_Y][step])
        target = torch.softmax(bank[GEN_TARGET][step] @ head[0].T + head[1], -1)
        kl = F.kl_div(logits.log_softmax(-1), target, reduction="none").sum(-1)[:7].mean()
        torch.testing.assert_close(loss, ce + 0.7 * generated + 0.3 * kl)
        (clock_grad,) = torch.autograd.grad(loss, [clock])
        assert float(clock_grad) == 1.0  # with lr -1 the clock counts the steps taken


def test_fedgen_round_counts_steps_sets_the_prior_from_batch_labels_and_trains_g() -> None:
    method = build_fedgen(local_epochs=1)  # unequal clients: some idle at the end
    method.configure_optimizers()
    trained = capture_local_training(method)
    clients = torch.tensor([0, 3, 5])
    batches = method.draw_batches(clients, 0)
    before = {n: t.clone() for n, t in method.generator.state_dict().items()}
    method.run_round(0, clients)
    torch.testing.assert_close(trained[0].params[CLOCK], batches.active.sum(1).float())
    _, labels = method.data.fetch(batches.index)
    counts = torch.zeros(10)
    counts.index_add_(0, labels.flatten(), batches.weight.flatten())
    torch.testing.assert_close(method.label_prior, counts / counts.sum())
    assert not torch.equal(method.generator.out.weight, before["out.weight"])
    # generated labels follow the prior: only the round's classes appear
    y_hat = sample_labels(method.label_prior, (2000,), torch.Generator().manual_seed(1))
    assert set(y_hat.tolist()) == set(counts.nonzero().flatten().tolist())


def test_fedgen_generator_objective_is_the_cross_entropy_of_the_mean_logits() -> None:
    method = build_fedgen()
    g = torch.Generator().manual_seed(0)
    heads = {
        "fc2.weight": torch.randn(3, 10, 64, generator=g),
        "fc2.bias": torch.randn(3, 10, generator=g),
    }
    z, y = torch.randn(4, 64, generator=g), torch.tensor([1, 2, 3, 4])
    mean = sum(z @ heads["fc2.weight"][k].T + heads["fc2.bias"][k] for k in range(3)) / 3
    torch.testing.assert_close(
        ensemble_cross_entropy(method.arch, heads, z, y), F.cross_entropy(mean, y)
    )
    optimizer = torch.optim.Adam(method.generator.parameters(), lr=1e-2)
    prior = torch.full((10,), 0.1)

    def objective() -> float:
        ys = torch.arange(10).repeat(20)
        method.generator.eval()
        with torch.no_grad():
            zs = method.generator(ys, method.generator.noise(200, torch.Generator().manual_seed(2)))
        return float(ensemble_cross_entropy(method.arch, heads, zs, ys))

    start = objective()
    train_generator(method.generator, optimizer, method.arch, heads, prior, 30, 32, g)
    assert objective() < 0.5 * start


def test_fedgen_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedGen, beta=1.0)


# ----------------------------------------------------------------------------- Floco
def test_floco_simplex_projection_and_riesz_energy_by_hand() -> None:
    # Duchi et al.: sorted (0.5, 0.2, -0.3), theta = (0.5 + 0.2 - 1) / 2 = -0.15
    beta = project_onto_simplex(torch.tensor([[0.5, -0.3, 0.2]]), torch.tensor(1.0))
    torch.testing.assert_close(beta, torch.tensor([[0.65, 0.0, 0.35]]))
    half = project_onto_simplex(torch.tensor([[0.5, -0.3, 0.2]]), torch.tensor(0.5))
    torch.testing.assert_close(half, torch.tensor([[0.4, 0.0, 0.1]]))  # theta = 0.1
    points = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])
    # squared distances 2, 0.5, 0.5: energy 1/2 + 2 + 2 over 3 pairs
    torch.testing.assert_close(riesz_log_energy(points), torch.tensor(math.log(4.5 / 3)))


def test_floco_centers_put_three_groups_of_clients_on_three_vertices() -> None:
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(3, 40, generator=g)
    signatures = basis[[0, 0, 1, 1, 2, 2]] + 0.05 * torch.randn(6, 40, generator=g)
    centers = simplex_centers(signatures, 3)
    assert centers.shape == (6, 3) and bool((centers >= 0).all())
    torch.testing.assert_close(centers.sum(1), torch.ones(6))
    distance = torch.cdist(centers, centers, p=1)
    same = torch.tensor([0, 0, 1, 1, 2, 2])
    together = same[:, None] == same[None]
    assert float(distance[together].max()) < 0.1 and float(distance[~together].min()) > 1.5


def build_floco(**kwargs: Any) -> Floco:
    method = build(Floco, digits_data(6), **{"clients_per_round": 3, "endpoints": 3, **kwargs})
    assert isinstance(method, Floco)
    return method


def test_floco_loss_uses_the_steps_simplex_point_and_scales_endpoint_gradients() -> None:
    method = build_floco()
    params = {n: t.clone() for n, t in method.payload(torch.tensor([0])).items()}
    params = {n: t[0].requires_grad_() for n, t in params.items()}
    alphas = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.1, 0.3]])
    x, y = method.data.fetch(torch.arange(8))
    weight = torch.ones(8)
    for step in (0, 1):
        clock = torch.tensor(float(step), requires_grad=True)
        loss = method.floco_loss(params | {CLOCK: clock}, {ALPHAS: alphas}, x, y, weight)
        assert isinstance(loss, torch.Tensor)
        w = torch.einsum("m,mij->ij", alphas[step], params[SIMPLEX])
        model = {n: t for n, t in params.items() if n != SIMPLEX} | {"fc2.weight": w}
        torch.testing.assert_close(loss, F.cross_entropy(method.arch(model, x), y))
        (g_simplex,) = torch.autograd.grad(loss, [params[SIMPLEX]], retain_graph=True)
        (g_w,) = torch.autograd.grad(F.cross_entropy(method.arch(model, x), y), [w])
        for m in range(3):
            torch.testing.assert_close(g_simplex[m], alphas[step, m] * g_w)


def test_floco_samples_the_simplex_then_each_clients_l1_ball() -> None:
    method = build_floco(tau=2, rho=0.2)
    clients = torch.tensor([1, 4])
    before = method.sample_alphas(clients, 50, round_idx=1)
    assert bool((before >= 0).all())
    torch.testing.assert_close(before.sum(-1), torch.ones(2, 50))
    centers = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    method.store.scatter(REGION, clients, {REGION: centers})
    after = method.sample_alphas(clients, 50, round_idx=2)
    radius = (after - centers[:, None]).abs().sum(-1)
    assert float(radius.max()) <= 0.2 + 1e-6 and float(radius.max()) > 0.1
    # round tau's signature pass still samples the whole simplex (no subregions yet)
    signature = method.sample_alphas(clients, 50, round_idx=2, phase=SIGNATURE_PHASE)
    assert bool((signature >= 0).all()) and float(signature.max()) > 0.9
    torch.testing.assert_close(signature.sum(-1), torch.ones(2, 50))


def test_floco_projects_every_client_at_tau_from_its_endpoint_update() -> None:
    method = build_floco(tau=1)
    method.configure_optimizers()
    trained = capture_local_training(method)
    method.run_round(0, torch.tensor([0, 1, 2]))
    assert len(trained) == 1  # no projection before tau
    centers0 = method.store.gather(REGION, torch.arange(6), method.device)[REGION]
    torch.testing.assert_close(centers0, torch.full((6, 3), 1 / 3))
    for p in method.parameters():  # the server step: lr 1, no momentum
        if p.grad is not None:
            p.data -= p.grad
            p.grad = None
    sent = method.simplex.detach().clone()
    method.run_round(1, torch.tensor([0, 3, 5]))
    assert len(trained) == 3 and trained[1].params[SIMPLEX].shape[0] == 6  # every client
    expected = simplex_centers((sent - trained[1].params[SIMPLEX]).flatten(1), 3)
    centers = method.store.gather(REGION, torch.arange(6), method.device)[REGION]
    torch.testing.assert_close(centers, expected)
    models = method.personalized_params(torch.arange(6))
    combined = torch.einsum("cm,mij->cij", centers, method.simplex.detach())
    torch.testing.assert_close(models["fc2.weight"], combined)


def test_floco_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(Floco, endpoints=3, tau=1)
