"""Every bad value is refused early, by name, in one paragraph, before any run folder exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_pfl.cli import _user_error, main
from lightning_pfl.errors import ConfigError
from tests.data.fake_datasets import write_mnist
from tests.helpers import CONF

FEDAVG = CONF / "fedavg.yaml"
PFEDHN = CONF / "pfedhn.yaml"
DIRICHLET = "--data.init_args.partition=Dirichlet"

# (config, extra arguments, what the message must contain: the key, or the value at fault)
CASES = [
    (FEDAVG, ["--model.init_args.local_steps=0"], "model.init_args.local_steps"),
    (FEDAVG, ["--model.init_args.local_epochs=0"], "model.init_args.local_epochs"),
    (FEDAVG, ["--model.init_args.local_lr=-0.05"], "model.init_args.local_lr"),
    (FEDAVG, ["--model.init_args.local_lr=nan"], "model.init_args.local_lr"),
    (FEDAVG, ["--model.init_args.batch_size=0"], "model.init_args.batch_size"),
    (FEDAVG, ["--model.init_args.batch_size=-4"], "model.init_args.batch_size"),
    (FEDAVG, ["--model.init_args.seed=-1"], "model.init_args.seed"),
    (FEDAVG, ["--data.init_args.seed=-3"], "data.init_args.seed"),
    (FEDAVG, ["--model.init_args.clients_per_round=0"], "model.init_args.clients_per_round"),
    (FEDAVG, ["--model.init_args.clients_per_round=9"], "model.init_args.clients_per_round"),
    (FEDAVG, ["--model.init_args.local_momentum=1.5"], "model.init_args.local_momentum"),
    (FEDAVG, ["--model.init_args.local_weight_decay=-1e-4"], "model.init_args.local_weight_decay"),
    (FEDAVG, ["--model.init_args.local_max_grad_norm=0"], "model.init_args.local_max_grad_norm"),
    (FEDAVG, ["--model.init_args.eval_batch_size=0"], "model.init_args.eval_batch_size"),
    (FEDAVG, ["--model.init_args.server_lr=0"], "model.init_args.server_lr"),
    (FEDAVG, ["--model.init_args.server_momentum=1.0"], "model.init_args.server_momentum"),
    (FEDAVG, ["--model.init_args.select_metric=loss"], "model.init_args.select_metric"),
    (FEDAVG, ["--model.init_args.net=resnet99"], "model.init_args.net"),
    (FEDAVG, ["--model.init_args.net_args={width: 4, n_kernel: 8}"], "n_kernel"),
    (FEDAVG, ["--model.init_args.clients_per_rnd=3"], "model.init_args.clients_per_rnd"),
    (FEDAVG, ["--model=FedAvgX"], "FedAvgX"),
    (PFEDHN, ["--model.init_args.hn_lr=0"], "model.init_args.hn_lr"),
    (PFEDHN, ["--model.init_args.hn_momentum=-0.5"], "model.init_args.hn_momentum"),
    (PFEDHN, ["--model.init_args.embed_dim=0"], "model.init_args.embed_dim"),
    (PFEDHN, ["--model.init_args.n_hidden=-1"], "model.init_args.n_hidden"),
    (PFEDHN, ["--model.init_args.hn_max_grad_norm=-1"], "model.init_args.hn_max_grad_norm"),
    (PFEDHN, ["--model.init_args.hn_update=sequential"], "model.init_args.hn_update"),
    (PFEDHN, ["--model.init_args.novel_clients=-1"], "model.init_args.novel_clients"),
    (PFEDHN, ["--model.init_args.novel_clients=3"], "model.init_args.novel_clients"),
    (FEDAVG, ["--data.init_args.num_clients=0"], "data.init_args.num_clients"),
    (FEDAVG, ["--data.init_args.val_fraction=1.0"], "data.init_args.val_fraction"),
    (FEDAVG, ["--data.init_args.test_fraction=0"], "data.init_args.test_fraction"),
    (FEDAVG, ["--data.init_args.eval_clients_per_batch=0"], "eval_clients_per_batch"),
    (FEDAVG, ["--data.init_args.dataset=cifar11"], "data.init_args.dataset"),
    (FEDAVG, ["--data.init_args.partition=Foo"], "data.init_args.partition"),
    (FEDAVG, ["--data.init_args.partition.init_args.classes=0"], "partition.init_args.classes"),
    (FEDAVG, ["--data.init_args.partition.init_args.classes=11"], "partition.init_args.classes"),
    (FEDAVG, ["--data.init_args.partition.init_args.low=0"], "partition.init_args.low"),
    (FEDAVG, [DIRICHLET, "--data.init_args.partition.init_args.alpha=0"], "init_args.alpha"),
    (FEDAVG, [DIRICHLET, "--data.init_args.partition.init_args.min_samples=-1"], "min_samples"),
    (FEDAVG, [DIRICHLET, "--data.init_args.partition.init_args.min_samples=900"], "min_samples"),
    (FEDAVG, ["--trainer.max_steps=0"], "trainer.max_steps"),
    (FEDAVG, ["--trainer.max_steps=-1"], "trainer.max_steps"),
    (FEDAVG, ["--trainer.val_check_interval=1000"], "trainer.val_check_interval"),
    (FEDAVG, ["--trainer.val_check_interval=0.5"], "trainer.val_check_interval"),
    (FEDAVG, ["--trainer.check_val_every_n_epoch=1"], "trainer.check_val_every_n_epoch"),
    (FEDAVG, ["--trainer.limit_train_batches=0.5"], "trainer.limit_train_batches"),
    (FEDAVG, ["--trainer.precision=16-mixed"], "trainer.precision"),
    (FEDAVG, ["--trainer.precision=16-true"], "trainer.precision"),
    (FEDAVG, ["--checkpoint.every_n_rounds=-1"], "checkpoint.every_n_rounds"),
    (FEDAVG, ["--checkpoint.every_minutes=0"], "checkpoint.every_minutes"),
    (FEDAVG, ["--checkpoint.every_n_train_steps=5"], "checkpoint.every_n_rounds"),
    (FEDAVG, ["--checkpoint.save_on_exception=true"], "checkpoint.save_on_exception"),
    (FEDAVG, ["--ckpt_path=/nonexistent/last.ckpt"], "--ckpt_path"),
    (FEDAVG, ["--ckpt_path=last"], "--ckpt_path last"),
]


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(args)
    except SystemExit as stop:  # jsonargparse's own parse errors
        code = int(stop.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "extra", "named"), CASES, ids=[" ".join(c[1]).lstrip("-") for c in CASES]
)
def test_bad_value_is_refused_by_name_before_any_folder_exists(
    config: Path, extra: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["fit", f"--config={config}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    code, err = run_cli([*args, *extra], capsys)
    assert code == 2, err
    assert named in err, err
    assert "Traceback" not in err
    assert not list(tmp_path.rglob("version_*")), "a run folder was created"


def test_missing_and_corrupt_dataset_files_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [
        "fit",
        f"--config={FEDAVG}",
        f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
        "--data.init_args.dataset=mnist",
        "--model.init_args.net=mlp",
    ]
    code, err = run_cli([*base, f"--data.init_args.root={tmp_path / 'empty'}"], capsys)
    assert code == 2 and "data.init_args.root" in err and "train-images-idx3-ubyte" in err
    write_mnist(tmp_path / "data")
    images = tmp_path / "data" / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    images.write_bytes(images.read_bytes()[:-7])
    code, err = run_cli([*base, f"--data.init_args.root={tmp_path / 'data'}"], capsys)
    assert code == 2 and str(images) in err and "download it again" in err
    assert "Traceback" not in err
    assert not list(tmp_path.rglob("version_*"))


def test_debug_flag_shows_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PFL_DEBUG", "1")
    with pytest.raises(Exception, match="local_lr") as raised:  # jsonargparse's wrapper
        main(
            [
                "fit",
                f"--config={FEDAVG}",
                f"--trainer.logger.init_args.save_dir={tmp_path}",
                "--model.init_args.local_lr=-1",
            ]
        )
    assert isinstance(_user_error(raised.value), ConfigError)


def test_enough_bad_inputs_are_covered() -> None:
    assert len(CASES) >= 30
