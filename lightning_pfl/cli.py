"""The command line: ``lightning-pfl fit|test|validate --config configs/....yaml``.

LightningCLI in subclass mode for methods and DataModules; the number of clients, classes and
the input shape flow from the DataModule to the method. ``fit`` also evaluates the test split
at the end (``--test_after_fit false`` to skip) and every run writes ``results.json`` into its
log directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.methods import FederatedMethod

TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 100,
    "val_check_interval": 10,
    "check_val_every_n_epoch": None,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    "enable_model_summary": False,
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "logs", "name": "run"},
    },
}


class PFLCLI(LightningCLI):
    """LightningCLI with data -> model links, resumable log folders and ``results.json``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for attribute in ("num_clients", "num_classes", "input_shape"):
            parser.link_arguments(
                f"data.{attribute}", f"model.init_args.{attribute}", apply_on="instantiate"
            )
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 0})
        parser.add_argument("--test_after_fit", type=bool, default=True, help="run test after fit")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        logger = config.trainer.logger
        if isinstance(logger, list) or not logger or not hasattr(logger, "init_args"):
            return
        configs = config.get("config") or []
        if logger.init_args.get("name") == "run" and configs:
            logger.init_args.name = Path(str(configs[-1])).stem
        if self.subcommand == "fit" and config.get("ckpt_path") == "last":
            run_dir = Path(logger.init_args.save_dir) / logger.init_args.name
            versions = sorted(
                (
                    p
                    for p in run_dir.glob("version_*")
                    if (p / "checkpoints" / "last.ckpt").exists()
                ),
                key=lambda p: int(p.name.split("_")[1]),
            )
            if not versions:
                raise FileNotFoundError(
                    f"--ckpt_path last: no checkpoints/last.ckpt under {run_dir}/version_*; "
                    "start a run without --ckpt_path first."
                )
            logger.init_args.version = versions[-1].name
            config.ckpt_path = str(versions[-1] / "checkpoints" / "last.ckpt")

    def after_fit(self) -> None:
        if self.config[self.subcommand].get("test_after_fit", True):
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=True)
        self._write_results()

    def after_test(self) -> None:
        self._write_results()

    def after_validate(self) -> None:
        self._write_results()

    def _write_results(self) -> None:
        log_dir = self.trainer.log_dir  # a collective under DDP: every rank must ask
        if not self.trainer.is_global_zero or log_dir is None:
            return
        assert isinstance(self.model, FederatedMethod)
        parser = self._parser(self.subcommand)
        config = parser.dump(self.config[self.subcommand], format="json", skip_none=False)
        results = {
            **self.model.results(),
            "subcommand": self.subcommand,
            "config": json.loads(config),
        }
        path = os.path.join(log_dir, "results.json")
        with open(path, "w") as f:
            json.dump(results, f, indent=2, default=str)


def run(args: list[str] | None = None) -> PFLCLI:
    """Run the CLI with ``args`` (default: ``sys.argv``) and return it (for scripts and tests)."""
    return PFLCLI(
        FederatedMethod,
        FederatedDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
        seed_everything_default=0,
    )


def main() -> None:
    """Entry point of ``lightning-pfl`` and ``python cli.py``."""
    run()


if __name__ == "__main__":
    main()
