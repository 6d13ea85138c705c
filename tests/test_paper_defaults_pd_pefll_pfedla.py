"""Paper defaults of PeFLL (the authors' server optimizer) and pFedLA (hypernetwork depth and
what one aggregation weight covers), each checked against a hand computation."""

from __future__ import annotations

import torch

from lightning_pfl.methods.pefll import PeFLL
from tests.conftest import build, digits_data


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
