"""Issue 43 item 3 for pFedLHN's hypernetwork: the public code's (tianyuzeke/pFedLHN) layer
module sizes by default (``--hdim`` 128, one linear map without activation, ``--embed-dim`` 40),
the old sizes reachable, and the configs pinned to the sizes their rows ran."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_pfl.methods.pfedlhn import LayerwiseHyperNetwork, PFedLHN
from tests.conftest import build, digits_data
from tests.helpers import assert_resume_is_exact, assert_vectorized_equals_sequential

CONF = Path(__file__).parent / "conf"


def test_pfedlhn_layer_modules_are_the_public_codes_by_default() -> None:
    """CNNHyper (models.py l. 24-60): theta_k = W_k (W_1 v_i + b_1) + b_k with v_i in R^40,
    W_1 in R^{128 x 40} and no activation; computed here by hand for every layer."""
    method = build(PFedLHN, digits_data(6))
    assert isinstance(method, PFedLHN)
    hnet = method.hnet
    assert isinstance(hnet, LayerwiseHyperNetwork)
    clients = torch.tensor([0, 4])
    generated = hnet(clients)
    for name in hnet.layer_names:
        layer = hnet.layer(name)
        (first,) = layer.mlp  # one Linear, no ReLU, no further hidden layer
        assert isinstance(first, nn.Linear)
        assert (first.in_features, first.out_features) == (40, 128)
        v = layer.embeddings.weight[clients]
        assert v.shape == (2, 40)
        features = v @ first.weight.T + first.bias
        for (tensor, shape), head in zip(layer.target_shapes.items(), layer.heads, strict=True):
            assert isinstance(head, nn.Linear) and head.in_features == 128
            expected = (features @ head.weight.T + head.bias).view(2, *shape)
            torch.testing.assert_close(generated[tensor], expected)


def test_pfedlhn_old_layer_modules_stay_reachable() -> None:
    """hidden 100, one ReLU hidden layer after the first, pFedHN's embedding floor(1 + n / 4)."""
    method = build(PFedLHN, digits_data(6), hidden_dim=100, n_hidden=1, embed_dim=None)
    hnet = method.hnet
    assert isinstance(hnet, LayerwiseHyperNetwork)
    for name in hnet.layer_names:
        mlp = hnet.layer(name).mlp
        assert [type(m) for m in mlp] == [nn.Linear, nn.ReLU, nn.Linear]
        assert mlp[0].in_features == int(1 + 6 / 4) and mlp[2].out_features == 100


def test_pfedlhn_vectorized_equals_sequential_with_the_public_codes_sizes() -> None:
    # SGD on the server for the reason in test_baselines_e's vectorized test (AdamW amplifies
    # float rounding of near-zero gradient elements); the sizes are the new defaults
    assert_vectorized_equals_sequential(
        PFedLHN, hn_optimizer="sgd", hn_lr=1e-2, hn_weight_decay=1e-3
    )


def test_pfedlhn_resume_is_exact_with_the_public_codes_sizes(tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / "pfedlhn.yaml",
        tmp_path,
        "--model.init_args.hidden_dim=128",
        "--model.init_args.n_hidden=0",
        "--model.init_args.embed_dim=40",
    )
