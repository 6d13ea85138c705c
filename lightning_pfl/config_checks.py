"""Checks of a parsed config across its sections, before anything is instantiated or written.

The argument types and ranges are checked by the parser, the trainer's settings one by one by
:mod:`lightning_pfl.trainer_settings`; these are the combinations: a model argument the data
section owns, what needs a validation split when there is none, and what a job of several runs
needs from the trainer. Pure functions of the parsed config: the CLI calls them.
"""

from __future__ import annotations

from jsonargparse import Namespace

from lightning_pfl.errors import ConfigError
from lightning_pfl.run_names import run_dir

# What the DataModule knows and the method is told (jsonargparse links, applied on
# instantiation), with where to set it instead.
LINKED_FROM_DATA = {
    "num_clients": "set data.init_args.num_clients instead",
    "num_classes": "the dataset (data.init_args.dataset) gives it",
    "input_shape": "the dataset (data.init_args.dataset) gives it",
}


def check_links(config: Namespace) -> None:
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


def check_validation_split(config: Namespace, subcommand: str) -> None:
    """Refuse what needs a validation split when the data has none (``val_fraction: 0``):
    the ``validate`` subcommand, a ``select_metric`` other than the default, and callbacks
    monitoring a ``val/`` metric (best-round checkpoints, early stopping)."""
    if config.data.init_args.get("val_fraction", 1) > 0:
        return
    why = "data.init_args.val_fraction is 0: the clients have no validation split"
    fix = "set data.init_args.val_fraction > 0"
    if subcommand == "validate":
        raise ConfigError(
            f"validate evaluates the validation split, but {why}; {fix}, or use test."
        )
    if config.model.init_args.get("select_metric", "acc") != "acc":
        raise ConfigError(
            f"model.init_args.select_metric = {config.model.init_args.select_metric!r} picks the "
            f"best-validation round, but {why} and no round is selected; remove select_metric, "
            f"or {fix}."
        )
    monitors = [("checkpoint.monitor", config.get("checkpoint", Namespace()).get("monitor"))]
    callbacks = config.trainer.get("callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if isinstance(callback, Namespace) and "init_args" in callback:
            name = str(callback.class_path).rsplit(".", 1)[-1]
            monitors.append(
                (f"trainer.callbacks {name}.monitor", callback.init_args.get("monitor"))
            )
    for argument, monitor in monitors:
        if isinstance(monitor, str) and monitor.startswith("val/"):
            raise ConfigError(
                f"{argument} = {monitor!r} needs a validation metric, but {why}; remove the "
                f"monitor (or the callback), or {fix}."
            )


def check_job(trainer: Namespace, subcommand: str) -> None:
    """Refuse what a job of several runs (``runs``) cannot do: other subcommands than ``fit``,
    several devices or nodes, a logger without run folders."""
    if subcommand != "fit":
        raise ConfigError(f"runs trains several runs: use fit, not {subcommand}.")
    devices = trainer.get("devices")
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    many = (isinstance(devices, int) and devices not in (1,)) or (
        isinstance(devices, (list, tuple)) and len(devices) > 1
    )
    if many or (trainer.get("num_nodes") or 1) > 1:
        raise ConfigError(
            "runs trains its runs together in one process: use trainer.devices 1 (a job "
            "shares one device), or run the seeds as separate DDP runs."
        )
    if run_dir(trainer.logger) is None:
        raise ConfigError("runs needs the TensorBoard logger: each run gets its own folder.")
