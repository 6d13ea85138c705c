"""The novel-client protocol (pFedHN section 5.3): held-out clients adapt what the method names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml
from lightning import Trainer
from torch import Tensor

from lightning_pfl import NovelClients
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import FedAvg, FederatedMethod, Local, PFedHN, PFedHNPC
from lightning_pfl.methods.fedavg_ft import FedAvgFT
from lightning_pfl.methods.fedper import FedPer
from lightning_pfl.methods.lg_fedavg import LGFedAvg
from lightning_pfl.methods.mh_pfedhn import MHPFedHN
from lightning_pfl.methods.mh_pfedhng import MHPFedHNG
from lightning_pfl.methods.per_fedavg import PerFedAvg
from lightning_pfl.novel import (
    gap_vs_distance_figure,
    main,
    requiring_grad,
    total_variation_to_nearest,
)
from lightning_pfl.partition import ClientDirichlet
from tests.conftest import build, digits_data, fit
from tests.helpers import CONF, cli, run_dir
from tests.test_runs import events

# A small MLP hypernetwork setup on digits that trains well in 40 rounds (about 3 s on a core),
# with the feature scale and target-scale heads its hn_lr was chosen for (the paper's
# parametrization, the default, left the training clients at 58% after 40 rounds).
LEARNS = {
    "hn_feature_scale": True,
    "hn_head_init": "target",
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


def novel_zoo(cls: type[MHPFedHN] = MHPFedHN) -> MHPFedHN:
    """The model zoo of tests/conf/mh_pfedhn_novel.yaml on 6 digits clients, the last two
    novel: client 4 a ResNet (batch norm) like training clients 2 and 3, client 5 the only
    SqueezeNet 1.1 (a parameter count, and so a head, of its own)."""
    with open(CONF / "mh_pfedhn_novel.yaml") as f:
        settings = yaml.safe_load(f)["model"]["init_args"]
    method = build(cls, digits_data(6), **settings)
    assert isinstance(method, MHPFedHN)
    return method


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
    for metric in (method.val_metric, method.test_metric, method.round_test_metric):
        assert (metric.total[:7] > 0).all() and (metric.total[7:] == 0).all()
    [(stats, per_client)] = method._evaluate_all(("val",))
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


@pytest.mark.parametrize("make", [novel_method, novel_zoo])
def test_the_callback_leaves_the_trained_model_as_it_was(make: Any) -> None:
    """Checkpoints and resumed runs never see the adaptation: every adapted tensor (MH-pFedHN:
    slot embeddings, the SqueezeNet's head, the novel ResNet's batch-norm statistics in the
    client store) is restored."""
    states = []
    for callbacks in ([], [NovelClients(steps=5, lr=0.1, eval_every=5)]):
        method = make()
        fit(method, method.data, rounds=3, callbacks=callbacks)
        states.append({**method.state_dict(), **flat_store(method)})
    accuracy = method.results()["novel_clients"]["test_acc"]
    assert accuracy[0] != accuracy[-1]  # the adaptation ran and changed the novel models
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name


def uneven_batch(method: FederatedMethod) -> tuple[Tensor, Tensor]:
    """One batch of the two novel clients: 5 samples of the first, 3 of the second (two padded
    slots of weight 0)."""
    parts = method.data._parts["train"]
    first, second = parts[-2], parts[-1]
    index = torch.tensor([list(first[:5]), list(second[:3]) + [0, 0]])
    weight = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    return index, weight


def flat_store(method: FederatedMethod) -> dict[str, Tensor]:
    """The client store's tensors, named ``store.<field>.<name>``."""
    fields = method.store.fields.items()
    return {f"store.{f}.{n}": t for f, tensors in fields for n, t in tensors.items()}


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


def novel_slots(method: MHPFedHN) -> Tensor:
    """Whether each embedding row is a slot of novel client 4 or 5."""
    hnet = method.hnet
    mask = torch.zeros(len(hnet.embeddings), dtype=torch.bool)
    for client in (4, 5):
        mask[hnet.slot_start[client] : hnet.slot_start[client] + hnet.tau[client]] = True
    return mask


@pytest.mark.parametrize("cls", [MHPFedHN, MHPFedHNG])
def test_mh_adaptation_changes_the_novel_slots_unseen_head_and_statistics_only(
    cls: type[MHPFedHN],
) -> None:
    method = novel_zoo(cls)
    fit(method, method.data, rounds=2)
    hnet = method.hnet
    unseen = hnet.head_of[5]
    assert unseen not in hnet.head_of[:4] + hnet.head_of[6:] and hnet.head_of[4] == "tau2"
    hnet_before = {n: t.clone() for n, t in hnet.state_dict().items()}
    store_before = {n: t.clone() for n, t in flat_store(method).items()}
    NovelClients(steps=3, lr=0.1, eval_every=3).adapt(method)
    novel = novel_slots(method)
    for name, tensor in hnet.state_dict().items():
        before = hnet_before[name]
        if name == "embeddings":
            assert torch.equal(tensor[~novel], before[~novel])
            assert (tensor[novel] != before[novel]).any(1).all()
        elif name.startswith(f"heads.{unseen}_"):  # the SqueezeNet's head never trained: it adapts
            assert not torch.equal(tensor, before), name
        else:
            assert torch.equal(tensor, before), name
    resnet_row = int(method.zoo.row_of[4])  # the novel ResNet's batch-norm statistics update
    for name, tensor in flat_store(method).items():
        before = store_before[name]
        assert name.startswith("store.buffers.resnet."), name  # the only per-client state
        assert torch.equal(tensor[:resnet_row], before[:resnet_row]), name
        assert not torch.equal(tensor[resnet_row], before[resnet_row]), name


