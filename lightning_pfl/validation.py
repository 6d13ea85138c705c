"""Range-checked arguments: ``Annotated[float, Range(gt=0)]`` on an ``__init__`` argument.

Every method, DataModule and partitioner calls :func:`check_arguments` on its own arguments
before it builds anything, so a value outside its range (or a ``Literal[...]`` argument's
choices) stops the run at once with the argument's config key, the value and what is allowed,
also when the class is built in Python rather than through the CLI. The annotation also shows in
``--help`` (jsonargparse prints the type).
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from lightning_pfl.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """The closed or open interval a numeric argument must lie in (None: unbounded)."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )

    def __str__(self) -> str:
        low = (
            f"> {self.gt:g}"
            if self.gt is not None
            else f">= {self.ge:g}"
            if self.ge is not None
            else ""
        )
        high = (
            f"< {self.lt:g}"
            if self.lt is not None
            else f"<= {self.le:g}"
            if self.le is not None
            else ""
        )
        return " and ".join(part for part in (low, high) if part) or "any number"


PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
UnitInterval = Annotated[float, Range(ge=0, le=1)]
OpenUnitInterval = Annotated[float, Range(gt=0, lt=1)]
Momentum = Annotated[float, Range(ge=0, lt=1)]
Seed = Annotated[int, Range(ge=0, lt=2**63)]


def _ranges_in(hint: Any) -> list[Range]:
    """The Range constraints that apply to a value of type ``hint`` (through Optional/Union)."""
    if typing.get_origin(hint) is Annotated:
        return [m for m in hint.__metadata__ if isinstance(m, Range)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [r for arg in typing.get_args(hint) for r in _ranges_in(arg)]
    return []


def _choices_in(hint: Any) -> tuple[Any, ...] | None:
    """The values a ``Literal[...]`` hint allows (through Annotated and Optional); None when the
    hint admits anything else."""
    if typing.get_origin(hint) is Annotated:
        return _choices_in(typing.get_args(hint)[0])
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        parts = [_choices_in(arg) for arg in members]
        if members and all(part is not None for part in parts):
            return tuple(c for part in parts for c in part)  # type: ignore[union-attr]
    return None


def _element_hint(hint: Any) -> Any | None:
    """The element type of a tuple/list hint (``tuple[X, ...]``, ``list[X]``), else None."""
    for candidate in [hint, *typing.get_args(hint)]:
        if typing.get_origin(candidate) in (tuple, list):
            args = [a for a in typing.get_args(candidate) if a is not Ellipsis]
            return args[0] if args else None
    return None


def argument_ranges(cls: type) -> dict[str, Any]:
    """Type hints of every ``__init__`` argument along ``cls``'s MRO (the subclass's first)."""
    hints: dict[str, Any] = {}
    for klass in reversed(inspect.getmro(cls)):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        try:
            found = typing.get_type_hints(init, include_extras=True)
        except (NameError, TypeError):
            continue
        hints.update({k: v for k, v in found.items() if k != "return"})
    return hints


def argument_default(cls: type, name: str) -> Any:
    """The default of ``__init__`` argument ``name`` that ``cls`` resolves to: the first class
    along the MRO whose ``__init__`` declares it (as jsonargparse resolves ``**kwargs``)."""
    for klass in inspect.getmro(cls):
        init = klass.__dict__.get("__init__")
        if init is not None:
            parameter = inspect.signature(init).parameters.get(name)
            if parameter is not None:
                return parameter.default
    raise KeyError(name)


def check_arguments(
    owner: object,
    values: Mapping[str, Any],
    section: str,
    error: type[ConfigError] = ConfigError,
) -> None:
    """Raise one ``error`` listing every value in ``values`` outside its annotated Range or
    ``Literal`` choices.

    Args:
        owner: the object (or class) whose ``__init__`` annotations define the ranges.
        values: argument name -> value.
        section: config section for the message (``model``, ``data``, ``data.partition``).
        error: the ConfigError subclass to raise.
    """
    hints = argument_ranges(owner if isinstance(owner, type) else type(owner))
    problems = []
    for name, value in values.items():
        if name not in hints or value is None or isinstance(value, bool):
            continue
        choices = _choices_in(hints[name])
        if choices is not None and value not in choices:
            listed = ", ".join(map(str, choices))
            problems.append(f"{config_key(section, name)} = {value!r} must be one of {listed}")
            continue
        checks = [(value, r) for r in _ranges_in(hints[name])]
        element = _element_hint(hints[name])
        if element is not None and isinstance(value, (tuple, list)):
            checks += [(v, r) for v in value for r in _ranges_in(element)]
        for checked, allowed in checks:
            if isinstance(checked, (int, float)) and not allowed.contains(checked):
                problems.append(f"{config_key(section, name)} = {value!r} must be {allowed}")
                break
    if problems:
        raise error(
            "Invalid argument"
            + ("s" if len(problems) > 1 else "")
            + ": "
            + "; ".join(problems)
            + ". Change the value in the config file or on the command line."
        )


def config_key(section: str, name: str) -> str:
    """The dotted config key of argument ``name`` of a class configured under ``section``."""
    return f"{section}.init_args.{name}" if section else name
