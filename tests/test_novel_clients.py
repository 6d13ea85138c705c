"""The novel-client protocol (pFedHN section 5.3): held-out clients adapt what the method names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning import Trainer
from torch import Tensor

from lightning_pfl import NovelClients
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import FedAvg, FederatedMethod, PFedHN, PFedHNPC
from lightning_pfl.novel import requiring_grad, total_variation_to_nearest
from tests.conftest import build, digits_data, fit
from tests.helpers import CONF, cli, run_dir
from tests.test_runs import events

# A small MLP hypernetwork setup on digits that trains well in 40 rounds (about 3 s on a core).
LEARNS = {
    "net": "mlp",
    "clients_per_round": 4,
    "local_steps": 10,
    "batch_size": 16,
    "hn_lr": 0.05,
    "embed_dim": 4,
    "n_hidden": 1,
}


def novel_method(cls: type[FederatedMethod] = PFedHN, **kwargs: Any) -> FederatedMethod:
    """10 digits clients, the last 2 novel."""
    return build(cls, digits_data(10), **{"novel_clients": 2, **LEARNS, **kwargs})


def test_novel_clients_are_never_sampled() -> None:
    method = build(FedAvg, digits_data(10), clients_per_round=4, novel_clients=3)
    sampled = torch.cat([method.sample_clients(r) for r in range(300)])
    assert sampled.max() < 7
    assert set(sampled.tolist()) == set(range(7))


def test_validation_and_test_metrics_cover_training_clients_only() -> None:
    dm = digits_data(10, eval_clients_per_batch=4)  # the last chunk [8, 9] is all novel
    method = build(PFedHN, dm, novel_clients=3)
    for chunk in dm.client_chunks():
        method.validation_step(chunk, 0)
        method.test_step(chunk, 0)
    for metric in (method.val_metric, method.test_metric):
        assert (metric.total[:7] > 0).all() and (metric.total[7:] == 0).all()
    stats, per_client = method._evaluate_all("val")
    assert not per_client[:7].isnan().any() and per_client[7:].isnan().all()
    assert stats["acc"] == pytest.approx(per_client[:7].mean().item())


@pytest.mark.parametrize("cls", [PFedHN, PFedHNPC])
def test_adaptation_changes_only_the_novel_rows(cls: type[PFedHN]) -> None:
    """The novel clients' embeddings change, and with pFedHN-PC their personal heads."""
    method = novel_method(cls)
    fit(method, method.data, rounds=3)
    hnet_before = {n: t.clone() for n, t in method.hnet.state_dict().items()}
    store_before = {f: {n: t.clone() for n, t in d.items()} for f, d in method.store.fields.items()}
    NovelClients(steps=5, lr=0.1, eval_every=5).adapt(method)
    for name, tensor in method.hnet.state_dict().items():
        if name == "embeddings.weight":
            assert torch.equal(tensor[:8], hnet_before[name][:8])
            assert (tensor[8:] != hnet_before[name][8:]).any(1).all()
        else:
            assert torch.equal(tensor, hnet_before[name]), name
    for field, tensors in method.store.fields.items():
        for name, tensor in tensors.items():
            before = store_before[field][name]
            assert not tensor.requires_grad
            if field == "head":
                assert torch.equal(tensor[:8], before[:8]), name
                assert (tensor[8:] != before[8:]).flatten(1).any(1).all(), name
            else:
                assert torch.equal(tensor, before), f"{field} {name}"


def test_the_callback_leaves_the_trained_model_as_it_was() -> None:
    """Checkpoints and resumed runs never see the adaptation: the novel rows are restored."""
    states = []
    for callbacks in ([], [NovelClients(steps=5, lr=0.1, eval_every=5)]):
        method = novel_method()
        fit(method, method.data, rounds=3, callbacks=callbacks)
        states.append(method.state_dict())
    accuracy = method.results()["novel_clients"]["test_acc"]
    assert accuracy[0] != accuracy[-1]  # the adaptation ran and changed the novel models
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name


def uneven_batch(method: FederatedMethod) -> tuple[Tensor, Tensor]:
    """One batch of novel clients 8 and 9: 5 samples of client 8, 3 of client 9 (two padded
    slots of weight 0)."""
    parts = method.data._parts["train"]
    index = torch.tensor([list(parts[8][:5]), list(parts[9][:3]) + [0, 0]])
    weight = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    return index, weight


def test_embedding_gradient_is_autograd_of_the_summed_novel_loss() -> None:
    method = novel_method()
    assert isinstance(method, PFedHN)
    index, weight = uneven_batch(method)
    callback = NovelClients()
    adaptation = callback.adaptation(method)
    assert adaptation.tensors == [method.hnet.embeddings.weight]
    loss, (grad,) = callback.gradients(adaptation, index, weight)

    table = method.hnet.embeddings.weight
    total = torch.zeros(())
    for row, (client, count) in enumerate(((8, 5), (9, 3))):
        params = {n: t[0] for n, t in method.hnet(torch.tensor([client])).items()}
        x, y = method.data.fetch(index[row, :count])
        total = total + F.cross_entropy(method.arch(params, x), y)
    (expected,) = torch.autograd.grad(total, table)
    torch.testing.assert_close(loss, total.detach())
    torch.testing.assert_close(grad, expected)
    assert (grad[:8] == 0).all() and (grad[8:] != 0).any(1).all()
    assert all(p.grad is None for p in method.hnet.parameters())


