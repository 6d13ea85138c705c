"""Runs that survive interruption, cannot mix experiments, and log what a researcher expects."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_pfl.cli import run
from lightning_pfl.errors import ConfigError
from lightning_pfl.run_names import config_path_name
from tests.helpers import CONF, cli, run_dir

ROOT = Path(__file__).parents[1]
FEDAVG = CONF / "fedavg.yaml"
LONG = [
    "--trainer.max_steps=12",
    "--trainer.val_check_interval=5",
    "--checkpoint.every_n_rounds=3",
    "--model.init_args.local_steps=6",
    "--trainer.enable_progress_bar=false",
    "--model.init_args.log_figures=false",
]
# the started run waits before round 8 until the signal has reached it (tests/holding.py)
HOLD = ["--trainer.callbacks+=tests.holding.HoldForSignal", "--trainer.callbacks.at_round=7"]
TIMING_KEYS = {"seconds_per_round", "config", "subcommand"}


def start(save_dir: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, str(ROOT / "cli.py"), "fit", f"--config={FEDAVG}", *LONG]
    command += [f"--trainer.logger.init_args.save_dir={save_dir}", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        command, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = process.communicate(timeout=300)
    return process.returncode, err


def results(save_dir: Path) -> dict[str, Any]:
    found = json.loads((run_dir(save_dir, FEDAVG) / "results.json").read_text())
    return {k: v for k, v in found.items() if k not in TIMING_KEYS}


def wait_until_held(process: subprocess.Popen[str]) -> None:
    """Read the run's stderr until it holds (:class:`tests.holding.HoldForSignal`)."""
    assert process.stderr is not None
    for line in process.stderr:
        if line.startswith("holding at round"):
            return
    raise AssertionError("the run ended before it held")


def test_a_run_stopped_by_ctrl_c_resumes_to_the_results_of_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    """SIGINT finishes the round, saves at the boundary and says how to resume; the resumed run
    ends where an uninterrupted one ends. SIGTERM takes the same handler (RoundCheckpoint's
    STOP_SIGNALS): tests/test_jobs.py sends it to a job, tests/test_benchmarks.py to runs in
    their own sessions. A crash (SIGKILL) resumes from a periodic checkpoint: tests/test_jobs.py
    kills a job, and every method's resume test (tests/helpers.py assert_resume_is_exact)
    resumes from one."""
    process = start(tmp_path / "stopped", *HOLD)
    wait_until_held(process)  # after the checkpoints of rounds 3 and 6
    process.send_signal(signal.SIGINT)
    code, err = finish(process)
    assert code == 128 + signal.SIGINT, err[-2000:]
    assert "--ckpt_path last" in err and "Traceback" not in err
    assert "stopped after round 8 " in err  # the round under way when the signal came
    last = run_dir(tmp_path / "stopped", FEDAVG) / "checkpoints" / "last.ckpt"
    assert torch.load(last)["pfl"]["round"] == 8
    assert last.exists() and not last.with_name("last.ckpt.tmp").exists()
    # the resumed and the uninterrupted run in this process (the CLI's code, one start each less)
    cli(FEDAVG, tmp_path / "stopped", *LONG, "--ckpt_path=last")
    cli(FEDAVG, tmp_path / "straight", *LONG)
    assert results(tmp_path / "stopped") == results(tmp_path / "straight")


def test_a_crash_while_saving_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cli(FEDAVG, tmp_path, "--trainer.max_steps=4", "--test_after_fit=false")
    last = run_dir(tmp_path, FEDAVG) / "checkpoints" / "last.ckpt"
    before = last.read_bytes()

    def crash(self: Any, filepath: str, weights_only: bool = False) -> None:
        Path(filepath).write_bytes(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr("lightning.pytorch.Trainer.save_checkpoint", crash)
    with pytest.raises(OSError, match="disk full"):
        cli(FEDAVG, tmp_path, "--trainer.max_steps=8", "--ckpt_path=last", "--test_after_fit=false")
    assert last.read_bytes() == before
    assert torch.load(last)["pfl"]["round"] == 4


def test_resume_refuses_a_checkpoint_of_another_experiment(tmp_path: Path) -> None:
    cli(CONF / "pfedhn.yaml", tmp_path, "--test_after_fit=false")
    ckpt = run_dir(tmp_path, CONF / "pfedhn.yaml") / "checkpoints" / "last.ckpt"
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError, match="model.class_path") as refused:
        cli(FEDAVG, tmp_path, f"--ckpt_path={ckpt}")
    assert "PFedHN" in str(refused.value) and "FedAvg" in str(refused.value)
    with pytest.raises(ConfigError, match="model.init_args.local_lr"):
        cli(CONF / "pfedhn.yaml", tmp_path, f"--ckpt_path={ckpt}", "--model.init_args.local_lr=0.1")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    allowed = cli(
        CONF / "pfedhn.yaml",
        tmp_path,
        f"--ckpt_path={ckpt}",
        "--model.init_args.local_lr=0.1",
        "--allow_changes=[model.init_args.local_lr]",
        "--trainer.max_steps=6",
        "--test_after_fit=false",
    )
    assert allowed["rounds"] == 6


