import os
import shutil
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch._dynamo.utils import counters

from lightning_pfl import FederatedDataModule, methods
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import FedAvg, FederatedMethod, Local, PFedHN, PFedHNPC
from lightning_pfl.methods.fedproto import class_statistics
from lightning_pfl.partition import Dirichlet
from tests.conftest import build, digits_data, fit
from tests.helpers import assert_vectorized_equals_sequential, capture_local_training


@pytest.mark.parametrize("cls", [PFedHN, PFedHNPC])
def test_hypernetwork_update_is_gradient_of_surrogate(cls: type[PFedHN]) -> None:
    """grad phi = grad of mean_i 0.5 ||h(v_i; phi) - theta~_i||^2 at the current phi."""
    dm = digits_data(6)
    method = build(cls, dm, clients_per_round=3, hn_max_grad_norm=None)
    clients = torch.tensor([0, 2, 5])
    trained = capture_local_training(method)
    method.run_round(0, clients)
    actual = {n: p.grad.clone() for n, p in method.hnet.named_parameters()}
    theta_tilde = trained[0].params
    generated = method.hnet(clients)
    surrogate = sum(0.5 * ((generated[n] - theta_tilde[n]) ** 2).sum() for n in generated) / len(
        clients
    )
    expected = torch.autograd.grad(surrogate, list(method.hnet.parameters()))
    for (name, _), g in zip(method.hnet.named_parameters(), expected, strict=True):
        torch.testing.assert_close(actual[name], g, msg=name)
    assert any(g.abs().sum() > 0 for g in expected)


def test_pfedhn_pc_keeps_the_head_local() -> None:
    dm = digits_data(6)
    method = build(PFedHNPC, dm, clients_per_round=2)
    assert set(method.hnet.target_shapes) == set(method.arch.shapes) - set(method.arch.head_names)
    before = {n: t.clone() for n, t in method.store.fields["head"].items()}
    clients = torch.tensor([1, 4])
    method.run_round(0, clients)
    after = method.store.fields["head"]
    for name in before:
        changed = (after[name] != before[name]).flatten(1).any(1)
        assert changed.tolist() == [i in (1, 4) for i in range(6)]
    assert method.store.fields["head_momentum"]["fc2.weight"][1].abs().sum() > 0


def test_fedavg_aggregation_is_the_sample_weighted_mean() -> None:
    dm = digits_data(6)
    method = build(FedAvg, dm, clients_per_round=3)
    clients = torch.tensor([0, 3, 4])
    trained = capture_local_training(method)
    method.run_round(0, clients)
    method.configure_server_optimizer().step()
    counts = torch.tensor([len(p) for p in dm._parts["train"]], dtype=torch.float64)[clients]
    assert len(set(counts.tolist())) > 1  # unequal sizes, so weighting matters
    weights = counts / counts.sum()
    for name, p in method.net.named_parameters():
        stacked = trained[0].params[name].double()
        expected = (weights.view(-1, *([1] * p.dim())) * stacked).sum(0)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-5, atol=1e-6)


def test_local_sends_nothing_and_keeps_momentum() -> None:
    dm = digits_data(4)
    method = build(Local, dm, clients_per_round=2)
    fit(method, dm, rounds=2)
    assert method.record.comm_bytes_total.sum() == 0
    assert method.store.fields["momentum"]["fc1.weight"].flatten(1).abs().sum(1).gt(0).any()


@pytest.mark.parametrize("cls", [Local, FedAvg, PFedHN, PFedHNPC])
def test_vectorized_and_sequential_rounds_agree(cls: type[FederatedMethod]) -> None:
    assert_vectorized_equals_sequential(cls)


def test_clients_per_round_is_checked() -> None:
    with pytest.raises(ValueError, match="clients_per_round"):
        build(FedAvg, digits_data(4), clients_per_round=5)


def test_round_client_sample_is_seeded_per_round() -> None:
    method = build(FedAvg, digits_data(6), clients_per_round=2)
    assert torch.equal(method.sample_clients(7), method.sample_clients(7))
    assert len({tuple(method.sample_clients(r).tolist()) for r in range(20)}) > 3


@pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None,
    reason="torch.compile's CPU backend needs a C++ compiler",
)
def test_compiled_step_matches_eager_and_compiles_once() -> None:
    stores = []
    for compile_step in (False, True):
        torch._dynamo.reset()
        counters.clear()
        dm = digits_data(6)
        method = build(
            Local, dm, net="mlp", clients_per_round=3, vectorize=True, compile_step=compile_step
        )
        fit(method, dm, rounds=3)
        stores.append(method.store.state_dict())
    assert counters["stats"]["unique_graphs"] == 1  # compiled in round 0, reused after
    for field, tensors in stores[0].items():
        for name, tensor in tensors.items():
            torch.testing.assert_close(stores[1][field][name], tensor, rtol=1e-4, atol=1e-5)


def test_per_client_hypernetwork_update_steps_once_per_client_in_turn() -> None:
    """per_client == C optimizer steps, the i-th with client i's J_i^T delta_i (clipped)."""
    dm = digits_data(6)
    clients = torch.tensor([0, 2, 5])
    stepped = build(PFedHN, dm, clients_per_round=3, hn_update="per_client")
    expected = build(PFedHN, dm, clients_per_round=3, hn_update="per_client")
    optimizer = stepped.configure_optimizers()
    trained = capture_local_training(stepped)
    optimizer.zero_grad()
    stepped.run_round(0, clients)
    optimizer.step()

    reference = expected.configure_optimizers()
    params = list(expected.hnet.parameters())
    generated = expected.hnet(clients)
    delta = {n: generated[n].detach() - trained[0].params[n] for n in generated}
    per_client = []  # every client's gradient at the round's starting phi, then one step each
    for i in range(len(clients)):
        outputs = [generated[n][i] for n in generated]
        grads = torch.autograd.grad(
            outputs, params, [delta[n][i] for n in generated], retain_graph=True, allow_unused=True
        )
        per_client.append(
            [
                g if g is not None else torch.zeros_like(p)
                for p, g in zip(params, grads, strict=True)
            ]
        )
    for grads in per_client:
        reference.zero_grad()
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_(params, 50.0)
        reference.step()
    for (name, a), b in zip(
        stepped.hnet.named_parameters(), expected.hnet.parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, msg=name)


