"""Shared deviations S1 and S2 (docs/methods.md): the local SGD a method runs by default, and
the local work of the papers that state one setting for all their experiments, are the paper's.

FedAvg's ClientUpdate (McMahan et al., AISTATS 2017, Algorithm 1) is plain SGD, and every method
built on FedAvg inherits it unless its paper (or the code its docs row names) says otherwise.
The baselines not built on FedAvg declare their paper's optimizer, or where the paper gives none
(or was not reachable), their authors' code's, or a public port's where no authors' code exists.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.func import grad

from lightning_pfl import methods
from lightning_pfl.engine import Params
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import FedAvg, FederatedMethod
from lightning_pfl.methods.fedproto import FedProto
from lightning_pfl.validation import argument_default
from tests.conftest import build, digits_data
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_vectorized_equals_sequential,
    capture_local_training,
)

# class -> (momentum, weight decay, gradient clip, source) of its paper's local SGD
PAPER_LOCAL_SGD: dict[str, tuple[float, float, float | None, str]] = {
    "MOON": (0.9, 1e-5, None, "Li et al., CVPR 2021, experiments: SGD momentum 0.9, wd 1e-5"),
    "FedPAC": (0.5, 5e-4, None, "Xu et al., ICLR 2023: momentum 0.5; JianXu95/FedPAC: wd 5e-4"),
    "PFedKT": (0.9, 5e-5, None, "pFedKT section 6.1: momentum 0.9, weight decay 5e-5"),
    "FedTP": (0.9, 1e-5, None, "FedTP experimental setup: SGD lr 0.01; reference code rho 0.9"),
    "VanillaPersonalizedT": (0.9, 1e-5, None, "FedTP's experimental setup, as FedTP"),
    "FedNova": (0.9, 0.0, None, "Wang et al., NeurIPS 2020: the momentum runs, rho = 0.9"),
    "FedDyn": (0.0, 1e-3, 10.0, "Acar et al., ICLR 2021: the authors' code's experiments"),
    # the baselines not built on FedAvg (their own code where the paper gives no optimizer)
    "FedProto": (0.5, 0.0, None, "yuetan031/FedProto lib/update.py: SGD momentum 0.5"),
    "FedU": (0.0, 0.0, None, "CharlieDinh/FedU_FMTL userFedU.py: SGD, weight decay 0"),
    "FedFomo": (0.0, 1e-4, None, "NVlabs/FedFomo federated/args.py: momentum 0, wd 1e-4"),
    "FedGH": (0.9, 1e-3, 50.0, "LipingYi/FedGH FedGH_mh.py: momentum 0.9, --wd 1e-3, clip 50"),
    "APPLE": (0.9, 0.0, None, "ljaiverson/pFL-APPLE train_APPLE.py: SGD momentum 0.9"),
    "CFL": (0.9, 0.0, None, "felisat/clustered-federated-learning notebook: momentum 0.9"),
    "PFedLA": (0.0, 0.0, None, "no official code; FL-bench and KarhouTam/pFedLA: plain SGD"),
    "FedAMP": (0.0, 0.0, None, "no authors' code found; PFLlib's port: plain SGD"),
}
CLIENT_UPDATE = (0.0, 0.0, None, "FedAvg's ClientUpdate: plain SGD")


def fedavg_family() -> list[type[FederatedMethod]]:
    found = {
        cls for cls in vars(methods).values() if inspect.isclass(cls) and issubclass(cls, FedAvg)
    }
    return sorted(found, key=lambda cls: cls.__name__)


def local_sgd_defaults(cls: type) -> tuple[object, ...]:
    return tuple(
        argument_default(cls, name)
        for name in ("local_momentum", "local_weight_decay", "local_max_grad_norm")
    )


@pytest.mark.parametrize("cls", fedavg_family(), ids=lambda cls: cls.__name__)
def test_methods_built_on_fedavg_default_to_their_papers_local_sgd(
    cls: type[FederatedMethod],
) -> None:
    paper = next((k.__name__ for k in cls.__mro__ if k.__name__ in PAPER_LOCAL_SGD), None)
    momentum, weight_decay, clip, source = PAPER_LOCAL_SGD[paper] if paper else CLIENT_UPDATE
    assert local_sgd_defaults(cls) == (momentum, weight_decay, clip), source


NOT_ON_FEDAVG = sorted(
    name for name in PAPER_LOCAL_SGD if not issubclass(getattr(methods, name), FedAvg)
)


@pytest.mark.parametrize("name", NOT_ON_FEDAVG)
def test_baselines_not_built_on_fedavg_default_to_their_sources_local_sgd(name: str) -> None:
    """Each declares its own paper's (or code's) optimizer instead of pFedHN's inner loop."""
    momentum, weight_decay, clip, source = PAPER_LOCAL_SGD[name]
    assert local_sgd_defaults(getattr(methods, name)) == (momentum, weight_decay, clip), source


