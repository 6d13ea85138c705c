"""How errors reach the user: one paragraph naming the config key and what to change.

jsonargparse reports a bad value as a nest of every parser it went through;
:class:`PFLArgumentParser` reduces that to the key and what is wrong with it. Errors raised
while building a class arrive wrapped in jsonargparse's own exceptions; :func:`user_error`
finds the :class:`~lightning_pfl.errors.PFLError` behind them, and :func:`report` formats it.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser

import lightning_pfl.methods as methods_module
from lightning_pfl import partition as partition_module
from lightning_pfl.errors import PFLError


def _partitioners() -> list[str]:
    return [
        name
        for name, value in vars(partition_module).items()
        if isinstance(value, type)
        and issubclass(value, partition_module.Partitioner)
        and value is not partition_module.Partitioner
    ]


def short_error(message: str) -> str:
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

    # The CLI dumps and saves only configs it has parsed, which parsing validated: checking
    # them again took 3/4 of each dump's time (Lightning dumps twice a run, we twice more).
    def dump(self, namespace: Any, *args: Any, skip_validation: bool = True, **kwargs: Any) -> str:
        return super().dump(namespace, *args, skip_validation=skip_validation, **kwargs)

    def save(
        self, namespace: Any, path: Any, *args: Any, skip_validation: bool = True, **kwargs: Any
    ) -> None:
        super().save(namespace, path, *args, skip_validation=skip_validation, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> Any:
        # Nested parsers (of a class's arguments) report first, to the outermost parser, whose
        # message then holds every config key of the path: only it rewrites the report.
        if self.rewrites_errors:
            message = short_error(message)
        return super().error(message, ex)


def user_error(error: BaseException) -> PFLError | None:
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


def report(error: PFLError) -> str:
    """The paragraph the command prints for ``error``."""
    return f"lightning-pfl: error: {error}\n(set PFL_DEBUG=1 for the traceback)\n"
