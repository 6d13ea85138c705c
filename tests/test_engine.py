import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_pfl.client_state import ClientStateStore
from lightning_pfl.engine import (
    Architecture,
    ClientBatches,
    ParamGroup,
    SGDConfig,
    cross_entropy_loss,
    train_clients,
)
from lightning_pfl.models import DigitsCNN
from lightning_pfl.sgd import sgd_rates


def make_data(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def random_batches(clients: int, steps: int, batch: int, n: int, seed: int = 1) -> ClientBatches:
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, n, (clients, steps, batch), generator=g)
    weight = (torch.rand(clients, steps, batch, generator=g) > 0.2).float()
    active = torch.rand(clients, steps, generator=g) > 0.25
    return ClientBatches(index, weight, active)


def test_functional_sgd_matches_torch_optim_with_clipping() -> None:
    x, y = make_data()
    torch.manual_seed(0)
    net = DigitsCNN()
    arch = Architecture(net)
    batches = random_batches(1, 6, 16, len(y))
    batches.active[:] = True
    batches.weight[:] = 1.0
    cfg = SGDConfig(lr=0.1, momentum=0.9, weight_decay=1e-3, max_grad_norm=0.5)
    params = {n: p.detach().unsqueeze(0).clone() for n, p in net.named_parameters()}
    result = train_clients(
        cross_entropy_loss(arch),
        params,
        [ParamGroup(tuple(params), cfg)],
        batches,
        lambda i: (x[i], y[i]),
    )
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    for s in range(6):
        idx = batches.index[0, s]
        opt.zero_grad()
        F.cross_entropy(net(x[idx]), y[idx]).backward()
        nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
    for name, p in net.named_parameters():
        torch.testing.assert_close(result.params[name][0], p.detach(), rtol=1e-4, atol=1e-5)