def test_fedavg_clients_take_plain_sgd_steps_by_default() -> None:
    """Two local steps from w: w1 = w - lr g(w; b0), w2 = w1 - lr g(w1; b1) (no momentum,
    weight decay or clip; with momentum 0.9 the second step would add 0.9 lr g(w; b0))."""
    dm = digits_data(4)
    lr = 0.5
    method = build(FedAvg, dm, local_steps=2, local_lr=lr, clients_per_round=2)
    assert isinstance(method, FedAvg)
    clients = torch.tensor([0, 3])
    start = method.global_state()
    batches = method.draw_batches(clients, 0)
    trained = capture_local_training(method)
    method.run_round(0, clients)
    for c in range(len(clients)):
        w = {n: start[n].clone() for n in method.arch.shapes}
        for step in range(2):
            x, y = dm.fetch(batches.index[c, step])
            g = grad(method.cross_entropy)(w, {}, x, y, batches.weight[c, step])
            w = {n: w[n] - lr * g[n] for n in w}
        for n in method.arch.shapes:
            torch.testing.assert_close(trained[0].params[n][c], w[n], rtol=1e-4, atol=1e-6, msg=n)


# S2: class -> (lr, batch, local epochs, source) of the one local-work setting its paper states
# for all its experiments; batch None: our sources disagree, the library's default stays
PAPER_LOCAL_WORK: dict[str, tuple[float, int | None, int, str]] = {
    "MOON": (0.01, 64, 10, "Li et al., CVPR 2021; QinbinLi/MOON README: --lr=0.01 --epochs=10"),
    "FedPAC": (0.01, 50, 5, "Xu et al., ICLR 2023 (eta 0.01 on (E)MNIST); JianXu95/FedPAC"),
    "FedBN": (0.01, 32, 1, "Li et al., ICLR 2021; med-air/FedBN --lr 1e-2 --batch 32"),
    # the paper's batch 8 (as docs/methods.md reads it) vs the authors' --local_bs 4
    "FedProto": (0.01, None, 1, "yuetan031/FedProto lib/options.py: --lr 0.01 --train_ep 1"),
}
LOCAL_WORK = ("local_lr", "batch_size", "local_epochs")


@pytest.mark.parametrize("name", sorted(PAPER_LOCAL_WORK))
def test_papers_with_one_local_work_setting_default_to_it(name: str) -> None:
    lr, batch, epochs, source = PAPER_LOCAL_WORK[name]
    size = batch or argument_default(FederatedMethod, "batch_size")
    cls = getattr(methods, name)
    assert tuple(argument_default(cls, k) for k in LOCAL_WORK) == (lr, size, epochs), source


def paper_default_method(name: str, **kwargs: Any) -> FederatedMethod:
    """``name`` built with its own defaults for everything but the network (the conftest's
    ``build`` would set its small test steps, batch and lr)."""
    dm = digits_data(4)
    net_args = {"batch_norm": True} if name == "FedBN" else {}
    method = getattr(methods, name)(
        num_clients=dm.num_clients,
        num_classes=dm.num_classes,
        input_shape=dm.input_shape,
        net="digits_cnn",
        net_args=net_args,
        **kwargs,
    )
    method.attach_data(dm)
    return method


