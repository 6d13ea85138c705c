"""pFedMe's round as the paper's Algorithm 1 by default: every client runs its local update
(and moves its theta_i) each round, only the sampled S^t upload, and the server mixes with the
uniform mean (1/S) sum w_i; the old round (sampled clients train, sample-weighted mean) stays
reachable by ``local_updates: sampled`` and ``aggregation: weighted``."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_pfl.costs import payload_bytes
from lightning_pfl.engine import TrainResult
from lightning_pfl.errors import ConfigError, NonFiniteLossError
from lightning_pfl.methods import PFedMe
from lightning_pfl.privacy import ClientDP
from tests.conftest import build, digits_data, fit
from tests.helpers import assert_vectorized_equals_sequential, capture_local_training

SAMPLED = torch.tensor([1, 4])  # 172 and 220 training samples: their weighted mean is not 1/2


def _round(method: PFedMe, clients: torch.Tensor = SAMPLED) -> list[TrainResult]:
    """One round of ``clients`` and the server step; the local training results."""
    trained = capture_local_training(method)
    method.run_round(0, clients)
    method.configure_server_optimizer().step()
    return trained


def test_default_round_trains_every_client_and_mixes_the_uniform_mean_of_the_sampled() -> None:
    dm = digits_data(6)
    counts = dm.num_samples("train")[SAMPLED]
    assert counts[0] != counts[1]  # uniform and sample-weighted means differ on these clients
    method = build(PFedMe, dm, clients_per_round=2, beta=0.5)
    before = {n: t.clone() for n, t in method.global_state().items()}
    everyone = torch.arange(6)
    theta_before = method.personalized_params(everyone)
    (result,) = _round(method)
    params = result.params
    theta = method.personalized_params(everyone)
    for name, old in before.items():
        assert params[name].shape[0] == 6, name  # all clients ran their R local steps
        # w <- (1 - beta) w + beta * (1/S) sum_{i in S^t} w_{i,R}, by hand
        mean = (params[name][1] + params[name][4]) / 2
        torch.testing.assert_close(method.global_state()[name], 0.5 * old + 0.5 * mean)
        assert torch.equal(theta[name], params[f"theta.{name}"]), name
        for client in range(6):  # every client's theta_i moved, sampled or not
            assert not torch.equal(theta[name][client], theta_before[name][client])


def test_weighted_aggregation_is_the_sample_weighted_mean_of_the_sampled() -> None:
    dm = digits_data(6)
    method = build(PFedMe, dm, clients_per_round=2, beta=0.5, aggregation="weighted")
    before = {n: t.clone() for n, t in method.global_state().items()}
    (result,) = _round(method)
    share = dm.num_samples("train")[SAMPLED].double()
    share = (share / share.sum()).float()
    for name, old in before.items():
        rows = result.params[name][SAMPLED]
        mean = share[0] * rows[0] + share[1] * rows[1]
        torch.testing.assert_close(method.global_state()[name], 0.5 * old + 0.5 * mean)


def test_sampled_local_updates_train_only_the_sampled_clients() -> None:
    dm = digits_data(6)
    method = build(PFedMe, dm, clients_per_round=2, local_updates="sampled")
    everyone = torch.arange(6)
    theta_before = method.personalized_params(everyone)
    (result,) = _round(method)
    theta = method.personalized_params(everyone)
    for name, old in theta_before.items():
        assert result.params[name].shape[0] == 2
        for client in range(6):
            moved = not torch.equal(theta[name][client], old[client])
            assert moved == (client in SAMPLED.tolist()), (name, client)


def test_novel_clients_do_not_train() -> None:
    dm = digits_data(6)
    method = build(PFedMe, dm, clients_per_round=2, novel_clients=2)
    theta_before = method.personalized_params(torch.arange(6))
    (result,) = _round(method, torch.tensor([0, 3]))
    theta = method.personalized_params(torch.arange(6))
    for name, old in theta_before.items():
        assert result.params[name].shape[0] == 4
        assert torch.equal(theta[name][4:], old[4:]), name


@pytest.mark.parametrize("local_updates", ["all", "sampled"])
def test_communication_counts_what_is_sent_and_uploaded(local_updates: str) -> None:
    dm = digits_data(6)
    method = build(PFedMe, dm, clients_per_round=2, local_updates=local_updates)
    model = payload_bytes(method.global_state())
    fit(method, dm, rounds=1)
    receivers = 6 if local_updates == "all" else 2  # Algorithm 1 sends w to every client
    assert method.record.comm_bytes_total.tolist() == [receivers * model, 2 * model]


@pytest.mark.parametrize("local_updates", ["all", "sampled"])
def test_vectorized_equals_sequential(local_updates: str) -> None:
    assert_vectorized_equals_sequential(
        PFedMe, local_updates=local_updates, aggregation="weighted", local_lr=0.05
    )


def test_client_dp_privatizes_the_uploads_of_the_sampled_clients() -> None:
    dm = digits_data(6)
    plain = build(PFedMe, dm, clients_per_round=2)
    _round(plain)
    no_noise = build(
        PFedMe,
        dm,
        clients_per_round=2,
        client_dp=ClientDP(noise_multiplier=0.0, clip_norm=math.inf),
    )
    _round(no_noise)
    for name, tensor in plain.global_state().items():  # z = 0, S = inf: DP changes nothing
        assert torch.equal(no_noise.global_state()[name], tensor), name
    clip = 0.01
    clipped = build(
        PFedMe, dm, clients_per_round=2, client_dp=ClientDP(noise_multiplier=0.0, clip_norm=clip)
    )
    before = clipped.global_state()
    before = {n: t.clone() for n, t in before.items()}
    _round(clipped)
    step = torch.cat([(clipped.global_state()[n] - t).flatten() for n, t in before.items()])
    assert 0 < step.norm() <= clip * (1 + 1e-5)  # beta = 1: the mean of two clipped updates
    with pytest.raises(ConfigError, match="model.init_args.aggregation = 'weighted'"):
        build(PFedMe, dm, aggregation="weighted", client_dp=ClientDP())


def test_a_non_finite_loss_of_a_client_outside_the_sample_stops_the_run() -> None:
    dm = digits_data(6)
    method = build(PFedMe, dm, clients_per_round=2)
    original = method.local_train

    def poisoned(*args: object, **kwargs: object) -> TrainResult:
        result = original(*args, **kwargs)  # type: ignore[arg-type]
        result.loss = result.loss.clone()
        result.loss[2] = float("nan")  # client 2 is not in S^t = {1, 4}
        return result

    method.local_train = poisoned  # type: ignore[method-assign]
    with pytest.raises(NonFiniteLossError, match=r"round 0 for clients \[2\]"):
        method.run_round(0, SAMPLED)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"local_updates": "some"}, "local_updates"), ({"aggregation": "mean"}, "aggregation")],
)
def test_bad_choices_are_refused_by_name(kwargs: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=f"model.init_args.{named}"):
        build(PFedMe, digits_data(4), **kwargs)