def test_vectorized_equals_sequential_with_padding_and_idle_steps() -> None:
    x, y = make_data()
    torch.manual_seed(0)
    arch = Architecture(DigitsCNN())
    init = arch.initial_params()
    params = {
        n: p.unsqueeze(0).repeat(3, *([1] * p.dim())) + 0.01 * torch.randn(3, *p.shape)
        for n, p in init.items()
    }
    batches = random_batches(3, 5, 12, len(y))
    groups = [ParamGroup(tuple(params), SGDConfig(0.05, 0.9, 1e-4, 1.0))]

    def run(vectorize: bool):  # type: ignore[no-untyped-def]
        return train_clients(
            cross_entropy_loss(arch),
            dict(params),
            groups,
            batches,
            lambda i: (x[i], y[i]),
            vectorize=vectorize,
        )

    fast, slow = run(True), run(False)
    for name in params:
        torch.testing.assert_close(fast.params[name], slow.params[name], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(fast.momentum[name], slow.momentum[name], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fast.loss, slow.loss)
    assert torch.equal(fast.steps, batches.active.sum(1))


@pytest.mark.parametrize(("vectorize", "threads"), [(False, 1), (False, 2), (True, 1)])
def test_training_under_a_callers_inference_mode_leaves_it(vectorize: bool, threads: int) -> None:
    """torch 2.11's torch.func differentiates to zeros under inference mode: the engine trains
    outside it, also from inference tensors (parameters a caller made under inference mode).
    Fails on the previous engine under torch 2.11 (checked with its CPU build); torch 2.14's
    torch.func leaves inference mode itself."""
    x, y = make_data()
    torch.manual_seed(0)
    arch = Architecture(DigitsCNN())
    init = {n: p.unsqueeze(0).repeat(2, *([1] * p.dim())) for n, p in arch.initial_params().items()}
    batches = random_batches(2, 4, 12, len(y))
    groups = [ParamGroup(tuple(init), SGDConfig(0.05, 0.9, 1e-4, 1.0))]
    modes: list[bool] = []
    ce = cross_entropy_loss(arch)

    def loss(p, c, xb, yb, w):  # type: ignore[no-untyped-def]
        modes.append(torch.is_inference_mode_enabled())
        return ce(p, c, xb, yb, w)

    def run(params: dict[str, torch.Tensor]):  # type: ignore[no-untyped-def]
        return train_clients(
            loss,
            params,
            groups,
            batches,
            lambda i: (x[i], y[i]),
            vectorize=vectorize,
            threads=threads,
        )

    expected = run(dict(init))
    modes.clear()
    with torch.inference_mode():
        made_there = {n: t.clone() for n, t in init.items()}
        result = run(made_there)
    assert modes and not any(modes)
    for name in init:
        torch.testing.assert_close(result.params[name], expected.params[name], rtol=0, atol=0)
    torch.testing.assert_close(result.loss, expected.loss, rtol=0, atol=0)


@pytest.mark.parametrize(("vectorize", "threads"), [(False, 1), (False, 2), (True, 1)])
def test_per_client_sgd_rates_train_each_client_with_its_own_settings(
    vectorize: bool, threads: int
) -> None:
    """Clients trained together with ``rates`` (a learning-rate grid's runs in one job) end
    where each set trained alone with its own numbers does: bit for bit one by one and in
    threads (the same arithmetic), within float rounding under vmap."""
    x, y = make_data()
    torch.manual_seed(0)
    arch = Architecture(DigitsCNN())
    init = arch.initial_params()
    params = {
        n: p.unsqueeze(0).repeat(4, *([1] * p.dim())) + 0.01 * torch.randn(4, *p.shape)
        for n, p in init.items()
    }
    batches = random_batches(4, 5, 12, len(y))
    names = tuple(params)
    split = (names[:2], names[2:])  # two groups: the first layer and the rest
    settings = [
        (SGDConfig(0.05, 0.9, 1e-4, 1.0), SGDConfig(0.01)),
        (SGDConfig(0.2, 0.5, 0.0, 0.3), SGDConfig(0.1, 0.9, 1e-3)),
    ]
    runs = [[ParamGroup(n, cfg) for n, cfg in zip(split, pair, strict=True)] for pair in settings]

    def train(rows: slice, groups: list[ParamGroup], rates: dict[str, torch.Tensor] | None):  # type: ignore[no-untyped-def]
        return train_clients(
            cross_entropy_loss(arch),
            {n: t[rows] for n, t in params.items()},
            groups,
            ClientBatches(batches.index[rows], batches.weight[rows], batches.active[rows]),
            lambda i: (x[i], y[i]),
            vectorize=vectorize,
            threads=threads,
            rates=rates,
        )

    rates = {
        n: torch.cat([sgd_rates(runs[0], 2, x.device)[n], sgd_rates(runs[1], 2, x.device)[n]])
        for n in sgd_rates(runs[0], 2, x.device)
    }
    together = train(slice(0, 4), runs[0], rates)
    for rows, groups in ((slice(0, 2), runs[0]), (slice(2, 4), runs[1])):
        alone = train(rows, groups, None)
        for name in params:
            if vectorize:
                torch.testing.assert_close(together.params[name][rows], alone.params[name])
            else:
                assert torch.equal(together.params[name][rows], alone.params[name]), name
                assert torch.equal(together.momentum[name][rows], alone.momentum[name]), name
    # the two settings really differ: the same clients trained with the first one move elsewhere
    other = train(slice(2, 4), runs[0], None)
    assert not torch.allclose(other.params[names[0]], together.params[names[0]][2:])


def test_rates_that_give_only_a_learning_rate_keep_the_groups_other_settings() -> None:
    """Per-client learning rates alone (CFL's decayed lr): momentum, weight decay and clip stay
    the group's on every path, one by one and in threads as under vmap."""
    x, y = make_data()
    torch.manual_seed(0)
    arch = Architecture(DigitsCNN())
    params = {
        n: p.unsqueeze(0).repeat(2, *([1] * p.dim())) for n, p in arch.initial_params().items()
    }
    batches = random_batches(2, 4, 12, len(y))
    groups = [ParamGroup(tuple(params), SGDConfig(0.05, 0.9, 1e-3, 1.0))]
    lr_only = {"0.lr": torch.tensor([0.05, 0.05])}
    results = [
        train_clients(
            cross_entropy_loss(arch),
            params,
            groups,
            batches,
            lambda i: (x[i], y[i]),
            vectorize=vectorize,
            threads=threads,
            rates=rates,
        )
        for vectorize, threads, rates in (
            (False, 1, None),
            (False, 1, lr_only),
            (False, 2, lr_only),
            (True, 1, lr_only),
        )
    ]
    for result in results[1:]:
        for name in params:
            torch.testing.assert_close(result.params[name], results[0].params[name])
            torch.testing.assert_close(result.momentum[name], results[0].momentum[name])


def test_inactive_steps_leave_a_client_untouched() -> None:
    x, y = make_data()
    arch = Architecture(DigitsCNN())
    params = {
        n: p.unsqueeze(0).repeat(2, *([1] * p.dim())) for n, p in arch.initial_params().items()
    }
    batches = random_batches(2, 3, 8, len(y))
    batches.active[0] = False
    batches.active[1] = True
    result = train_clients(
        cross_entropy_loss(arch),
        dict(params),
        [ParamGroup(tuple(params), SGDConfig(0.1))],
        batches,
        lambda i: (x[i], y[i]),
    )
    for name in params:
        assert torch.equal(result.params[name][0], params[name][0])
        assert not torch.equal(result.params[name][1], params[name][1])


def test_every_trainable_tensor_needs_a_group() -> None:
    arch = Architecture(DigitsCNN())
    params = {n: p.unsqueeze(0) for n, p in arch.initial_params().items()}
    with pytest.raises(ValueError, match="group"):
        train_clients(
            cross_entropy_loss(arch),
            params,
            [ParamGroup(("fc2.weight",), SGDConfig(0.1))],
            random_batches(1, 1, 2, 10),
            lambda i: make_data()[0][:2],
        )


def test_architecture_head_and_batch_norm_buffers() -> None:
    assert Architecture(DigitsCNN()).head_names == ("fc2.weight", "fc2.bias")
    arch = Architecture(DigitsCNN(batch_norm=True))
    assert not Architecture(DigitsCNN()).stateful and arch.stateful
    assert set(arch.buffer_shapes) == {
        f"bn{i}.running_{s}" for i in (1, 2, 3) for s in ("mean", "var")
    }  # no integer num_batches_tracked counters
    with pytest.raises(ValueError, match="momentum"):
        Architecture(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, momentum=None)))


