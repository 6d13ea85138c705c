"""Paper defaults of PeFLL (the authors' server optimizer) and pFedLA (hypernetwork depth and
what one aggregation weight covers), each checked against a hand computation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.pefll import PeFLL
from lightning_pfl.methods.pfedla import PFedLA
from tests.conftest import build, digits_data
from tests.helpers import CONF, assert_resume_is_exact, assert_vectorized_equals_sequential


# ----------------------------------------------------------------------------- PeFLL
def test_pefll_default_server_optimizer_is_the_authors_adam() -> None:
    method = build(PeFLL, digits_data(6))
    assert isinstance(method, PeFLL)
    h = method.hp
    assert (h.hn_optimizer, h.hn_lr, h.lambda_h, h.lambda_v, h.hn_weight_decay) == (
        "adam",
        2e-4,
        0.0,
        0.0,
        0.0,
    )
    optimizer = method.configure_optimizers()
    assert type(optimizer) is torch.optim.Adam
    for group in optimizer.param_groups:
        assert group["lr"] == 2e-4 and group["weight_decay"] == 0
        assert group["betas"] == (0.9, 0.999) and group["eps"] == 1e-8
    sgd = build(PeFLL, digits_data(6), hn_optimizer="sgd", hn_lr=0.01).configure_optimizers()
    assert type(sgd) is torch.optim.SGD
    assert all(g["momentum"] == 0.9 and g["lr"] == 0.01 for g in sgd.param_groups)


def test_pefll_server_steps_are_hand_computed_adam_steps() -> None:
    """Two rounds of the default: phi moves by Adam's bias-corrected step at 2e-4, psi at
    2e-4 * s (the standardization's scale), from the gradients each round sets."""
    method = build(PeFLL, digits_data(6))
    assert isinstance(method, PeFLL)
    optimizer = method.configure_optimizers()
    method.calibrate_descriptors()
    scale = float(method.network.embedder.scale)
    phi = method.network.body_parameters()
    psi = method.network.embedding_parameters()
    rates = [2e-4] * len(phi) + [2e-4 * scale] * len(psi)
    params = phi + psi
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step, clients in enumerate((torch.tensor([0, 3]), torch.tensor([1, 4])), start=1):
        optimizer.zero_grad()
        method.run_round(step - 1, clients)
        before = [p.detach().clone() for p in params]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        optimizer.step()
        for i, (p, g, lr) in enumerate(zip(params, grads, rates, strict=True)):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            m_hat, v_hat = m[i] / (1 - 0.9**step), v[i] / (1 - 0.999**step)
            expected = before[i] - lr * m_hat / (v_hat.sqrt() + 1e-8)
            torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-9)
        assert any((p.detach() != b).any() for p, b in zip(phi, before, strict=False))


# ----------------------------------------------------------------------------- pFedLA
def relu_sum(out: torch.Tensor) -> torch.Tensor:
    positive = torch.relu(out)
    return positive / positive.sum(-1, keepdim=True)


def test_pfedla_default_hypernetwork_has_three_hidden_relu_layers() -> None:
    method = build(PFedLA, digits_data(5))
    assert isinstance(method, PFedLA)
    hn, c = method.hnet, 2
    assert method.hp.hidden_layers == 3 and len(hn.hidden_weights) == 3
    w, b = hn.hidden_weights, hn.hidden_biases
    z = torch.relu(w[0][c] @ hn.embedding[c] + b[0][c])
    z = torch.relu(w[1][c] @ z + b[1][c])
    z = torch.relu(w[2][c] @ z + b[2][c])
    out = (hn.out_weight[c] @ z + hn.out_bias[c]).view(len(method.layers), 5)
    torch.testing.assert_close(hn(torch.tensor([c]))[0], relu_sum(out))

    earlier = build(PFedLA, digits_data(5), hidden_layers=2)
    assert isinstance(earlier, PFedLA)
    hn = earlier.hnet
    w, b = hn.hidden_weights, hn.hidden_biases
    assert len(w) == 2
    z = torch.relu(w[1][c] @ torch.relu(w[0][c] @ hn.embedding[c] + b[0][c]) + b[1][c])
    out = (hn.out_weight[c] @ z + hn.out_bias[c]).view(len(earlier.layers), 5)
    torch.testing.assert_close(hn(torch.tensor([c]))[0], relu_sum(out))


@pytest.mark.parametrize("unit", ["layer", "tensor"])
def test_pfedla_aggregation_unit_mixes_layers_or_tensors_by_hand(unit: str) -> None:
    n = 4
    method = build(PFedLA, digits_data(n), aggregation_unit=unit)
    assert isinstance(method, PFedLA)
    names = list(method.arch.shapes)
    modules = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in names))
    units = names if unit == "tensor" else modules
    assert method.layers == units and len(modules) < len(names)  # weight and bias per module

    def unit_of(name: str) -> int:
        return names.index(name) if unit == "tensor" else modules.index(name.rsplit(".", 1)[0])

    generator = torch.Generator().manual_seed(0)
    models = {k: torch.randn(n, *s, generator=generator) for k, s in method.arch.shapes.items()}
    method.store.scatter("params", torch.arange(n), models)
    clients = torch.tensor([1, 3])
    alpha = method.hnet(clients)
    assert alpha.shape == (2, len(units), n)
    mixed = method.personalized_params(clients)
    for name, t in models.items():
        for row in range(2):
            expected = sum(alpha[row, unit_of(name), j] * t[j] for j in range(n))
            torch.testing.assert_close(mixed[name][row], expected)
    weight, bias = f"{modules[0]}.weight", f"{modules[0]}.bias"
    same_row = torch.equal(alpha[:, unit_of(weight)], alpha[:, unit_of(bias)])
    assert same_row == (unit == "layer")


def test_pfedla_refuses_an_unknown_aggregation_unit() -> None:
    with pytest.raises(ConfigError, match="aggregation_unit"):
        build(PFedLA, digits_data(4), aggregation_unit="module")


def test_pfedla_per_tensor_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(PFedLA, aggregation_unit="tensor", hidden_layers=2)


def test_pfedla_per_tensor_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / "pfedla.yaml", tmp_path, "--model.init_args.aggregation_unit=tensor"
    )