def test_mh_gradient_is_autograd_of_the_summed_novel_loss() -> None:
    method = novel_zoo()
    index, weight = uneven_batch(method)
    callback = NovelClients()
    adaptation = callback.adaptation(method)
    hnet = method.hnet
    unseen = [hnet.heads[f"{hnet.head_of[5]}_{part}"] for part in ("weight", "bias")]
    assert adaptation.tensors == [hnet.embeddings, *unseen]
    statistics = method.store.fields["buffers.resnet"]
    assert adaptation.buffers == list(statistics.values())
    row = int(method.zoo.row_of[4])
    start = {n: t[row].clone() for n, t in statistics.items()}
    loss, grads = callback.gradients(adaptation, index, weight)

    total = torch.zeros(())
    for position, (client, kind, count) in enumerate(((4, "resnet", 5), (5, "squeezenet", 3))):
        params = {n: t[0] for n, t in method.codecs[kind].to_params(hnet([client])).items()}
        x, y = method.data.fetch(index[position, :count])
        arch = method.zoo.archs[kind]
        logits, updated = arch.forward_train(params | (start if arch.stateful else {}), x)
        total = total + F.cross_entropy(logits, y)
        for name, tensor in updated.items():  # the step's batch statistics reach the store
            torch.testing.assert_close(statistics[name][row], tensor)
    expected = torch.autograd.grad(total, [hnet.embeddings, *unseen])
    torch.testing.assert_close(loss, total.detach())
    for grad, reference in zip(grads, expected, strict=True):
        torch.testing.assert_close(grad, reference)
    novel = novel_slots(method)
    assert (grads[0][~novel] == 0).all() and (grads[0][novel] != 0).any(1).all()
    assert all(p.grad is None for p in hnet.parameters())


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
        (build(FedAvgFT, digits_data(10), clients_per_round=2, novel_clients=2), "FedAvgFT"),
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


@pytest.mark.parametrize("name", ["pfedhn_novel", "mh_pfedhn_novel"])
def test_cli_run_logs_novel_keys_and_writes_the_results_entry(name: str, tmp_path: Path) -> None:
    """pFedHN, and MH-pFedHN with a novel client of an architecture no training client has."""
    config = CONF / f"{name}.yaml"
    result = cli(config, tmp_path, figures=True)
    entry = result["novel_clients"]
    assert entry["steps"] == 4 and entry["eval_steps"] == [0, 2, 4]
    assert [c["id"] for c in entry["clients"]] == [4, 5]
    folder = run_dir(tmp_path, config)
    logged = events(folder)
    assert [e.step for e in logged.Scalars("novel/test_acc")] == [0, 2, 4]
    assert [e.step for e in logged.Scalars("novel/test_acc_weighted")] == [0, 2, 4]
    assert len(logged.Scalars("novel/train_clients_test_acc")) == 1
    assert [e.step for e in logged.Scalars("novel/gap")] == [0]
    assert len(logged.Images("novel/gap_vs_tv_distance")) == 1
    with open(folder / "results.json") as f:
        assert json.load(f)["novel_clients"] == entry


BASELINES = [FedAvg, FedPer, LGFedAvg, PerFedAvg, Local]


def baseline(cls: type[FederatedMethod]) -> FederatedMethod:
    """10 digits clients, the last 2 novel, a small MLP."""
    extra = {"alpha": 0.05} if cls is PerFedAvg else {}
    if cls is FedPer:  # the MLP has two layers: K_P = 1 leaves one to share
        extra = {"personal_layers": 1}
    return build(
        cls,
        digits_data(10),
        net="mlp",
        clients_per_round=4,
        local_steps=5,
        batch_size=16,
        novel_clients=2,
        seed=0,
        **extra,
    )


def trained_state(method: FederatedMethod) -> dict[str, Tensor]:
    return {n: t.clone() for n, t in {**method.state_dict(), **flat_store(method)}.items()}


@pytest.mark.parametrize("cls", BASELINES)
def test_baselines_adapt_novel_clients_and_leave_the_trained_model_bit_identical(
    cls: type[FederatedMethod],
) -> None:
    """Each baseline's novel clients learn under the same protocol as pFedHN's, and the global
    model, the training clients' state and (after the callback) every tensor are as trained."""
    method = baseline(cls)
    trainer = fit(method, method.data, rounds=3)
    before = trained_state(method)
    callback = NovelClients(steps=10, lr=0.1, eval_every=10)
    callback.on_train_end(trainer, method)
    summary = method.results()["novel_clients"]
    start, end = summary["test_acc"]
    assert end > start + 0.1, summary["test_acc"]
    after = trained_state(method)
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