def test_pfedhn_pc_gradient_covers_the_embeddings_and_the_novel_heads() -> None:
    method = novel_method(PFedHNPC)
    assert isinstance(method, PFedHNPC)
    index, weight = uneven_batch(method)
    callback = NovelClients()
    adaptation = callback.adaptation(method)
    heads = method.store.fields["head"]
    table = method.hnet.embeddings.weight
    assert adaptation.tensors == [table, *heads.values()]
    loss, grads = callback.gradients(adaptation, index, weight)

    with requiring_grad(list(heads.values())):
        total = torch.zeros(())
        for row, (client, count) in enumerate(((8, 5), (9, 3))):
            body = {n: t[0] for n, t in method.hnet(torch.tensor([client])).items()}
            params = body | {n: t[client] for n, t in heads.items()}
            x, y = method.data.fetch(index[row, :count])
            total = total + F.cross_entropy(method.arch(params, x), y)
        expected = torch.autograd.grad(total, [table, *heads.values()])
    torch.testing.assert_close(loss, total.detach())
    for grad, reference in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, reference)
        assert (grad[:8] == 0).all() and (grad[8:] != 0).flatten(1).any(1).all()
    assert all(not t.requires_grad for t in heads.values())


def test_pfedhn_pc_novel_heads_adapt_far_beyond_embedding_only() -> None:
    """A novel pFedHN-PC client's head starts at the untrained initialization: adapting only the
    embedding left the novel clients' mean test accuracy at 0.02 to 0.29 after 50 steps (seeds
    0-2), adapting both reached 0.99 with each seed."""
    method = novel_method(PFedHNPC, seed=0)
    fit(method, method.data, rounds=40)
    callback = NovelClients(steps=20, lr=0.1, eval_every=20)
    trained = {n: t.clone() for n, t in method.state_dict().items()}
    store = method.store.state_dict()
    embedding_only = PFedHN.novel_adaptation(method, callback.novel_ids(method))
    alone = callback.adapt(method, embedding_only)["acc"]
    method.load_state_dict(trained)
    method.store.load_state_dict(store)
    joint = callback.adapt(method)["acc"]
    assert joint[0] == alone[0]
    assert joint[-1] > 0.9 and joint[-1] > alone[-1] + 0.5, (alone, joint)


def test_novel_accuracy_improves_with_adaptation() -> None:
    method = novel_method(seed=0)
    callback = NovelClients(steps=50, lr=0.1, eval_every=10)
    fit(method, method.data, rounds=40, callbacks=[callback])
    summary = method.results()["novel_clients"]
    assert summary["eval_steps"] == [0, 10, 20, 30, 40, 50]
    start, end = summary["test_acc"][0], summary["test_acc"][-1]
    assert end > start + 0.2 and end > 0.8, summary["test_acc"]
    assert summary["train_clients_test_acc"] > 0.9
    assert [c["id"] for c in summary["clients"]] == [8, 9]
    for client in summary["clients"]:
        assert client["test_acc_end"] > client["test_acc_start"]
        assert 0 <= client["tv_distance"] <= 1 and 0 <= client["nearest_train_client"] < 8


def test_total_variation_to_the_nearest_training_client() -> None:
    novel = torch.tensor([[5, 5, 0], [0, 0, 4]])
    train = torch.tensor([[10, 0, 0], [2, 2, 0], [0, 1, 1]])
    distance, nearest = total_variation_to_nearest(novel, train)
    torch.testing.assert_close(distance, torch.tensor([0.0, 0.5], dtype=torch.float64))
    assert nearest.tolist() == [1, 2]


def test_methods_that_cannot_adapt_and_runs_without_novel_clients_are_refused() -> None:
    cases = [
        (build(FedAvg, digits_data(10), clients_per_round=2, novel_clients=2), "FedAvg"),
        (novel_method(novel_clients=0), "model.init_args.novel_clients"),
    ]
    for method, named in cases:
        trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, callbacks=[NovelClients()])
        with pytest.raises(ConfigError, match=named):
            trainer.fit(method, datamodule=method.data)
        assert method.global_step == 0  # refused before the first round


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="NovelClients.init_args.steps"):
        NovelClients(steps=0)
    with pytest.raises(ConfigError, match="NovelClients.init_args.lr"):
        NovelClients(lr=-1.0)
    with pytest.raises(ConfigError, match="novel_clients"):
        build(PFedHN, digits_data(6), clients_per_round=5, novel_clients=2)


def test_cli_run_logs_novel_keys_and_writes_the_results_entry(tmp_path: Path) -> None:
    config = CONF / "pfedhn_novel.yaml"
    result = cli(config, tmp_path)
    entry = result["novel_clients"]
    assert entry["steps"] == 4 and entry["eval_steps"] == [0, 2, 4]
    assert [c["id"] for c in entry["clients"]] == [4, 5]
    folder = run_dir(tmp_path, config)
    logged = events(folder)
    assert [e.step for e in logged.Scalars("novel/test_acc")] == [0, 2, 4]
    assert [e.step for e in logged.Scalars("novel/test_acc_weighted")] == [0, 2, 4]
    assert len(logged.Scalars("novel/train_clients_test_acc")) == 1
    assert len(logged.Images("novel/accuracy_vs_tv_distance")) == 1
    with open(folder / "results.json") as f:
        assert json.load(f)["novel_clients"] == entry
