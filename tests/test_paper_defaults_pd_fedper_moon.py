"""FedPer's K_P personalization layers and MOON's output layer on the projection (issue 43)."""

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import MOON, FedPer, LGFedAvg
from lightning_pfl.methods.lg_fedavg import weighted_layers
from lightning_pfl.models.targets import NETWORKS
from tests.conftest import build, digits_data
from tests.helpers import assert_vectorized_equals_sequential, capture_local_training


def weighted_mean(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (weights.view(-1, *[1] * (stacked.dim() - 1)) * stacked).sum(0)


def server_round(method: FedPer | MOON, clients: torch.Tensor) -> None:
    optimizer = method.configure_server_optimizer()
    optimizer.zero_grad()
    method.run_round(0, clients)
    optimizer.step()


# ----------------------------------------------------------------------------- FedPer
def test_fedper_default_keeps_the_top_two_layers_and_averages_the_base() -> None:
    dm = digits_data(6)
    method = build(FedPer, dm, clients_per_round=3)
    assert method.hp.personal_layers == 2
    personal = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    assert method.personal_names() == personal
    initial = method.arch.initial_params()
    trained = capture_local_training(method)
    clients = torch.tensor([0, 3, 4])
    server_round(method, clients)
    weights = method.client_weights(clients).double()
    for name, p in method.net.named_parameters():
        if name in personal:  # never uploaded: the server's copy stays at the initialization
            assert torch.equal(p.detach(), initial[name]), name
        else:  # the base: the sample-weighted mean of the clients' trained base
            mean = weighted_mean(trained[0].params[name].double(), weights)
            torch.testing.assert_close(p.detach().double(), mean, rtol=1e-5, atol=1e-6)
    stored = method.store.fields["personal"]
    for name in personal:
        assert torch.equal(stored[name][clients], trained[0].params[name]), name
        assert torch.equal(stored[name][1], initial[name]), name  # not sampled
    base = [p for n, p in method.net.named_parameters() if n not in personal]
    per_client = sum(p.numel() * p.element_size() for p in base)
    assert method.record.round_bytes == [3.0 * per_client, 3.0 * per_client]  # base only, both ways
    model = method.personalized_params(torch.tensor([3]))
    assert torch.equal(model["fc1.weight"][0], stored["fc1.weight"][3])
    assert torch.equal(model["conv2.weight"][0], method.net.conv2.weight.detach())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_fedper_counts_layers_as_lg_fedavg(k: int) -> None:
    """K_P personal layers of FedPer are exactly the K_P global layers of LG-FedAvg."""
    dm = digits_data(4)
    fedper = build(FedPer, dm, personal_layers=k)
    lg = build(LGFedAvg, dm, global_layers=k)
    layers = weighted_layers(fedper.arch)
    assert layers == ["conv1", "conv2", "fc1", "fc2"]
    personal = {n.rsplit(".", 1)[0] for n in fedper.personal_names()}
    lg_local = {n.rsplit(".", 1)[0] for n in lg.local_names()}
    assert personal == set(layers[-k:]) == set(layers) - lg_local


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_fedper_one_personal_layer_is_the_classifier(name: str) -> None:
    shape = (1, 8, 8) if name == "digits_cnn" else (3, 32, 32)
    method = FedPer(num_clients=2, num_classes=10, input_shape=shape, net=name, personal_layers=1)
    assert method.personal_names() == method.arch.head_names


def test_fedper_batch_norm_after_a_personal_layer_stays_personal() -> None:
    method = build(FedPer, digits_data(4), net_args={"batch_norm": True})
    personal = set(method.personal_names())
    stats = {"bn3.running_mean", "bn3.running_var"}
    assert (
        personal == {f"{m}.{t}" for m in ("fc1", "bn3", "fc2") for t in ("weight", "bias")} | stats
    )
    assert not any(n.startswith(("bn2.", "conv2.")) for n in personal)


def test_fedper_refuses_personal_layers_that_leave_no_base() -> None:
    dm = digits_data(4)
    with pytest.raises(ConfigError, match=r"personal_layers = 4: .* 4 layers .* use 1\.\.3"):
        build(FedPer, dm, personal_layers=4)
    with pytest.raises(ConfigError, match=r"personal_layers = 2: .*\(mlp\).* use 1\.\.1"):
        build(FedPer, dm, net="mlp")
    with pytest.raises(ConfigError, match="personal_layers = 0"):
        build(FedPer, dm, personal_layers=0)


# ----------------------------------------------------------------------------- MOON
def by_hand(method: MOON, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z = W2 relu(W1 h + b1) + b2 on the global network's representation h, logits = Wo z + bo,
    from the server's modules."""
    h = method.net(x, features_only=True)
    p, out = method.projection, method.output
    assert out is not None
    z = F.linear(F.relu(F.linear(h, p[0].weight, p[0].bias)), p[2].weight, p[2].bias)
    return z, F.linear(z, out.weight, out.bias)


def test_moon_default_output_layer_reads_the_projection() -> None:
    dm = digits_data(4)
    method = build(MOON, dm)
    assert method.hp.classifier_input == "projection"
    assert method.output is not None
    assert tuple(method.output.weight.shape) == (dm.num_classes, method.hp.projection_dim)
    clients = torch.arange(4)
    model = method.personalized_params(clients)
    assert not any(n.startswith("fc2.") for n in model)  # the network's classifier is dropped
    assert {"output.weight", "output.bias", "projection.2.weight"} <= set(model)
    x, y = dm.fetch(dm.index["test"].flat[:12])
    z, logits = by_hand(method, x)
    first = {n: t[0] for n, t in model.items()}
    with torch.no_grad():
        torch.testing.assert_close(method.predict(first, x), logits)
        torch.testing.assert_close(method.represent(first, x)[0], z)
        # global = previous = the model: both cosines are 1, l_con = log 2
        context = {f"{k}.{n}": t for k in ("global", "previous") for n, t in first.items()}
        torch.testing.assert_close(
            method.moon_loss(first, context, x, y, torch.ones(12)),
            F.cross_entropy(logits, y) + method.hp.mu * math.log(2),
        )
    # the evaluation scores the same composition
    correct, total, _ = method.evaluate(clients, "test")
    xs, ys = dm.fetch(dm.index["test"].flat)
    hits = by_hand(method, xs)[1].argmax(-1) == ys
    assert int(correct.sum()) == int(hits.sum()) and int(total.sum()) == len(ys)


def test_moon_output_layer_is_trained_averaged_and_counted() -> None:
    dm = digits_data(6)
    # local_epochs None: the conftest's 3 steps, not the paper's 10 epochs at batch 8
    method = build(MOON, dm, clients_per_round=2, local_epochs=None)
    head = method.net.fc2.weight.detach().clone()
    optimizer = method.configure_server_optimizer()
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(method.net.fc2.weight) not in optimized and id(method.output.weight) in optimized
    trained = capture_local_training(method)
    clients = torch.tensor([1, 4])
    server_round(method, clients)
    weights = method.client_weights(clients).float()
    state = method.global_state()
    for name in ("output.weight", "output.bias", "projection.0.weight", "fc1.weight"):
        torch.testing.assert_close(state[name], weighted_mean(trained[0].params[name], weights))
        assert torch.equal(method.store.fields["previous"][name][clients], trained[0].params[name])
    assert torch.equal(method.net.fc2.weight.detach(), head)  # not part of the model
    assert "fc2.weight" not in trained[0].params
    tensors = [
        *(p for n, p in method.net.named_parameters() if not n.startswith("fc2.")),
        *method.projection.parameters(),
        *method.output.parameters(),
    ]
    per_client = sum(p.numel() * p.element_size() for p in tensors)
    assert method.record.round_bytes == [2.0 * per_client, 2.0 * per_client]


def test_moon_features_keeps_the_networks_classifier() -> None:
    dm = digits_data(4)
    method = build(MOON, dm, classifier_input="features")
    assert method.output is None
    model = method.personalized_params(torch.arange(4))
    assert not any(n.startswith(("projection.", "output.")) for n in model)
    x, _ = dm.fetch(dm.index["test"].flat[:12])
    first = {n: t[0] for n, t in model.items()}
    with torch.no_grad():
        torch.testing.assert_close(method.predict(first, x), method.net(x))
    assert "fc2.weight" in method.global_state()


def test_moon_features_vectorized_equals_sequential() -> None:
    # local_epochs None: the conftest's 3 steps, not the paper's 10 epochs at batch 8
    assert_vectorized_equals_sequential(
        MOON, projection_dim=16, classifier_input="features", local_epochs=None
    )


def test_moon_refuses_an_unknown_classifier_input() -> None:
    with pytest.raises(ConfigError, match="model.init_args.classifier_input = 'logits'"):
        build(MOON, digits_data(4), classifier_input="logits")
