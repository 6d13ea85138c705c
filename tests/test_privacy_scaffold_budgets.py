"""Client-level DP and unreliable clients for SCAFFOLD and pFedHN-Budgets (issue 47).

SCAFFOLD: each client's [Delta y_i, Delta c_i] is clipped as one vector, x and c move by the
one noisy release; a dropped client keeps its c_i and adds nothing. pFedHN-Budgets: each
client's contribution to the shared hypernetwork (body and every size's heads) is clipped as
one vector, the embeddings are personal; the server averages the clients that arrived."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import Tensor

from lightning_pfl.conditions import Conditions, Stragglers
from lightning_pfl.engine import TrainResult
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.methods.pfedhn_budgets import PFedHNBudgets
from lightning_pfl.methods.scaffold import SCAFFOLD
from lightning_pfl.privacy import ClientDP, PrivacyAccountant
from tests.conftest import build, digits_data, fit
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_same_trained_state,
    assert_vectorized_equals_sequential,
    capture_local_training,
    run_dir,
)
from tests.test_conditions import one_round, round_with_drops, state
from tests.test_peer_a import randomized
from tests.test_pfedhn_budgets import SIZES

NO_DP = ClientDP(noise_multiplier=0.0, clip_norm=math.inf)
DP_FLAG = "--model.init_args.client_dp={noise_multiplier: 1.0, clip_norm: 0.3, delta: 1e-4}"


def trained(cls: type[FederatedMethod], rounds: int = 3, **kwargs: Any) -> FederatedMethod:
    dm = digits_data(6)
    method = build(cls, dm, **{"clients_per_round": 3, **kwargs})
    fit(method, dm, rounds=rounds)
    return method


def assert_resume_is_exact_with_dp(
    config: Path, tmp_path: Path, clients: int, per_round: int
) -> None:
    """6 rounds == 3, then resumed to 6, with DP; epsilon is the accountant's for the
    config's ``clients`` and ``per_round``."""
    assert_resume_is_exact(config, tmp_path, DP_FLAG)
    runs = [run_dir(tmp_path / name, config) for name in ("straight", "resumed")]
    straight, resumed = (json.loads((r / "results.json").read_text()) for r in runs)
    assert resumed["privacy"] == straight["privacy"]
    assert straight["privacy"]["rounds"] == 6
    assert straight["privacy"]["epsilon"] == (
        PrivacyAccountant(ClientDP(1.0, 0.3, 1e-4), clients, per_round).epsilon(6)
    )


# ----------------------------------------------------------------- SCAFFOLD
def scaffold(**kwargs: Any) -> SCAFFOLD:
    method = build(SCAFFOLD, digits_data(6), **{"clients_per_round": 3, **kwargs})
    assert isinstance(method, SCAFFOLD)
    method.configure_optimizers()
    return method


def with_control_variates(method: SCAFFOLD) -> dict[str, Tensor]:
    """Set c and every c_i to random values (the correction c - c_i then matters); return c."""
    c = randomized(method.control.tensors(), 1)
    for n, t in c.items():
        method.control[n].copy_(t)
    n_clients = method.hp.num_clients
    method.store.fields["control"] = {
        n: torch.stack([t * (i + 1) for i in range(n_clients)]) for n, t in randomized(c, 2).items()
    }
    return c


class Uploads(NamedTuple):
    delta_y: dict[str, Tensor]  # y_i - x
    delta_c: dict[str, Tensor]  # option II's c_i+ - c_i = -c + (x - y_i) / (K eta_l)
    c: dict[str, Tensor]  # before the round
    c_all: dict[str, Tensor]  # every client's c_i before the round
    steps: Tensor  # K of each client


