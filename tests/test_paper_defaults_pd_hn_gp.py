"""Paper defaults of pFedLA (weight normalization), PeFLL (the objective's regularizers) and
pFedGP (learned kernel hyperparameters): each checked against a hand computation, with
vectorized == sequential and exact resume on the new path."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.pefll import PeFLL
from lightning_pfl.methods.pfedgp import (
    KERNEL,
    NOISE_FLOOR,
    PFedGP,
    gp_negative_log_likelihood,
    gp_posterior_mean,
)
from lightning_pfl.methods.pfedla import PFedLA
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    capture_local_training,
)


# ----------------------------------------------------------------------------- pFedLA
def hand_hypernetwork_outputs(method: PFedLA, client: int) -> torch.Tensor:
    """HN_i's raw outputs ``[L, N]`` for one client, layer by layer with plain matmuls."""
    hn = method.hnet
    z = hn.embedding[client]
    for w, b in zip(hn.hidden_weights, hn.hidden_biases, strict=True):
        z = torch.relu(w[client] @ z + b[client])
    return (hn.out_weight[client] @ z + hn.out_bias[client]).view(len(method.layers), -1)


def test_pfedla_default_weights_are_relu_outputs_over_their_sum() -> None:
    method = build(PFedLA, digits_data(5))
    assert isinstance(method, PFedLA)
    assert method.hp.weight_normalization == "relu_sum"
    hn = method.hnet
    assert (hn.out_weight >= 0).all() and (hn.out_weight <= 1).all() and not hn.out_bias.any()
    alpha = hn(torch.tensor([0, 3]))
    for row, client in enumerate((0, 3)):
        out = torch.relu(hand_hypernetwork_outputs(method, client))
        torch.testing.assert_close(alpha[row], out / out.sum(-1, keepdim=True))
    # a layer whose outputs are all zero falls back to the client's own model
    with torch.no_grad():
        hn.out_weight[3, : method.hp.num_clients].fill_(-1.0)  # client 3's first layer
        hn.out_bias[3].zero_()
    alpha = hn(torch.tensor([3]))
    torch.testing.assert_close(alpha[0, 0], torch.eye(5)[3])
    assert alpha[0, 1:].gt(0).sum() > 1  # the other layers still mix several clients


def test_pfedla_softmax_weights_remain_reachable() -> None:
    method = build(PFedLA, digits_data(5), weight_normalization="softmax")
    assert isinstance(method, PFedLA)
    alpha = method.hnet(torch.tensor([2]))
    torch.testing.assert_close(alpha[0], hand_hypernetwork_outputs(method, 2).softmax(-1))
    assert (method.hnet.out_weight < 0).any()  # PyTorch's default init, as before the option


def test_pfedla_refuses_an_unknown_weight_normalization() -> None:
    with pytest.raises(ConfigError, match="weight_normalization"):
        build(PFedLA, digits_data(5), weight_normalization="sum")


@pytest.mark.parametrize("normalization", ["relu_sum", "softmax"])
def test_pfedla_vectorized_equals_sequential_per_normalization(normalization: str) -> None:
    assert_vectorized_equals_sequential(PFedLA, weight_normalization=normalization)


def test_pfedla_softmax_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / "pfedla.yaml", tmp_path, "--model.init_args.weight_normalization=softmax"
    )


