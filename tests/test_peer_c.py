"""CFL, CCVR, FedAS, GPFL and FedCP (issue 46): their math on hand examples, vmap == loop
(exact resume: tests/test_cli.py, RESUMED; CFL's tests/test_paper_defaults_cfl_lhn.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_pfl.costs import payload_bytes
from lightning_pfl.engine import derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.ccvr import (
    CALIBRATION_STREAM,
    CCVR,
    class_moments,
    global_moments,
    sample_virtual,
)
from lightning_pfl.methods.cfl import CFL, optimal_bipartition
from lightning_pfl.methods.fedas import FedAS, alignment_loss
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.methods.fedcp import FedCP, policy, rbf_mmd
from lightning_pfl.methods.gpfl import GPFL, conditional_inputs, conditional_valve, gce_loss
from tests.conftest import build, digits_data
from tests.helpers import (
    assert_vectorized_equals_sequential,
    capture_local_training,
)


# ----------------------------------------------------------------------------- CFL
def brute_force_bipartition(similarity: torch.Tensor) -> float:
    """min over every bipartition of the largest cross similarity."""
    m = len(similarity)
    best = float("inf")
    for mask in itertools.product([False, True], repeat=m - 1):
        second = torch.tensor([False, *mask])
        if second.any():
            best = min(best, float(similarity[~second][:, second].max()))
    return best


def test_cfl_bipartition_minimizes_the_largest_cross_similarity() -> None:
    # A chain 0 - 1 - 2 weakly tied to 3: {0, 1, 2} | {3}, whose cross maximum is 0.1, where
    # complete linkage (the authors' code) would cut the chain between 1 and 2.
    alpha = torch.tensor(
        [[1.0, 0.9, 0.2, -0.5], [0.9, 1.0, 0.8, 0.0], [0.2, 0.8, 1.0, 0.1], [-0.5, 0.0, 0.1, 1.0]]
    )
    assert optimal_bipartition(alpha).tolist() == [False, False, False, True]
    g = torch.Generator().manual_seed(0)
    for m in (2, 3, 5, 7):
        u = torch.nn.functional.normalize(torch.randn(m, 4, generator=g), dim=1)
        alpha = u @ u.T
        second = optimal_bipartition(alpha)
        assert second.any() and not second.all()
        assert float(alpha[~second][:, second].max()) == brute_force_bipartition(alpha)


def cfl_round(**kwargs: float) -> tuple[CFL, torch.Tensor, dict[str, torch.Tensor], list]:
    dm = digits_data(6)
    method = build(CFL, dm, split_from_round=0, min_cluster_size=2, **kwargs)
    assert isinstance(method, CFL)
    before = {n: t.clone() for n, t in method.models().items()}
    trained = capture_local_training(method)
    clients = torch.arange(6)
    method.run_round(0, clients)
    return method, clients, before, trained


def test_cfl_splits_by_the_optimal_bipartition_when_the_criterion_holds() -> None:
    method, clients, before, trained = cfl_round(eps_1=1e6, eps_2=0.0)
    delta = torch.cat(
        [(trained[0].params[n] - before[n][0]).flatten(1) for n in method.arch.shapes], 1
    )
    unit = torch.nn.functional.normalize(delta.double(), dim=1)
    second = optimal_bipartition(unit @ unit.T)
    assert method.cluster_of.tolist() == second.long().tolist()
    # both halves start from the one model and move by their own members' weighted mean update
    n = method.data.num_samples("train")[clients].double()
    for name in method.arch.shapes:
        d = (trained[0].params[name] - before[name][0]).double()
        for c, rows in ((0, ~second), (1, second)):
            w = n * rows
            mean = (w.view(-1, *[1] * (d.dim() - 1)) * d).sum(0) / w.sum()
            torch.testing.assert_close(
                method.models()[name][c], (before[name][0] + mean).float(), msg=name
            )
        assert torch.equal(method.models()[name][2:], before[name][2:])
    stored = method.store.gather("update", clients, method.device)["delta"]
    torch.testing.assert_close(stored, delta)


def test_cfl_keeps_one_cluster_unless_both_norm_bounds_hold() -> None:
    # the mean update is never below 0 (eps_1 = 0), the largest never above 1e6 (eps_2)
    for eps in ({"eps_1": 0.0, "eps_2": 0.0}, {"eps_1": 1e6, "eps_2": 1e6}):
        method, clients, before, trained = cfl_round(**eps)
        assert method.cluster_of.tolist() == [0] * 6
        n = method.data.num_samples("train")[clients].double()
        name = "fc2.weight"
        d = (trained[0].params[name] - before[name][0]).double()
        mean = (n.view(-1, 1, 1) * d).sum(0) / n.sum()  # FedAvg within the cluster
        torch.testing.assert_close(method.models()[name][0], (before[name][0] + mean).float())
    # the mean norm bound is strict: just above the round's mean norm it splits, at it not
    method, clients, before, trained = cfl_round(eps_1=1e6, eps_2=0.0)
    delta = torch.cat(
        [(trained[0].params[n] - before[n][0]).flatten(1) for n in method.arch.shapes], 1
    )
    weights = method.client_weights(clients).double()
    mean_norm = float((weights[:, None] * delta.double()).sum(0).norm())
    assert cfl_round(eps_1=mean_norm * 1.001, eps_2=0.0)[0].cluster_of.max() == 1
    assert cfl_round(eps_1=mean_norm * 0.999, eps_2=0.0)[0].cluster_of.max() == 0


def test_cfl_without_a_split_is_fedavg() -> None:
    dm = digits_data(6)
    cfl = build(CFL, dm, eps_1=0.0, keep_client_optimizer=False, lr_decay=1.0)  # FedAvg's SGD
    sgd = ("local_momentum", "local_weight_decay", "local_max_grad_norm")
    fedavg = build(FedAvg, dm, **{key: cfl.hparams[key] for key in sgd})
    for r in range(3):
        clients = cfl.sample_clients(r)
        cfl.run_round(r, clients)
        fedavg.run_round(r, clients)
        for p in fedavg.net.parameters():  # the server step: lr 1, no momentum
            p.data -= p.grad
    assert cfl.cluster_of.max() == 0
    for name, t in fedavg.global_state().items():
        torch.testing.assert_close(cfl.models()[name][0], t, rtol=1e-5, atol=1e-6, msg=name)


def test_cfl_personalized_model_is_the_clusters() -> None:
    method, clients, _, _ = cfl_round(eps_1=1e6, eps_2=0.0)
    params = method.personalized_params(clients)
    for name, t in params.items():
        assert torch.equal(t, method.models()[name][method.cluster_of]), name


def test_cfl_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(CFL, eps_1=1e6, eps_2=0.0, split_from_round=1)


# ----------------------------------------------------------------------------- CCVR
def test_ccvr_server_moments_are_the_pooled_mean_and_unbiased_covariance() -> None:
    g = torch.Generator().manual_seed(0)
    # 3 clients, 2 classes, D = 3; client 2 has one sample of class 1 and none of class 0
    sizes = [[4, 3], [5, 2], [0, 1]]
    feats = [[torch.randn(n, 3, generator=g, dtype=torch.float64) for n in row] for row in sizes]
    counts = torch.tensor(sizes, dtype=torch.float64)
    mean = torch.stack(
        [torch.stack([f.mean(0) if len(f) else torch.zeros(3) for f in row]) for row in feats]
    ).double()
    cov = torch.stack(
        [
            torch.stack([torch.cov(f.T) if len(f) > 1 else torch.zeros(3, 3) for f in row])
            for row in feats
        ]
    ).double()
    total, mu, sigma = global_moments(counts, mean, cov)
    for c in range(2):
        pooled = torch.cat([row[c] for row in feats])
        assert int(total[c]) == len(pooled)
        torch.testing.assert_close(mu[c], pooled.mean(0))
        torch.testing.assert_close(sigma[c], torch.cov(pooled.T))


def test_ccvr_client_moments_are_each_clients_class_statistics() -> None:
    dm = digits_data(4)
    method = build(CCVR, dm)
    assert isinstance(method, CCVR)
    clients = torch.tensor([2, 0])
    state = method.global_state()
    params = {n: t.expand(2, *t.shape) for n, t in state.items()}
    counts, mean, cov = class_moments(method, params, clients)
    for row, client in enumerate(clients.tolist()):
        x, y = dm.fetch(torch.as_tensor(dm._parts["train"][client]))
        z = method.arch.features(state, x).double()
        for c in range(10):
            zc = z[y == c]
            assert int(counts[row, c]) == len(zc)
            if len(zc) > 1:
                torch.testing.assert_close(mean[row, c], zc.mean(0))
                torch.testing.assert_close(cov[row, c], torch.cov(zc.T))


def test_ccvr_virtual_representations_follow_the_class_gaussians() -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 3, 3, generator=g, dtype=torch.float64)
    sigma = a @ a.transpose(1, 2)
    mu = torch.randn(2, 3, generator=g, dtype=torch.float64)
    total = torch.tensor([5.0, 0.0], dtype=torch.float64)
    z, y, weight = sample_virtual(total, mu, sigma, 40000, g)
    assert y.tolist()[:2] == [0, 0] and weight[y == 1].sum() == 0 and weight[y == 0].min() == 1
    torch.testing.assert_close(z[y == 0].mean(0), mu[0], atol=0.05, rtol=0)
    torch.testing.assert_close(torch.cov(z[y == 0].T), sigma[0], atol=0.1, rtol=0.05)


def test_ccvr_calibration_is_one_sgd_step_of_the_classifier_on_the_virtual_features() -> None:
    dm = digits_data(4)
    # 10 classes x 3 virtual representations = one batch of 30: one plain SGD step
    method = build(CCVR, dm, virtual_per_class=3, batch_size=32, calibration_lr=0.5)
    assert isinstance(method, CCVR)
    method.run_round(0, torch.tensor([0, 1]))
    state = method.global_state()
    clients = torch.arange(4)
    params = {n: t.expand(4, *t.shape) for n, t in state.items()}
    total, mu, sigma = global_moments(*class_moments(method, params, clients))
    generator = torch.Generator().manual_seed(derive_seed(0, 0, CALIBRATION_STREAM))
    z, y, weight = sample_virtual(total, mu, sigma, 3, generator)
    z = z.float()
    w, b = state["fc2.weight"], state["fc2.bias"]
    present = weight > 0
    residual = torch.softmax(z @ w.T + b, -1) - torch.nn.functional.one_hot(y, 10)
    residual = residual * present[:, None] / present.sum()  # mean CE over real classes
    calibrated = method.personalized_params(clients)
    torch.testing.assert_close(calibrated["fc2.weight"][3], w - 0.5 * residual.T @ z)
    torch.testing.assert_close(calibrated["fc2.bias"][0], b - 0.5 * residual.sum(0))
    for name in method.arch.shapes:  # the feature extractor and the server model are untouched
        if name not in method.arch.head_names:
            assert torch.equal(calibrated[name][1], state[name])
    assert torch.equal(method.global_state()["fc2.weight"], w)


def test_ccvr_vectorized_equals_sequential() -> None:
    # momentum: with FedAvg's plain SGD the 3-round models sit near ties and the calibration's
    # sampled features amplify float rounding between the paths into flipped argmaxes
    assert_vectorized_equals_sequential(CCVR, local_momentum=0.9)


# ----------------------------------------------------------------------------- FedAS
def test_fedas_alignment_loss_by_hand() -> None:
    z = torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 5.0], [9.0, 9.0]])
    y = torch.tensor([0, 0, 1, 0])
    weight = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last sample is padding
    prototypes = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    present = torch.tensor([1.0, 0.0, 1.0])  # class 1 has no local prototype
    # class 0: ((0 + 1) + (4 + 1)) / (2 samples x 2 dims) = 1.5; class 1: none
    loss = alignment_loss(z, y, weight, prototypes, present)
    torch.testing.assert_close(loss, torch.tensor(1.5))


def test_fedas_aligns_the_global_body_then_averages_bodies_by_fisher_trace() -> None:
    dm = digits_data(4)
    # batches larger than any client: one alignment step per client
    method = build(FedAS, dm, batch_size=512, alignment_lr=0.3, local_lr=0.05)
    assert isinstance(method, FedAS)
    clients = torch.tensor([0, 2, 3])
    global_state = {n: t.clone() for n, t in method.global_state().items()}
    local = method.store.gather("model", clients, method.device)
    trained = capture_local_training(method)
    method.run_round(0, clients)
    aligned, result = trained
    fisher = []
    for row, client in enumerate(clients.tolist()):
        x, y = dm.fetch(torch.as_tensor(dm._parts["train"][client]))
        # alignment: one plain SGD step of the global body on the local model's prototypes
        own = {n: t[row] for n, t in local.items()}
        z_local = method.arch.features(own, x)
        prototypes = torch.stack(
            [z_local[y == c].mean(0) if (y == c).any() else torch.zeros(64) for c in range(10)]
        )
        body = {n: global_state[n].clone().requires_grad_() for n in method.body}
        z = method.arch.features(body, x)
        loss = sum(((z[y == c] - prototypes[c]) ** 2).mean() for c in y.unique().tolist())
        grads = torch.autograd.grad(loss, list(body.values()))
        for (name, p), g in zip(body.items(), grads, strict=True):
            torch.testing.assert_close(aligned.params[name][row], p - 0.3 * g, msg=name)
        # the Fisher trace: one epoch of batches (here one) of the trained model
        model = {n: t[row].clone().requires_grad_() for n, t in result.params.items()}
        nll = torch.nn.functional.cross_entropy(method.arch(model, x), y)
        fisher.append(
            sum(float((g**2).sum()) for g in torch.autograd.grad(nll, list(model.values())))
        )
    weights = torch.tensor(fisher, dtype=torch.float64) / sum(fisher)
    for name in method.body:
        p = method.net.get_parameter(name)
        assert p.grad is not None
        mean = (weights.view(-1, *[1] * p.dim()) * result.params[name].double()).sum(0)
        torch.testing.assert_close(p.detach() - p.grad, mean.float(), msg=name)
    # the client keeps the trained model, its own head trained on from its previous one
    kept = method.store.gather("model", clients, method.device)
    for name, t in kept.items():
        assert torch.equal(t, result.params[name]), name


def test_fedas_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedAS)


# ----------------------------------------------------------------------------- GPFL
def test_gpfl_conditional_valve_gce_and_conditional_inputs_by_hand() -> None:
    eye = torch.eye(2)
    params = {
        "cov.gamma.weight": eye,
        "cov.gamma.bias": torch.zeros(2),
        "cov.beta.weight": -eye,
        "cov.beta.bias": torch.zeros(2),
    }
    for part in ("gamma", "beta"):
        params |= {f"cov.{part}.ln_weight": torch.ones(2), f"cov.{part}.ln_bias": torch.zeros(2)}
    # gamma = LN(relu([1, 3])) = [-1, 1]; beta = LN(relu([-1, -3])) = LN([0, 0]) = [0, 0]
    out = conditional_valve(params, torch.tensor([[2.0, 5.0]]), torch.tensor([1.0, 3.0]))
    torch.testing.assert_close(out, torch.tensor([[0.0, 10.0]]), atol=1e-4, rtol=0)
    # cosines of f = [1, 0] with e_0 = [2, 0] and e_1 = [0, 3]: [1, 0]
    loss = gce_loss(
        torch.tensor([[1.0, 0.0]]),
        torch.tensor([0]),
        torch.ones(1),
        torch.tensor([[2.0, 0.0], [0.0, 3.0]]),
    )
    torch.testing.assert_close(loss, torch.tensor(math.log(1 + math.exp(-1.0))))
    embedding = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    g, p = conditional_inputs(embedding, torch.tensor([0.25, 0.75, 0.0]))
    torch.testing.assert_close(g, torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(p, torch.tensor([0.25, 0.75]))


def test_gpfl_local_loss_is_ce_plus_gce_plus_lambda_batch_norm_distance() -> None:
    dm = digits_data(4)
    method = build(GPFL, dm, lam=0.5)
    assert isinstance(method, GPFL)
    clients = torch.tensor([1])
    start = method.personalized_params(clients)
    context = method.contexts(start, clients)
    counts = torch.as_tensor(dm.partition_counts()["train"][1], dtype=torch.float32)
    torch.testing.assert_close(
        context["context.personal"][0], counts / counts.sum() @ method.extra["gce__embedding"]
    )
    params = {n: t[0] for n, t in start.items()}
    x, y = dm.fetch(torch.as_tensor(dm._parts["train"][1][:8]))
    w = torch.ones(8)
    loss = method.gpfl_loss(params, {n: t[0] for n, t in context.items()}, x, y, w)
    z = method.arch.features(method.network(params), x)
    embedding = params["gce.embedding"]
    f_p = conditional_valve(params, z, counts / counts.sum() @ embedding)
    f_g = conditional_valve(params, z, embedding.mean(0))
    ce = torch.nn.functional.cross_entropy(method.arch.classify(params, f_p), y)
    distance = torch.linalg.matrix_norm(f_g - embedding[y])  # Frobenius over the batch
    expected = ce + gce_loss(f_g, y, w, embedding) + 0.5 * distance
    torch.testing.assert_close(loss, expected)


def test_gpfl_shares_extractor_gce_and_cov_and_keeps_the_head() -> None:
    dm = digits_data(4)
    method = build(GPFL, dm)
    assert isinstance(method, GPFL)
    trained = capture_local_training(method)
    clients = torch.tensor([0, 3])
    method.run_round(0, clients)
    result = trained[0].params
    weights = method.client_weights(clients).double()
    for name in method.extra_names:
        p = method.extra[name.replace(".", "__")]
        assert p.grad is not None
        mean = (weights.view(-1, *[1] * p.dim()) * result[name].double()).sum(0)
        torch.testing.assert_close(p.detach() - p.grad, mean.float(), msg=name)
    heads = method.store.gather("personal", clients, method.device)
    for name in method.arch.head_names:
        assert torch.equal(heads[name], result[name]), name
    sent, _ = method.record.round_bytes
    assert sent == payload_bytes({n: t for n, t in method.payload(clients).items()})


def test_gpfl_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(GPFL)


# ----------------------------------------------------------------------------- FedCP
def test_fedcp_policy_and_mmd_by_hand() -> None:
    params = {
        "cpn.weight": torch.tensor([[1.0], [2.0]]),
        "cpn.bias": torch.zeros(2),
        "cpn.ln_weight": torch.ones(2),
        "cpn.ln_bias": torch.zeros(2),
    }
    # W x = [1, 2]; LayerNorm over the two: [-1, 1]; ReLU: [0, 1]; softmax over (r, s)
    r, s = policy(params, torch.tensor([[1.0]]), tau=1.0, noise=False)
    torch.testing.assert_close(r, torch.tensor([[1 / (1 + math.e)]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(s, torch.tensor([[math.e / (1 + math.e)]]), atol=1e-4, rtol=0)
    torch.manual_seed(0)
    r, s = policy(params, torch.ones(50, 1), tau=1.0, noise=True)
    torch.testing.assert_close(r + s, torch.ones(50, 1))
    assert r.std() > 0.05  # Gumbel noise: per-sample shares
    a, b = torch.tensor([[0.0], [7.0]]), torch.tensor([[1.0], [-3.0]])
    cross = sum(math.exp(-0.5 / s) for s in (10.0, 15.0, 20.0, 50.0))
    # the second pair is padding: one point each, k(a, a) = k(b, b) = 4 kernels x exp(0)
    mmd = rbf_mmd(a, b, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(mmd, torch.tensor(8 - 2 * cross))


def test_fedcp_local_loss_and_server_update() -> None:
    dm = digits_data(4)
    method = build(FedCP, dm, lam=2.0, gumbel_noise=False)
    assert isinstance(method, FedCP)
    clients = torch.tensor([0, 2])
    before = method.personalized_params(clients)
    trained = capture_local_training(method)
    method.run_round(0, clients)
    # the loss: CE(head_p(h r) + head_g(h s)) + lambda MMD(phi(x), phi_g(x))
    one = {n: t[1] for n, t in before.items()}
    x, y = dm.fetch(torch.as_tensor(dm._parts["train"][2][:8]))
    context = {"global_head." + n: one[n] for n in method.arch.head_names}
    context |= {"global_body." + n: one[n] for n in method.body} | {"context": one["context"]}
    params = {
        n: one[n] for n in (*method.body, "cpn.weight", "cpn.bias", "cpn.ln_weight", "cpn.ln_bias")
    }
    params |= {n: t for n, t in one.items() if n in method.arch.head_names}
    loss = method.policy_loss(params, context, x, y, torch.ones(8))
    h = method.arch.features({n: one[n] for n in method.body}, x)
    r, s = policy(one, h * one["context"] / one["context"].norm(), 1.0, noise=False)
    logits = method.arch.classify(one, h * r) + method.arch.classify(one, h * s)
    expected = torch.nn.functional.cross_entropy(logits, y) + 2.0 * rbf_mmd(h, h, torch.ones(8))
    torch.testing.assert_close(loss, expected)
    # the client keeps its head, its context becomes the head's column sums; the server
    # averages (head_p + head_g) / 2 and the CPN
    result = trained[0].params
    weights = method.client_weights(clients).double()
    own = method.store.fields["personal"]
    for name in method.arch.head_names:
        assert torch.equal(own[name][clients], result[name])
        p = method.net.get_parameter(name)
        assert p.grad is not None
        mixed = 0.5 * (result[name].double() + before[name].double())
        mean = (weights.view(-1, *[1] * p.dim()) * mixed).sum(0)
        torch.testing.assert_close(p.detach() - p.grad, mean.float(), msg=name)
    torch.testing.assert_close(own["context"][clients], result["fc2.weight"].sum(1))
    p = method.cpn["weight"]
    assert p.grad is not None
    mean = (weights.view(-1, 1, 1) * result["cpn.weight"].double()).sum(0)
    torch.testing.assert_close(p.detach() - p.grad, mean.float())


def test_fedcp_with_gumbel_noise_refuses_worker_threads() -> None:
    with pytest.raises(ConfigError, match="client_threads = 2 .* Gumbel noise"):
        build(FedCP, digits_data(4), client_threads=2)
    build(FedCP, digits_data(4), client_threads=2, gumbel_noise=False)


def test_fedcp_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedCP, gumbel_noise=False)