def scaffold_uploads(method: SCAFFOLD, round_idx: int, clients: Tensor) -> Uploads:
    """Run the round; return what each client computes, by hand from its trained model."""
    x = {n: p.detach().clone() for n, p in method.net.named_parameters()}
    c = {n: t.clone() for n, t in method.control.tensors().items()}
    c_all = {n: t.clone() for n, t in method.store.fields["control"].items()}
    captured = capture_local_training(method)
    method.run_round(round_idx, clients)
    result = captured[0]
    k_eta = (result.steps.clamp_min(1) * method.hp.local_lr).double()
    delta_y = {n: result.params[n] - x[n] for n in x}
    delta_c = {n: -delta_y[n] / k_eta.view(-1, *[1] * x[n].dim()) - c[n] for n in x}
    return Uploads(delta_y, delta_c, c, c_all, result.steps)


def joint_norms(*parts: dict[str, Tensor]) -> Tensor:
    return torch.cat([t.flatten(1).double() for p in parts for t in p.values()], 1).norm(dim=1)


def test_scaffold_no_noise_and_no_clip_is_the_run_without_dp_bit_for_bit() -> None:
    plain, private = trained(SCAFFOLD), trained(SCAFFOLD, client_dp=NO_DP)
    assert private.record.extra_results["privacy"]["epsilon"] == math.inf
    assert_same_trained_state(plain, private)  # x, c and every client's c_i
    noisy = trained(SCAFFOLD, client_dp=ClientDP(1e-3, 10.0))  # the check sees a changed run
    for key in ("net.conv1.weight", "control.conv1__weight"):  # x and c
        assert not torch.equal(noisy.state_dict()[key], plain.state_dict()[key]), key


def test_scaffold_clips_the_model_and_control_updates_together() -> None:
    """f_i = min(1, S / ||[Delta y_i, Delta c_i]||); x <- x + sum_i f_i Delta y_i / qN,
    c <- c + sum_i f_i Delta c_i / N, and the client keeps its unclipped c_i+."""
    method = scaffold(client_dp=ClientDP(0.0, 1.0))
    with_control_variates(method)
    clients = torch.tensor([0, 2, 5])
    probe = scaffold(client_dp=NO_DP)  # the same round without a clip, to pick S
    with_control_variates(probe)
    unclipped = scaffold_uploads(probe, 0, clients)
    norms = joint_norms(unclipped.delta_y, unclipped.delta_c)
    clip = float(norms.median())
    method.client_dp = ClientDP(0.0, clip)
    delta_y, delta_c, c, c_all, _ = scaffold_uploads(method, 0, clients)
    norms = joint_norms(delta_y, delta_c)
    factors = (clip / norms).clamp(max=1.0)
    assert factors.min() < 1 and factors.max() == 1, "some clients clipped, some not"
    assert ((factors * norms) <= clip * (1 + 1e-6)).all()
    model_only = joint_norms(delta_y)
    assert (model_only < norms * 0.99).all(), "Delta c_i carries weight in the joint norm"
    n = method.num_training_clients
    kept = method.store.fields["control"]
    for name, p in method.net.named_parameters():
        f = factors.view(-1, *[1] * (p.dim()))
        assert p.grad is not None
        torch.testing.assert_close(
            p.grad.double(), -(f * delta_y[name]).sum(0) / 3, rtol=1e-4, atol=1e-7
        )
        moved = method.control[name] - c[name]
        torch.testing.assert_close(
            moved.double(), (f * delta_c[name]).sum(0) / n, rtol=1e-4, atol=1e-6
        )
        torch.testing.assert_close(  # c_i+ = c_i + Delta c_i, unclipped
            kept[name][clients].double(),
            c_all[name][clients] + delta_c[name],
            rtol=1e-4,
            atol=1e-6,
        )


def no_training(method: FederatedMethod) -> None:
    """Clients return what they received after K steps: Delta y_i = 0, Delta c_i = -c."""

    def local_train(start: Any, clients: Tensor, *args: Any, **kwargs: Any) -> TrainResult:
        zero = torch.zeros(len(clients))
        return TrainResult(start, {}, zero, zero + method.hp.local_steps, {})

    method.local_train = local_train  # type: ignore[method-assign, assignment]


