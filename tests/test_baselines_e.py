"""FedGH, pFedLHN, PeFLL, FedAKT, pFedGP and the heterogeneous Local: their distinguishing math
and engine checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import (
    FedAKT,
    FedGH,
    HeterogeneousLocal,
    Local,
    PeFLL,
    PFedGP,
    PFedHN,
    PFedLHN,
)
from lightning_pfl.methods.fedgh import train_header
from lightning_pfl.methods.pfedgp import (
    gp_negative_log_likelihood,
    gp_posterior_mean,
    rbf_kernel,
)
from lightning_pfl.methods.pfedlhn import LayerwiseHyperNetwork
from tests.conftest import build, digits_data, fit
from tests.helpers import (
    assert_vectorized_equals_sequential,
    capture_local_training,
)

HETEROGENEOUS = {
    "cnn": {"net": "digits_cnn", "share": 0.5},
    "small": {"net": "small_cnn", "net_args": {"width": 32}, "share": 0.5},
}


# ----------------------------------------------------------------- FedGH
def test_fedgh_server_header_training_reduces_cross_entropy_and_matches_one_sgd_step() -> None:
    g = torch.Generator().manual_seed(0)
    reps = torch.randn(6, 5, generator=g)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    w, b = torch.randn(3, 5, generator=g) * 0.1, torch.zeros(3)

    def ce(w: torch.Tensor, b: torch.Tensor) -> float:
        return float(F.cross_entropy(reps @ w.T + b, labels))

    w2, b2 = train_header(w, b, reps, labels, lr=0.1, epochs=20)
    assert ce(w2, b2) < 0.5 * ce(w, b)
    # One pair, one step: theta - lr * grad CE, by hand: grad_W = (softmax - onehot) r^T.
    w1, b1 = train_header(w, b, reps[:1], labels[:1], lr=0.1)
    residual = torch.softmax(reps[0] @ w.T + b, 0) - F.one_hot(labels[0], 3).float()
    torch.testing.assert_close(w1, w - 0.1 * residual[:, None] * reps[0][None])
    torch.testing.assert_close(b1, b - 0.1 * residual)


def build_fedgh(**kwargs: Any) -> FedGH:
    dm = digits_data(6)
    defaults: dict[str, Any] = {"architectures": HETEROGENEOUS, "clients_per_round": 3}
    method = build(FedGH, dm, **{**defaults, **kwargs})
    assert isinstance(method, FedGH)
    return method


def test_fedgh_uploads_only_class_representations_and_the_server_trains_the_header() -> None:
    method = build_fedgh()
    clients = torch.tensor([0, 2, 5])
    before = method.header.weight.detach().clone()
    method.run_round(0, clients)
    down, up = method.record.round_bytes
    # 2 classes per client, d = 64 float32 each, plus an int64 class id each.
    assert up == 3 * 2 * (64 * 4 + 8)
    assert down == 3 * (10 * 64 + 10) * 4
    model_bytes = min(
        sum(t[0].numel() * t.element_size() for t in method.store.fields[f].values())
        for f in method.store.fields
    )
    assert up < model_bytes
    assert not torch.equal(method.header.weight, before)
    # The uploaded means are those of the trained local models on the clients' data.
    kind, rows = next(iter(method.groups.split(clients)))
    members = clients[rows]
    params = method.store.gather(f"model.{kind}", method.groups.row_of[members], method.device)
    reps, counts = method.class_representations(method.groups.archs[kind], params, members)
    x, y = method.data.fetch(next(method.data.eval_blocks(members[:1], "train", 10**6))[0][0])
    z = method.groups.archs[kind].features({n: t[0] for n, t in params.items()}, x)
    c = int(y[0])
    torch.testing.assert_close(reps[0, c], z[y == c].mean(0), rtol=1e-4, atol=1e-5)
    assert counts[0].sum() == len(y)


def test_fedgh_clients_start_from_the_global_header() -> None:
    method = build_fedgh(local_lr=1e-9)
    method.header.weight.data.fill_(0.25)
    trained = capture_local_training(method)
    method.run_round(0, torch.tensor([0, 1, 2]))
    for result in trained:
        weights = [
            t for n, t in result.params.items() if n.endswith("weight") and t.shape[1:] == (10, 64)
        ]
        torch.testing.assert_close(weights[0], torch.full_like(weights[0], 0.25), atol=1e-6, rtol=0)


def test_fedgh_refuses_architectures_without_a_shared_representation_size() -> None:
    with pytest.raises(ConfigError, match="same shape"):
        build_fedgh(architectures={"a": {"net": "digits_cnn"}, "b": {"net": "small_cnn"}})


def test_fedgh_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedGH, architectures=HETEROGENEOUS)


# ----------------------------------------------------------------- pFedLHN
def test_pfedlhn_each_layer_hypernetwork_generates_exactly_its_layer() -> None:
    method = build(
        PFedLHN, digits_data(6), n_embeds=None, shared_embedding=True, layer_modules="per_layer"
    )
    assert isinstance(method, PFedLHN)
    hnet = method.hnet
    assert isinstance(hnet, LayerwiseHyperNetwork)
    clients = torch.tensor([0, 3])
    assert hnet.layer_names == ["conv1", "conv2", "fc1", "fc2"]
    full = hnet(clients)
    assert {n: tuple(t.shape[1:]) for n, t in full.items()} == method.arch.shapes
    for name in hnet.layer_names:
        out = hnet.layer(name)(clients)
        assert sorted(out) == sorted(n for n in method.arch.shapes if n.startswith(name + "."))
        for n, t in out.items():
            assert torch.equal(t, full[n])
    # Perturbing fc1's module changes fc1's tensors and nothing else.
    with torch.no_grad():
        for p in hnet.layer("fc1").body_parameters():
            p.add_(0.1)
    changed = {n for n, t in hnet(clients).items() if not torch.equal(t, full[n])}
    assert changed == {"fc1.weight", "fc1.bias"}
    # One shared embedding table: v_i is a single parameter the optimizer sees once.
    assert len(hnet.embedding_parameters()) == 1
    assert (
        len(
            build(
                PFedLHN,
                digits_data(6),
                n_embeds=None,
                shared_embedding=False,
                layer_modules="per_layer",
                coefficients="per_layer",
            ).hnet.embedding_parameters()
        )
        == 4
    )


def test_pfedlhn_server_gradient_is_the_gradient_of_the_delta_surrogate() -> None:
    method = build(PFedLHN, digits_data(6), hn_max_grad_norm=None)
    trained = capture_local_training(method)
    clients = torch.tensor([1, 2, 4])
    generated = {n: t.detach().clone() for n, t in method.hnet(clients).items()}
    method.run_round(0, clients)
    delta = {n: generated[n] - trained[0].params[n] for n in generated}
    params = list(method.hnet.parameters())
    theta = method.hnet(clients)
    surrogate = sum((theta[n] * delta[n]).sum() for n in theta) / len(clients)
    expected = torch.autograd.grad(surrogate, params)
    for p, g in zip(params, expected, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-7)
    assert any(float(g.abs().sum()) > 0 for g in expected)


def test_pfedlhn_vectorized_equals_sequential() -> None:
    # SGD on the server: AdamW (the default) divides each gradient element by its own root
    # mean square, which turns the paths' float rounding of a near-zero element into a step of
    # up to lr (1 of 819,200 weights off by 1.4e-5 after 3 rounds); the clients' math is the same
    assert_vectorized_equals_sequential(
        PFedLHN, hn_optimizer="sgd", hn_lr=1e-2, hn_weight_decay=1e-3
    )


# ----------------------------------------------------------------- PeFLL
def test_pefll_descriptor_is_permutation_invariant_and_ignores_padding() -> None:
    method = build(PeFLL, digits_data(6))
    assert isinstance(method, PeFLL)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 7, 1, 8, 8, generator=g), torch.randint(0, 10, (2, 7), generator=g)
    weight = torch.ones(2, 7)
    v = method.hnet.embedder(x, y, weight)
    perm = torch.randperm(7, generator=g)
    torch.testing.assert_close(method.hnet.embedder(x[:, perm], y[:, perm], weight), v)
    padded = method.hnet.embedder(
        torch.cat([x, torch.randn(2, 3, 1, 8, 8)], 1),
        torch.cat([y, torch.zeros(2, 3, dtype=torch.long)], 1),
        torch.cat([weight, torch.zeros(2, 3)], 1),
    )
    torch.testing.assert_close(padded, v)
    assert not torch.allclose(v[0], v[1])


def test_pefll_unseen_client_gets_a_model_without_a_gradient_step() -> None:
    method = build(PeFLL, digits_data(6), clients_per_round=3)
    for r in range(2):  # clients 4 and 5 never take part
        method.run_round(r, torch.tensor([0, 1, 2]))
    state = {n: t.clone() for n, t in method.state_dict().items()}
    unseen = torch.tensor([4, 5])
    with torch.inference_mode():  # no autograd at all: no local or server step is possible
        models = method.personalized_params(unseen)
    for n, t in method.state_dict().items():
        assert torch.equal(t, state[n]), n
    # h(e(S)) over the client's whole training data, the same as model_for on that data.
    index, weight = next(method.data.eval_blocks(unseen, "train", 10**6))
    x, y = method.data.fetch(index)
    direct = method.model_for(x, y, weight)
    for n in models:
        torch.testing.assert_close(models[n], direct[n])
    assert not torch.allclose(models["fc2.weight"][0], models["fc2.weight"][1])


def test_pefll_gradient_flows_through_the_descriptor_into_the_embedding_network() -> None:
    method = build(PeFLL, digits_data(6), hn_max_grad_norm=None, lambda_v=0.0)  # psi's delta part
    trained = capture_local_training(method)
    clients = torch.tensor([0, 3])
    x, y, w = method.descriptor_batches(clients, 0)
    generated = {n: t.detach().clone() for n, t in method.hnet(x, y, w).items()}
    method.run_round(0, clients)
    delta = {n: generated[n] - trained[0].params[n] for n in generated}
    theta = method.hnet(x, y, w)
    surrogate = sum((theta[n] * delta[n]).sum() for n in theta) / len(clients)
    psi = method.hnet.embedding_parameters()
    expected = torch.autograd.grad(surrogate, psi)
    for p, g in zip(psi, expected, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-8)
    assert float(sum(g.abs().sum() for g in expected)) > 0


def test_pefll_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(PeFLL)


def client_spread(params: dict[str, torch.Tensor]) -> float:
    """How much generated weight matrices differ between clients: RMS over entries of their
    standard deviation across clients over the RMS of their mean, averaged over matrices."""
    ratios = [
        t.std(0).pow(2).mean().sqrt() / t.mean(0).pow(2).mean().sqrt()
        for t in params.values()
        if t.dim() > 2
    ]
    return float(torch.stack(ratios).mean())


def test_pefll_models_differ_between_clients_as_much_as_pfedhns() -> None:
    # The hypernetwork is calibrated on standard normal inputs (pFedHN's embeddings). Raw mean
    # embeddings of 2-class clients lie about 30 times closer together than that, so every
    # client got (nearly) the same model (spread 0.007 against pFedHN's 0.2) and stayed so in
    # training; standardized descriptors restore pFedHN's spread.
    dm = digits_data(6)
    spread = {}
    for cls in (PeFLL, PFedHN):
        method = build(cls, dm, clients_per_round=3)
        fit(method, dm, rounds=1)
        with torch.no_grad():
            spread[cls] = client_spread(method.personalized_params(torch.arange(6)))
    assert spread[PeFLL] > 0.5 * spread[PFedHN], spread


@pytest.mark.parametrize("optimizer, power", [("sgd", 2), ("adam", 1)])
def test_pefll_calibration_standardizes_descriptors_and_rescales_psis_rate(
    optimizer: str, power: int
) -> None:
    dm = digits_data(6)
    method = build(PeFLL, dm, hn_optimizer=optimizer, hn_lr=0.03, embed_lr=0.02)
    assert isinstance(method, PeFLL)
    method.configure_optimizers()
    raw = method.mean_embeddings(torch.arange(6))
    before = method.record.comm_bytes_total.clone()
    method.calibrate_descriptors()
    method.calibrate_descriptors()  # idempotent: the rate is set from embed_lr, not compounded
    embedder = method.network.embedder
    v = embedder.standardize(raw)
    torch.testing.assert_close(v.mean(0), torch.zeros(v.shape[1]), atol=1e-5, rtol=0)
    torch.testing.assert_close(v.pow(2).mean(), torch.tensor(1.0))
    assert float(embedder.scale) < 0.2  # raw descriptors are far less spread than N(0, I)
    rates = [g["lr"] for g in method.server_optimizer.param_groups]
    assert rates == pytest.approx([0.03, 0.02 * float(embedder.scale) ** power])
    # each client received psi and sent its d numbers, twice here
    sent = method.record.comm_bytes_total - before
    assert float(sent[1]) == 2 * 6 * v.shape[1] * 4
    # the personalized model reads the standardized full-data descriptor
    models = method.personalized_params(torch.arange(6))
    expected = method.network.generate(v)
    for n in models:
        torch.testing.assert_close(models[n], expected[n])


def test_pefll_without_standardization_reads_raw_mean_embeddings() -> None:
    dm = digits_data(6)
    method = build(PeFLL, dm, standardize_descriptors=False)
    assert isinstance(method, PeFLL)
    method.configure_optimizers()
    method.calibrate_descriptors()
    embedder = method.network.embedder
    assert float(embedder.scale) == 1.0 and not embedder.shift.any()
    assert [g["lr"] for g in method.server_optimizer.param_groups] == [method.hp.hn_lr] * 2


# ----------------------------------------------------------------- FedAKT
ADAPTER = {"net": "small_cnn", "net_args": {"width": 32}}


def build_fedakt(**kwargs: Any) -> FedAKT:
    defaults: dict[str, Any] = {
        "architectures": HETEROGENEOUS,
        "adapter": ADAPTER,
        "clients_per_round": 3,
        "distill_weight": 0.5,
    }
    method = build(FedAKT, digits_data(6), **{**defaults, **kwargs})
    assert isinstance(method, FedAKT)
    return method


def test_fedakt_loss_is_dual_use_cross_entropy_plus_mutual_feature_distillation() -> None:
    method = build_fedakt()
    arch = method.groups.archs["small"]
    model = arch.initial_params()
    shared = {n: p.detach() for n, p in method.adapter.named_parameters() if p.requires_grad}
    x, y = method.data.fetch(torch.arange(12))
    w = torch.ones(12)
    params = {f"model.{n}": t.clone().requires_grad_() for n, t in model.items()}
    params |= {f"adapter.{n}": t.clone().requires_grad_() for n, t in shared.items()}
    loss = method.losses["small"](params, {}, x, y, w)
    z = arch.features(model, x)
    za = method.adapter_arch.features(shared, x)
    head = model["fc.weight"], model["fc.bias"]
    expected = (
        F.cross_entropy(z @ head[0].T + head[1], y)
        + F.cross_entropy(za @ head[0].T + head[1], y)
        + 0.5 * ((z - za) ** 2).mean()
    )
    torch.testing.assert_close(loss, expected)
    # Mutual: the distillation term moves both extractors (and the header gets both views).
    no_distill = build_fedakt(distill_weight=0.0).losses["small"](params, {}, x, y, w)
    distill = torch.autograd.grad(loss - no_distill, list(params.values()), allow_unused=True)
    moved = {
        n for n, g in zip(params, distill, strict=True) if g is not None and g.abs().sum() > 1e-4
    }
    assert "model.conv1.weight" in moved and "adapter.conv1.weight" in moved
    assert "model.fc.weight" not in moved


def test_fedakt_only_the_adapter_extractor_travels_and_is_averaged() -> None:
    method = build_fedakt()
    trained = capture_local_training(method)
    clients = torch.tensor([0, 2, 5])
    method.run_round(0, clients)
    extractor = {n: p for n, p in method.adapter.named_parameters() if p.requires_grad}
    assert "fc.weight" not in extractor
    size = sum(p.numel() * 4 for p in extractor.values())
    assert method.record.round_bytes == [3 * size, 3 * size]
    weights = method.client_weights(clients)
    stacked = {n: torch.zeros(3, *p.shape) for n, p in extractor.items()}
    for kind, rows in method.groups.split(clients):
        result = trained[[k for k, _ in method.groups.split(clients)].index(kind)]
        for n in stacked:
            stacked[n][rows] = result.params[f"adapter.{n}"]
    for n, p in extractor.items():
        mean = (weights.float().view(-1, *[1] * p.dim()) * stacked[n]).sum(0)
        torch.testing.assert_close(p.detach() - p.grad, mean, rtol=1e-5, atol=1e-6)


def test_fedakt_refuses_an_adapter_of_another_representation_size() -> None:
    with pytest.raises(ConfigError, match="representation size"):
        build_fedakt(adapter={"net": "small_cnn", "net_args": {"width": 8}})


def test_fedakt_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedAKT, architectures=HETEROGENEOUS, adapter=ADAPTER)


# ----------------------------------------------------------------- pFedGP
def test_pfedgp_posterior_mean_and_likelihood_match_the_closed_form() -> None:
    g = torch.Generator().manual_seed(0)
    z, z_test = (
        torch.randn(5, 3, generator=g, dtype=torch.float64),
        torch.randn(2, 3, dtype=torch.float64),
    )
    y = torch.tensor([0, 1, 1, 2, 0])
    w = torch.ones(5, dtype=torch.float64)
    ell, s2 = 0.7, 0.2
    sq = ((z[:, None] - z[None]) ** 2).sum(-1)
    k = torch.exp(-sq / (2 * ell**2))
    k_star = torch.exp(-((z_test[:, None] - z[None]) ** 2).sum(-1) / (2 * ell**2))
    targets = F.one_hot(y, 3).double()
    expected = k_star @ torch.linalg.inv(k + s2 * torch.eye(5, dtype=torch.float64)) @ targets
    mean = gp_posterior_mean(z, y, w, z_test, 3, ell, s2)
    torch.testing.assert_close(mean, expected)
    normal = torch.distributions.MultivariateNormal(
        torch.zeros(5, dtype=torch.float64), k + s2 * torch.eye(5, dtype=torch.float64)
    )
    log_likelihood = sum(normal.log_prob(targets[:, c]) for c in range(3))
    torch.testing.assert_close(gp_negative_log_likelihood(z, y, w, 3, ell, s2), -log_likelihood / 5)
    # Padding points change neither the posterior nor the likelihood.
    zp = torch.cat([z, torch.randn(3, 3, dtype=torch.float64)])
    yp, wp = (
        torch.cat([y, torch.tensor([1, 1, 1])]),
        torch.cat([w, torch.zeros(3, dtype=torch.float64)]),
    )
    torch.testing.assert_close(gp_posterior_mean(zp, yp, wp, z_test, 3, ell, s2), expected)
    torch.testing.assert_close(
        gp_negative_log_likelihood(zp, yp, wp, 3, ell, s2), -log_likelihood / 5
    )


class LargestOutput(TorchDispatchMode):
    """Records the element count of the largest tensor any operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_pfedgp_kernel_never_materializes_pairwise_differences() -> None:
    a, b = torch.randn(2, 30, 16, dtype=torch.float64), torch.randn(2, 20, 16, dtype=torch.float64)
    with LargestOutput() as largest:
        k = rbf_kernel(a, b, 0.7)
    assert largest.numel <= 2 * 30 * 20  # [C, N, M]; broadcasting makes [C, N, M, d] (19,200)
    direct = torch.exp(-((a[:, :, None] - b[:, None]) ** 2).sum(-1) / (2 * 0.7**2))
    torch.testing.assert_close(k, direct)
    diagonal = torch.diagonal(rbf_kernel(a, a, 0.7), dim1=-2, dim2=-1)
    torch.testing.assert_close(diagonal, torch.ones_like(diagonal))  # rounding stays at ~1e-15


