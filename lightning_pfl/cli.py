"""The command line: ``lightning-pfl fit|validate|test --config configs/....yaml``.

LightningCLI in subclass mode for methods and DataModules; the number of clients, classes and
the input shape flow from the DataModule to the method. Before anything is written, every
argument is range-checked, the trainer settings are checked, the data is loaded and split, and
a checkpoint to resume from is checked against the config; only then is the run folder
created. ``fit`` also evaluates the test split at the end (``--test_after_fit false`` to skip)
and every run writes ``results.json`` into its log directory.

Errors that are the user's to fix print one paragraph and exit with status 2 (set
``PFL_DEBUG=1`` for the traceback); a run stopped by SIGINT/SIGTERM saves ``last.ckpt`` and
exits with 130/143.
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_pfl.methods as methods_module
from lightning_pfl import partition as partition_module
from lightning_pfl.callbacks import RoundCheckpoint
from lightning_pfl.console import quiet_third_party, result_lines
from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.errors import ConfigError, PFLError
from lightning_pfl.jobs import Job, Runs, RunSpec, expand
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.papers import describe_record, paper_record
from lightning_pfl.trainer_settings import check_trainer

DEFAULT_LOGS = "logs"
TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 100,
    "val_check_interval": 10,
    "check_val_every_n_epoch": None,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        # A relative save_dir is relative to trainer.default_root_dir (default: the current
        # directory); name null: the config file's path under configs/ (see _config_path_name).
        "init_args": {"save_dir": DEFAULT_LOGS, "name": None, "default_hp_metric": False},
    },
}
# Arguments that change speed or placement but not the math: they may differ on resume.
RUNTIME_KEYS = {
    "model.init_args.vectorize",
    "model.init_args.compile_step",
    "model.init_args.cuda_graphs",
    "model.init_args.client_threads",
    "model.init_args.eval_batch_size",
    "model.init_args.last_evals",
    "model.init_args.offload_client_state",
    "data.init_args.root",
    "data.init_args.download",
    "data.init_args.eval_clients_per_batch",
}
EXPERIMENT_FILE = "experiment.json"
# What the DataModule knows and the method is told (jsonargparse links, applied on
# instantiation), with where to set it instead.
LINKED_FROM_DATA = {
    "num_clients": "set data.init_args.num_clients instead",
    "num_classes": "the dataset (data.init_args.dataset) gives it",
    "input_shape": "the dataset (data.init_args.dataset) gives it",
}


def _partitioners() -> list[str]:
    return [
        name
        for name, value in vars(partition_module).items()
        if isinstance(value, type)
        and issubclass(value, partition_module.Partitioner)
        and value is not partition_module.Partitioner
    ]


def _short_error(message: str) -> str:
    """jsonargparse's nested report reduced to the config key and what is wrong with it."""
    keys = re.findall(r'Parser key "([\w.]+)"', message)
    path = ".init_args.".join(keys)
    unknown_option = re.search(r"Option '([\w.]+)' is not accepted", message)
    if unknown_option:
        return f"unknown option {path}.init_args.{unknown_option.group(1)} (see --help)."
    bad_class = re.search(
        r"Expected a dot import path string: (\S+)|Import path (\S+) does not correspond", message
    )
    if bad_class:
        value = bad_class.group(1) or bad_class.group(2)
        choices = {
            "model": [c for c in methods_module.__all__ if c != "FederatedMethod"],
            "data": ["FederatedDataModule"],
            "data.init_args.partition": _partitioners(),
        }.get(path)
        listed = f" Choose one of: {', '.join(sorted(choices))}" if choices else ""
        return (
            f"unknown class_path '{value}' for {path}.{listed} (or the full import path of "
            "your own subclass)."
        )
    wrong_type = [
        m
        for m in re.finditer(r"Expected an? ([^\n]+?)\. Got value: ([^\n]+)", message)
        if "NoneType" not in m.group(1)
    ]
    if wrong_type:
        return f"{path}: expected {wrong_type[0].group(1)}, got {wrong_type[0].group(2)}."
    return message