def test_scaffold_noise_std_on_both_means_is_sigma_c_over_the_expected_clients() -> None:
    sigma, clip, per_round = 2.0, 0.1, 3
    method = scaffold(client_dp=ClientDP(sigma, clip), clients_per_round=per_round)
    no_training(method)  # c = 0: both updates are zero, the release is the noise alone
    method.run_round(0, method.sample_clients(0))
    grads = [p.grad for p in method.net.parameters()]
    x_noise = torch.cat([g.flatten() for g in grads if g is not None])
    # c moved by |S|/N times the noisy mean: the mean's noise is the move times N / qN
    scale = method.num_training_clients / per_round
    c_noise = torch.cat([t.flatten() for t in method.control.tensors().values()]) * scale
    assert len(x_noise) == len(c_noise) > 5000
    expected = sigma * clip / per_round
    for noise in (x_noise, c_noise):
        assert noise.std().item() == pytest.approx(expected, rel=0.03)
        assert abs(noise.mean().item()) < 4 * expected / math.sqrt(len(noise))
    correlation = torch.corrcoef(torch.stack([x_noise, c_noise]))[0, 1]
    assert abs(correlation.item()) < 4 / math.sqrt(len(x_noise)), "independent draws"


def test_scaffold_resume_is_exact_with_dp(tmp_path: Path) -> None:
    assert_resume_is_exact_with_dp(CONF / "scaffold.yaml", tmp_path, 4, 2)


def test_scaffold_dp_rounds_vectorized_equal_client_by_client() -> None:
    assert_vectorized_equals_sequential(SCAFFOLD, rounds=2, client_dp=ClientDP(1.0, 0.5))


def test_scaffold_a_dropped_client_keeps_c_i_and_the_server_averages_what_arrived() -> None:
    """x <- mean over the arrived S of y_i, c <- c + (1/N) sum_S Delta c_i (|S|/N times their
    mean), with option II's K the steps each straggler took; a dropped c_i is untouched."""
    steps = 5
    stragglers = Stragglers(rate=0.5, fraction=0.6, min_fraction=0.2)  # at most 3 of 5 steps
    conditions = Conditions(drop_rate=0.5, stragglers=stragglers)
    method = scaffold(clients_per_round=4, local_steps=steps, conditions=conditions)
    with_control_variates(method)
    r = round_with_drops(method)
    clients = method.sample_clients(r)
    arrived = method.arrived(clients, r)
    delta_y, delta_c, c, c_all, taken = scaffold_uploads(method, r, clients)
    assert (taken[arrived] < steps).any() and (taken[~arrived] == 0).all()
    n = method.num_training_clients
    kept = method.store.fields["control"]
    for name, p in method.net.named_parameters():
        assert p.grad is not None
        mean = delta_y[name][arrived].double().mean(0)
        torch.testing.assert_close(p.grad.double(), -mean, rtol=1e-4, atol=1e-7)
        moved = (method.control[name] - c[name]).double()
        torch.testing.assert_close(moved, delta_c[name][arrived].sum(0) / n, rtol=1e-4, atol=1e-6)
        for row, client in enumerate(clients.tolist()):
            if arrived[row]:
                torch.testing.assert_close(
                    kept[name][client].double(),
                    c_all[name][client] + delta_c[name][row],
                    rtol=1e-4,
                    atol=1e-6,
                )
            else:
                assert torch.equal(kept[name][client], c_all[name][client]), (name, client)


