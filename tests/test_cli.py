import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Trainer
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_pfl.cli import PFLCLI
from lightning_pfl.console import result_lines
from lightning_pfl.errors import ConfigError
from lightning_pfl.experiment import LAST_CHECKPOINT
from tests.helpers import CONF, assert_resume_is_exact, cli, cli_run, results_of, run_dir

CONFIGS = sorted(CONF.glob("*.yaml"))


# Configs whose checkpoint the CLI's own ``test --ckpt_path`` reads back (one of each kind: a
# global model, a hypernetwork, client groups, a model zoo, transformers, novel clients); every
# other config's checkpoint is read back in-process by the same Trainer.test the CLI calls.
TESTED_BY_THE_CLI = {"fedavg", "pfedhn", "fedsimsup", "mh_pfedhn", "fedtp", "pfedhn_novel"}


def read_back(fitted: PFLCLI) -> dict[str, Any]:
    """``test --ckpt_path last.ckpt`` without a second CLI: a fresh method built from the run's
    hyperparameters, the checkpoint restored by the Trainer.test the CLI calls."""
    hparams = {k: v for k, v in fitted.model.hparams.items() if not k.startswith("_")}
    method = type(fitted.model)(**hparams)  # jsonargparse adds _class_path
    log_dir = Path(str(fitted.trainer.log_dir))
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
    with warnings.catch_warnings():  # the fit's callbacks have nothing to restore for a test
        warnings.filterwarnings("ignore", "Be aware that when using `ckpt_path`")
        trainer.test(method, datamodule=fitted.datamodule, ckpt_path=log_dir / LAST_CHECKPOINT)
    return json.loads(json.dumps(method.results()))  # type: ignore[no-any-return]  # as read


# Configs whose method's resume test is its CLI test here: the fit runs 6 rounds in one go and
# is compared with its round-3 checkpoint resumed (tests/helpers.py assert_resume_is_exact).
# Resume tests with other settings stay in the method's test file.
RESUMED = {
    "apple", "ccvr", "fedakt", "fedala", "fedamp", "fedas", "fedbabu", "fedbn", "fedcp",
    "feddyn", "fedem", "fedfomo", "fedgen", "fedgh", "fedlc", "fedmgda_plus", "fednova",
    "fedopt", "fedpac", "fedphp", "fedproto", "fedrod", "fedu", "floco", "fml", "gpfl",
    "heterogeneous_local", "mapper", "mh_pfedhngd", "moon", "partialfed", "pefll", "pfedgp",
    "pfedkt", "pfedla", "pfedlhn", "pfedme", "power_of_choice", "qffl", "scaffold", "fedtp_rod",
}  # fmt: skip


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_fit_then_test_through_the_cli(config: Path, tmp_path: Path, fake_data_root: str) -> None:
    root = f"--data.init_args.root={fake_data_root}"
    if config.stem in RESUMED:
        instance = assert_resume_is_exact(config, tmp_path, root, tested=True)
        save_dir, rounds, evaluated = tmp_path / "straight", 6, (0, 3, 6)
    else:
        instance = cli_run(config, tmp_path, root)
        save_dir, rounds, evaluated = tmp_path, 4, (0, 2, 4)
    fitted = results_of(instance)
    assert fitted["rounds"] == rounds and fitted["best_round"] in evaluated
    for key in ("acc", "acc_weighted", "acc_std", "acc_min", "acc_p10", "loss"):
        assert 0 <= fitted["test_last"][key] < (1.0001 if key.startswith("acc") else 100)
    folder = run_dir(save_dir, config)
    assert (folder / "partition.json").exists() and (folder / "partition_train.csv").exists()
    if config.stem in TESTED_BY_THE_CLI:
        last = f"--ckpt_path={folder / 'checkpoints' / 'last.ckpt'}"
        tested = cli(config, save_dir, root, last, subcommand="test")
        assert tested["subcommand"] == "test"
    else:
        tested = read_back(instance)
    assert tested["test_last"]["acc"] == pytest.approx(fitted["test_last"]["acc"])
    assert tested["test_at_best_val"] == fitted["test_at_best_val"]
    if config.stem == "fedsimsup":
        for kind in ("cnn", "vit"):
            assert 0 <= fitted["test_last"][f"supervisor_{kind}/acc"] <= 1


@pytest.mark.parametrize("figures", [True, False])
def test_figures_reach_tensorboard_unless_switched_off(figures: bool, tmp_path: Path) -> None:
    config = CONF / "fedavg.yaml"
    cli(config, tmp_path, figures=figures)
    folder = run_dir(tmp_path, config)
    tags = EventAccumulator(str(folder), size_guidance={"images": 0}).Reload().Tags()
    drawn = {"partition/train_counts", "partition/test_counts", "val/client_acc_sorted"}
    assert drawn <= set(tags["images"]) if figures else not set(tags["images"])
    assert "val/client_acc" in tags["histograms"] and "val/acc" in tags["scalars"]
    assert (folder / "partition.json").exists() and (folder / "partition_train.csv").exists()


