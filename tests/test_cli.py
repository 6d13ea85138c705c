from pathlib import Path

import pytest

from lightning_pfl.errors import ConfigError
from tests.helpers import CONF, assert_resume_is_exact, cli, run_dir

CONFIGS = sorted(CONF.glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_fit_then_test_through_the_cli(config: Path, tmp_path: Path, fake_data_root: str) -> None:
    root = f"--data.init_args.root={fake_data_root}"
    fitted = cli(config, tmp_path, root)
    assert fitted["rounds"] == 4 and fitted["best_round"] in (0, 2, 4)
    for key in ("acc", "acc_weighted", "acc_std", "acc_min", "acc_p10", "loss"):
        assert 0 <= fitted["test_last"][key] < (1.0001 if key.startswith("acc") else 100)
    folder = run_dir(tmp_path, config)
    assert (folder / "partition.json").exists() and (folder / "partition_train.csv").exists()
    last = f"--ckpt_path={folder / 'checkpoints' / 'last.ckpt'}"
    tested = cli(config, tmp_path, root, last, subcommand="test")
    assert tested["subcommand"] == "test"
    assert tested["test_last"]["acc"] == pytest.approx(fitted["test_last"]["acc"])
    assert tested["test_at_best_val"] == fitted["test_at_best_val"]
    if config.stem == "fedsimsup":
        for kind in ("cnn", "vit"):
            assert 0 <= fitted["test_last"][f"supervisor_{kind}/acc"] <= 1


@pytest.mark.parametrize("method", ["fedavg", "pfedhn_pc", "fedsimsup"])
def test_resume_reaches_the_state_of_an_uninterrupted_run(method: str, tmp_path: Path) -> None:
    assert_resume_is_exact(CONF / f"{method}.yaml", tmp_path)


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