def test_client_state_store_gathers_scatters_and_round_trips() -> None:
    store = ClientStateStore(5)
    store.add_field("head", {"w": torch.zeros(2, 3)})
    ids = torch.tensor([1, 3])
    store.scatter("head", ids, {"w": torch.ones(2, 2, 3)})
    assert store.fields["head"]["w"].sum() == 12
    assert torch.equal(store.gather("head", ids, torch.device("cpu"))["w"], torch.ones(2, 2, 3))
    other = ClientStateStore(5)
    other.add_field("head", {"w": torch.zeros(2, 3)})
    other.load_state_dict(store.state_dict())
    assert torch.equal(other.fields["head"]["w"], store.fields["head"]["w"])
    assert store.nbytes() == 5 * 6 * 4


def test_batch_norm_statistics_are_per_client_state_matching_torch_modules() -> None:
    """Two clients with BN trained vmapped == each client's own nn.Module + torch.optim.SGD,
    running statistics included; evaluation uses them (eval mode)."""
    x, y = make_data()
    torch.manual_seed(0)
    net = DigitsCNN(batch_norm=True)
    arch = Architecture(net)
    batches = random_batches(2, 4, 16, len(y))
    batches.active[:] = True
    batches.weight[:] = 1.0
    state = {
        n: b.unsqueeze(0).repeat(2, *([1] * b.dim())) for n, b in arch.initial_buffers().items()
    }
    params = {
        n: p.unsqueeze(0).repeat(2, *([1] * p.dim())) for n, p in arch.initial_params().items()
    }
    result = train_clients(
        cross_entropy_loss(arch),
        params,
        [ParamGroup(tuple(params), SGDConfig(0.1, 0.9))],
        batches,
        lambda i: (x[i], y[i]),
        state=state,
    )
    for c in range(2):
        module = DigitsCNN(batch_norm=True)
        module.load_state_dict(net.state_dict(), strict=False)
        opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        for s in range(4):
            idx = batches.index[c, s]
            opt.zero_grad()
            F.cross_entropy(module(x[idx]), y[idx]).backward()
            opt.step()
        for name, tensor in module.state_dict().items():
            if "num_batches" in name:
                continue
            got = result.state[name][c] if name in result.state else result.params[name][c]
            torch.testing.assert_close(got, tensor, rtol=1e-4, atol=1e-5, msg=name)
        module.eval()
        tensors = {n: t[c] for n, t in {**result.params, **result.state}.items()}
        torch.testing.assert_close(arch(tensors, x[:8]), module(x[:8]), rtol=1e-4, atol=1e-5)
    assert not torch.equal(result.state["bn1.running_mean"][0], result.state["bn1.running_mean"][1])


def test_inactive_steps_leave_batch_norm_statistics_untouched() -> None:
    x, y = make_data()
    arch = Architecture(DigitsCNN(batch_norm=True))
    params = {
        n: p.unsqueeze(0).repeat(2, *([1] * p.dim())) for n, p in arch.initial_params().items()
    }
    state = {
        n: b.unsqueeze(0).repeat(2, *([1] * b.dim())) for n, b in arch.initial_buffers().items()
    }
    batches = random_batches(2, 3, 8, len(y))
    batches.active[0] = False
    result = train_clients(
        cross_entropy_loss(arch),
        params,
        [ParamGroup(tuple(params), SGDConfig(0.1))],
        batches,
        lambda i: (x[i], y[i]),
        state=state,
    )
    for name in state:
        assert torch.equal(result.state[name][0], state[name][0])