def test_pfedgp_predicts_with_each_clients_own_gp_and_shares_only_the_extractor() -> None:
    method = build(PFedGP, digits_data(6), clients_per_round=3)
    assert isinstance(method, PFedGP)
    clients = torch.tensor([0, 4])
    method.run_round(0, torch.tensor([0, 1, 4]))
    assert "fc2.weight" not in method.payload(clients)
    size = sum(p.numel() * 4 for n, p in method.net.named_parameters() if not n.startswith("fc2"))
    assert method.record.round_bytes == [3 * size, 3 * size]
    params = method.personalized_params(clients)
    index, weight = next(method.data.eval_blocks(clients, "train", 10**6))
    x, y = method.data.fetch(index)
    net = {n: t[1] for n, t in params.items() if not n.startswith("gp.")}
    count = int(weight[1].sum())
    z = method.extractor(net, x[1, :count]).double()
    x_test, _ = method.data.fetch(next(method.data.eval_blocks(clients, "test", 10**6))[0][1])
    expected = gp_posterior_mean(
        z,
        y[1, :count],
        torch.ones(count, dtype=torch.float64),
        method.extractor(net, x_test).double(),
        10,
        0.5,
        0.1,
    )
    logits = method.predict({n: t[1] for n, t in params.items()}, x_test)
    torch.testing.assert_close(logits, expected.float(), rtol=1e-4, atol=1e-5)
    # Client 1's GP only knows its own two classes: every other class has mean 0.
    own = set(y[1, :count].tolist())
    assert torch.all(logits[:, [c for c in range(10) if c not in own]].abs() < 1e-6)