def test_scaffold_with_drops_under_dp_a_dropped_client_adds_nothing() -> None:
    """The fixed denominator qN counts the clients that did not report back."""
    clip = 0.05
    method = scaffold(
        clients_per_round=4, client_dp=ClientDP(0.0, clip), conditions=Conditions(drop_rate=0.5)
    )
    r = round_with_drops(method)
    clients = method.sample_clients(r)
    arrived = method.arrived(clients, r)
    delta_y, delta_c, c, _, _ = scaffold_uploads(method, r, clients)
    assert torch.equal(joint_norms(delta_y) == 0, ~arrived)
    delta_c = {
        n: torch.where(arrived.view(-1, *[1] * t[0].dim()), t, 0) for n, t in delta_c.items()
    }
    norms = joint_norms(delta_y, delta_c)
    assert (norms[arrived] > clip).all(), "the check needs updates that the clip shortens"
    factors = clip / norms.clamp_min(clip)
    for name, p in method.net.named_parameters():
        f = factors.view(-1, *[1] * p.dim())
        assert p.grad is not None
        expected = (f * delta_y[name]).sum(0) / 4
        torch.testing.assert_close(p.grad.double(), -expected, rtol=1e-4, atol=1e-7)
        moved = (method.control[name] - c[name]).double()
        n = method.num_training_clients
        torch.testing.assert_close(moved, (f * delta_c[name]).sum(0) / n, rtol=1e-4, atol=1e-6)


def test_scaffold_a_round_where_nothing_arrives_leaves_x_and_c_alone() -> None:
    method = scaffold(clients_per_round=1, conditions=Conditions(drop_rate=0.5))
    c = with_control_variates(method)
    before = {n: t.clone() for n, t in method.store.fields["control"].items()}
    r = next(r for r in range(50) if not method.arrived(method.sample_clients(r), r).any())
    one_round(method, r)
    assert all(p.grad is None for p in method.parameters())
    for n, t in method.control.tensors().items():
        assert torch.equal(t, c[n]), n
    for n, t in method.store.fields["control"].items():
        assert torch.equal(t, before[n]), n


# ----------------------------------------------------------------- pFedHN-Budgets
BUDGETS: dict[str, Any] = {"architectures": SIZES}


def budgets(**kwargs: Any) -> PFedHNBudgets:
    method = build(PFedHNBudgets, digits_data(6), **{**BUDGETS, "clients_per_round": 3, **kwargs})
    assert isinstance(method, PFedHNBudgets)
    method.configure_optimizers()
    return method


def shared_and_embeddings(method: PFedHNBudgets) -> tuple[list[Tensor], list[Tensor]]:
    named = dict(method.hnet.named_parameters())
    embeddings = named.pop("body.embeddings.weight")
    return list(named.values()), [embeddings]


