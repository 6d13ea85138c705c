"""Every bad value is refused early, by name, in one paragraph, before any run folder exists."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Any

import pytest
from jsonargparse._link_arguments import get_link_actions
from lightning import Trainer

from lightning_pfl.cli import PFLCLI, main, run
from lightning_pfl.config_checks import LINKED_FROM_DATA
from lightning_pfl.errors import ConfigError
from lightning_pfl.messages import user_error
from lightning_pfl.methods.partialfed import PartialFed
from lightning_pfl.trainer_settings import TRAINER_RULES, check_trainer
from lightning_pfl.validation import check_arguments
from tests.conftest import build, digits_data
from tests.data.fake_datasets import write_mnist
from tests.helpers import CONF, cli

FEDAVG = CONF / "fedavg.yaml"
PFEDHN = CONF / "pfedhn.yaml"
DIRICHLET = "--data.init_args.partition=Dirichlet"

# (config, extra arguments, what the message must contain: the key, or the value at fault)
CASES = [
    (FEDAVG, ["--model.init_args.local_steps=0"], "model.init_args.local_steps"),
    (FEDAVG, ["--model.init_args.local_epochs=0"], "model.init_args.local_epochs"),
    # pFedKT's own default E = 10 would silently replace the given steps
    (
        CONF / "pfedkt.yaml",
        ["--model.init_args.local_epochs=10", "--model.init_args.local_steps=7"],
        "model.init_args.local_steps = 7 would be ignored",
    ),
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
    (FEDAVG, ["--trainer.precision=64-true"], "trainer.precision"),
    (FEDAVG, ["--trainer.precision=bf16-true"], "trainer.precision"),
    (FEDAVG, ["--trainer.detect_anomaly=true"], "trainer.detect_anomaly"),
    (FEDAVG, ["--trainer.gradient_clip_val=1.0"], "trainer.gradient_clip_val"),
    (FEDAVG, ["--trainer.limit_val_batches=0.5"], "trainer.limit_val_batches"),
    (FEDAVG, ["--trainer.val_check_interval=00:00:01:00"], "trainer.val_check_interval"),
    (FEDAVG, ["--trainer.strategy=ddp_spawn"], "trainer.strategy"),
    (FEDAVG, ["--trainer.plugins=lightning.pytorch.plugins.AsyncCheckpointIO"], "trainer.plugins"),
    (FEDAVG, ["--trainer.num_nodes=0"], "num_nodes"),  # Lightning's own refusal, in one line
    (FEDAVG, ["--model.init_args.num_clients=5"], "model.init_args.num_clients"),
    (FEDAVG, ["--model.init_args.num_classes=5"], "model.init_args.num_classes"),
    (FEDAVG, ["--model.init_args.input_shape=[1,8,8]"], "model.init_args.input_shape"),
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
    assert isinstance(user_error(raised.value), ConfigError)


def test_enough_bad_inputs_are_covered() -> None:
    assert len(CASES) >= 30


# One row per argument of lightning.Trainer: a value that works in a federated run, and one
# that is refused (None: every value Lightning accepts works). The refusals of a representative
# few run end to end in CASES; the rest are checked against the validator here.
DDP = "lightning.pytorch.strategies.DDPStrategy"
TRAINER_TABLE: dict[str, tuple[Any, Any]] = {
    "accelerator": ("cpu", None),
    "strategy": ("ddp", "fsdp"),
    "devices": (2, None),
    "num_nodes": (2, None),
    "precision": ("bf16-mixed", "bf16-true"),
    "logger": (False, None),
    "callbacks": ([], None),
    "fast_dev_run": (False, True),
    "max_epochs": (None, 1),
    "min_epochs": (None, 1),
    "max_steps": (10, 0),
    "min_steps": (None, 2),
    "max_time": ("00:01:00:00", None),
    "limit_train_batches": (1.0, 0.5),
    "limit_val_batches": (0, 3),
    "limit_test_batches": (1.0, 0),
    "limit_predict_batches": (None, 0.5),
    "overfit_batches": (0.0, 1),
    "val_check_interval": (5, 5.0),
    "check_val_every_n_epoch": (None, 1),
    "num_sanity_val_steps": (2, None),
    "log_every_n_steps": (1, 50),
    "enable_checkpointing": (True, False),
    "enable_progress_bar": (False, None),
    "enable_model_summary": (True, None),
    "accumulate_grad_batches": (1, 2),
    "gradient_clip_val": (None, 0.5),
    "gradient_clip_algorithm": (None, "norm"),
    "deterministic": (True, None),
    "benchmark": (True, None),
    "inference_mode": (False, True),
    "use_distributed_sampler": (True, False),
    "profiler": ("simple", None),
    "detect_anomaly": (False, True),
    "barebones": (False, True),
    "plugins": (
        {"class_path": "lightning.fabric.plugins.environments.SLURMEnvironment"},
        {"class_path": "lightning.pytorch.plugins.precision.MixedPrecision"},
    ),
    "sync_batchnorm": (False, True),
    "reload_dataloaders_every_n_epochs": (0, 1),
    "default_root_dir": ("runs", None),
    "enable_autolog_hparams": (False, None),
    "model_registry": (None, "my-model"),
}
VALID_TRAINER = {"max_steps": 10, "val_check_interval": 5, "check_val_every_n_epoch": None}


def test_every_trainer_argument_has_a_row_and_a_rule() -> None:
    arguments = set(inspect.signature(Trainer.__init__).parameters) - {"self"}
    assert set(TRAINER_TABLE) == arguments
    assert set(TRAINER_RULES) == arguments


@pytest.mark.parametrize("name", sorted(TRAINER_TABLE))
def test_trainer_argument_works_or_is_refused_by_name(name: str) -> None:
    works, refused = TRAINER_TABLE[name]
    check_trainer({**VALID_TRAINER, name: works}, "fit")
    if refused is not None:
        with pytest.raises(ConfigError, match=rf"trainer\.{name} = "):
            check_trainer({**VALID_TRAINER, name: refused}, "fit")


@pytest.mark.parametrize(
    ("strategy", "allowed"),
    [
        ("auto", True),
        ("ddp_find_unused_parameters_true", True),
        ("ddp_fork", False),
        ("ddp_notebook", False),
        ("deepspeed", False),
        ("xla", False),
        ({"class_path": DDP, "init_args": {"start_method": "popen"}}, True),
        ({"class_path": DDP, "init_args": {"start_method": "spawn"}}, False),
        ({"class_path": "lightning.pytorch.strategies.FSDPStrategy"}, False),
    ],
)
def test_strategies(strategy: Any, allowed: bool) -> None:
    if allowed:
        check_trainer({**VALID_TRAINER, "strategy": strategy}, "fit")
    else:
        with pytest.raises(ConfigError, match=r"trainer\.strategy = "):
            check_trainer({**VALID_TRAINER, "strategy": strategy}, "fit")


def test_every_precision_lightning_accepts_works_or_is_refused() -> None:
    accepted = {
        value
        for literal in typing.get_args(
            inspect.signature(Trainer.__init__).parameters["precision"].annotation
        )
        for value in (typing.get_args(literal) or [None])
    }
    supported = {None, 32, "32", "32-true", "bf16", "bf16-mixed"}
    assert supported < accepted
    for precision in accepted:
        if precision in supported:
            check_trainer({**VALID_TRAINER, "precision": precision}, "test")
        else:
            with pytest.raises(ConfigError, match=r"trainer\.precision = .*'bf16-mixed'"):
                check_trainer({**VALID_TRAINER, "precision": precision}, "test")


def test_every_link_target_is_refused_in_the_model_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The links jsonargparse applies are exactly those the CLI refuses in the model section
    (each refusal runs end to end in CASES)."""
    targets: list[str] = []

    def record_links(cli: PFLCLI) -> None:
        links = get_link_actions(cli._parser(cli.subcommand), "instantiate")
        targets.extend(link.target[0] for link in links)
        raise SystemExit(0)

    monkeypatch.setattr(PFLCLI, "before_instantiate_classes", record_links)
    with pytest.raises(SystemExit):
        run(["fit", f"--config={FEDAVG}"])
    assert sorted(targets) == sorted(f"model.init_args.{name}" for name in LINKED_FROM_DATA)