def test_last_resumes_only_a_run_of_the_same_experiment(tmp_path: Path) -> None:
    cli(FEDAVG, tmp_path, "--test_after_fit=false")
    with pytest.raises(ConfigError, match="model.init_args.local_steps"):
        cli(FEDAVG, tmp_path, "--ckpt_path=last", "--model.init_args.local_steps=3")


def test_configs_with_the_same_file_name_get_different_run_folders() -> None:
    a = config_path_name([ROOT / "configs" / "digits" / "pfedhn.yaml"])
    b = config_path_name([ROOT / "configs" / "fashion_mnist" / "pfedhn.yaml"])
    assert (a, b) == ("digits/pfedhn", "fashion_mnist/pfedhn")


def test_testing_a_checkpoint_reports_its_round(tmp_path: Path) -> None:
    cli(FEDAVG, tmp_path, "--trainer.max_steps=3", "--trainer.val_check_interval=3")
    ckpt = run_dir(tmp_path, FEDAVG) / "checkpoints" / "last.ckpt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tested = cli(FEDAVG, tmp_path, f"--ckpt_path={ckpt}", subcommand="test")
    assert tested["rounds"] == 3 and tested["test_last"]["round"] == 3
    assert not [w for w in caught if "dirpath has changed" in str(w.message)]


def events(folder: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(folder), size_guidance={"histograms": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def test_validation_before_training_after_the_final_round_and_at_round_steps(
    tmp_path: Path,
) -> None:
    result = cli(
        FEDAVG, tmp_path, "--trainer.max_steps=5", "--trainer.val_check_interval=2", figures=True
    )
    assert result["val_last"]["round"] == 5 and result["stopped_by"] == "max_steps"
    logged = events(run_dir(tmp_path, FEDAVG))
    assert [e.step for e in logged.Scalars("val/acc")] == [0, 2, 4, 5]
    assert [e.step for e in logged.Scalars("train/loss")] == [1, 2, 3, 4, 5]
    assert [e.step for e in logged.Histograms("val/client_acc")] == [0, 2, 4, 5]
    assert [e.step for e in logged.Images("val/client_acc_sorted")] == [0, 2, 4, 5]
    assert [e.step for e in logged.Scalars("test/acc")] == [5]


def test_hparams_tab_has_method_data_and_split_and_best_accuracy_metric(tmp_path: Path) -> None:
    cli(FEDAVG, tmp_path, "--trainer.max_steps=2", "--trainer.val_check_interval=2")
    from tensorboard.plugins.hparams import plugin_data_pb2

    logged = events(run_dir(tmp_path, FEDAVG))
    assert "hp_metric" not in logged.Tags()["scalars"]
    content = logged.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/experiment"]
    ).experiment
    names = {h.name for h in experiment.hparam_infos}
    assert {"method", "model/local_lr", "data/dataset", "data/partition"} <= names
    assert "data/partition.classes" in names and not any("instantiator" in n for n in names)
    assert [m.name.tag for m in experiment.metric_infos] == ["val/best_acc"]


def test_default_root_dir_is_honored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    instance = run(
        [
            "fit",
            f"--config={FEDAVG}",
            f"--trainer.default_root_dir={tmp_path / 'root'}",
            "--trainer.enable_progress_bar=false",
            "--test_after_fit=false",
        ]
    )
    expected = tmp_path / "root" / "logs" / "conf" / "fedavg" / "version_0"
    assert Path(instance.trainer.log_dir) == expected
    assert (expected / "results.json").exists() and not (tmp_path / "logs").exists()


def test_a_run_without_a_logger_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    from lightning_pfl.methods import FedAvg
    from tests.conftest import build, digits_data, fit

    dm = digits_data(4)
    fit(build(FedAvg, dm, clients_per_round=2), dm, rounds=2)
    assert list(tmp_path.iterdir()) == []


def test_without_the_progress_bar_each_validation_prints_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO"):
        cli(FEDAVG, tmp_path, "--trainer.max_steps=4", "--trainer.val_check_interval=2")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("round ")]
    assert [line.split(":")[0] for line in lines] == ["round 0/4", "round 2/4", "round 4/4"]
    assert all("val acc" in line and "weighted" in line for line in lines)


