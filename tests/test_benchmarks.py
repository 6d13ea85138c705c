import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import lightning_pfl.execution as execution
from benchmarks import evaluation, report, speed
from lightning_pfl.experiment import checkpointed_versions
from tests.conftest import build, digits_data
from tests.helpers import CONF, cli, run_dir

# the benchmarks' CLI runs in these tests draw no figures (log_figures; test_cli checks them)
NO_FIGURES = ["--model.init_args.log_figures=false"]
TINY = {"workload": "lenet5_mnist", "batch": 32, "batches_per_epoch": 4, "steps": 2}


def one_round(path: str) -> dict[str, torch.Tensor]:
    args = argparse.Namespace(device="cpu", **TINY)
    torch.manual_seed(0)
    model = speed.build("FedAvg", num_clients=4, clients_per_round=3, args=args, path=path)
    before = {name: p.detach().clone() for name, p in model.net.named_parameters()}
    speed.round_runner(model, precision="32-true", device="cpu", path=path)(0)
    after = {name: p.detach().clone() for name, p in model.net.named_parameters()}
    assert all(not torch.equal(before[name], after[name]) for name in after), "did not train"
    return after


@pytest.mark.parametrize("path", ["sequential", "vectorized"])
def test_the_reference_loop_trains_the_same_model_as_the_engine(path: str) -> None:
    """The speed ratios compare equal work: same clients, batches, optimizer and aggregation."""
    reference, engine = one_round("reference"), one_round(path)
    for name, value in reference.items():
        torch.testing.assert_close(engine[name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("path", ["default", "vectorized", "vectorized-graphs"])
def test_speed_gives_every_path_the_round_graphs_a_trainer_would(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU's `default` is graphed under a Trainer, so the benchmark's `default` must be too."""
    recorded = object()
    monkeypatch.setattr(
        execution,
        "make_round_graphs",
        lambda settings, device: recorded if settings.cuda_graphs in (None, True) else None,
    )
    args = argparse.Namespace(device="cpu", **TINY)
    model = speed.build("FedAvg", num_clients=4, clients_per_round=3, args=args, path=path)
    assert (model.executor.graphs is recorded) == (path != "vectorized")


def test_speed_times_a_fedtp_round_that_trains_its_generated_qkv() -> None:
    args = argparse.Namespace(device="cpu", workload="cifar_vit", batch=4, steps=1)
    model = speed.build("FedTP", num_clients=3, clients_per_round=1, args=args, path="default")
    before = {n: t.clone() for n, t in model.hnet.state_dict().items()}
    seconds = speed.round_runner(model, precision="32-true", device="cpu", path="default")(0)
    assert seconds > 0
    after = model.hnet.state_dict()
    assert any(not torch.equal(before[n], after[n]) for n in after), "HN step did not run"


def test_speed_skips_the_threaded_path_for_a_network_with_dropout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "speed.json"
    argv = ["speed", "--device", "cpu", "--workload", "cifar_vit", "--methods", "FedAvg"]
    argv += ["--clients", "1", "--num-clients", "2", "--steps", "1", "--batch", "4"]
    argv += ["--rounds", "1", "--precisions", "32-true", "--paths", "default", "threaded"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    speed.main()
    assert [row["path"] for row in json.loads(out.read_text())["rows"]] == ["default"]


def test_speed_writes_json_that_the_report_renders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "speed.json"
    argv = ["speed", "--device", "cpu", "--methods", "FedAvg", "--clients", "2", "--rounds", "1"]
    argv += ["--workload", "lenet5_mnist", "--batch", "32", "--batches-per-epoch", "4"]
    argv += ["--num-clients", "4", "--precisions", "32-true", "--out", str(out)]
    argv += ["--paths", "reference", "sequential", "vectorized", "vectorized-graphs"]
    monkeypatch.setattr(sys, "argv", argv)
    speed.main()
    result = json.loads(out.read_text())
    rows = {row["path"]: row for row in result["rows"]}
    assert set(rows) == {"reference", "sequential", "vectorized"}  # graphs: CUDA only
    assert rows["reference"]["speedup_over_reference"] == 1.0
    for row in rows.values():
        assert row["seconds_per_round"] > 0
        expected = rows["reference"]["seconds_per_round"] / row["seconds_per_round"]
        assert row["speedup_over_reference"] == pytest.approx(expected)
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["report", str(out)])
    report.main()
    table = capsys.readouterr().out
    assert [line.split(" | ")[2] for line in table.splitlines() if line.startswith("| FedAvg")] == [
        "reference",
        "sequential",
        "vectorized",
    ]


def test_evaluation_benchmark_compares_equal_results_of_ragged_and_padded_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "evaluation.json"
    argv = ["evaluation", "--clients", "12", "--min-samples", "5", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    evaluation.main()
    result = json.loads(out.read_text())
    rows = {row["path"]: row for row in result["rows"]}
    assert rows["ragged"]["same_counts_as_padded"] and rows["padded"]["same_counts_as_padded"]
    assert rows["ragged"]["max_loss_difference_to_padded"] < 1e-3
    assert result["largest_client"] > result["mean_client"], "a split of unequal clients"
    assert 1.0 <= rows["ragged"]["computed_per_real"] < rows["padded"]["computed_per_real"]
    assert rows["ragged"]["computed_samples"] >= result["real_samples"]
    assert result["environment"]["commit"]
    # what decides a CPU run's float rounding, so that a row can be reproduced bit for bit
    assert result["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert result["environment"]["cpu_model"]
    assert "| ragged |" in capsys.readouterr().out


def test_report_renders_end_to_end_rows_and_skips_an_empty_total_clients_table() -> None:
    row = {"method": "FedAvg", "clients_per_round": 1, "path": "sequential", "precision": "32-true"}
    row |= {"seconds_per_round": 0.5, "client_updates_per_second": 2.0, "achieved_tflops": 0.0}
    end_to_end = {"path": "vectorized", "rounds": 9}
    end_to_end |= {"end_to_end_seconds_per_round": 0.25, "training_step_seconds_per_round": 0.2}
    result = {"rows": [row], "total_clients_curve": [], "end_to_end": [end_to_end]}
    table = report.speed_table(result)
    assert "total clients" not in table
    assert "| vectorized | 9 | 0.2500 | 0.2000 |" in table.splitlines()
    assert table.startswith("| method")
    noted = report.speed_table({**result, "note": "default rows: eager vmap"}).splitlines()
    assert noted[:3] == ["> default rows: eager vmap", "", table.splitlines()[0]]


def test_accuracy_rows_keep_each_client_groups_accuracy_and_the_report_averages_seeds() -> None:
    from benchmarks.accuracy import summarize

    def result(seed_acc: float) -> dict:
        test = {"acc": 0.8, "acc_weighted": 0.8, "arch_cnn/acc": seed_acc, "arch_res/acc": 0.5}
        test |= {"arch_cnn/acc_weighted": 0.0, "acc_std": 0.1}
        return {
            "method": "MHPFedHN",
            "rounds": 2,
            "best_round": 2,
            "select_metric": "acc",
            "val_at_best": {"acc": 0.85},
            "test_at_best_val": test,
            "test_last": test,
            "seconds_per_round": 1.0,
            "comm_bytes_down_total": 0.0,
            "comm_bytes_up_total": 0.0,
            "stability": {},
            "majority_class": {"acc": 0.5, "acc_weighted": 0.4},
        }

    rows = [
        summarize("mh", "pathological", s, result(a), "abc", ["fit"])
        for s, a in ((0, 0.9), (1, 0.7))
    ]
    assert rows[0]["test_group_acc_at_best_val"] == {"arch_cnn": 0.9, "arch_res": 0.5}
    assert rows[0]["val_acc_at_best"] == 0.85  # the accuracy the best round was chosen by
    assert rows[0]["test_acc_majority_class"] == 0.5
    table = report.group_table([{"rows": rows}])
    assert "| pathological | mh | 2 | arch_cnn 80.00 ± 10.00, arch_res 50.00 ± 0.00 |" in table
    assert report.group_table([{"rows": [{**rows[0], "test_group_acc_at_best_val": {}}]}]) == ""
    # seeds of different lengths are shown as such, not averaged as if they were one protocol
    mixed = report.accuracy_table([{"rows": [rows[0], {**rows[1], "rounds": 150}]}])
    assert "| pathological | mh | 2 | 2, 150 |" in mixed


def test_accuracy_rows_name_their_machine_when_seeds_ran_on_different_ones(tmp_path: Path) -> None:
    from benchmarks.accuracy import write_rows

    path = tmp_path / "fashion_mnist" / "fedavg.json"
    cpu = {"device": "x86_64", "torch": "2.14.1", "commit": "abc"}
    gpu = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "commit": "abc"}
    path.parent.mkdir()
    # a file written before rows named their machine (its seed-0 row ran on the CPU)
    path.write_text(json.dumps({"environment": cpu, "rows": [{"split": "p", "seed": 0}]}))
    write_rows(path, [{"split": "p", "seed": 1}], gpu)
    result = json.loads(path.read_text())
    assert [r["device"] for r in result["rows"]] == ["x86_64", gpu["device"]]
    write_rows(path, [{"split": "p", "seed": 2}, {"split": "p", "seed": 0}], cpu)
    result = json.loads(path.read_text())
    assert [(r["seed"], r["device"], r["torch"]) for r in result["rows"]] == [
        (0, "x86_64", "2.14.1"),
        (1, gpu["device"], "2.11.0"),
        (2, "x86_64", "2.14.1"),
    ]
    assert result["environment"] == cpu  # the last run's
    for row in result["rows"]:
        row |= {"method": "fedavg", "rounds": 2, "commit": "abc", "test_acc_last": 0.5}
        row |= {"test_acc_at_best_val": 0.5, "test_acc_weighted_at_best_val": 0.5}
        row["seconds_per_round"] = float(row["seed"] ** 2)  # CPU: 0 and 4, GPU: 1
    # seconds per round are averaged per machine (not 1.667 across them)
    assert "| 1.000 (H100), 2.000 (x86_64) | abc |" in report.accuracy_table([result])


def test_accuracy_table_says_how_many_seeds_a_column_with_removed_values_covers() -> None:
    rows = [
        {"split": "p", "method": "m", "seed": seed, "rounds": 2, "commit": "abc"}
        | {"test_acc_at_best_val": 0.9, "test_acc_weighted_at_best_val": 0.9}
        | {"seconds_per_round": 1.0, "test_acc_last": last}
        for seed, last in enumerate([0.8, None, None])  # seeds 1-2 invalid, kept as *_invalid
    ]
    table = report.accuracy_table([{"rows": rows}])
    assert "| 90.00 ± 0.00 | 90.00 ± 0.00 | 80.00 (1 of 3) |" in table
    rows[1]["test_acc_last"] = rows[2]["test_acc_last"] = 0.8
    assert "| 80.00 ± 0.00 |" in report.accuracy_table([{"rows": rows}])


def test_majority_class_floor_predicts_each_clients_most_frequent_training_class() -> None:
    from benchmarks.accuracy import majority_class_accuracy

    train = np.array([[5, 1, 0], [0, 2, 3], [1, 0, 0]])
    # client 0 predicts class 0 (3 of 4 right), client 1 class 2 (1 of 5: its test majority
    # is class 1, which the floor cannot know), client 2 has no test samples and is skipped
    test = np.array([[3, 1, 0], [0, 4, 1], [0, 0, 0]])
    floor = majority_class_accuracy({"train": train, "val": train, "test": test})
    assert floor == pytest.approx({"acc": (3 / 4 + 1 / 5) / 2, "acc_weighted": 4 / 9})


def test_floor_table_counts_each_split_and_seed_once_and_skips_rows_without_a_floor() -> None:
    def row(method: str, split: str, seed: int, floor: float | None) -> dict:
        key = {"method": method, "split": split, "seed": seed}
        if floor is None:
            return key
        return key | {
            "test_acc_majority_class": floor,
            "test_acc_weighted_majority_class": floor / 2,
        }

    rows = [
        row("local", "dirichlet", 0, 0.4),
        row("fedavg", "dirichlet", 0, 0.4),  # same split and seed: not a second sample
        row("local", "dirichlet", 1, 0.6),
        row("local", "pathological", 0, None),  # an old row without the field
    ]
    table = report.floor_table([{"rows": rows}])
    assert "| dirichlet | 2 | 50.00 ± 10.00 | 25.00 ± 5.00 |" in table.splitlines()
    assert "pathological" not in table
    assert report.floor_table([{"rows": rows[3:]}]) == ""


def test_comparison_table_lists_methods_by_split_with_differences_to_the_references() -> None:
    def row(method: str, split: str, seed: int, acc: float, rounds: int = 150) -> dict:
        return {"method": method, "split": split, "seed": seed, "rounds": rounds,
                "test_acc_at_best_val": acc}  # fmt: skip

    rows = [
        row("fedavg", "dirichlet", 0, 0.90),
        row("fedavg", "dirichlet", 1, 0.94),
        row("local", "dirichlet", 0, 0.80),
        row("ditto", "dirichlet", 0, 0.95),
        row("ditto", "dirichlet", 1, 0.97),
        row("ditto", "pathological", 0, 0.99),
        row("ditto", "pathological", 1, 0.10, rounds=30),  # another protocol: left out
    ]
    table = report.comparison_table([{"rows": rows}], rounds=150)
    lines = table.splitlines()
    references = "| vs fedavg | vs local |"
    assert lines[0] == f"| method | dirichlet (%) {references} pathological (%) {references}"
    assert "| ditto | 96.00 ± 1.00 (2) | +4.00 | +16.00 | 99.00 (1) | - | - |" in lines
    assert "| fedavg | 92.00 ± 2.00 (2) | - | +12.00 | - | - | - |" in lines
    assert "| local | 80.00 (1) | -12.00 | - | - | - | - |" in lines


def test_paired_table_differences_each_seed_to_the_references_row_of_that_seed() -> None:
    def row(method: str, seed: int, acc: float, rounds: int = 100) -> dict:
        return {"method": method, "split": "d", "seed": seed, "rounds": rounds,
                "test_acc_at_best_val": acc}  # fmt: skip

    local = [row("local", 0, 0.80), row("local", 1, 0.82)]
    fedx = [row("fedx", 0, 0.85), row("fedx", 1, 0.81), row("fedx", 2, 0.90, rounds=30)]
    lines = report.paired_table([{"rows": local}, {"rows": fedx}], ["local"]).splitlines()
    assert lines[0] == "| split | method | acc per seed (%) | vs local per seed |"
    # seed 2 ran another protocol (30 rounds) and local has no seed 2: it is listed, not paired
    fedx_cells = "| d | fedx | s0 85.00 (100 rounds), s1 81.00 (100 rounds), s2 90.00 (30 rounds) "
    assert f"{fedx_cells}| +5.00, -1.00 (1/2 above) |" in lines
    assert "| d | local | s0 80.00, s1 82.00 | - |" in lines


def test_methods_table_has_a_row_per_digits_result_with_bytes_per_sampled_client_round() -> None:
    """docs/methods.md's table: every committed digits config, (down + up) / (rounds x clients)."""
    from benchmarks import methods_table

    repo = Path(__file__).resolve().parents[1]
    results, configs = repo / "benchmarks/results/digits", repo / "configs/digits"
    lines = methods_table.render(results, configs).splitlines()
    assert lines[0] == methods_table.HEADER
    assert lines[1].count("|") == lines[0].count("|")
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ") for line in lines[2:]}
    assert sorted(rows) == sorted(p.stem for p in results.glob("*.json"))
    for name, cells in rows.items():
        row = methods_table.seed_row(json.loads((results / f"{name}.json").read_text()))
        assert (row["split"], row["seed"]) == ("pathological", 0)
        assert cells[2:4] == list(methods_table.ABOUT[name])
        clients = int(cells[4])
        assert cells[5] == str(row["rounds"])
        assert cells[6] == f"{round(row['comm_bytes_total'] / (row['rounds'] * clients)):,}"
    assert rows["fedavg"][4:7] == ["5", "150", "109,648"]
    assert rows["fedper"][3] == "the top K_P = 2 layers (fc1 and the classifier)"
    # the formula on a hand-made row: 3,000 bytes over 2 rounds of 3 clients
    row = {"class": "X", "rounds": 2, "comm_bytes_total": 3000.0}
    line = methods_table.table_row("x", row, 3, "t", ("P", "head"))
    assert line == "| x | `X` | P | head | 3 | 2 | 500 | t |"


def test_methods_table_refuses_a_result_without_paper_and_personalization(tmp_path: Path) -> None:
    from benchmarks import methods_table

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "brand_new.json").write_text("{}")
    with pytest.raises(KeyError, match="brand_new: add its paper"):
        methods_table.render(tmp_path, repo / "configs/digits")


def test_mh_trained_vs_generated_records_every_visit_without_changing_training(
    tmp_path: Path,
) -> None:
    config = CONF / "mh_pfedhn.yaml"
    plain = cli(config, tmp_path / "plain")
    out = tmp_path / "diagnosis.json"
    tracked = cli(
        config,
        tmp_path / "tracked",
        "--model.class_path=benchmarks.mh_trained_vs_generated.TrackedMHPFedHN",
        f"--model.init_args.diagnosis_out={out}",
    )
    assert tracked["test_last"] == plain["test_last"]
    plain_state = torch.load(
        run_dir(tmp_path / "plain", config) / "checkpoints" / "last.ckpt", weights_only=False
    )["state_dict"]
    tracked_state = torch.load(
        run_dir(tmp_path / "tracked", config) / "checkpoints" / "last.ckpt", weights_only=False
    )["state_dict"]
    assert plain_state.keys() == tracked_state.keys()
    for name, value in plain_state.items():
        assert torch.equal(value, tracked_state[name]), name
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["round"] for r in rows] == [r for r in range(4) for _ in range(2)]
    assert {r["arch"] for r in rows} <= {"cnn", "mlp", "resnet"}
    for r in rows:
        for key in ("generated_before", "trained", "generated_after"):
            assert 0.0 <= r[key] <= 1.0
    visits = sum(s["visits"] for spans in result["summary"].values() for s in spans.values())
    assert visits == len(rows)


def test_mh_trained_vs_generated_summary_on_hand_rows() -> None:
    from benchmarks.mh_trained_vs_generated import summarize

    def visit(round_: int, client: int, before: float, after: float) -> dict[str, object]:
        return {
            "round": round_,
            "client": client,
            "arch": "cnn",
            "generated_before": before,
            "trained": 1.0,
            "generated_after": after,
        }

    # client 0: left at 0.5 after round 0, found at 0.25 in round 2 (-0.25 between visits);
    # client 1: left at 0.5 after round 1, found at 1.0 in round 3 (+0.5)
    rows = [
        visit(0, 0, 0.0, 0.5),
        visit(1, 1, 0.0, 0.5),
        visit(2, 0, 0.25, 0.75),
        visit(3, 1, 1.0, 1.0),
    ]
    summary = summarize(rows, windows=2)["cnn"]
    assert summary["rounds 0-1"] == {
        "visits": 2,
        "generated_before": 0.0,
        "trained": 1.0,
        "generated_after": 0.5,
        "between_visits": None,
    }
    assert summary["rounds 2-3"]["generated_before"] == 0.625
    assert summary["rounds 2-3"]["between_visits"] == 0.125


def test_init_spread_tells_he_init_from_pytorch_default_on_vgg8() -> None:
    from benchmarks.init_spread import logit_spread

    zoo = logit_spread("vgg8", (1, 28, 28), "zoo", seed=0, batch=32)
    default = logit_spread("vgg8", (1, 28, 28), "pytorch_default", seed=0, batch=32)
    assert zoo > 1e-2 > 1e-3 > default > 0, (zoo, default)


def test_fedtp_spread_replaces_every_clients_qkv_by_their_mean() -> None:
    from benchmarks.fedtp_spread import measure
    from lightning_pfl.methods import FedTP

    vit = {"patch": 2, "dim": 16, "depth": 2, "heads": 2, "head_dim": 8, "mlp_dim": 32}
    method = build(FedTP, digits_data(4), net="vit", net_args=vit, local_epochs=None).eval()
    assert isinstance(method, FedTP)
    clients = torch.arange(4)
    generated = method.personalized_params(clients)
    before = measure(method)
    assert before["qkv_spread"] > 0.01
    with torch.no_grad():  # every client now generates the mean of the qkv it had
        for name, head in zip(method.hnet.target_shapes, method.hnet.heads, strict=True):
            head.weight.zero_()
            head.bias.copy_(generated[name].mean(0).flatten())
    after = measure(method)
    assert after["qkv_spread"] < 1e-6
    assert after["val_acc"] == after["val_acc_shared_qkv"] == before["val_acc_shared_qkv"]


def test_accuracy_resume_goes_on_from_an_interrupted_runs_checkpoint_to_the_same_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import accuracy

    def benchmark(log_dir: Path, out_dir: Path, *more: str, extra: tuple[str, ...] = ()) -> dict:
        argv = ["accuracy", "--setting", "digits", "--methods", "fedavg", "--splits", "dirichlet"]
        argv += ["--rounds-scale", str(4 / 300), "--log-dir", str(log_dir)]
        more = (*more, "--extra", *NO_FIGURES, *extra)
        monkeypatch.setattr(sys, "argv", [*argv, "--out-dir", str(out_dir), *more])
        accuracy.main()
        rows = json.loads((out_dir / "digits" / "fedavg.json").read_text())["rows"]
        assert len(rows) == 1
        return {k: v for k, v in rows[0].items() if k not in ("seconds_per_round", "commit")}

    run = "digits-dirichlet-fedavg-s0"
    assert not checkpointed_versions(tmp_path / "stopped" / run)
    halfway = benchmark(tmp_path / "stopped", tmp_path / "out", extra=("--trainer.max_steps=2",))
    assert halfway["rounds"] == 2
    assert checkpointed_versions(tmp_path / "stopped" / run)
    resumed = benchmark(tmp_path / "stopped", tmp_path / "out", "--resume")
    assert [p.name for p in (tmp_path / "stopped" / run).iterdir()] == ["version_0"]
    fresh = benchmark(tmp_path / "fresh", tmp_path / "out_fresh")
    assert resumed["rounds"] == 4
    assert resumed == fresh


def test_an_accuracy_rows_cli_arguments_train_the_same_row_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import accuracy

    argv = ["accuracy", "--setting", "digits", "--methods", "fedavg", "--splits", "dirichlet"]
    argv += ["--seeds", "1", "--rounds-scale", str(3 / 300), "--log-dir", str(tmp_path / "logs")]
    argv += ["--out-dir", str(tmp_path / "out"), "--extra", *NO_FIGURES]
    argv += ["--model.init_args.local_epochs=2"]
    monkeypatch.setattr(sys, "argv", argv)
    accuracy.main()
    [row] = json.loads((tmp_path / "out" / "digits" / "fedavg.json").read_text())["rows"]
    assert row["cli"][:2] == ["fit", "--config=configs/digits/fedavg.yaml"]
    assert "--model.init_args.seed=1" in row["cli"]
    assert row["cli"][-1] == "--model.init_args.local_epochs=2"
    monkeypatch.chdir(accuracy.REPO)  # the config path is relative to the repository
    again = cli(Path("configs/digits/fedavg.yaml"), tmp_path, *row["cli"][2:])
    assert again["rounds"] == row["rounds"] == 3
    assert again["best_round"] == row["best_round"]
    assert again["test_last"]["acc"] == row["test_acc_last"]
    assert again["test_at_best_val"]["acc"] == row["test_acc_at_best_val"]


def test_accuracy_jobs_run_each_seed_in_its_own_process_to_the_same_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import accuracy

    def benchmark(out_dir: Path, *more: str) -> list[dict]:
        argv = ["accuracy", "--setting", "digits", "--methods", "fedavg", "--splits", "dirichlet"]
        argv += ["--seeds", "0", "1", "--rounds-scale", str(2 / 300), "--out-dir", str(out_dir)]
        monkeypatch.setattr(sys, "argv", [*argv, "--log-dir", str(out_dir / "logs"), *more])
        accuracy.main()
        rows = json.loads((out_dir / "digits" / "fedavg.json").read_text())["rows"]
        return [{k: v for k, v in r.items() if k != "seconds_per_round"} for r in rows]

    one_by_one = ["--model.init_args.vectorize=false", "--model.init_args.client_threads=1"]
    one_by_one += NO_FIGURES
    in_processes = benchmark(tmp_path / "jobs", "--jobs", "2", "--extra", *one_by_one)
    assert [r["seed"] for r in in_processes] == [0, 1]
    assert (tmp_path / "jobs" / "logs" / "digits-dirichlet-fedavg-s1.log").exists()
    assert in_processes == benchmark(tmp_path / "apart", "--seeds-apart", "--extra", *one_by_one)
    # without --jobs the seeds are one job of the CLI (runs.seeds): the same rows
    assert in_processes == benchmark(tmp_path / "together", "--extra", *one_by_one)
    assert (tmp_path / "together" / "logs" / "digits-dirichlet-fedavg" / "seed_1").is_dir()
    # a run that fails is summed up as a stopped one is (the SIGTERM test below)


def test_accuracy_jobs_pass_a_sigterm_on_to_the_runs_which_save_and_resume_to_full_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM to the benchmark alone (a scheduler's ``kill``) must reach the runs, which start
    in their own sessions: each saves after its round and stops, no row is written for it, and
    ``--resume`` finishes both from their checkpoints. The benchmark runs in this process (its
    handlers are restored when it returns), the signal sent to this process alone."""
    from benchmarks import accuracy

    logs = tmp_path / "logs"
    argv = ["accuracy", "--setting", "digits", "--jobs", "2", "--methods", "fedavg"]
    argv += ["--splits", "dirichlet", "--seeds", "0", "1", "--rounds-scale", str(6 / 300)]
    argv += ["--log-dir", str(logs), "--out-dir", str(tmp_path / "out")]
    # each run waits at round 3 until the signal reaches it (tests/holding.py), so neither can
    # finish, or not yet train, when it comes, however slowly the other one starts
    hold = ["--trainer.callbacks+=tests.holding.HoldForSignal", "--trainer.callbacks.at_round=3"]
    cheap_rounds = ["--extra", "--model.init_args.local_steps=2", *hold, *NO_FIGURES]
    names = [accuracy.run_name("digits", "dirichlet", "fedavg", seed) for seed in (0, 1)]
    monkeypatch.chdir(accuracy.REPO)

    def log(name: str) -> str:
        path = logs / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def terminate_once_both_train() -> None:
        deadline = time.monotonic() + 240
        while not all("holding at round 3" in log(name) for name in names):
            if time.monotonic() > deadline:
                return  # unsignalled, the benchmark ends by itself: pytest.raises fails
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=terminate_once_both_train, daemon=True)
    monkeypatch.setattr(sys, "argv", [*argv, *cheap_rounds])
    watcher.start()
    with pytest.raises(SystemExit, match="2 of 2 runs failed or were stopped"):
        accuracy.main()
    watcher.join()
    assert not (tmp_path / "out" / "digits" / "fedavg.json").exists()
    for name in names:
        assert log(name).count("SIGTERM received: stopped after round 4 ") == 1, log(name)
        assert checkpointed_versions(logs / name)

    monkeypatch.setattr(sys, "argv", [*argv, "--resume", *cheap_rounds])
    accuracy.main()
    capsys.readouterr()
    rows = json.loads((tmp_path / "out" / "digits" / "fedavg.json").read_text())["rows"]
    assert [(row["seed"], row["rounds"]) for row in rows] == [(0, 6), (1, 6)]
    for name in names:
        assert log(name).count("resuming from its last.ckpt") == 1
        assert [p.name for p in (logs / name).iterdir()] == ["version_0"]


def test_a_sigterm_to_an_in_process_benchmark_ends_with_the_paragraph_and_status_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --jobs the runs train in the benchmark's own process: the run's RunInterrupted
    reaches the benchmark, which prints the run's paragraph and how to go on (no traceback)
    and exits as the CLI does, 128 + SIGTERM."""
    from benchmarks import accuracy

    logs = tmp_path / "logs"
    argv = ["accuracy", "--setting", "digits", "--methods", "fedavg", "--splits", "dirichlet"]
    argv += ["--rounds-scale", str(6 / 300), "--log-dir", str(logs)]
    argv += ["--out-dir", str(tmp_path / "out"), "--extra", "--model.init_args.local_steps=2"]
    argv += ["--trainer.callbacks+=tests.holding.HoldForSignal", *NO_FIGURES]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(accuracy.REPO)
    monkeypatch.delenv("PFL_DEBUG", raising=False)

    def terminate_once_held() -> None:
        deadline = time.monotonic() + 240
        while "holding at round 3" not in capsys.readouterr().err:
            if time.monotonic() > deadline:
                return  # unsignalled, the benchmark ends by itself: pytest.raises fails
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=terminate_once_held, daemon=True)
    watcher.start()
    with pytest.raises(SystemExit) as stopped:
        accuracy.main()
    watcher.join()
    assert stopped.value.code == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "lightning-pfl: error: SIGTERM received: stopped after round 4 " in err
    assert f"continue with the same command and --resume --log-dir {logs}" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out" / "digits" / "fedavg.json").exists()
    assert checkpointed_versions(logs / accuracy.run_name("digits", "dirichlet", "fedavg", 0))


def test_accuracy_jobs_must_be_at_least_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import accuracy

    monkeypatch.setattr(sys, "argv", ["accuracy", "--setting", "digits", "--jobs", "0"])
    with pytest.raises(SystemExit):
        accuracy.main()
    assert "--jobs 0: runs at once must be 1 or more" in capsys.readouterr().err


def test_accuracy_resume_needs_the_log_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import accuracy

    monkeypatch.setattr(sys, "argv", ["accuracy", "--setting", "digits", "--resume"])
    with pytest.raises(SystemExit):
        accuracy.main()


def test_issue46_rows_runs_only_the_methods_whose_split_lacks_a_seed(tmp_path: Path) -> None:
    """The script reads the committed rows from its working directory: a method is run when a
    seed it needs has no row of that split (rows of another split do not count); FedAMP's
    Dirichlet rows train in a call of their own, with the 100-client alpha and lambda."""
    script = Path(__file__).parents[1] / "benchmarks" / "issue46_rows.sh"
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python"  # runs the script's own Python, records the benchmark commands
    stub.write_text(
        f'#!/bin/sh\nif [ "$1" = -m ]; then echo "$*" >> {calls}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n'
    )
    stub.chmod(0o755)

    def run(resume: str = "0") -> list[list[str]]:
        calls.unlink(missing_ok=True)
        env = {**os.environ, "PYTHON": str(stub), "RESUME": resume}
        subprocess.run(["bash", str(script), "ROOT"], cwd=tmp_path, env=env, check=True)
        return sorted(line.split() for line in calls.read_text().splitlines())

    def methods(command: list[str]) -> list[str]:
        start = command.index("--methods") + 1
        return command[start : command.index("--seeds")]

    def write(setting: str, method: str, split: str, seeds: list[int]) -> None:
        folder = tmp_path / "benchmarks" / "results" / setting
        folder.mkdir(parents=True, exist_ok=True)
        rows = [{"split": split, "seed": seed} for seed in seeds]
        (folder / f"{method}.json").write_text(json.dumps({"rows": rows}))

    def by_kind(commands: list[list[str]]) -> tuple[list[str], list[str], list[list[str]]]:
        """The pathological call, the Dirichlet call and FedAMP's own Dirichlet calls."""
        setting = {c[c.index("--setting") + 1] for c in commands}
        assert setting <= {"fashion_mnist", "fashion_mnist_dirichlet"}
        fedamp = [c for c in commands if methods(c) == ["fedamp"]]
        rest = [c for c in commands if c not in fedamp]
        (pathological,) = [c for c in rest if c[c.index("--setting") + 1] == "fashion_mnist"]
        (dirichlet,) = [c for c in rest if c is not pathological]
        return pathological, dirichlet, fedamp

    pathological, dirichlet, fedamp = by_kind(run())
    every = methods(pathological)
    assert methods(dirichlet) == [m for m in every if m != "fedamp"] and len(every) == 22
    assert "--resume" not in dirichlet
    # FedAMP's config is refused at 100 clients: its Dirichlet rows run with alpha = lam = 0.495
    (fedamp_call,) = fedamp
    assert fedamp_call[-2:] == ["--model.init_args.alpha=0.495", "--model.init_args.lam=0.495"]
    assert "--model.init_args.alpha=0.495" not in dirichlet
    write("fashion_mnist_dirichlet", "fedamp", "dirichlet", [0, 1, 2])
    write("fashion_mnist_dirichlet", "scaffold", "dirichlet", [0, 1, 2])
    write("fashion_mnist_dirichlet", "fedadam", "dirichlet", [0, 1])
    for method in every:
        write("fashion_mnist", method, "pathological", [0, 1, 2])
    write("fashion_mnist", "fedbabu", "pathological", [0])
    write("fashion_mnist", "fedlc", "dirichlet", [1, 2])
    pathological, dirichlet, fedamp = by_kind(run(resume="1"))
    assert fedamp == []
    assert methods(dirichlet) == [m for m in every if m not in ("scaffold", "fedamp")]
    assert methods(pathological) == ["fedbabu", "fedlc"]
    assert pathological[
        pathological.index("--seeds") + 1 : pathological.index("--rounds-scale")
    ] == [
        "1",
        "2",
    ]
    assert "--resume" in dirichlet and "--resume" in pathological


def test_speed_times_a_job_against_a_sample_of_its_runs_timed_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--job 3 --job-alone-sample 1``: one run is timed alone and scaled to the three runs;
    the job trains the three runs' clients of a round as one computation."""
    args = argparse.Namespace(
        device="cpu", job=3, job_rounds=2, job_lrs=None, job_alone_sample=1, job_root=None
    )
    row = speed.job_speed(args, "tests/conf/pfedhn.yaml")
    out = capsys.readouterr().out
    assert out.count("run alone, seed") == 1  # the sample: seed 0 alone, not seeds 1 and 2
    timed = float(out.split("run alone, seed 0: ")[1].split(" s")[0])
    assert row["runs"] == 3 and row["one_after_another_timed_runs"] == 1
    assert abs(row["one_after_another_seconds"] - 3 * timed) <= 3 * 0.05 + 1e-9
    assert row["throughput_ratio"] == row["one_after_another_seconds"] / row["job_seconds"]
    assert (row["jobs_handed_in"], row["computations"]) == (6, 2)
    assert row["trained_apart_because"] == []