class PFLArgumentParser(LightningArgumentParser):
    """Short errors: a one-line usage and the config key with what is wrong with it."""

    def print_usage(self, file: Any = None) -> None:
        (file or sys.stdout).write(
            "usage: lightning-pfl {fit,validate,test} --config CONFIG [--section.key VALUE ...]\n"
        )

    rewrites_errors = False  # set on the CLI's own parsers, not jsonargparse's nested ones

    def error(self, message: str, ex: Exception | None = None) -> Any:
        # Nested parsers (of a class's arguments) report first, to the outermost parser, whose
        # message then holds every config key of the path: only it rewrites the report.
        if self.rewrites_errors:
            message = _short_error(message)
        return super().error(message, ex)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two flat experiment descriptions."""
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: {saved.get(k, '<unset>')!r} in the checkpoint, {current.get(k, '<unset>')!r} now"
        for k in keys
        if saved.get(k, "<unset>") != current.get(k, "<unset>")
    ]


def checkpointed_versions(run_dir: Path) -> list[Path]:
    """The ``version_*`` folders of ``run_dir`` holding ``checkpoints/last.ckpt``, newest first
    (what ``--ckpt_path last`` resumes from)."""
    return sorted(
        (p for p in run_dir.glob("version_*") if (p / "checkpoints" / "last.ckpt").exists()),
        key=lambda p: int(p.name.split("_")[1]) if p.name.split("_")[1].isdigit() else -1,
        reverse=True,
    )


def _config_path_name(configs: list[Any]) -> str:
    """Run name from the last config file: its path under ``configs/`` without the suffix."""
    if not configs:
        return "run"
    path = Path(str(configs[-1])).resolve()
    parts = path.with_suffix("").parts
    if "configs" in parts:
        index = len(parts) - 1 - parts[::-1].index("configs")
        return "/".join(parts[index + 1 :])
    return f"{path.parent.name}/{path.stem}"


class PFLCLI(LightningCLI):
    """LightningCLI with data -> model links, checked resumes, safe run folders and results."""

    job: Job | None = None
    results_path: Path | None = None

    def __init__(
        self, *positional: Any, argv: list[str], defer: bool = False, **kwargs: Any
    ) -> None:
        self.argv = argv  # the command's arguments (a job's runs extend them)
        self.defer = defer
        super().__init__(*positional, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "test": {"model", "dataloaders", "datamodule"},
        }

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        self.parser_class = PFLArgumentParser
        parser = super().init_parser(**kwargs)
        parser.rewrites_errors = True  # type: ignore[attr-defined]
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for attribute in LINKED_FROM_DATA:
            parser.link_arguments(
                f"data.{attribute}", f"model.init_args.{attribute}", apply_on="instantiate"
            )
        parser.add_lightning_class_args(RoundCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 0})
        parser.add_argument("--test_after_fit", type=bool, default=True, help="run test after fit")
        parser.add_argument(
            "--allow_changes",
            type=list[str],
            default=[],
            help="config keys (e.g. model.init_args.local_lr) that may differ from the "
            "checkpoint's when resuming; every other difference in model or data is refused",
        )
        parser.add_class_arguments(Runs, "runs")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        try:
            return super().instantiate_trainer(**kwargs)
        except (MisconfigurationException, ValueError) as error:
            # Lightning refuses some combinations in Trainer(...) itself: before any folder.
            raise ConfigError(f"trainer settings refused by Lightning: {error}") from error

    def _parse_ckpt_path(self) -> None:
        """Never replace the config with the checkpoint's hyperparameters (see _check_resume)."""

    # ----------------------------------------------------------------- before instantiation
    def _set_seed(self) -> None:
        # LightningCLI seeds first and logs it; the paper check is to be the run's first line.
        self.paper = self._paper_record(self.config[self.subcommand])
        super()._set_seed()

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        assert self.subcommand is not None
        check_trainer(config.trainer, self.subcommand)
        _check_links(config)
        self.experiment = self._experiment(config)
        logger = config.trainer.logger
        if isinstance(logger, Namespace) and "init_args" in logger:
            root = config.trainer.get("default_root_dir")
            save_dir = logger.init_args.get("save_dir")
            if root and save_dir is not None and not os.path.isabs(str(save_dir)):
                logger.init_args.save_dir = os.path.join(str(root), str(save_dir))
            if "name" in logger.init_args and logger.init_args.name is None:
                logger.init_args.name = _config_path_name(config.get("config") or [])
        self.job = self._job(config)
        if self.job is not None:
            return  # each run checks its own checkpoint
        ckpt_path = config.get("ckpt_path")
        if ckpt_path == "last":
            if self.subcommand != "fit":
                raise ConfigError("--ckpt_path last resumes training; give a file to test.")
            config.ckpt_path = self._resolve_last(logger)
        elif ckpt_path:
            self._check_checkpoint(Path(ckpt_path), config)

    def _job(self, config: Namespace) -> Job | None:
        """The job of ``runs`` (None: a single run), checked before anything is written."""
        runs = Runs(**config.runs)
        if not runs.requested:
            return None
        if self.subcommand != "fit":
            raise ConfigError(f"runs trains several runs: use fit, not {self.subcommand}.")
        devices = config.trainer.get("devices")
        if isinstance(devices, str) and devices.lstrip("-").isdigit():
            devices = int(devices)
        many = (isinstance(devices, int) and devices not in (1,)) or (
            isinstance(devices, (list, tuple)) and len(devices) > 1
        )
        if many or (config.trainer.get("num_nodes") or 1) > 1:
            raise ConfigError(
                "runs trains its runs together in one process: use trainer.devices 1 (a job "
                "shares one device), or run the seeds as separate DDP runs."
            )
        logger = config.trainer.logger
        if not isinstance(logger, Namespace) or "init_args" not in logger:
            raise ConfigError("runs needs the TensorBoard logger: each run gets its own folder.")
        dumped = json.loads(
            self._parser(self.subcommand).dump(config, format="json", skip_none=False)
        )
        specs = expand(runs, flatten(dumped))
        return Job(
            specs,
            Path(str(logger.init_args.save_dir)),
            str(logger.init_args.name),
            str(config.model.init_args.get("select_metric", "acc")),
        )

    def instantiate_classes(self) -> None:
        if self.job is None:
            super().instantiate_classes()

    def _run_subcommand(self, subcommand: str) -> None:
        if self.defer:  # a run of a job: fit_now starts it
            return
        if self.job is None:
            super()._run_subcommand(subcommand)
            return
        resume = self.config[subcommand].get("ckpt_path") == "last"
        self.job.run(lambda index, spec, member: self._member(spec, member, resume))

    def _member(self, spec: RunSpec, member: Callback, resume: bool) -> PFLCLI:
        """One run of the job: the command's arguments with the run's values and folder."""
        assert self.job is not None
        folder = self.job.folder / spec.label
        args = [*self.argv, "--runs.seeds=null", "--runs.grid={}"]
        for key, value in spec.overrides.items():
            args.append(f"--{key}={value if isinstance(value, str) else json.dumps(value)}")
        args += [
            f"--trainer.logger.init_args.save_dir={self.job.save_dir}",
            f"--trainer.logger.init_args.name={self.job.name}/{spec.label}",
            "--trainer.enable_progress_bar=false",
        ]
        if resume and not checkpointed_versions(folder):
            args.append("--ckpt_path=null")  # interrupted before its first checkpoint
        with warnings.catch_warnings():  # the job's own arguments are in sys.argv
            warnings.filterwarnings("ignore", "LightningCLI's args parameter")
            return run(args, callbacks=[member], run_subcommand=False)

    def fit_now(self) -> None:
        """Fit a CLI built with ``run_subcommand=False`` (a run of a job)."""
        super()._run_subcommand("fit")

    def _experiment(self, config: Namespace) -> dict[str, Any]:
        """Every model and data argument that defines the experiment, flattened."""
        dumped = json.loads(
            self._parser(self.subcommand).dump(config, format="json", skip_none=False)
        )
        flat = flatten({"model": dumped["model"], "data": dumped["data"]})
        return {k: v for k, v in flat.items() if k not in RUNTIME_KEYS}

    def _paper_record(self, config: Namespace) -> dict[str, Any] | None:
        """The fact-table check of the last config file (``lightning_pfl.papers``), announced
        in the run's first log line."""
        files = config.get("config") or []
        if not files:
            return None
        path = Path(str(files[-1]))
        dumped = json.loads(
            self._parser(self.subcommand).dump(config, format="json", skip_none=False)
        )
        record = paper_record(path, flatten(dumped))
        if record is not None:
            rank_zero_info(describe_record(path, record))
        return record

    def _compare(self, saved: Mapping[str, Any] | None, source: str) -> None:
        if saved is None:
            raise ConfigError(
                f"{source} was not written by a lightning-pfl run (no experiment record); "
                "it cannot be checked against the config."
            )
        allowed = set(self.config[self.subcommand].get("allow_changes") or [])
        found = [d for d in differences(saved, self.experiment) if d.split(":")[0] not in allowed]
        if found:
            raise ConfigError(
                f"{source} belongs to a different experiment than this config: "
                + "; ".join(found)
                + ". Use the config it was trained with, or, if a difference is intended, list "
                "its key in --allow_changes."
            )

    def _resolve_last(self, logger: Any) -> str:
        if not isinstance(logger, Namespace) or "init_args" not in logger:
            raise ConfigError("--ckpt_path last needs the TensorBoard logger's run folders.")
        run_dir = Path(logger.init_args.save_dir) / str(logger.init_args.name)
        candidates = checkpointed_versions(run_dir)
        if not candidates:
            raise ConfigError(
                f"--ckpt_path last: no checkpoints/last.ckpt under {run_dir}/version_*; start "
                "the run without --ckpt_path (checkpoints are written every "
                "checkpoint.every_n_rounds rounds, every checkpoint.every_minutes and on stop)."
            )
        for version in candidates:
            record = version / EXPERIMENT_FILE
            saved = json.loads(record.read_text()) if record.exists() else None
            try:
                self._compare(saved, str(version / "checkpoints" / "last.ckpt"))
            except ConfigError as mismatch:
                if version == candidates[-1]:
                    raise mismatch from None
                continue
            logger.init_args.version = version.name
            return str(version / "checkpoints" / "last.ckpt")
        raise AssertionError("unreachable")

    def _check_checkpoint(self, path: Path, config: Namespace) -> None:
        if not path.is_file():
            raise ConfigError(f"--ckpt_path {path}: no such file.")
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ConfigError(
                f"--ckpt_path {path} cannot be read as a checkpoint: {error}"
            ) from error
        self._compare(checkpoint.get("pfl", {}).get("experiment"), str(path))
        logger = config.trainer.logger
        version_dir = path.resolve().parent.parent
        if (
            self.subcommand == "fit"
            and isinstance(logger, Namespace)
            and "init_args" in logger
            and version_dir.parent
            == (Path(logger.init_args.save_dir) / str(logger.init_args.name)).resolve()
        ):
            logger.init_args.version = version_dir.name  # continue that run in its own folder

    # ----------------------------------------------------------------- before running
    def _prepare(self, stage: str) -> None:
        """Load and split the data now, so a bad split fails before any folder exists."""
        assert isinstance(self.datamodule, FederatedDataModule)
        assert isinstance(self.model, FederatedMethod)
        self.datamodule.setup(stage)
        self.model.experiment = self.experiment

    def before_fit(self) -> None:
        self._prepare("fit")
        log_dir = self.trainer.log_dir
        if self.trainer.is_global_zero and log_dir is not None and self.trainer.logger is not None:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, EXPERIMENT_FILE), "w") as f:
                json.dump(self.experiment, f, indent=1, default=str)

    def before_validate(self) -> None:
        self._prepare("validate")

    def before_test(self) -> None:
        self._prepare("test")

    def after_fit(self) -> None:
        checkpoint = self.trainer.checkpoint_callback
        if isinstance(checkpoint, RoundCheckpoint) and checkpoint.interrupted is not None:
            raise checkpoint.interrupted
        if self.config[self.subcommand].get("test_after_fit", True):
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=True)
        self._write_results(announce=True)

    def after_test(self) -> None:
        self._write_results(announce=True)

    def after_validate(self) -> None:
        self._write_results()

    def _write_results(self, announce: bool = False) -> None:
        """Write ``results.json`` (when there is a logger); ``announce``: also print the run's
        result."""
        log_dir = self.trainer.log_dir  # a collective under DDP: every rank must ask
        if not self.trainer.is_global_zero:
            return
        logger = self.trainer.logger
        writes = log_dir is not None and logger is not None
        if not (writes or announce):
            return
        results = self._results()
        path = None
        if writes:
            path = os.path.join(str(log_dir), "results.json")
            self.results_path = Path(path)
            with open(path, "w") as f:
                json.dump(results, f, indent=2, default=str)
        if announce:
            tensorboard = logger.log_dir if isinstance(logger, TensorBoardLogger) else None
            print("\n".join(result_lines(results, path, tensorboard)), flush=True)

    def _results(self) -> dict[str, Any]:
        assert isinstance(self.model, FederatedMethod)
        parser = self._parser(self.subcommand)
        config = parser.dump(self.config[self.subcommand], format="json", skip_none=False)
        return {
            **self.model.results(),
            "subcommand": self.subcommand,
            **({"paper": self.paper} if self.paper is not None else {}),
            "config": json.loads(config),
        }


