"""q-FFL's server step written as docs/methods.md explains its FashionMNIST row (issue 46): the
F^q-weighted mean of the clients' model changes, shrunk by the ||Delta w_k||^2 term of h_k."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_pfl.methods.qffl import QFFL
from tests.conftest import build, digits_data
from tests.helpers import capture_local_training


def test_qffl_step_is_the_loss_weighted_mean_change_shrunk_by_the_norm_term() -> None:
    """With d_k = w - wbar_k (so Delta w_k = L d_k), Algorithm 3's step
    sum_k F_k^q Delta w_k / sum_k h_k is s * sum_k F_k^q d_k / sum_k F_k^q with the shrink
    s = sum_k F_k^q / sum_k (F_k^q + q L F_k^{q-1} ||d_k||^2): a configured L (here 4, not
    1 / eta_l = 20) enters only the shrink."""
    dm = digits_data(6)
    q, lip = 1.5, 4.0
    method = build(QFFL, dm, q=q, lipschitz=lip, local_lr=0.05, clients_per_round=3)
    assert isinstance(method, QFFL)
    trained = capture_local_training(method)
    clients = torch.tensor([0, 2, 5])
    w = {n: t.clone() for n, t in method.global_state().items()}
    method.run_round(0, clients)
    names = list(method.arch.shapes)
    losses, changes = [], []
    for i, c in enumerate(clients):
        index = next(dm.eval_blocks(c.view(1), "train", 10**6))[0][0]
        x, y = dm.fetch(index)
        losses.append(float(F.cross_entropy(method.arch(w, x), y)))
        changes.append({n: w[n] - trained[0].params[n][i] for n in names})
    powered = [f**q for f in losses]
    squared = [sum(float((d[n] ** 2).sum()) for n in names) for d in changes]
    shrink = sum(powered) / sum(
        p + q * lip * f ** (q - 1) * s for p, f, s in zip(powered, losses, squared, strict=True)
    )
    assert shrink < 0.9  # the norm term matters in this case
    for name, param in method.net.named_parameters():
        mean = sum(p * d[name] for p, d in zip(powered, changes, strict=True)) / sum(powered)
        torch.testing.assert_close(param.grad, shrink * mean, rtol=1e-4, atol=1e-8, msg=name)
