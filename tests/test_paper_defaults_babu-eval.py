"""FedBABU fine-tunes with its reference code's optimizer by default (issue 46; issue 43, item 3).

jhoon-oh/FedBABU's personalization (analysis.ipynb) fine-tunes every client's copy of the model
for 5 epochs with ``torch.optim.SGD(lr=1e-3, momentum=0.9)`` (its training rate 0.1 after two
x0.1 decays, and its training momentum), whatever the training learning rate. The library
fine-tuned at the local SGD's rate and momentum, at which a few clients' fine-tuning diverges
on digits (benchmarks/results/digits_fedbabu_eval); ``finetune_lr`` / ``finetune_momentum``
None keep that.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg_ft import FINETUNE_PHASE
from lightning_pfl.methods.fedbabu import FedBABU
from tests.conftest import build, digits_data
from tests.helpers import assert_vectorized_equals_sequential


@pytest.mark.parametrize(
    ("kwargs", "lr", "momentum"),
    [
        ({}, 1e-3, 0.9),  # the reference code's fine-tuning
        ({"finetune_lr": None, "finetune_momentum": None}, 0.05, 0.0),  # the local SGD's
    ],
)
def test_fedbabu_fine_tunes_with_torch_sgd_at_the_reference_rate_and_momentum(
    kwargs: dict[str, Any], lr: float, momentum: float
) -> None:
    """Client 0's personalized model equals the global model after one epoch of
    ``torch.optim.SGD(lr, momentum)`` on the fine-tuning batches, step by step with autograd
    (the class default local SGD: lr 0.05 here, momentum 0, no weight decay or clip)."""
    dm = digits_data(4)
    method = build(FedBABU, dm, finetune_epochs=1, **kwargs)
    assert isinstance(method, FedBABU)
    assert (method.hp.local_lr, method.hp.local_momentum) == (0.05, 0.0)
    clients = torch.tensor([0])
    tuned = method.personalized_params(clients)
    net = copy.deepcopy(method.net)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    batches = method.draw_batches(clients, 0, 1, FINETUNE_PHASE)
    steps = int(batches.active[0].sum())
    assert steps > 1  # momentum matters from the second step
    for s in range(steps):
        index = batches.index[0, s][batches.weight[0, s] > 0]
        x, y = dm.fetch(index)
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
    for name, tensor in net.state_dict().items():
        torch.testing.assert_close(tuned[name][0], tensor, rtol=1e-4, atol=1e-6, msg=name)
        assert not torch.equal(tensor, method.global_state()[name]), name


def test_fedbabu_fine_tuning_momentum_is_validated() -> None:
    with pytest.raises(ConfigError, match="finetune_momentum"):
        build(FedBABU, digits_data(4), finetune_momentum=1.0)


def test_fedbabu_default_fine_tuning_vectorized_equals_sequential() -> None:
    assert_vectorized_equals_sequential(FedBABU, finetune_epochs=1)
