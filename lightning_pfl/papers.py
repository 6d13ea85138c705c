"""The papers' fact tables (``configs/papers/*.yaml``) and the check of a run's config against them.

A fact table lists, per entry, the configs that reproduce one of a paper's tables and every
setting the paper states for it, each with the section or table it comes from. A run of a listed
config compares its resolved config with the entry: the run always goes ahead (users may change
anything), but the first log line and ``results.json`` (``paper``) say which of the paper's
settings it overrides. ``tests/test_configs.py`` requires every listed config to hold every
setting of its entries.

File format::

    paper: "<authors, title, venue>"
    code: "<reference code address, or 'none public'>"
    entries:
      <entry name>:
        what: "<which table or figure, which cells>"
        metric: <results.json key the paper's numbers compare to, e.g. test_at_best_val.acc>
        reported: {<method>: <percent>}          # optional
        configs: [<path under configs/>, ...]
        settings:
          <dotted config key>: {value: <value>, source: "<section / table>"}

Keys are dotted paths into the resolved config (``model.init_args.local_lr``,
``data.init_args.partition.init_args.classes``, ``trainer.max_steps``); class paths compare by
their last component, floats with a relative tolerance of 1e-9. A mapping value pins the whole
subtree under its key (``model.init_args.architectures: {value: {cnn: {net: zoo_cnn}}}``): the
run must hold exactly those keys below it, none more, each with the paper's value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lightning_pfl.errors import ConfigError

FACTS_FOLDER = "papers"
ENTRY_KEYS = {"what", "metric", "reported", "configs", "settings"}
REQUIRED_ENTRY_KEYS = {"what", "metric", "configs", "settings"}


@dataclass(frozen=True)
class Setting:
    """One setting a paper states: its value and where the paper states it."""

    value: Any
    source: str


@dataclass(frozen=True)
class PaperEntry:
    """One entry of a fact table: a family of configs and the paper's settings for it."""

    facts: Path
    paper: str
    name: str
    what: str
    metric: str
    reported: dict[str, float]
    configs: tuple[str, ...]
    settings: dict[str, Setting]


@dataclass(frozen=True)
class Override:
    """A paper setting a run's config does not hold."""

    key: str
    paper: Any
    run: Any
    source: str

    def describe(self) -> str:
        return f"{self.key} = {self.run!r} (paper: {self.paper!r}, {self.source})"


def configs_root(config: Path) -> Path | None:
    """The nearest folder named ``configs`` above ``config`` (None: not under one)."""
    for parent in config.resolve().parents:
        if parent.name == "configs":
            return parent
    return None


def load_fact_table(path: Path) -> list[PaperEntry]:
    """The entries of the fact table ``path``; a malformed file raises a ConfigError naming it."""

    def fail(problem: str) -> ConfigError:
        return ConfigError(f"fact table {path}: {problem}; see lightning_pfl/papers.py.")

    try:
        table = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise fail(f"not valid YAML ({error})") from None
    if not isinstance(table, dict) or not {"paper", "code", "entries"} <= set(table):
        raise fail("needs the top-level keys paper, code and entries")
    entries = []
    for name, entry in (table["entries"] or {}).items():
        if not isinstance(entry, dict) or not set(entry) >= REQUIRED_ENTRY_KEYS:
            raise fail(f"entry {name} needs {sorted(REQUIRED_ENTRY_KEYS)}")
        unknown = set(entry) - ENTRY_KEYS
        if unknown:
            raise fail(f"entry {name} has unknown keys {sorted(unknown)}")
        settings = {}
        for key, setting in (entry["settings"] or {}).items():
            if not isinstance(setting, dict) or set(setting) != {"value", "source"}:
                raise fail(f"entry {name}, setting {key} needs exactly value and source")
            if not str(setting["source"]).strip():
                raise fail(f"entry {name}, setting {key} has an empty source")
            settings[key] = Setting(setting["value"], str(setting["source"]))
        if not settings or not entry["configs"]:
            raise fail(f"entry {name} lists no settings or no configs")
        entries.append(
            PaperEntry(
                path,
                str(table["paper"]),
                str(name),
                str(entry["what"]),
                str(entry["metric"]),
                dict(entry.get("reported") or {}),
                tuple(str(c) for c in entry["configs"]),
                settings,
            )
        )
    return entries