def test_per_client_and_mean_updates_agree_with_one_client_per_round() -> None:
    dm = digits_data(6)
    methods = [build(PFedHN, dm, clients_per_round=1, hn_update=u) for u in ("mean", "per_client")]
    for method in methods:
        optimizer = method.configure_optimizers()
        for r in range(2):
            optimizer.zero_grad()
            method.run_round(r, method.sample_clients(r))
            optimizer.step()
    for a, b in zip(methods[0].hnet.parameters(), methods[1].hnet.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("net", ["cnn", "kt_cnn", "mlp", "lenet5", "small_cnn", "transformer"])
@pytest.mark.parametrize("n_hidden", [0, 3])
def test_generated_weights_start_at_the_targets_own_init_scale(net: str, n_hidden: int) -> None:
    """Every generated tensor's std is the target's own init std (within 1.25x), for any HN
    depth; the default head initialization was off by up to 17x (pFedHN's MNIST HN)."""
    from lightning_pfl.engine import Architecture
    from lightning_pfl.models import HyperNetwork, build_network

    shape = (1, 28, 28) if net in ("mlp",) else (3, 32, 32)
    arch = Architecture(build_network(net, shape, 10))
    torch.manual_seed(0)
    hnet = HyperNetwork(50, arch.shapes, 13, 100, n_hidden, target_init=arch.initial_params())
    with torch.no_grad():
        generated = hnet(torch.arange(50))
    for name, own in arch.initial_params().items():
        if own.numel() < 10 or float(own.std()) == 0:
            continue
        ratio = float(generated[name].std()) / float(own.std())
        assert 0.8 < ratio < 1.25, (name, ratio)
        if own.numel() >= 100:
            gap = abs(float(generated[name].mean() - own.mean()))
            assert gap < 0.5 * float(own.std()), name


@pytest.mark.parametrize("net", ["kt_cnn", "digits_cnn"])
def test_chunked_hypernetwork_starts_within_4x_of_each_tensors_init_scale(net: str) -> None:
    from lightning_pfl.engine import Architecture
    from lightning_pfl.models import build_network
    from lightning_pfl.models.chunked_hypernetwork import ChunkedHyperNetwork

    shape = (1, 8, 8) if net == "digits_cnn" else (3, 32, 32)
    arch = Architecture(build_network(net, shape, 10))
    torch.manual_seed(0)
    hn = ChunkedHyperNetwork(arch.shapes, target_init=arch.initial_params())
    with torch.no_grad():
        generated = hn.unflatten(hn())
    for name, own in arch.initial_params().items():
        if own.numel() >= 100:
            ratio = float(generated[name].std()) / float(own.std())
            assert 0.25 < ratio < 4, (name, ratio)


def test_hypernetwork_features_have_the_reference_mean_square() -> None:
    from lightning_pfl.models import HyperNetwork
    from lightning_pfl.models.hypernetwork import REFERENCE_MEAN_SQUARE

    for n_hidden in (0, 1, 3):
        hnet = HyperNetwork(100, {"w": (4,)}, 26, 100, n_hidden, feature_scale=True)
        square = hnet.features(torch.arange(100)).pow(2).sum(-1).mean()
        torch.testing.assert_close(square, torch.tensor(REFERENCE_MEAN_SQUARE), rtol=1e-4, atol=0)


BUDGET_SIZES = {
    "S": {"net": "digits_cnn", "net_args": {"width": 4, "hidden": 16}},
    "L": {"net": "digits_cnn", "net_args": {"width": 8, "hidden": 16}},
}


@pytest.mark.parametrize("name", ["PFedHN", "PFedHNPC", "PFedHNBudgets", "PFedLHN", "PeFLL"])
def test_hypernetworks_are_the_papers_by_default(name: str) -> None:
    """No feature scaling and every linear layer (heads included) at nn.Linear's default
    initialization, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias, as in the pFedHN
    paper's code (the heads were rescaled to the target's init and the features scaled)."""
    from lightning_pfl.models.hypernetwork import FeatureScale

    kwargs = {"architectures": BUDGET_SIZES} if name == "PFedHNBudgets" else {}
    method = build(getattr(methods, name), digits_data(6), net="mlp", n_hidden=0, **kwargs)
    scales = [m for m in method.hnet.modules() if isinstance(m, FeatureScale)]
    assert scales and all(float(m.scale) == 1.0 for m in scales)
    linears = [m for m in method.hnet.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) > 2
    for layer in linears:
        bound = layer.in_features**-0.5
        assert layer.weight.abs().max() <= bound and layer.bias.abs().max() <= bound
        if layer.weight.numel() >= 1000:  # the std of U(-b, b) is b / sqrt(3)
            ratio = float(layer.weight.std()) / (bound / 3**0.5)
            assert 0.95 < ratio < 1.05, (layer, ratio)


def test_parametrization_options_restore_feature_scale_and_target_init() -> None:
    """hn_feature_scale and hn_head_init: target are FeatureScale's calibration and
    match_target_init applied to the paper's hypernetwork of the same seed, exactly."""
    import copy

    from lightning_pfl.models.hypernetwork import REFERENCE_MEAN_SQUARE, match_target_init

    dm = digits_data(6)
    paper = build(PFedHN, dm, net="mlp", n_hidden=0)
    ours = build(PFedHN, dm, net="mlp", n_hidden=0, hn_feature_scale=True, hn_head_init="target")
    assert paper.hp.hn_feature_scale is False and paper.hp.hn_head_init == "pytorch"
    for (name, a), b in zip(
        paper.hnet.mlp.named_parameters(), ours.hnet.mlp.parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    assert torch.equal(paper.hnet.embeddings.weight, ours.hnet.embeddings.weight)
    with torch.no_grad():
        raw = paper.hnet.mlp(paper.hnet.embeddings.weight)
        scale = (REFERENCE_MEAN_SQUARE / raw.pow(2).sum(-1).mean()).sqrt()
        torch.testing.assert_close(ours.hnet.feature_scale.scale, scale, rtol=1e-6, atol=0)
        heads = copy.deepcopy(paper.hnet.heads)
        own = paper.arch.initial_params()
        match_target_init(list(heads), raw * ours.hnet.feature_scale.scale, list(own.values()))
    for (name, expected), actual in zip(
        heads.named_parameters(), ours.hnet.heads.parameters(), strict=True
    ):
        assert torch.equal(expected, actual), name
    clients = torch.arange(6)
    with torch.no_grad():
        generated = ours.hnet(clients)
        for name, tensor in generated.items():
            own_std = float(own[name].std())
            if own[name].numel() >= 100:
                assert abs(float(tensor.std()) / own_std - 1) < 0.25, name


@pytest.mark.parametrize(
    "name",
    [
        "APFL",
        "APPLE",
        "CCVR",
        "FedALA",
        "FedAMP",
        "FedAS",
        "FedCP",
        "GPFL",
        "FML",
        "FedRoD",
        "MAPPER",
        "MOON",
        "PerFedAvg",
        "PFedGP",
        "PFedHN",
        "PFedHNPC",
        "PFedKT",
        "PFedLA",
        "PFedMe",
    ],
)
def test_methods_whose_math_needs_no_batch_norm_refuse_it_at_construction(name: str) -> None:
    with pytest.raises(ConfigError, match="use a network without batch norm"):
        build(getattr(methods, name), digits_data(6), net_args={"batch_norm": True})


def test_evaluation_of_unequal_clients_equals_each_clients_own_prediction() -> None:
    """The ragged blocks (clients reordered by sample count) give each client its own numbers."""
    dm = digits_data(6, partition=Dirichlet(0.3, min_samples=5))
    method = build(Local, dm, eval_batch_size=7)
    fit(method, dm, rounds=2)
    clients = torch.tensor([4, 0, 5, 2])
    correct, total, loss = method.evaluate(clients, "test")
    params = method.personalized_params(clients)
    for row, client in enumerate(clients.tolist()):
        x, y = dm.fetch(torch.as_tensor(dm._parts["test"][client]))
        logits = method.predict({k: v[row] for k, v in params.items()}, x)
        assert int(total[row]) == len(y)
        assert int(correct[row]) == int((logits.argmax(-1) == y).sum())
        expected = torch.nn.functional.cross_entropy(logits, y, reduction="sum")
        torch.testing.assert_close(loss[row], expected, rtol=1e-4, atol=1e-4)


def _per_client_passes(
    dm: FederatedDataModule,
) -> dict[str, Callable[[Tensor], tuple[Tensor, ...]]]:
    """The methods' passes over every sample of a set of clients, each as clients -> results."""
    small = {"eval_batch_size": 7}
    hypcluster = build(methods.HypCluster, dm, num_hypotheses=2, **small)
    pefll = build(methods.PeFLL, dm, **small)
    fedfomo = build(methods.FedFomo, dm, **small)
    fedproto = build(methods.FedProto, dm, **small)
    fedgh = build(methods.FedGH, dm, **small)
    assert isinstance(hypcluster, methods.HypCluster) and isinstance(pefll, methods.PeFLL)
    assert isinstance(fedfomo, methods.FedFomo) and isinstance(fedgh, methods.FedGH)

    def fomo(clients: Tensor) -> tuple[Tensor, ...]:
        own = fedfomo.store.gather("params", clients, fedfomo.device)
        other = {n: 0.5 * t for n, t in own.items()}
        return (fedfomo.validation_losses(clients, [own, other]),)

    def prototypes(clients: Tensor) -> tuple[Tensor, ...]:
        return class_statistics(fedproto, fedproto.personalized_params(clients), clients)

    def representations(clients: Tensor) -> tuple[Tensor, ...]:
        models = fedgh.gather_models("net", clients)
        return fedgh.class_representations(fedgh.groups.archs["net"], models, clients)

    return {
        "HypCluster": lambda clients: (hypcluster.cluster_losses(clients),),
        "PeFLL": lambda clients: (pefll.mean_embeddings(clients),),
        "FedFomo": fomo,
        "FedProto": prototypes,
        "FedGH": representations,
    }


@pytest.mark.parametrize("name", ["HypCluster", "PeFLL", "FedFomo", "FedProto", "FedGH"])
def test_passes_over_unequal_clients_data_equal_each_clients_own_pass(name: str) -> None:
    """The ragged blocks of the methods' data passes give each client its own numbers."""
    dm = digits_data(6, partition=Dirichlet(0.3, min_samples=5))
    clients = torch.tensor([4, 0, 5, 2])
    counts = dm.num_samples("train")[clients]
    assert len(set(counts.tolist())) == len(clients), "the test needs unequal clients"
    assert not torch.equal(counts.argsort(descending=True), torch.arange(len(clients)))
    data_pass = _per_client_passes(dm)[name]
    together = data_pass(clients)
    alone = [data_pass(clients[row : row + 1]) for row in range(len(clients))]
    for result, parts in zip(together, zip(*alone, strict=True), strict=True):
        torch.testing.assert_close(result, torch.cat(parts), rtol=1e-4, atol=1e-5)