@pytest.mark.parametrize("cls", [FedAvg, PerFedAvg])
def test_fine_tuning_starts_from_the_global_model_on_copies(cls: type[FedAvg]) -> None:
    method = baseline(cls)
    assert isinstance(method, FedAvg)
    adaptation = NovelClients().adaptation(method)
    assert adaptation.params is not None
    params = adaptation.params()
    for name, tensor in method.global_state().items():
        assert params[name].shape == (2, *tensor.shape)
        assert torch.equal(params[name][0], tensor) and torch.equal(params[name][1], tensor)
    assert all(
        t.data_ptr() != p.data_ptr() for t in adaptation.tensors for p in method.net.parameters()
    )


@pytest.mark.parametrize("cls", [FedPer, LGFedAvg, Local])
def test_personal_parts_adapt_only_in_the_novel_rows(cls: type[FederatedMethod]) -> None:
    """FedPer's head, LG-FedAvg's local layers and Local's model train from the
    initialization in the novel clients' rows; the shared part and every other row stay."""
    method = baseline(cls)
    fit(method, method.data, rounds=2)
    before = trained_state(method)
    adaptation = NovelClients().adaptation(method)
    assert adaptation.params is None and adaptation.tensors
    NovelClients(steps=3, lr=0.1, eval_every=3).adapt(method, adaptation)
    after = trained_state(method)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert changed and all(n.startswith("store.") for n in changed), changed
    for name in changed:
        assert torch.equal(after[name][:8], before[name][:8]), name


def test_gap_uses_the_training_clients_accuracy_at_the_best_validation_round(
    tmp_path: Path,
) -> None:
    method = novel_method(seed=0)
    callback = NovelClients(steps=4, lr=0.1, eval_every=2)
    trainer = Trainer(
        max_steps=6,
        val_check_interval=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[callback],
        default_root_dir=tmp_path,
    )
    trainer.fit(method, datamodule=method.data)
    summary = method.results()["novel_clients"]
    assert summary["train_clients_round"] == method.record.best["round"]
    assert summary["train_clients_test_acc"] == method.record.best["test"]["acc"]
    assert summary["gap"] == summary["test_acc"][-1] - method.record.best["test"]["acc"]
    for client in summary["clients"]:
        assert client["gap"] == client["test_acc_end"] - summary["train_clients_test_acc"]
    assert summary["tv_distance"] == pytest.approx(
        sum(c["tv_distance"] for c in summary["clients"]) / 2
    )


def test_client_dirichlet_must_draw_the_held_out_clients_with_novel_alpha() -> None:
    data = digits_data(10, partition=ClientDirichlet(0.5, 1.0, novel_clients=3))
    method = build(PFedHN, data, novel_clients=2)
    trainer = Trainer(max_steps=1, accelerator="cpu", logger=False, callbacks=[NovelClients()])
    with pytest.raises(ConfigError, match="partition.init_args.novel_clients"):
        trainer.fit(method, datamodule=data)


def test_figure2_is_drawn_from_results_files(tmp_path: Path) -> None:
    rows = [{"tv_distance": 0.2, "gap": -0.1}, {"tv_distance": 0.6, "gap": -0.3}]
    paths = []
    for name in ("pfedhn", "fedavg"):
        path = tmp_path / name / "results.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"novel_clients": {"clients": rows}, "config": {}}))
        paths.append(str(path))
    main([str(tmp_path / "figure2.png"), *paths])
    assert (tmp_path / "figure2.png").stat().st_size > 0
    figure = gap_vs_distance_figure({"a": ([0.1], [0.0])})
    assert figure.axes[0].get_ylabel().startswith("acc(novel)")


def test_figure2_pools_the_runs_of_one_method(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs of one method (e.g. its four novel alphas) in CLI run folders, all named
    version_0, give one series holding every run's novel clients; none is dropped."""
    drawn: dict[str, Any] = {}

    def figure(series: dict[str, Any]) -> Any:
        drawn.update(series)
        return gap_vs_distance_figure(series)

    monkeypatch.setattr("lightning_pfl.novel.gap_vs_distance_figure", figure)
    paths = []
    for method, alpha in [("PFedHN", 0.1), ("PFedHN", 1.0), ("FedAvg", 0.1)]:
        path = tmp_path / f"{method}_{alpha}" / "version_0" / "results.json"
        path.parent.mkdir(parents=True)
        rows = [{"tv_distance": alpha / 2, "gap": -alpha}, {"tv_distance": alpha, "gap": 0.0}]
        config = {"model": {"class_path": f"lightning_pfl.{method}"}}
        path.write_text(json.dumps({"novel_clients": {"clients": rows}, "config": config}))
        paths.append(str(path))
    main([str(tmp_path / "figure2.png"), *paths])
    assert sorted(drawn) == ["FedAvg", "PFedHN"]
    assert drawn["PFedHN"] == ([0.05, 0.1, 0.5, 1.0], [-0.1, 0.0, -1.0, 0.0])
    assert drawn["FedAvg"] == ([0.05, 0.1], [-0.1, 0.0])