# ----------------------------------------------------------------------------- PeFLL
def pefll_round_and_expected_gradient(
    method: PeFLL, lambda_h: float, lambda_v: float, lambda_theta: float
) -> tuple[list[torch.nn.Parameter], tuple[torch.Tensor, ...]]:
    """Run round 0 of clients 0 and 3 and return (phi + psi, the gradient of the paper's
    objective with the delta surrogate for the loss, by autograd on the whole expression)."""
    trained = capture_local_training(method)
    clients = torch.tensor([0, 3])
    x, y, w = method.descriptor_batches(clients, 0)
    generated = {n: t.detach().clone() for n, t in method.network(x, y, w).items()}
    method.run_round(0, clients)
    delta = {n: generated[n] - trained[0].params[n] for n in generated}
    theta = method.network(x, y, w)
    phi = method.network.body_parameters()
    psi = method.network.embedding_parameters()
    objective = (
        sum((theta[n] * delta[n]).sum() + lambda_theta * theta[n].pow(2).sum() for n in theta)
        / len(clients)
        + lambda_h * sum(p.pow(2).sum() for p in phi)
        + lambda_v * sum(p.pow(2).sum() for p in psi)
    )
    return phi + psi, torch.autograd.grad(objective, phi + psi)


def test_pefll_sgd_setting_server_gradient_carries_the_objectives_regularizers() -> None:
    # the authors' --optim sgd decay as lambdas (the default Adam has none: lambdas 0)
    method = build(
        PeFLL,
        digits_data(6),
        hn_max_grad_norm=None,
        hn_optimizer="sgd",
        lambda_h=5e-4,
        lambda_v=5e-4,
    )
    assert isinstance(method, PeFLL)
    h = method.hp
    assert (h.lambda_theta, h.hn_weight_decay) == (0.0, 0.0)
    params, expected = pefll_round_and_expected_gradient(method, 5e-4, 5e-4, 0.0)
    for p, e in zip(params, expected, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-8)
    method.configure_optimizers()
    optimizer = method.server_optimizer
    assert optimizer is not None
    assert all(g["weight_decay"] == 0 for g in optimizer.param_groups)


def test_pefll_every_regularizer_enters_the_server_gradient() -> None:
    lambdas = {"lambda_h": 0.03, "lambda_v": 0.02, "lambda_theta": 0.5}
    method = build(PeFLL, digits_data(6), hn_max_grad_norm=None, **lambdas)
    assert isinstance(method, PeFLL)
    params, expected = pefll_round_and_expected_gradient(method, *lambdas.values())
    for p, e in zip(params, expected, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, e, rtol=1e-4, atol=1e-7)
    # lambda_theta acts through theta_i's Jacobian, not on the parameters directly
    plain = build(PeFLL, digits_data(6), hn_max_grad_norm=None, **{**lambdas, "lambda_theta": 0})
    assert isinstance(plain, PeFLL)
    plain_params, _ = pefll_round_and_expected_gradient(plain, 0.03, 0.02, 0.0)
    assert not torch.allclose(params[0].grad, plain_params[0].grad)  # type: ignore[arg-type]


def test_pefll_regularizers_are_clipped_with_the_delta_gradient() -> None:
    method = build(PeFLL, digits_data(6), hn_max_grad_norm=1e-3, lambda_h=10.0)
    assert isinstance(method, PeFLL)
    method.run_round(0, torch.tensor([0, 3]))
    params = method.network.body_parameters() + method.network.embedding_parameters()
    grads = [p.grad for p in params if p.grad is not None]
    assert len(grads) == len(params)
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    torch.testing.assert_close(norm, torch.tensor(1e-3))


def test_pefll_regularized_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(PeFLL, lambda_theta=0.1)


def test_pefll_regularized_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "pefll.yaml", tmp_path, "--model.init_args.lambda_theta=0.1")


# ----------------------------------------------------------------------------- pFedGP
def test_pfedgp_kernel_is_fixed_by_default_as_in_the_authors_code() -> None:
    method = build(PFedGP, digits_data(6), clients_per_round=3)
    assert isinstance(method, PFedGP)
    assert not method.hp.learn_kernel and len(method.kernel) == 0
    assert not any(n.startswith("gp.") for n in method.payload(torch.tensor([0])))
    assert method.kernel_hyperparameters({}) == (0.5, 0.1)