def test_supported_trainer_flags_run_and_change_no_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--test_after_fit=false", "--trainer.val_check_interval=null"]
    plain = cli(FEDAVG, tmp_path / "plain", *common)
    flagged = cli(
        FEDAVG,
        tmp_path / "flagged",
        *common,
        "--trainer.num_sanity_val_steps=2",
        "--trainer.max_time=00:01:00:00",
        "--trainer.profiler=simple",
        "--trainer.inference_mode=false",
        "--trainer.deterministic=true",
        "--trainer.enable_model_summary=true",
        "--trainer.enable_autolog_hparams=false",
        "--trainer.plugins=lightning.fabric.plugins.environments.LightningEnvironment",
    )
    for key in ("rounds", "best_round", "val_last", "eval_history", "comm_bytes_up_total"):
        assert flagged[key] == plain[key], key
    assert [entry["round"] for entry in plain["eval_history"]] == [0, 4]  # interval null
    capsys.readouterr()
    root = f"--trainer.default_root_dir={tmp_path / 'no_logger'}"  # its checkpoint goes there
    code = main(
        ["fit", f"--config={FEDAVG}", "--trainer.logger=false", "--trainer.max_steps=2", root]
    )
    out = capsys.readouterr().out
    assert code == 0 and "results: not written (trainer.logger is off)" in out
    assert "last round 2" in out
    assert (tmp_path / "no_logger" / "checkpoints" / "last.ckpt").exists()


def test_a_choice_outside_its_literal_is_refused_in_python_too() -> None:
    """``check_arguments`` refuses a value outside an argument's ``Literal[...]`` (through
    Optional) for a class built in Python, where jsonargparse does not check it, and accepts
    every listed choice and None."""

    class Owner:
        def __init__(
            self,
            mode: typing.Literal["a", "b"] = "a",
            maybe: typing.Literal["x"] | None = None,
            loose: typing.Literal["auto"] | int = "auto",
        ) -> None:
            pass

    check_arguments(Owner, {"mode": "b", "maybe": None, "loose": 3}, "model")
    with pytest.raises(ConfigError, match=r"model.init_args.mode = 'c' must be one of a, b"):
        check_arguments(Owner, {"mode": "c"}, "model")
    with pytest.raises(ConfigError, match=r"model.init_args.maybe = 'y' must be one of x"):
        check_arguments(Owner, {"maybe": "y"}, "model")
    with pytest.raises(ConfigError, match="model.init_args.decision = 'always'"):
        build(PartialFed, digits_data(4), decision="always")