def generated_and_deltas(
    method: PFedHNBudgets, clients: Tensor
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Every size's generated tensors for its clients among ``clients`` (with their graphs),
    deltas of norms spread over two orders of magnitude, and each tensor's rows."""
    torch.manual_seed(0)
    scales = torch.logspace(-2, 0, len(clients))
    generated, deltas, owners = [], [], []
    for size, rows in method.sizes.split(clients):
        for t in method.network(clients[rows], size).values():
            generated.append(t)
            deltas.append(scales[rows].view(-1, *[1] * (t.dim() - 1)) * torch.randn_like(t))
            owners.append(rows)
    return generated, deltas, owners


def test_budgets_no_noise_and_no_clip_is_the_run_without_dp_bit_for_bit() -> None:
    plain = trained(PFedHNBudgets, **BUDGETS)
    private = trained(PFedHNBudgets, **BUDGETS, client_dp=NO_DP)
    assert private.record.extra_results["privacy"]["epsilon"] == math.inf
    assert_same_trained_state(plain, private)
    noisy = trained(PFedHNBudgets, **BUDGETS, client_dp=ClientDP(1e-3, 10.0))
    key = "hnet.body.mlp.0.weight"  # the check sees a changed run
    assert not torch.equal(noisy.state_dict()[key], plain.state_dict()[key])


def test_budgets_clip_each_clients_body_and_heads_contribution_and_not_the_embeddings() -> None:
    """f_i = min(1, S / ||c_i||) with c_i = J_i^T delta_i over the body and every size's heads
    (client i's own size's only are nonzero); grad = sum_i f_i c_i / qN; the embeddings' grad
    is the unclipped mean."""
    method = budgets(client_dp=ClientDP(0.0, 1.0), hn_max_grad_norm=None, clients_per_round=4)
    sizes = method.sizes
    clients = torch.cat([sizes.members("S"), sizes.members("L")]).sort().values
    generated, deltas, owners = generated_and_deltas(method, clients)
    shared, embeddings = shared_and_embeddings(method)
    contributions, norms, body_norms = [], [], []
    body = [p for p in method.network.body.parameters() if p is not embeddings[0]]
    for row in range(len(clients)):
        surrogate = torch.stack(
            [
                (g[(o == row).nonzero()[:, 0]] * d[(o == row).nonzero()[:, 0]]).sum()
                for g, d, o in zip(generated, deltas, owners, strict=True)
            ]
        ).sum()
        c = torch.autograd.grad(surrogate, shared, retain_graph=True, allow_unused=True)
        contributions.append(c)
        norms.append(torch.cat([x.flatten() for x in c if x is not None]).double().norm())
        ids = {id(p) for p in body}
        body_norms.append(
            torch.cat(
                [
                    x.flatten()
                    for x, p in zip(c, shared, strict=True)
                    if id(p) in ids and x is not None
                ]
            )
            .double()
            .norm()
        )
    assert all(b < n * 0.99 for b, n in zip(body_norms, norms, strict=True)), "heads count"
    mean = torch.stack([(g * d).sum() for g, d in zip(generated, deltas, strict=True)]).sum() / 4
    expected = torch.autograd.grad(mean, embeddings, retain_graph=True)
    clip = float(torch.stack(norms).median())
    method.client_dp = ClientDP(0.0, clip)
    method.set_private_budget_gradients(generated, deltas, owners, len(clients), 0)
    factors = [min(1.0, clip / float(n)) for n in norms]
    assert min(factors) < 1 and max(factors) == 1, "some clients clipped, some not"
    for f, n in zip(factors, norms, strict=True):
        assert f * float(n) <= clip * (1 + 1e-6)
    for name, (k, p) in zip(
        [n for n, q in method.hnet.named_parameters() if q is not embeddings[0]],
        enumerate(shared),
        strict=True,
    ):
        parts = [f * c[k] for f, c in zip(factors, contributions, strict=True) if c[k] is not None]
        if not parts:  # the heads of size M: no client of the round, no noise at z = 0
            assert name.startswith("heads.M.") and p.grad is None, name
            continue
        want = sum(parts) / 4
        assert isinstance(want, Tensor)
        scale = float(want.abs().max())  # float32 sums of four clients: a few ulp of the largest
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-5 * scale, msg=name)
    torch.testing.assert_close(embeddings[0].grad, expected[0], rtol=1e-5, atol=1e-9)


def test_budgets_noise_std_is_sigma_c_over_the_expected_clients_on_every_shared_tensor() -> None:
    sigma, clip = 2.0, 0.5
    method = budgets(client_dp=ClientDP(sigma, clip), hn_max_grad_norm=None)
    clients = method.sizes.members("S")  # the heads of M and L are read by none
    generated, deltas, owners = generated_and_deltas(method, clients)
    zero = [torch.zeros_like(d) for d in deltas]
    method.set_private_budget_gradients(generated, zero, owners, len(clients), 0)
    shared, embeddings = shared_and_embeddings(method)
    grads = [p.grad for p in shared]
    assert all(g is not None for g in grads), "every shared tensor is noised"
    noise = torch.cat([g.flatten() for g in grads if g is not None])
    expected = sigma * clip / 3  # qN = clients_per_round
    assert noise.std().item() == pytest.approx(expected, rel=0.03)
    assert abs(noise.mean().item()) < 4 * expected / math.sqrt(len(noise))
    absent = dict(method.hnet.named_parameters())["heads.L.0.weight"].grad
    assert absent is not None and absent.std().item() == pytest.approx(expected, rel=0.05)
    grad = embeddings[0].grad
    assert grad is not None and not grad.any()  # no noise, no signal