def test_pfedgp_learned_kernel_is_trained_on_the_marginal_likelihood_and_averaged() -> None:
    dm = digits_data(6)
    method = build(
        PFedGP,
        dm,
        clients_per_round=3,
        learn_kernel=True,
        lengthscale=0.7,
        noise=0.2,
        objective="marginal",
    )
    assert isinstance(method, PFedGP)
    start = {n: float(p) for n, p in method.kernel.items()}
    assert start["log_lengthscale"] == pytest.approx(math.log(0.7))
    assert start["log_noise"] == pytest.approx(math.log(0.2 - NOISE_FLOOR))
    sent = method.payload(torch.tensor([0, 4]))
    assert set(KERNEL) <= set(sent) and sent[KERNEL[0]].shape == (2,)
    # the client loss is the GP likelihood at l = exp(log l), s2 = exp(log s2) + floor
    params = {n: t[0] for n, t in sent.items()}
    index, weight = next(method.data.eval_blocks(torch.tensor([0]), "train", 16))
    x, y = method.data.fetch(index)
    z = method.extractor(params, x[0], train=True).double()
    expected = gp_negative_log_likelihood(z, y[0], weight[0].double(), 10, 0.7, 0.2).float()
    got = method.gp_loss(params, {}, x[0], y[0], weight[0])
    torch.testing.assert_close(got, expected)
    leaves = {n: t.detach().requires_grad_() for n, t in params.items()}
    loss = method.gp_loss(leaves, {}, x[0], y[0], weight[0])
    assert isinstance(loss, torch.Tensor)
    grads = torch.autograd.grad(loss, [leaves[n] for n in KERNEL])
    assert all(float(g.abs()) > 0 for g in grads)
    # one round: the server's kernel is the sample-weighted mean of the clients' trained ones
    trained = capture_local_training(method)
    clients = torch.tensor([0, 1, 4])
    round_loss = method.run_round(0, clients)
    method.server_optimizer = method.configure_server_optimizer()
    method.server_optimizer.step()
    weights = method.client_weights(clients, 0)
    for name, p in method.kernel.items():
        uploaded = trained[0].params[f"gp.{name}"]
        assert not torch.allclose(uploaded, torch.full_like(uploaded, start[name]))
        torch.testing.assert_close(p.detach(), (weights * uploaded).sum().to(p.dtype))
    assert torch.isfinite(round_loss).all()


def test_pfedgp_prediction_reads_the_learned_kernel() -> None:
    method = build(PFedGP, digits_data(6), clients_per_round=3, learn_kernel=True)
    assert isinstance(method, PFedGP)
    with torch.no_grad():
        method.kernel["log_lengthscale"].fill_(math.log(0.3))
        method.kernel["log_noise"].fill_(math.log(0.05))
    clients = torch.tensor([2])
    params = {n: t[0] for n, t in method.personalized_params(clients).items()}
    index, weight = next(method.data.eval_blocks(clients, "train", 10**6))
    x, y = method.data.fetch(index)
    count = int(weight[0].sum())
    net = {n: t for n, t in params.items() if not n.startswith("gp.")}
    z = method.extractor(net, x[0, :count]).double()
    x_test, _ = method.data.fetch(next(method.data.eval_blocks(clients, "test", 10**6))[0][0])
    expected = gp_posterior_mean(
        z,
        y[0, :count],
        torch.ones(count, dtype=torch.float64),
        method.extractor(net, x_test).double(),
        10,
        0.3,
        0.05 + NOISE_FLOOR,
    )
    torch.testing.assert_close(
        method.predict(params, x_test), expected.float(), rtol=1e-4, atol=1e-5
    )


def test_pfedgp_refuses_a_noise_at_the_floor_when_learning_the_kernel() -> None:
    with pytest.raises(ConfigError, match="learn_kernel"):
        build(PFedGP, digits_data(6), learn_kernel=True, noise=NOISE_FLOOR)


def test_pfedgp_learned_kernel_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(PFedGP, learn_kernel=True)


def test_pfedgp_learned_kernel_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "pfedgp.yaml", tmp_path, "--model.init_args.learn_kernel=true")