def test_pfedgp_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(PFedGP)


# ----------------------------------------------------------------- HeterogeneousLocal
def test_heterogeneous_local_with_one_architecture_is_local() -> None:
    dm = digits_data(6)
    local, zoo = build(Local, dm), build(HeterogeneousLocal, dm)
    assert isinstance(zoo, HeterogeneousLocal)
    initial = local.store.gather("params", torch.arange(6), local.device)
    zoo.store.scatter("model.net", torch.arange(6), initial)
    for round_idx, clients in enumerate(([0, 2, 5], [2, 3, 4], [5, 0, 1])):
        for method in (local, zoo):
            method.run_round(round_idx, torch.tensor(clients))
    everyone = torch.arange(6)
    ours = zoo.store.gather("model.net", everyone, zoo.device)
    theirs = local.store.gather("params", everyone, local.device)
    for name in theirs:  # momentum carried across rounds the same way, too
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)


def test_heterogeneous_local_trains_only_the_sampled_clients_and_sends_nothing() -> None:
    # Headers of different shapes are fine: nothing is shared.
    architectures = {"cnn": {"net": "digits_cnn"}, "mlp": {"net": "mlp", "net_args": {"hidden": 7}}}
    method = build(HeterogeneousLocal, digits_data(6), architectures=architectures)
    before = {f: {n: t.clone() for n, t in ts.items()} for f, ts in method.store.fields.items()}
    method.run_round(0, torch.tensor([0, 1, 2, 3]))
    assert method.record.round_bytes == [0.0, 0.0]
    for kind in architectures:
        members = method.groups.members(kind)
        sampled = torch.isin(members, torch.tensor([0, 1, 2, 3]))
        for name, tensor in method.store.fields[f"model.{kind}"].items():
            changed = (tensor != before[f"model.{kind}"][name]).flatten(1).any(1)
            assert torch.equal(changed, sampled), (kind, name)


def test_heterogeneous_local_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(HeterogeneousLocal, architectures=HETEROGENEOUS)
