"""The threaded per-client loop (CPU): same math as one by one, deterministic, thread-safe."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import lightning_pfl.execution as execution
from lightning_pfl.client_threads import _channels_last, predict_clients
from lightning_pfl.engine import (
    Architecture,
    ClientBatches,
    ParamGroup,
    SGDConfig,
    TrainResult,
    cross_entropy_loss,
    train_clients,
)
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import FedAvg
from lightning_pfl.models import LeNet5, build_network
from lightning_pfl.sgd import _foreach_sgd_step, _sgd_step
from tests.conftest import build, digits_data, fit


def mnist_like(n: int = 300) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def lenet_round(threads: int, clients: int = 5, **kwargs: Any) -> TrainResult:
    """Clients with different starting weights, padding and idle steps, BN statistics."""
    x, y = mnist_like()
    torch.manual_seed(0)
    arch = Architecture(LeNet5(in_channels=1, input_size=28, batch_norm=True))
    state = arch.initial_state()
    stacked = {
        n: t.unsqueeze(0).repeat(clients, *([1] * t.dim()))
        + (0.01 * torch.randn(clients, *t.shape) if n in arch.shapes else 0)
        for n, t in state.items()
    }
    params = {n: t for n, t in stacked.items() if n in arch.shapes}
    buffers = {n: t for n, t in stacked.items() if n in arch.buffer_shapes}
    g = torch.Generator().manual_seed(1)
    batches = ClientBatches(
        torch.randint(0, len(y), (clients, 4, 16), generator=g),
        (torch.rand(clients, 4, 16, generator=g) > 0.2).float(),
        torch.rand(clients, 4, generator=g) > 0.25,
    )
    return train_clients(
        cross_entropy_loss(arch),
        params,
        [ParamGroup(tuple(params), SGDConfig(0.05, 0.9, 1e-4, 1.0))],
        batches,
        lambda i: (x[i], y[i]),
        vectorize=False,
        state=buffers,
        threads=threads,
        **kwargs,
    )


@pytest.mark.parametrize("clients", [5, 1])  # one client: trained on the calling thread
def test_threaded_loop_equals_one_by_one_and_repeats_exactly(clients: int) -> None:
    slow, fast, again = (lenet_round(t, clients) for t in (1, 2, 2))
    for field in ("params", "momentum", "state"):
        for name, tensor in getattr(slow, field).items():
            torch.testing.assert_close(
                getattr(fast, field)[name], tensor, rtol=1e-4, atol=1e-5, msg=name
            )
            assert torch.equal(getattr(again, field)[name], getattr(fast, field)[name]), name
    torch.testing.assert_close(fast.loss, slow.loss)
    assert torch.equal(fast.steps, slow.steps)


def test_threaded_loop_trains_under_the_callers_autocast() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        slow, fast = lenet_round(1), lenet_round(2)
    full = lenet_round(2)
    weight = "conv1.weight"
    torch.testing.assert_close(fast.params[weight], slow.params[weight], rtol=0.02, atol=2e-3)
    assert not torch.allclose(fast.params[weight], full.params[weight], rtol=1e-5, atol=1e-6)


def test_architecture_calls_are_thread_safe() -> None:
    """functional_call swaps tensors into a module: each worker thread needs its own."""
    arch = Architecture(LeNet5(in_channels=1, input_size=28))
    x, _ = mnist_like(8)
    weights = [{n: t + 0.1 * k for n, t in arch.initial_params().items()} for k in range(4)]
    expected = [arch(w, x) for w in weights]
    results: dict[int, list[torch.Tensor]] = {k: [] for k in range(4)}

    def work(k: int) -> None:
        for _ in range(20):
            results[k].append(arch(weights[k], x))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(4):
        for out in results[k]:
            torch.testing.assert_close(out, expected[k])


def test_channels_last_strides_for_one_channel() -> None:
    x = torch.randn(4, 1, 5, 5)
    assert x.contiguous(memory_format=torch.channels_last).stride() == x.stride()  # why it exists
    y = _channels_last(x)
    assert y.stride() == (25, 1, 5, 1)
    assert torch.equal(y, x)
    assert _channels_last(y) is y
    assert _channels_last(torch.randn(3, 4)).shape == (3, 4)


def test_step_flops_counts_forward_and_backward_on_meta() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    net = LeNet5(in_channels=1, input_size=28)
    x = torch.randn(64, 1, 28, 28)
    with FlopCounterMode(display=False) as counter:
        net(x).logsumexp(-1).sum().backward()
    assert Architecture(net).step_flops(x) == counter.get_total_flops() > 0
    with torch.inference_mode():  # evaluation asks too (FedAvg-FT fine-tunes there)
        assert Architecture(net).step_flops(x) == counter.get_total_flops()


def paths(monkeypatch: pytest.MonkeyPatch, world: int = 1, **kwargs: Any) -> tuple[bool, int]:
    monkeypatch.setattr(execution, "usable_cores", lambda: 4)
    dm = digits_data(6)
    method = build(FedAvg, dm, **kwargs)
    return execution.Executor(method.execution, dm, method.device, world=world).path(method.arch)


def test_default_path_per_network_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """vectorize null: vmap for small steps, the threaded loop for large ones (CPU)."""
    assert paths(monkeypatch) == (True, 1)  # digits CNN, batch 8: ~4 MFLOP
    big = {"net_args": {"width": 64}, "batch_size": 256}
    wide = Architecture(build_network("digits_cnn", (1, 8, 8), 10, width=64))
    assert wide.step_flops(torch.zeros(256, 1, 8, 8)) > execution.VMAP_CPU_MAX_STEP_FLOPS
    assert paths(monkeypatch, **big) == (False, 4)
    assert paths(monkeypatch, **big, client_threads=3) == (False, 3)
    assert paths(monkeypatch, **big, compile_step=True) == (True, 1)
    assert paths(monkeypatch, **big, vectorize=True) == (True, 1)
    assert paths(monkeypatch, **big, vectorize=False) == (False, 1)
    assert paths(monkeypatch, vectorize=False, client_threads=2) == (False, 2)
    assert paths(monkeypatch, world=2, **big) == (True, 1)  # DDP ranks: one thread, vmap
    assert paths(monkeypatch, world=2, **big, vectorize=False, client_threads=3) == (False, 1)


def test_dropout_networks_train_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    vit = {"net": "vit", "net_args": {"patch": 4, "dim": 16, "depth": 1, "heads": 2}}
    assert paths(monkeypatch, **vit, vectorize=False) == (False, 1)
    with pytest.raises(ConfigError, match="client_threads = 2 .* dropout"):
        paths(monkeypatch, **vit, client_threads=2)
    with pytest.raises(ConfigError, match="client_threads = 2 with compile_step"):
        paths(monkeypatch, client_threads=2, compile_step=True)


def test_auto_path_trains_as_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A method left on the defaults with a large step runs threaded and matches one by one."""
    monkeypatch.setattr(execution, "usable_cores", lambda: 2)
    monkeypatch.setattr(execution, "VMAP_CPU_MAX_STEP_FLOPS", 0)
    calls: list[int] = []
    original = execution.train_clients

    def spy(*args: Any) -> TrainResult:
        calls.append(args[12])  # threads
        return original(*args)

    monkeypatch.setattr(execution, "train_clients", spy)
    states = []
    for kwargs in ({}, {"vectorize": False, "client_threads": 1}):
        dm = digits_data(6)
        method = build(FedAvg, dm, clients_per_round=3, **kwargs)
        fit(method, dm, rounds=2)
        states.append(method.state_dict())
    assert calls == [2, 2, 1, 1]
    for name, tensor in states[1].items():
        torch.testing.assert_close(states[0][name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "sgd",
    [
        SGDConfig(0.1, momentum=0.9, weight_decay=1e-2, max_grad_norm=0.5),
        SGDConfig(0.1, momentum=0.9, weight_decay=1e-2, max_grad_norm=1e3),
        SGDConfig(0.05),
    ],
)
def test_foreach_sgd_step_equals_the_per_tensor_step(sgd: SGDConfig) -> None:
    g = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 4), "b": (4,), "c": (2, 2, 2)}
    params, grads, momentum = (
        {n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(3)
    )
    groups = [ParamGroup(("a", "b"), sgd), ParamGroup(("c",), SGDConfig(0.3, momentum=0.5))]
    slow = _sgd_step(params, grads, momentum, groups)
    fast = _foreach_sgd_step(params, grads, momentum, groups)
    for slow_part, fast_part in zip(slow, fast, strict=True):
        assert slow_part.keys() == fast_part.keys()
        for name, tensor in slow_part.items():
            torch.testing.assert_close(fast_part[name], tensor, rtol=1e-6, atol=1e-7)


def test_fine_tuning_in_threads_under_inference_mode_matches_one_by_one() -> None:
    """Evaluation runs under inference mode, where the threaded step falls back to torch.func.

    Workers use one intra-op thread, so float sums differ in the last bits from the main
    thread's, and SGD amplifies that with the steps taken: one short epoch at a small rate."""
    from lightning_pfl.methods import FedAvgFT

    tuned = []
    for threads in (1, 2):
        dm = digits_data(4)
        method = build(
            FedAvgFT, dm, vectorize=False, client_threads=threads, local_lr=0.01, batch_size=32
        )
        with torch.inference_mode():
            tuned.append(method.personalized_params(torch.arange(4)))
    for name, tensor in tuned[0].items():
        assert not torch.equal(tensor, method.payload(torch.arange(4))[name]), name
        torch.testing.assert_close(tuned[1][name], tensor, rtol=1e-4, atol=1e-5, msg=name)


def test_threaded_prediction_equals_vmap() -> None:
    arch = Architecture(LeNet5(in_channels=1, input_size=28))
    params = {
        n: t.unsqueeze(0) + 0.1 * torch.randn(3, *t.shape) for n, t in arch.initial_params().items()
    }
    x = torch.randn(3, 16, 1, 28, 28)
    expected = torch.vmap(arch)(params, x)
    for threads in (1, 2):
        torch.testing.assert_close(predict_clients(arch, params, x, threads), expected)
