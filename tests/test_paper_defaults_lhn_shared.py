"""Issue 43 item 3 for pFedLHN's layer modules: the public code's structure by default
(tianyuzeke/pFedLHN ``models.py`` l. 24-60: one body ``fc1`` shared by every generated tensor,
one head per tensor, one coefficient row c_i^k per tensor, weight and bias apart); one
hypernetwork per layer with one row per layer (``layer_modules``/``coefficients: per_layer``)
reachable."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.pfedlhn import (
    LayerwiseHyperNetwork,
    MixedEmbedding,
    PFedLHN,
    SharedBodyHyperNetwork,
)
from tests.conftest import build, digits_data
from tests.helpers import CONF, assert_resume_is_exact, assert_vectorized_equals_sequential

# a tiny target (fc1: 64 -> 3, fc2: 3 -> 10; four tensors in two layers) and hypernetwork
TINY = {"net": "mlp", "net_args": {"hidden": 3}, "embed_dim": 3, "hidden_dim": 4, "n_embeds": 2}


def tiny(**kwargs: object) -> PFedLHN:
    method = build(PFedLHN, digits_data(4), **{**TINY, **kwargs})
    assert isinstance(method, PFedLHN)
    return method


def dependencies(hnet: nn.Module, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The gradient of sum(tensor) for every hypernetwork parameter it depends on."""
    named = dict(hnet.named_parameters())
    grads = torch.autograd.grad(
        tensor.sum(), list(named.values()), allow_unused=True, retain_graph=True
    )
    return {n: g for (n, _), g in zip(named.items(), grads, strict=True) if g is not None}


def test_pfedlhn_generates_the_public_codes_shared_body_and_per_tensor_rows_by_default() -> None:
    """theta_i^k = W_k (W_1 (c_i^k E) + b_1) + b_k (models.py l. 48-60, ``use_fc`` True): one
    Linear body for every tensor, no activation, row k of c_i E for tensor k; by hand."""
    method = tiny()
    hnet = method.hnet
    assert method.hp.layer_modules == "shared_body" and method.hp.coefficients == "per_tensor"
    assert isinstance(hnet, SharedBodyHyperNetwork)
    mixed = hnet.embeddings
    assert isinstance(mixed, MixedEmbedding)
    (body,) = hnet.mlp
    assert isinstance(body, nn.Linear)
    basis, coefficients = mixed.basis.weight, mixed.coefficients
    assert basis.shape == (2, 3) and coefficients.shape == (4, 4, 2)  # [n, K tensors, M]
    clients = torch.tensor([3, 1])
    generated = hnet(clients)
    assert list(generated) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    for k, ((name, shape), head) in enumerate(
        zip(method.arch.shapes.items(), hnet.heads, strict=True)
    ):
        for row, client in enumerate(clients.tolist()):
            v = sum(coefficients[client, k, m] * basis[m] for m in range(2))  # c_i^k E
            f = body.weight @ v + body.bias
            assert isinstance(head, nn.Linear)
            expected = (head.weight @ f + head.bias).view(shape)
            torch.testing.assert_close(generated[name][row], expected)


def test_pfedlhn_every_tensor_reads_the_shared_body_and_its_own_coefficient_row() -> None:
    """By the gradients, whatever the module names: the parameters every tensor depends on are
    the body and the client inputs; besides them each tensor has only its own head (a weight and
    a bias); and it reads client i's coefficients through row k only (weight and bias apart)."""
    method = tiny()
    hnet = method.hnet
    generated = hnet(torch.tensor([2]))
    grads = {name: dependencies(hnet, tensor) for name, tensor in generated.items()}
    shared = set.intersection(*(set(g) for g in grads.values()))
    own = [set(g) - shared for g in grads.values()]
    assert all(len(o) == 2 for o in own), own
    assert len(set.union(*own)) == 2 * len(generated)
    inputs = {n for n, _ in hnet.named_parameters() if n.startswith("embeddings.")}
    assert shared - inputs == {"mlp.0.weight", "mlp.0.bias"}
    assert inputs <= shared
    for k, g in enumerate(grads.values()):
        coefficient = g["embeddings.coefficients"]  # [n, rows, M]
        assert coefficient.abs().sum(-1).nonzero().tolist() == [[2, k]]


def test_pfedlhn_parameter_count_is_the_public_codes() -> None:
    """n K M coefficients + M E basis + one body (E H + H) + a head (H + 1) numel_k per tensor."""
    method = tiny()
    shapes = method.arch.shapes
    n, k, m, e, h = 4, len(shapes), 2, 3, 4
    heads = sum((h + 1) * math.prod(s) for s in shapes.values())
    expected = n * k * m + m * e + (e * h + h) + heads
    assert sum(p.numel() for p in method.hnet.parameters()) == expected
    embeddings = sum(p.numel() for p in method.hnet.embedding_parameters())
    assert embeddings == n * k * m + m * e