def _check_links(config: Namespace) -> None:
    """Refuse model arguments that the DataModule sets (they would be silently replaced)."""
    given = [name for name in LINKED_FROM_DATA if config.model.init_args.get(name) is not None]
    if given:
        raise ConfigError(
            "; ".join(
                f"model.init_args.{name} comes from the data section: remove it from the "
                f"model section ({LINKED_FROM_DATA[name]})"
                for name in given
            )
            + "."
        )


def _default_logger_name(args: list[str]) -> None:
    """Put the run name derived from ``--config`` into the defaults (shown by --print_config)."""
    configs = [
        a.split("=", 1)[1] if "=" in a else args[i + 1]
        for i, a in enumerate(args)
        if a.split("=", 1)[0] in ("--config", "-c") and ("=" in a or i + 1 < len(args))
    ]
    TRAINER_DEFAULTS["logger"]["init_args"]["name"] = (
        _config_path_name(configs) if configs else None
    )


def run(
    args: list[str] | None = None,
    callbacks: list[Callback] | None = None,
    run_subcommand: bool = True,
) -> PFLCLI:
    """Run the CLI with ``args`` (default: ``sys.argv``) and return it (for scripts and tests);
    ``callbacks`` are added to the trainer's. ``run_subcommand=False``: parse, check and build
    only (:meth:`PFLCLI.fit_now` runs it)."""
    quiet_third_party()
    argv = list(args if args is not None else sys.argv[1:])
    _default_logger_name(argv)
    return PFLCLI(
        FederatedMethod,
        FederatedDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={**TRAINER_DEFAULTS, **({"callbacks": callbacks} if callbacks else {})},
        save_config_kwargs={"overwrite": True},
        argv=argv,
        args=args,
        auto_configure_optimizers=False,
        seed_everything_default=0,
        defer=not run_subcommand,
    )


def _user_error(error: BaseException) -> PFLError | None:
    """The PFLError that caused ``error`` (jsonargparse wraps errors raised while building a
    class in its own ValueError, with the original as its cause), or None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, PFLError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def main(args: list[str] | None = None) -> int:
    """Entry point of ``lightning-pfl`` and ``python cli.py``; returns the exit status."""
    try:
        run(args)
    except Exception as error:
        found = _user_error(error)
        if found is None or os.environ.get("PFL_DEBUG") == "1":
            raise
        sys.stderr.write(f"lightning-pfl: error: {found}\n(set PFL_DEBUG=1 for the traceback)\n")
        return found.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
