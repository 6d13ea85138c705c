"""Shared deviation S1 (docs/methods.md): the local SGD a method runs by default is its paper's.

FedAvg's ClientUpdate (McMahan et al., AISTATS 2017, Algorithm 1) is plain SGD, and every method
built on FedAvg inherits it unless its paper (or the code its docs row names) says otherwise.
The baselines not built on FedAvg declare their paper's optimizer, or where the paper gives none
(or was not reachable), their authors' code's, or a public port's where no authors' code exists.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.func import grad

from lightning_pfl import methods
from lightning_pfl.methods import FedAvg, FederatedMethod
from tests.conftest import build, digits_data
from tests.helpers import capture_local_training

# class -> (momentum, weight decay, gradient clip, source) of its paper's local SGD
PAPER_LOCAL_SGD: dict[str, tuple[float, float, float | None, str]] = {
    "MOON": (0.9, 1e-5, None, "Li et al., CVPR 2021, experiments: SGD momentum 0.9, wd 1e-5"),
    "FedPAC": (0.5, 0.0, None, "Xu et al., ICLR 2023, experimental setup: SGD momentum 0.5"),
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


def default(cls: type, name: str) -> object:
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            parameters = inspect.signature(vars(klass)["__init__"]).parameters
            if name in parameters:
                return parameters[name].default
    raise KeyError(name)


def local_sgd_defaults(cls: type) -> tuple[object, ...]:
    return tuple(
        default(cls, name)
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
