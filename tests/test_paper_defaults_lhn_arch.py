"""Issue 43 item 3 for pFedLHN's hypernetwork: the public code's (tianyuzeke/pFedLHN) layer
module sizes by default (``--hdim`` 128, one linear map without activation, ``--embed-dim`` 40,
the client input mixed from ``--n-embeds`` 5 shared embeddings with coefficients of standard
deviation ``--norm-var`` 0.002), the old hypernetwork reachable. The shared body and per-tensor
coefficients (the default since) are tested in test_paper_defaults_lhn_shared.py; the tests
here of one hypernetwork per layer set ``layer_modules``/``coefficients: per_layer``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_pfl.methods.pfedlhn import (
    LayerwiseHyperNetwork,
    MixedEmbedding,
    PFedLHN,
    SharedBodyHyperNetwork,
)
from tests.conftest import build, digits_data
from tests.helpers import assert_resume_is_exact, assert_vectorized_equals_sequential

CONF = Path(__file__).parent / "conf"


def coefficients_of(hnet: object) -> torch.Tensor:
    """The initial mixing coefficients of every client and row, [rows, M]."""
    assert isinstance(hnet, SharedBodyHyperNetwork)
    assert isinstance(hnet.embeddings, MixedEmbedding)
    return hnet.embeddings.coefficients.detach().flatten(0, 1)


def test_pfedlhn_per_layer_modules_have_the_public_codes_sizes() -> None:
    """The code's sizes (models.py l. 18-60) in one hypernetwork per layer:
    theta_k = W_k^l (W_1^l c_i^l E + b_1^l) + b_k with E in R^{5 x 40} shared by every layer,
    c_i^l in R^5 per layer, W_1^l in R^{128 x 40} and no activation; computed here by hand for
    every layer."""
    method = build(PFedLHN, digits_data(6), layer_modules="per_layer", coefficients="per_layer")
    assert isinstance(method, PFedLHN)
    hnet = method.hnet
    assert isinstance(hnet, LayerwiseHyperNetwork)
    clients = torch.tensor([0, 4])
    generated = hnet(clients)
    first_layer = hnet.layer(hnet.layer_names[0]).embeddings
    assert isinstance(first_layer, MixedEmbedding)
    basis = first_layer.basis.weight
    assert basis.shape == (5, 40)
    coefficients = []
    for name in hnet.layer_names:
        layer = hnet.layer(name)
        (first,) = layer.mlp  # one Linear, no ReLU, no further hidden layer
        assert isinstance(first, nn.Linear)
        assert (first.in_features, first.out_features) == (40, 128)
        mixed = layer.embeddings
        assert isinstance(mixed, MixedEmbedding)
        assert mixed.basis.weight is basis  # one basis for every layer
        assert mixed.coefficients.shape == (6, 5)
        coefficients.append(mixed.coefficients)
        features = mixed.coefficients[clients] @ basis @ first.weight.T + first.bias
        for (tensor, shape), head in zip(layer.target_shapes.items(), layer.heads, strict=True):
            assert isinstance(head, nn.Linear) and head.in_features == 128
            expected = (features @ head.weight.T + head.bias).view(2, *shape)
            torch.testing.assert_close(generated[tensor], expected)
    # each layer its own coefficients; the server optimizer sees the basis and each once
    assert len({id(c) for c in coefficients}) == len(hnet.layer_names)
    assert len(hnet.embedding_parameters()) == 1 + len(hnet.layer_names)


def test_pfedlhn_mixing_coefficients_start_at_the_codes_scale() -> None:
    """torch.normal(0, norm_var) with norm_var 0.002 (a standard deviation), basis N(0, 1)."""
    hnet = build(PFedLHN, digits_data(40)).hnet
    coefficients = coefficients_of(hnet)
    assert coefficients.numel() == 40 * 8 * 5  # a row per client and tensor
    assert 0.0018 < float(coefficients.std()) < 0.0022
    assert isinstance(hnet, SharedBodyHyperNetwork)
    mixed = hnet.embeddings
    assert isinstance(mixed, MixedEmbedding)
    assert 0.8 < float(mixed.basis.weight.detach().std()) < 1.2
    scaled = coefficients_of(build(PFedLHN, digits_data(40), coefficient_std=0.2).hnet)
    assert 0.18 < float(scaled.std()) < 0.22


def test_pfedlhn_one_coefficient_row_for_every_layer_is_the_codes_layer_wise_false() -> None:
    hnet = build(PFedLHN, digits_data(6), shared_embedding=True).hnet
    assert isinstance(hnet, SharedBodyHyperNetwork)
    assert hnet.groups == [0] * 8  # every tensor reads row 0
    assert len(hnet.embedding_parameters()) == 2  # c and E
    per_layer = build(
        PFedLHN, digits_data(6), shared_embedding=True, layer_modules="per_layer"
    ).hnet
    assert isinstance(per_layer, LayerwiseHyperNetwork)
    assert len({id(layer.embeddings) for layer in per_layer.layer_modules()}) == 1
    assert len(per_layer.embedding_parameters()) == 2


def test_pfedlhn_old_layer_modules_stay_reachable() -> None:
    """hidden 100, one ReLU hidden layer after the first, pFedHN's embedding floor(1 + n / 4),
    one free embedding table read by every layer."""
    method = build(
        PFedLHN,
        digits_data(6),
        hidden_dim=100,
        n_hidden=1,
        embed_dim=None,
        n_embeds=None,
        shared_embedding=True,
        layer_modules="per_layer",
    )
    hnet = method.hnet
    assert isinstance(hnet, LayerwiseHyperNetwork)
    (table,) = hnet.embedding_parameters()
    assert table.shape == (6, int(1 + 6 / 4))
    for name in hnet.layer_names:
        mlp = hnet.layer(name).mlp
        assert [type(m) for m in mlp] == [nn.Linear, nn.ReLU, nn.Linear]
        assert mlp[0].in_features == int(1 + 6 / 4) and mlp[2].out_features == 100


def test_pfedlhn_vectorized_equals_sequential_with_the_public_codes_hypernetwork() -> None:
    # SGD on the server for the reason in test_baselines_e's vectorized test (AdamW amplifies
    # float rounding of near-zero gradient elements); the sizes are the new defaults
    assert_vectorized_equals_sequential(
        PFedLHN, hn_optimizer="sgd", hn_lr=1e-2, hn_weight_decay=1e-3
    )


def test_pfedlhn_resume_is_exact_with_the_public_codes_hypernetwork(tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / "pfedlhn.yaml",
        tmp_path,
        "--model.init_args.hidden_dim=128",
        "--model.init_args.n_hidden=0",
        "--model.init_args.embed_dim=40",
        "--model.init_args.n_embeds=5",
        "--model.init_args.shared_embedding=false",
    )
