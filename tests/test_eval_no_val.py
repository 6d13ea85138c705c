"""Runs without a validation split (``val_fraction: 0``, FedTP's protocol): the test split is
still evaluated every ``val_check_interval`` rounds; what needs validation is refused."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from lightning_pfl.cli import run
from lightning_pfl.errors import ConfigError
from tests.helpers import CONF, assert_resume_is_exact, cli, run_dir

NO_VAL = "--data.init_args.val_fraction=0"


def test_without_validation_the_test_split_is_evaluated_at_every_evaluation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = CONF / "fedavg.yaml"
    extra = ["--trainer.max_steps=7", "--trainer.val_check_interval=3"]
    result = cli(config, tmp_path, NO_VAL, *extra, "--model.init_args.last_evals=2")
    lines = capsys.readouterr().out.splitlines()

    history = result["eval_history"]
    assert [entry["round"] for entry in history] == [0, 3, 6, 7]  # round 0, every 3, the last
    # the final evaluation is the test split at round 7, as the test after fit measures it
    assert history[-1] == {
        "round": 7,
        **{k: result["test_last"][k] for k in ("acc", "acc_weighted")},
    }
    for key in ("acc", "acc_weighted"):
        tail = [entry[key] for entry in history[-2:]]
        assert result["test_last_evals"][f"{key}_mean"] == pytest.approx(statistics.fmean(tail))
        assert result["test_last_evals"][f"{key}_std"] == pytest.approx(statistics.pstdev(tail))
        assert result["test_max_over_evals"][key] == max(entry[key] for entry in history)
    assert result["test_last_evals"]["rounds"] == [6, 7]
    # nothing was selected by validation
    assert result["select_metric"] is None
    assert result["best_round"] is None and result["test_at_best_val"] is None

    events = EventAccumulator(str(run_dir(tmp_path, config))).Reload()
    for key in ("acc", "acc_weighted"):
        logged = [(e.step, e.value) for e in events.Scalars(f"test_eval/{key}")]
        assert logged == [(e["round"], pytest.approx(e[key])) for e in history]
    assert not [tag for tag in events.Tags()["scalars"] if tag.startswith("val/")]

    spread = result["test_last_evals"]
    row = next(line for line in lines if line.startswith("mean +- std of the last 2 evaluations"))
    assert row.split()[-6:] == [
        f"{spread['acc_mean']:.4f}",
        "+-",
        f"{spread['acc_std']:.4f}",
        f"{spread['acc_weighted_mean']:.4f}",
        "+-",
        f"{spread['acc_weighted_std']:.4f}",
    ]
    assert not [line for line in lines if line.startswith("best val")]  # no such row


@pytest.mark.parametrize(
    ("extra", "subcommand", "message"),
    [
        (
            ["--model.init_args.select_metric=acc_weighted"],
            "fit",
            r"model\.init_args\.select_metric = 'acc_weighted'.*remove select_metric",
        ),
        (["--checkpoint.monitor=val/acc"], "fit", r"checkpoint\.monitor = 'val/acc'"),
        (
            [
                "--trainer.callbacks+=lightning.pytorch.callbacks.EarlyStopping",
                "--trainer.callbacks.monitor=val/acc_weighted",
            ],
            "fit",
            r"trainer\.callbacks EarlyStopping\.monitor = 'val/acc_weighted'",
        ),
        ([], "validate", r"validate evaluates the validation split.*use test"),
    ],
)
def test_what_needs_validation_is_refused_before_any_folder(
    tmp_path: Path, extra: list[str], subcommand: str, message: str
) -> None:
    args = [subcommand, f"--config={CONF / 'fedavg.yaml'}", NO_VAL, *extra]
    with pytest.raises(ConfigError, match=message) as refused:
        run([*args, f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}"])
    assert "data.init_args.val_fraction" in str(refused.value)
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize(
    ("config", "message"),
    [("knn_per.yaml", r"knn_weight is null.*kNN-Per"), ("fedfomo.yaml", r"FedFomo weighs")],
)
def test_methods_reading_validation_refuse_data_without_it_before_any_folder(
    tmp_path: Path, config: str, message: str
) -> None:
    """kNN-Per's per-client lambda and FedFomo's model weights are fitted on the validation
    split: without one, the method refuses the data (``check_data``) before anything exists."""
    args = ["fit", f"--config={CONF / config}", NO_VAL]
    with pytest.raises(ConfigError, match=message) as refused:
        run([*args, f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}"])
    assert "data.init_args.val_fraction" in str(refused.value)
    assert not (tmp_path / "logs").exists()


def test_resume_without_validation_is_exact(tmp_path: Path) -> None:
    config = CONF / "fedtp.yaml"
    assert_resume_is_exact(config, tmp_path, NO_VAL, "--model.init_args.picture_clients=0")
    resumed = json.loads((run_dir(tmp_path / "resumed", config) / "results.json").read_text())
    assert [entry["round"] for entry in resumed["eval_history"]] == [0, 3, 6]
    assert resumed["test_last_evals"]["n"] == 3


def test_mh_pfedhn_trains_without_validation_and_reports_the_best_test_over_rounds(
    tmp_path: Path,
) -> None:
    """MH-pFedHN's paper configs have no validation split (the metric is the best pooled test
    accuracy over rounds): its heterogeneous round, batch-norm recalibration and results work
    without one."""
    config = CONF / "mh_pfedhngd.yaml"
    result = cli(
        config, tmp_path, NO_VAL, "--trainer.max_steps=2", "--trainer.val_check_interval=1"
    )
    history = result["eval_history"]
    assert [entry["round"] for entry in history] == [0, 1, 2]
    best = max(history, key=lambda entry: entry["acc_weighted"])
    assert result["test_max_over_evals"]["acc_weighted"] == best["acc_weighted"]
    assert result["test_max_over_evals"]["round_acc_weighted"] == best["round"]
    assert result["best_round"] is None and result["test_at_best_val"] is None