def test_print_config_shows_the_run_name_and_predict_is_not_offered(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        run(["fit", f"--config={FEDAVG}", "--print_config"])
    assert "name: conf/fedavg" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run(["predict", f"--config={FEDAVG}"])
    assert "invalid choice" in capsys.readouterr().err


def test_benchmark_rounds_and_validation_interval_scale_together(tmp_path: Path) -> None:
    from benchmarks.accuracy import scaled_trainer_args

    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  max_steps: 300\n  val_check_interval: 25\n")
    assert scaled_trainer_args(config, 0.05) == [
        "--trainer.max_steps=15",
        "--trainer.val_check_interval=1",
    ]
    assert shutil.which("git")  # benchmarks record the commit


def test_a_rounds_loss_is_read_a_round_later_and_before_anything_uses_its_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host waits for round r's losses only once round r + 1's local training is queued
    (so it prepares a round while the device still trains the last), and for the last
    round's before a checkpoint, a validation or the end of fit uses the state it left."""
    from lightning import Trainer

    from lightning_pfl.methods import FedAvg
    from lightning_pfl.run_record import PendingLoss
    from tests.conftest import build, digits_data

    dm = digits_data(6)
    method = build(FedAvg, dm, clients_per_round=3)
    order: list[tuple[str, int]] = []
    run_round, read = method.run_round, PendingLoss.read

    def training(round_idx: int, clients: torch.Tensor) -> torch.Tensor:
        order.append(("train", round_idx))
        return run_round(round_idx, clients)

    def reading(pending: PendingLoss) -> float:
        order.append(("read", pending.round_idx))
        return read(pending)

    def saving(checkpoint: dict[str, Any], save: Any = method.on_save_checkpoint) -> None:
        save(checkpoint)
        order.append(("save", method.global_step))

    method.run_round = training  # type: ignore[method-assign]
    method.on_save_checkpoint = saving  # type: ignore[method-assign]
    monkeypatch.setattr(PendingLoss, "read", reading)
    trainer = Trainer(
        max_steps=4,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    trainer.fit(method, datamodule=dm)
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    assert order == [
        ("train", 0),
        ("train", 1),
        ("read", 0),
        ("train", 2),
        ("read", 1),
        ("train", 3),
        ("read", 2),
        ("read", 3),  # the end of fit
        ("save", 4),
    ]
    assert method.record.pending_loss is None


def test_a_non_finite_round_is_never_saved(tmp_path: Path) -> None:
    # checkpoints after every round and no validation: the checkpoint is what reads the loss
    every_round = ["--checkpoint.every_n_rounds=1", "--trainer.limit_val_batches=0"]
    cli(FEDAVG, tmp_path, "--trainer.max_steps=2", *every_round, "--test_after_fit=false")
    ckpt = run_dir(tmp_path, FEDAVG) / "checkpoints" / "last.ckpt"
    saved = ckpt.read_bytes()
    diverging = ["--model.init_args.local_lr=1e12", "--model.init_args.local_max_grad_norm=null"]
    allow = "--allow_changes=[model.init_args.local_lr,model.init_args.local_max_grad_norm]"
    with pytest.raises(FloatingPointError, match="round 2 for clients") as stopped:
        cli(
            FEDAVG,
            tmp_path,
            "--trainer.max_steps=4",
            *every_round,
            "--ckpt_path=last",
            *diverging,
            allow,
        )
    assert f"The last checkpoint, {ckpt} (after round 2), is intact" in str(stopped.value)
    assert ckpt.read_bytes() == saved
