from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import PFedHN
from lightning_pfl.methods.pfedhn_budgets import PFedHNBudgets
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    capture_local_training,
    cli,
)

SIZES = {
    name: {"net": "digits_cnn", "net_args": {"width": width, "hidden": 16}}
    for name, width in (("S", 4), ("M", 8), ("L", 16))
}


def budgets(num_clients: int = 6, **kwargs: Any) -> PFedHNBudgets:
    kwargs.setdefault("architectures", SIZES)
    method = build(PFedHNBudgets, digits_data(num_clients), **kwargs)
    assert isinstance(method, PFedHNBudgets)
    return method


def test_each_size_generates_exactly_its_networks_shapes() -> None:
    method = budgets()
    assert [len(method.sizes.members(s)) for s in "SML"] == [2, 2, 2]
    for size in "SML":
        members = method.sizes.members(size)
        params = method.personalized_params(members)
        shapes = method.sizes.archs[size].shapes
        assert {n: tuple(t.shape) for n, t in params.items()} == {
            f"{size}/{n}": (len(members), *s) for n, s in shapes.items()
        }
    assert method.sizes.archs["L"].shapes["conv1.weight"] == (16, 1, 3, 3)
    assert method.sizes.archs["S"].shapes["conv2.weight"] == (8, 4, 3, 3)


def test_default_sizes_are_the_papers_cnns_with_8_16_32_kernels() -> None:
    method = PFedHNBudgets(num_clients=75, num_classes=10, input_shape=(3, 32, 32))
    assert [len(method.sizes.members(s)) for s in "SML"] == [25, 25, 25]
    for size, k in (("S", 8), ("M", 16), ("L", 32)):
        shapes = method.sizes.archs[size].shapes
        assert shapes["conv1.weight"] == (k, 3, 5, 5)
        assert shapes["conv2.weight"] == (2 * k, k, 5, 5)


def test_sizes_share_embeddings_and_body_but_not_heads() -> None:
    method = budgets(clients_per_round=2)
    hnet = method.network
    assert hnet.embedding_parameters() == [hnet.body.embeddings.weight]
    assert len(hnet.body.heads) == 0
    optimizer = method.configure_optimizers()
    method.run_round(0, torch.arange(6))  # every head now has SGD momentum
    optimizer.step()
    before = {n: p.detach().clone() for n, p in hnet.named_parameters()}
    small = method.sizes.members("S")
    optimizer.zero_grad()
    method.run_round(1, small)
    optimizer.step()
    for name, p in hnet.named_parameters():
        changed = not torch.equal(p, before[name])
        if name.startswith(("heads.M.", "heads.L.")):
            assert not changed, name
            assert p.grad is None, name
        else:
            assert changed, name


def test_server_gradient_is_the_gradient_of_the_surrogate_over_a_mixed_round() -> None:
    """grad = grad of (1/C) sum_i 0.5 ||h_{s(i)}(v_i; phi) - theta~_i||^2 over sizes S and L."""
    method = budgets(clients_per_round=4, hn_max_grad_norm=None)
    sizes = method.sizes
    clients = torch.cat([sizes.members("S"), sizes.members("L")]).sort().values
    trained = capture_local_training(method)
    method.run_round(0, clients)
    assert len(trained) == 2  # one local_train per size in the round
    actual = {n: p.grad for n, p in method.hnet.named_parameters()}
    surrogate = torch.zeros(())
    for result, (size, rows) in zip(trained, sizes.split(clients), strict=True):
        generated = method.network(clients[rows], size)
        for n, t in generated.items():
            surrogate = surrogate + 0.5 * ((t - result.params[n]) ** 2).sum() / len(clients)
    names = [n for n, _ in method.hnet.named_parameters()]
    expected = torch.autograd.grad(surrogate, list(method.hnet.parameters()), allow_unused=True)
    for name, g in zip(names, expected, strict=True):
        if name.startswith("heads.M."):
            assert g is None and actual[name] is None, name
        else:
            assert g is not None and g.abs().sum() > 0, name
            torch.testing.assert_close(actual[name], g, msg=name)


def test_vectorized_and_sequential_rounds_agree() -> None:
    assert_vectorized_equals_sequential(PFedHNBudgets, architectures=SIZES)


def test_resume_is_exact_and_accuracy_is_reported_per_size(tmp_path: Path) -> None:
    config = CONF / "pfedhn_budgets.yaml"
    assert_resume_is_exact(config, tmp_path)
    fitted = cli(config, tmp_path / "per_size", "--trainer.max_steps=2")
    for size in "SML":
        assert 0 <= fitted["test_last"][f"arch_{size}/acc"] <= 1
        assert 0 <= fitted["val_last"][f"arch_{size}/acc"] <= 1
        assert fitted["size_clients"][size] == 2
    assert fitted["size_parameters"]["S"] < fitted["size_parameters"]["M"]
    by_size = fitted["comm_bytes_by_size"]
    assert sum(b["down"] for b in by_size.values()) == fitted["comm_bytes_down_total"]
    assert sum(b["up"] for b in by_size.values()) == fitted["comm_bytes_up_total"]


def test_batch_norm_sizes_and_per_client_steps_are_refused() -> None:
    with_bn = {**SIZES, "L": {"net": "digits_cnn", "net_args": {"batch_norm": True}}}
    with pytest.raises(ConfigError, match=r"architectures\.L.*without batch norm"):
        budgets(architectures=with_bn)
    with pytest.raises(ConfigError, match="model.init_args.hn_update"):
        budgets(hn_update="per_client")


# ----------------------------------------------------------------- PFedHN hooks
def test_weighted_hypernetwork_gradient_is_the_gradient_of_the_weighted_surrogate() -> None:
    """set_hypernetwork_gradients(weights=w) = grad of sum_i w_i <h(v_i; phi), delta_i>."""
    method = build(PFedHN, digits_data(6), hn_max_grad_norm=None)
    clients = torch.tensor([0, 3, 4])
    generated = method.hnet(clients)
    torch.manual_seed(0)
    delta = {n: torch.randn_like(t) for n, t in generated.items()}
    weights = torch.tensor([0.5, 0.2, 0.3])
    method.set_hypernetwork_gradients(generated, delta, weights=weights)
    actual = [p.grad for p in method.hnet.parameters()]
    generated = method.hnet(clients)
    surrogate = sum(
        (weights.view(-1, *[1] * (t.dim() - 1)) * t * delta[n]).sum() for n, t in generated.items()
    )
    expected = torch.autograd.grad(surrogate, list(method.hnet.parameters()))
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e)
    method.set_hypernetwork_gradients(method.hnet(clients), delta)  # default: uniform 1/C
    uniform = [p.grad for p in method.hnet.parameters()]
    method.set_hypernetwork_gradients(method.hnet(clients), delta, weights=torch.full((3,), 1 / 3))
    for a, e in zip(uniform, [p.grad for p in method.hnet.parameters()], strict=True):
        torch.testing.assert_close(a, e)


def test_build_hypernetwork_is_the_hypernetwork_a_subclass_builds() -> None:
    from lightning_pfl.methods.pfedlhn import PFedLHN, SharedBodyHyperNetwork

    method = build(PFedLHN, digits_data(6))
    assert isinstance(method.hnet, SharedBodyHyperNetwork)
