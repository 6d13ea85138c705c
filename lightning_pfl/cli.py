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

The concerns live in their own modules: the trainer settings (``trainer_settings``), the checks
across config sections (``config_checks``), what makes a checkpoint the same experiment and
which one a run resumes from (``experiment``), the run folder's name (``run_names``), the error
messages (``messages``) and what a run prints (``console``).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from jsonargparse import Namespace
from lightning import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_pfl.callbacks import RoundCheckpoint
from lightning_pfl.config_checks import (
    LINKED_FROM_DATA,
    check_job,
    check_links,
    check_validation_split,
)
from lightning_pfl.console import quiet_third_party, result_lines
from lightning_pfl.costs import RoundCosts
from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.errors import ConfigError
from lightning_pfl.experiment import (
    EXPERIMENT_FILE,
    checkpointed_versions,
    experiment_of,
    flatten,
    resume_from,
)
from lightning_pfl.jobs import Job, Runs, RunSpec, expand
from lightning_pfl.messages import PFLArgumentParser, report, user_error
from lightning_pfl.methods import FederatedMethod
from lightning_pfl.papers import describe_record, paper_record
from lightning_pfl.run_names import default_logger, place_run, run_dir
from lightning_pfl.trainer_settings import check_trainer

TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 100,
    "val_check_interval": 10,
    "check_val_every_n_epoch": None,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
}


# (parser, subcommand parsers, subcommand method arguments) per parser configuration
_PARSERS: dict[str, tuple[LightningArgumentParser, dict[str, Any], dict[str, list[str]]]] = {}


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

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        # Building the parser (every Trainer, method and data argument, for each subcommand)
        # takes about a second; a process that runs several CLIs (a job's runs, the benchmarks'
        # and tests' in-process runs) builds it once. Only the logger default differs per run.
        static = {
            k: v for k, v in self.trainer_defaults.items() if k not in ("logger", "callbacks")
        }
        key = repr(
            (
                self._model_class,
                self._datamodule_class,
                self.subclass_mode_model,
                self.subclass_mode_data,
                add_subcommands,
                main_kwargs,
                subparser_kwargs,
                static,
                self.seed_everything_default,
            )
        )
        if key not in _PARSERS:
            super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
            _PARSERS[key] = (
                self.parser,
                getattr(self, "_subcommand_parsers", {}),
                getattr(self, "_subcommand_method_arguments", {}),
            )
        self.parser, self._subcommand_parsers, self._subcommand_method_arguments = _PARSERS[key]
        logger = {"trainer.logger": self.trainer_defaults.get("logger")}
        for parser in self._subcommand_parsers.values() or [self.parser]:
            parser.set_defaults(logger)

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
        # evaluation trains some methods' models: under no_grad (trainer_settings, inference_mode)
        parser.set_defaults({"trainer.inference_mode": False})
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
        """Never replace the config with the checkpoint's hyperparameters: a checkpoint is
        checked against the config instead (:func:`~lightning_pfl.experiment.resume_from`)."""

    # ----------------------------------------------------------------- before instantiation
    def _set_seed(self) -> None:
        # LightningCLI seeds first and logs it; the paper check is to be the run's first line.
        config = self.config[self.subcommand]
        # The config as given, dumped once: the paper check, the experiment and the job read
        # it (their model and data sections, which nothing changes before instantiation).
        self.given = self._dumped(config)
        self.paper = self._paper_record(config)
        super()._set_seed()

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        assert self.subcommand is not None
        check_trainer(config.trainer, self.subcommand)
        check_links(config)
        check_validation_split(config, self.subcommand)
        self.experiment = experiment_of(self.given)
        logger = config.trainer.logger
        place_run(logger, config.trainer.get("default_root_dir"), config.get("config") or [])
        self.job = self._job(config)
        if self.job is not None:
            return  # each run checks its own checkpoint
        if config.get("ckpt_path"):
            allowed = set(config.get("allow_changes") or [])
            config.ckpt_path, version = resume_from(
                config.ckpt_path, self.subcommand, run_dir(logger), self.experiment, allowed
            )
            if version is not None:
                logger.init_args.version = version

    def _job(self, config: Namespace) -> Job | None:
        """The job of ``runs`` (None: a single run), checked before anything is written."""
        runs = Runs(**config.runs)
        if not runs.requested:
            return None
        assert self.subcommand is not None
        check_job(config.trainer, self.subcommand)
        logger = config.trainer.logger
        specs = expand(runs, flatten(self.given))
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

    def _dumped(self, config: Namespace) -> dict[str, Any]:
        dumped = self._parser(self.subcommand).dump(config, format="json", skip_none=False)
        parsed: dict[str, Any] = json.loads(dumped)
        return parsed

    def _paper_record(self, config: Namespace) -> dict[str, Any] | None:
        """The fact-table check (``lightning_pfl.papers``) of every config file a fact table
        lists, whichever ``--config`` it is, against the config as given (later files and flags
        included), announced in the run's first log lines."""
        entries = []
        for path in dict.fromkeys(Path(str(file)) for file in config.get("config") or []):
            record = paper_record(path, flatten(self.given))
            if record is not None:
                rank_zero_info(describe_record(path, record))
                entries += record["entries"]
        return {"entries": entries} if entries else None

    # ----------------------------------------------------------------- before running
    def _prepare(self, stage: str) -> None:
        """Load and split the data now, so a bad split fails before any folder exists."""
        assert isinstance(self.datamodule, FederatedDataModule)
        assert isinstance(self.model, FederatedMethod)
        self.datamodule.setup(stage)
        self.model.check_data(self.datamodule)
        self.model.record.experiment = self.experiment

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
        return {
            **self.model.results(),
            "subcommand": self.subcommand,
            **({"paper": self.paper} if self.paper is not None else {}),
            "config": self._dumped(self.config[self.subcommand]),
        }


def run(
    args: list[str] | None = None,
    callbacks: list[Callback] | None = None,
    run_subcommand: bool = True,
) -> PFLCLI:
    """Run the CLI with ``args`` (default: ``sys.argv``) and return it (for scripts and tests);
    ``callbacks`` are added to the trainer's, after :class:`RoundCosts` (every run's).
    ``run_subcommand=False``: parse, check and build only (:meth:`PFLCLI.fit_now` runs it)."""
    quiet_third_party()
    argv = list(args if args is not None else sys.argv[1:])
    logger = default_logger(argv)
    callbacks = [RoundCosts(), *(callbacks or [])]
    return PFLCLI(
        FederatedMethod,
        FederatedDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={**TRAINER_DEFAULTS, "logger": logger, "callbacks": callbacks},
        save_config_kwargs={"overwrite": True},
        argv=argv,
        args=args,
        auto_configure_optimizers=False,
        seed_everything_default=0,
        defer=not run_subcommand,
    )


def main(args: list[str] | None = None) -> int:
    """Entry point of ``lightning-pfl`` and ``python cli.py``; returns the exit status."""
    try:
        run(args)
    except Exception as error:
        found = user_error(error)
        if found is None or os.environ.get("PFL_DEBUG") == "1":
            raise
        sys.stderr.write(report(found))
        return found.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