@pytest.mark.parametrize("name", sorted(PAPER_LOCAL_WORK))
def test_default_round_takes_the_papers_epochs_in_its_batches(name: str) -> None:
    """Client i takes E * ceil(n_i / B) steps at the paper's lr, E shuffled passes over its
    training split (main's defaults: 50 steps of batch 64 at lr 5e-3)."""
    lr, batch, epochs, _ = PAPER_LOCAL_WORK[name]
    method = paper_default_method(name)
    size = batch or argument_default(FederatedMethod, "batch_size")
    clients = torch.tensor([0, 3])
    drawn = method.draw_batches(clients, 0)
    n = method.data.num_samples("train")[clients].tolist()
    assert drawn.active.sum(1).tolist() == [epochs * math.ceil(k / size) for k in n]
    assert drawn.index.shape[-1] == size
    for c in range(len(clients)):  # each epoch visits every training sample once
        taken = drawn.index[c][drawn.weight[c] > 0]
        assert torch.equal(taken.unique(return_counts=True)[1], torch.full((n[c],), epochs))
    assert method.local_sgd().lr == lr


def test_papers_epochs_refuse_a_step_count_they_would_override() -> None:
    with pytest.raises(ConfigError, match="local_steps = 7 would be ignored"):
        paper_default_method("MOON", local_steps=7)
    assert paper_default_method("MOON", local_epochs=None, local_steps=7).hp.local_steps == 7


# FedProto: the authors' code (yuetan031/FedProto lib/update.py update_weights_het) builds its
# SGD inside every round's local update, so no momentum carries over between rounds.
def fedproto_two_rounds_of_one_client(client_momentum: str) -> tuple[Params, Params, Params]:
    """Two rounds of one local step each by client 1: (trained, fresh, kept), the trained
    model after round 1 and its hand-computed values for a fresh and a kept momentum."""
    dm = digits_data(4)
    lr, mu = 0.5, 0.5
    method = build(
        FedProto,
        dm,
        local_epochs=None,
        local_steps=1,
        local_lr=lr,
        clients_per_round=1,
        client_momentum=client_momentum,
    )
    assert isinstance(method, FedProto)
    assert method.hp.local_momentum == mu  # the authors' SGD momentum
    clients = torch.tensor([1])
    names = tuple(method.arch.shapes)
    w = {n: method.store.gather("params", clients, method.device)[n][0].clone() for n in names}
    grads = []
    for round_idx in range(2):
        sent = {k: v[0] for k, v in method.prototype_payload(clients).items()}
        batches = method.draw_batches(clients, round_idx)
        x, y = dm.fetch(batches.index[0, 0])
        g = grad(method.proto_loss)(w, sent, x, y, batches.weight[0, 0])
        grads.append(g)
        method.run_round(round_idx, clients)
        if round_idx == 0:  # both settings take the same first step from zero momentum
            w = {n: w[n] - lr * g[n] for n in names}
    g0, g1 = grads
    fresh = {n: w[n] - lr * g1[n] for n in names}
    kept = {n: w[n] - lr * (mu * g0[n] + g1[n]) for n in names}
    trained = {n: t[0] for n, t in method.store.gather("params", clients, method.device).items()}
    return trained, fresh, kept


def test_fedproto_default_restarts_the_client_momentum_every_round() -> None:
    assert argument_default(FedProto, "client_momentum") == "fresh"
    trained, fresh, kept = fedproto_two_rounds_of_one_client("fresh")
    for n in fresh:
        torch.testing.assert_close(trained[n], fresh[n], rtol=1e-4, atol=1e-6, msg=n)
    assert any(not torch.allclose(trained[n], kept[n], atol=1e-5) for n in kept)


def test_fedproto_kept_momentum_carries_into_the_clients_next_round() -> None:
    trained, _, kept = fedproto_two_rounds_of_one_client("kept")
    for n in kept:
        torch.testing.assert_close(trained[n], kept[n], rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("client_momentum", ["fresh", "kept"])
def test_fedproto_client_momentum_vectorized_equals_sequential(client_momentum: str) -> None:
    assert_vectorized_equals_sequential(
        FedProto, local_epochs=None, client_momentum=client_momentum
    )


def test_fedproto_fresh_momentum_resume_is_exact(tmp_path: Path) -> None:
    """tests/conf/fedproto.yaml pins the kept momentum (test_baselines_c resumes that)."""
    assert_resume_is_exact(
        CONF / "fedproto.yaml", tmp_path, "--model.init_args.client_momentum=fresh"
    )