@pytest.mark.parametrize("method", ["fedavg", "pfedhn_pc", "fedsimsup"])
def test_resume_reaches_the_state_of_an_uninterrupted_run(method: str, tmp_path: Path) -> None:
    """Stopped by ``max_steps`` and continued (every method's resume test resumes from a
    checkpoint of a run that went on)."""
    assert_resume_is_exact(CONF / f"{method}.yaml", tmp_path, stopped=True)


def test_resume_without_a_checkpoint_says_so(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no checkpoints/last.ckpt"):
        cli(CONFIGS[0], tmp_path, "--ckpt_path=last")


def test_unknown_config_key_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli(CONFIGS[0], tmp_path, "--model.init_args.clients_per_rnd=3")
    assert "clients_per_rnd" in capsys.readouterr().err


def test_fp16_is_refused_and_bf16_runs(tmp_path: Path) -> None:
    config = CONF / "pfedhn.yaml"
    with pytest.raises(ValueError, match="bf16-mixed"):
        cli(config, tmp_path, "--trainer.precision=16-true")
    result = cli(config, tmp_path, "--trainer.precision=bf16-mixed")
    assert result["test_last"]["acc"] >= 0


def test_nan_loss_stops_with_a_message(tmp_path: Path) -> None:
    config = CONF / "fedavg.yaml"
    with pytest.raises(FloatingPointError, match="lower model.init_args.local_lr") as stopped:
        cli(
            config,
            tmp_path,
            "--model.init_args.local_lr=1e12",
            "--model.init_args.local_max_grad_norm=null",
        )
    assert "No checkpoint was saved before this round" in str(stopped.value)


def test_nan_loss_keeps_the_last_checkpoint_and_says_how_to_continue(tmp_path: Path) -> None:
    config = CONF / "fedavg.yaml"
    cli(config, tmp_path, "--trainer.max_steps=4", "--test_after_fit=false")
    ckpt = run_dir(tmp_path, config) / "checkpoints" / "last.ckpt"
    saved = ckpt.read_bytes()
    diverging = ["--model.init_args.local_lr=1e12", "--model.init_args.local_max_grad_norm=null"]
    allow = "--allow_changes=[model.init_args.local_lr,model.init_args.local_max_grad_norm]"
    with pytest.raises(FloatingPointError, match="round 4") as stopped:
        cli(config, tmp_path, "--trainer.max_steps=8", "--ckpt_path=last", *diverging, allow)
    assert f"The last checkpoint, {ckpt} (after round 4), is intact" in str(stopped.value)
    assert ckpt.read_bytes() == saved
    resumed = cli(config, tmp_path, "--trainer.max_steps=8", f"--ckpt_path={ckpt}", allow)
    assert resumed["rounds"] == 8


def test_impossible_split_fails_early(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only 10 classes"):
        cli(CONFIGS[0], tmp_path, "--data.init_args.partition.init_args.classes=11")


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_fit_ends_with_its_result_and_no_third_party_noise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = CONF / "fedavg.yaml"
    catcher = Records()
    logging.getLogger("lightning.pytorch").addHandler(catcher)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fitted = cli(config, tmp_path)
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(catcher)
    lines = capsys.readouterr().out.splitlines()
    folder = run_dir(tmp_path, config)
    best, last = fitted["test_at_best_val"], fitted["test_last"]
    assert lines[-5].split() == ["FedAvg", "test", "accuracy", "mean", "over", "clients", "pooled"]
    assert lines[-4].split() == [
        "best",
        "val/acc",
        "round",
        str(fitted["best_round"]),
        f"{best['acc']:.4f}",
        f"{best['acc_weighted']:.4f}",
    ]
    assert lines[-3].split() == [
        "last",
        "round",
        "4",
        f"{last['acc']:.4f}",
        f"{last['acc_weighted']:.4f}",
    ]
    assert lines[-2] == f"results: {folder / 'results.json'}"
    assert lines[-1] == f"TensorBoard: tensorboard --logdir {folder}"
    messages = [r.getMessage() for r in catcher.records]
    assert any("GPU available" in m for m in messages)  # Lightning's own lines still come
    assert not [m for m in messages if "litlogger" in m or "litmodels" in m]
    assert not [w for w in caught if "LeafSpec" in str(w.message)]


def test_result_lines_say_what_was_not_evaluated() -> None:
    results = {
        "method": "FedAvg",
        "subcommand": "fit",
        "rounds": 7,
        "select_metric": "acc_weighted",
        "best_round": 5,
        "test_at_best_val": {"acc": 0.5, "acc_weighted": 0.25},
        "test_last": None,
    }
    lines = result_lines(results, "run/results.json", None)
    assert lines[1].split() == ["best", "val/acc_weighted", "round", "5", "0.5000", "0.2500"]
    assert lines[2].split()[:3] == ["last", "round", "7"]
    assert "--test_after_fit false" in lines[2]
    assert lines[-1] == "results: run/results.json"  # no TensorBoard logger: no such line
    unvalidated = {**results, "best_round": None, "test_at_best_val": None}
    assert "no validation ran" in result_lines(unvalidated, "r.json", None)[1]
    tested = {**results, "subcommand": "test", "test_last": {"acc": 1.0, "acc_weighted": 1.0}}
    assert result_lines(tested, "r.json", None)[2].split()[:4] == [
        "checkpoint's",
        "round",
        "7",
        "1.0000",
    ]
