"""CFL's split criterion compares what the authors' code compares (issue 43: why CFL never splits
on digits). The code (``clustered_federated_learning.ipynb``) splits a cluster when
``mean_norm < EPS_1 and max_norm > EPS_2 and len(idc) > 2 and c_round > 20`` with ``c_round``
counted from 1, ``max_norm`` the largest norm of a member's raw update ``dW = W - W_old``."""

from __future__ import annotations

import torch

from lightning_pfl.methods.cfl import CFL
from tests.conftest import build, digits_data
from tests.helpers import capture_local_training


def first_round(round_idx: int, **kwargs: float) -> tuple[CFL, torch.Tensor]:
    """One round of six clients in one cluster at ``round_idx``; the method and the raw updates."""
    method = build(CFL, digits_data(6), min_cluster_size=2, **kwargs)
    assert isinstance(method, CFL)
    before = {n: t[0].clone() for n, t in method.models().items()}
    trained = capture_local_training(method)
    method.run_round(round_idx, torch.arange(6))
    delta = torch.cat(
        [(trained[0].params[n] - before[n]).flatten(1) for n in method.arch.shapes], 1
    )
    return method, delta


def test_cfl_max_update_norm_bound_is_strict_on_the_raw_update() -> None:
    # eps_1 never binds; the largest raw update norm of the round decides
    _, delta = first_round(0, eps_1=1e6, eps_2=0.0, split_from_round=0)
    max_norm = float(delta.double().norm(dim=1).max())
    below, _ = first_round(0, eps_1=1e6, eps_2=max_norm * 0.999, split_from_round=0)
    above, _ = first_round(0, eps_1=1e6, eps_2=max_norm * 1.001, split_from_round=0)
    assert below.cluster_of.max() == 1
    assert above.cluster_of.max() == 0


def test_cfl_first_split_round_is_the_codes_21st() -> None:
    # round_idx counts from 0: the code's ``c_round > 20`` is round_idx >= 20
    assert first_round(19, eps_1=1e6, eps_2=0.0, split_from_round=20)[0].cluster_of.max() == 0
    assert first_round(20, eps_1=1e6, eps_2=0.0, split_from_round=20)[0].cluster_of.max() == 1