def test_budgets_resume_is_exact_with_dp(tmp_path: Path) -> None:
    assert_resume_is_exact_with_dp(CONF / "pfedhn_budgets.yaml", tmp_path, 6, 3)


def test_budgets_dp_rounds_vectorized_equal_client_by_client() -> None:
    assert_vectorized_equals_sequential(
        PFedHNBudgets, rounds=2, client_dp=ClientDP(1.0, 0.5), **BUDGETS
    )


def test_budgets_steps_from_the_mean_over_the_clients_that_arrived() -> None:
    """grad = grad of (1/|S|) sum_{i in S} 0.5 ||h_{s(i)}(v_i; phi) - theta~_i||^2; the heads
    of a sampled size none of whose clients arrived get no gradient, as an unsampled size's."""
    method = budgets(
        clients_per_round=4, hn_max_grad_norm=None, conditions=Conditions(drop_rate=0.5)
    )
    sizes = method.sizes

    def sizes_of(clients: Tensor, arrived: Tensor) -> tuple[set[str], set[str]]:
        return (
            {name for name, _ in sizes.split(clients)},
            {name for name, rows in sizes.split(clients) if arrived[rows].any()},
        )

    r = next(  # some but not all arrived, and one sampled size has no client that did
        r
        for r in range(100)
        if 0 < int((a := method.arrived(c := method.sample_clients(r), r)).sum()) < len(a)
        and len(set.difference(*sizes_of(c, a))) == 1
    )
    clients = method.sample_clients(r)
    arrived = method.arrived(clients, r)
    sampled, live = sizes_of(clients, arrived)
    captured = capture_local_training(method)
    method.run_round(r, clients)
    surrogate = torch.zeros(())
    for result, (size, rows) in zip(captured, sizes.split(clients), strict=True):
        if size not in live:
            continue
        for n, t in method.network(clients[rows], size).items():
            diff = (t - result.params[n]) * arrived[rows].view(-1, *[1] * (t.dim() - 1))
            surrogate = surrogate + 0.5 * (diff**2).sum() / arrived.sum()
    params = dict(method.hnet.named_parameters())
    expected = torch.autograd.grad(surrogate, list(params.values()), allow_unused=True)
    for (name, p), g in zip(params.items(), expected, strict=True):
        if name.startswith("heads.") and name.split(".")[1] not in live:
            assert p.grad is None and g is None, name
            continue
        assert p.grad is not None and g is not None and g.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, g, msg=name)
    assert len(sampled) == len(live) + 1


def test_a_round_where_nothing_arrives_sets_no_hypernetwork_gradient() -> None:
    method = budgets(clients_per_round=1, conditions=Conditions(drop_rate=0.5))
    r = next(r for r in range(50) if not method.arrived(method.sample_clients(r), r).any())
    one_round(method, r)
    assert all(p.grad is None for p in method.parameters())


@pytest.mark.parametrize(
    ("cls", "kwargs"), [(SCAFFOLD, {}), (PFedHNBudgets, BUDGETS)], ids=["SCAFFOLD", "Budgets"]
)
def test_reliable_conditions_equal_a_run_without_them_bit_for_bit(
    cls: type[FederatedMethod], kwargs: dict[str, Any]
) -> None:
    today = state(trained(cls, **kwargs))
    masked = trained(cls, **kwargs, conditions=Conditions(stragglers=Stragglers(rate=0.0)))
    for name, tensor in state(masked).items():
        assert torch.equal(tensor, today[name]), name
