"""Where a run's folder goes: ``<save_dir>/<config path under configs/>/version_N``.

``logs/digits/pfedhn`` and ``logs/fashion_mnist/pfedhn`` for two configs both named
``pfedhn.yaml``; a relative ``save_dir`` is taken under ``trainer.default_root_dir``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

DEFAULT_LOGS = "logs"
TENSORBOARD = "lightning.pytorch.loggers.TensorBoardLogger"


def config_path_name(configs: list[Any]) -> str:
    """Run name from the last config file: its path under ``configs/`` without the suffix."""
    if not configs:
        return "run"
    path = Path(str(configs[-1])).resolve()
    parts = path.with_suffix("").parts
    if "configs" in parts:
        index = len(parts) - 1 - parts[::-1].index("configs")
        return "/".join(parts[index + 1 :])
    return f"{path.parent.name}/{path.stem}"


def config_files(args: list[str]) -> list[str]:
    """The ``--config`` / ``-c`` files named on a command line, in order."""
    return [
        a.split("=", 1)[1] if "=" in a else args[i + 1]
        for i, a in enumerate(args)
        if a.split("=", 1)[0] in ("--config", "-c") and ("=" in a or i + 1 < len(args))
    ]


def default_logger(args: list[str]) -> dict[str, Any]:
    """The TensorBoard logger a run of ``args`` gets by default, named after its config (so
    that ``--print_config`` shows the name)."""
    configs = config_files(args)
    return {
        "class_path": TENSORBOARD,
        # name null: config_path_name of the configs given in the config file itself.
        "init_args": {
            "save_dir": DEFAULT_LOGS,
            "name": config_path_name(configs) if configs else None,
            "default_hp_metric": False,
        },
    }


def place_run(logger: Any, default_root_dir: Any, configs: list[Any]) -> None:
    """Complete a parsed logger setting: a relative ``save_dir`` under ``default_root_dir``,
    and a null ``name`` from the config files."""
    if not (isinstance(logger, Namespace) and "init_args" in logger):
        return
    save_dir = logger.init_args.get("save_dir")
    if default_root_dir and save_dir is not None and not os.path.isabs(str(save_dir)):
        logger.init_args.save_dir = os.path.join(str(default_root_dir), str(save_dir))
    if "name" in logger.init_args and logger.init_args.name is None:
        logger.init_args.name = config_path_name(configs)


def run_dir(logger: Any) -> Path | None:
    """``<save_dir>/<name>`` of a parsed (and placed) logger setting, the folder of its
    ``version_*`` run folders; None for a logger without run folders."""
    if not (isinstance(logger, Namespace) and "init_args" in logger):
        return None
    return Path(str(logger.init_args.save_dir)) / str(logger.init_args.name)
