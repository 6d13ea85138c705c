"""PFedMe, PerFedAvg, FedBN, FedRoD and MOON: their math, vmap == loop, exact resume."""

from pathlib import Path

import pytest
import torch

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import FedBN
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    capture_local_training,
)

BN = {"net_args": {"batch_norm": True}}


# ----------------------------------------------------------------------------- FedBN
def test_fedbn_keeps_batch_norms_per_client_and_averages_the_rest() -> None:
    dm = digits_data(6)
    method = build(FedBN, dm, clients_per_round=3, **BN)
    personal = set(method.personal_names())
    assert personal == {
        f"bn{i}.{t}" for i in (1, 2, 3) for t in ("weight", "bias", "running_mean", "running_var")
    }
    initial = {n: t.clone() for n, t in method.global_state().items()}
    trained = capture_local_training(method)
    clients = torch.tensor([0, 2, 5])
    method.run_round(0, clients)
    method.configure_server_optimizer().step()
    params = trained[0].params
    weights = method.client_weights(clients).float()
    state = method.global_state()
    for name in initial:
        if name in personal:  # never uploaded: the server's copy never moves
            assert torch.equal(state[name], initial[name]), name
            assert not torch.allclose(params[name][0], params[name][1]), name
            kept = method.store.fields["personal"][name][clients]
            assert torch.equal(kept, params[name]), name
        else:
            mean = (weights.view(-1, *[1] * (params[name].dim() - 1)) * params[name]).sum(0)
            torch.testing.assert_close(state[name], mean, msg=name)
    assert "bn1.weight" not in method.payload(clients)


def test_fedbn_refuses_a_network_without_batch_norm() -> None:
    with pytest.raises(ConfigError, match="batch_norm"):
        build(FedBN, digits_data(4))


def test_fedbn_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedBN, **BN)


def test_fedbn_resume_is_exact(tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / "fedbn.yaml", tmp_path)