def load_fact_tables(root: Path) -> list[PaperEntry]:
    """Every entry of every fact table under ``root/papers``."""
    return [
        entry
        for path in sorted((root / FACTS_FOLDER).glob("*.yaml"))
        for entry in load_fact_table(path)
    ]


def entries_for(config: Path) -> list[PaperEntry]:
    """The fact entries that list ``config`` (none when it is not under a ``configs`` folder)."""
    root = configs_root(config)
    if root is None:
        return []
    relative = config.resolve().relative_to(root).as_posix()
    return [entry for entry in load_fact_tables(root) if relative in entry.configs]


def same_value(paper: Any, run: Any, key: str) -> bool:
    """Whether a run's value equals the paper's (class paths by last component, floats 1e-9)."""
    if key.endswith("class_path") and isinstance(paper, str) and isinstance(run, str):
        return paper.rsplit(".", 1)[-1] == run.rsplit(".", 1)[-1]
    if isinstance(paper, bool) or isinstance(run, bool):
        return paper is run
    if isinstance(paper, (int, float)) and isinstance(run, (int, float)):
        return math.isclose(paper, run, rel_tol=1e-9)
    if isinstance(paper, list) and isinstance(run, list):
        return len(paper) == len(run) and all(
            same_value(p, r, key) for p, r in zip(paper, run, strict=True)
        )
    if isinstance(paper, Mapping) and isinstance(run, Mapping):
        return paper.keys() == run.keys() and all(
            same_value(paper[k], run[k], f"{key}.{k}") for k in paper
        )
    return bool(paper == run)


def value_at(flat_config: Mapping[str, Any], key: str) -> Any:
    """The value of ``key`` in ``flat_config`` (dotted keys): a leaf, the nested mapping of
    the keys below it, or ``'<absent>'``."""
    if key in flat_config:
        return flat_config[key]
    prefix = key + "."
    below = {k.removeprefix(prefix): v for k, v in flat_config.items() if k.startswith(prefix)}
    if not below:
        return "<absent>"
    nested: dict[str, Any] = {}
    for dotted, value in below.items():
        *parents, last = dotted.split(".")
        node = nested
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = value
    return nested


def overrides(entry: PaperEntry, flat_config: Mapping[str, Any]) -> list[Override]:
    """The settings of ``entry`` that ``flat_config`` (dotted keys) does not hold; a key the
    config lacks counts as overridden with the run's value ``'<absent>'``."""
    found = []
    for key, setting in entry.settings.items():
        run = value_at(flat_config, key)
        if not same_value(setting.value, run, key):
            found.append(Override(key, setting.value, run, setting.source))
    return found


def paper_record(config: Path, flat_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """What ``results.json`` says about the paper settings of a run of ``config`` (None: the
    config reproduces no paper table)."""
    entries = entries_for(config)
    if not entries:
        return None
    return {
        "entries": [
            {
                "facts": entry.facts.as_posix(),
                "entry": entry.name,
                "what": entry.what,
                "metric": entry.metric,
                "reported": entry.reported,
                "overridden": [vars(o) for o in overrides(entry, flat_config)],
            }
            for entry in entries
        ]
    }


def describe_record(config: Path, record: Mapping[str, Any]) -> str:
    """The one log line that says whether a run keeps its paper's settings."""
    parts = []
    for entry in record["entries"]:
        where = f"{Path(entry['facts']).name} {entry['entry']} ({entry['what']})"
        if entry["overridden"]:
            changed = "; ".join(Override(**o).describe() for o in entry["overridden"])
            parts.append(f"{where}: this run overrides the paper's {changed}")
        else:
            parts.append(
                f"{where}: every setting the paper states holds; compare results.json "
                f"{entry['metric']} with the paper's {entry['reported'] or 'numbers'}"
            )
    return f"Paper settings of {config}: " + " | ".join(parts)