def test_pfedlhn_per_layer_coefficients_with_the_shared_body() -> None:
    """``coefficients: per_layer``: weight and bias of a layer read one row c_i^l."""
    method = tiny(coefficients="per_layer")
    hnet = method.hnet
    assert isinstance(hnet, SharedBodyHyperNetwork)
    assert hnet.groups == [0, 0, 1, 1]
    mixed = hnet.embeddings
    assert isinstance(mixed, MixedEmbedding) and mixed.coefficients.shape == (4, 2, 2)
    clients = torch.tensor([0, 3])
    generated = hnet(clients)
    features = hnet.mlp(mixed.coefficients[clients] @ mixed.basis.weight)  # [C, L, H]
    for (name, shape), head, layer in zip(
        method.arch.shapes.items(), hnet.heads, [0, 0, 1, 1], strict=True
    ):
        expected = head(features[:, layer]).view(2, *shape)
        torch.testing.assert_close(generated[name], expected)


def test_pfedlhn_one_row_for_every_tensor_with_the_shared_embedding() -> None:
    """``shared_embedding``: the code's ``--layer-wise False`` (``ft[0]`` for every head)."""
    hnet = tiny(shared_embedding=True).hnet
    assert isinstance(hnet, SharedBodyHyperNetwork) and hnet.groups == [0, 0, 0, 0]
    free = tiny(shared_embedding=True, n_embeds=None).hnet
    assert isinstance(free, SharedBodyHyperNetwork)
    assert isinstance(free.embeddings, nn.Embedding)
    assert free.embeddings.weight.shape == (4, 3)  # one free v_i per client


def test_pfedlhn_free_per_tensor_embeddings_without_n_embeds() -> None:
    hnet = tiny(n_embeds=None).hnet
    assert isinstance(hnet, SharedBodyHyperNetwork)
    (table,) = hnet.embedding_parameters()
    assert table.shape == (4, 4 * 3)  # K rows of size E per client
    torch.testing.assert_close(hnet.inputs(torch.tensor([1]))[0, 2], table[1, 6:9])


def test_pfedlhn_per_layer_modules_stay_reachable() -> None:
    method = tiny(layer_modules="per_layer", coefficients="per_layer")
    hnet = method.hnet
    assert isinstance(hnet, LayerwiseHyperNetwork)
    assert hnet.layer_names == ["fc1", "fc2"]
    bodies = [id(layer.mlp) for layer in hnet.layer_modules()]
    assert len(set(bodies)) == 2


def test_pfedlhn_per_tensor_coefficients_with_per_layer_modules_are_refused() -> None:
    with pytest.raises(ConfigError, match="coefficients: per_tensor"):
        tiny(layer_modules="per_layer")
    # one shared row needs no per-tensor rows: accepted
    assert isinstance(tiny(layer_modules="per_layer", shared_embedding=True).hnet, nn.Module)


def test_pfedlhn_shared_body_heads_start_at_the_targets_init_with_the_configs_parametrization() -> (
    None
):
    """``hn_head_init: target`` and ``hn_feature_scale`` (the digits config's) on the shared body:
    every head over the features of the row it reads, E||f||^2 over every row = 0.5."""
    method = tiny(hn_feature_scale=True, hn_head_init="target")
    hnet = method.hnet
    assert isinstance(hnet, SharedBodyHyperNetwork)
    everyone = torch.arange(4)
    with torch.no_grad():
        features = hnet.features(everyone)
        square = features.pow(2).sum(-1).mean()
        generated = hnet(everyone)
    torch.testing.assert_close(square, torch.tensor(0.5), rtol=1e-4, atol=0)
    initial = method.arch.initial_params()
    for name, tensor in generated.items():
        torch.testing.assert_close(tensor.std(), initial[name].float().std(), rtol=1e-4, atol=0)


def test_pfedlhn_vectorized_equals_sequential_with_the_shared_body() -> None:
    # the class defaults (shared body, per-tensor rows) with the digits config's
    # parametrization; SGD on the server for the reason in test_baselines_e's vectorized test
    assert_vectorized_equals_sequential(
        PFedLHN,
        hn_optimizer="sgd",
        hn_lr=1e-2,
        hn_weight_decay=1e-3,
        hn_feature_scale=True,
        hn_head_init="target",
    )


def test_pfedlhn_resume_is_exact_with_the_shared_body(tmp_path: Path) -> None:
    assert_resume_is_exact(
        CONF / "pfedlhn.yaml",
        tmp_path,
        "--model.init_args.layer_modules=shared_body",
        "--model.init_args.coefficients=per_tensor",
        "--model.init_args.hidden_dim=128",
        "--model.init_args.n_hidden=0",
        "--model.init_args.embed_dim=40",
        "--model.init_args.n_embeds=5",
        "--model.init_args.shared_embedding=false",
    )
