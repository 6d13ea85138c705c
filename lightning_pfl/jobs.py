"""Many runs, one job: the runs of one config that differ by seed or by a grid of values, trained
together (the ``runs`` section of the CLI).

Every run is an ordinary CLI run (its own run folder, config.yaml, checkpoints, results.json and
TensorBoard events); the runs share their local training through :mod:`lightning_pfl.lockstep`
(one vmap, one threaded loop, one recorded graph over every run's clients) and keep everything
else (sampling, the server update, evaluation, logging) to themselves. The job ends with a
summary over seeds per grid point (``job.json``, printed).
"""

from __future__ import annotations

import itertools
import json
import signal
import statistics
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lightning import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_pfl.console import closing_entries
from lightning_pfl.datasets.registry import shared_loads
from lightning_pfl.errors import ConfigError, RunInterrupted
from lightning_pfl.experiment import flatten
from lightning_pfl.lockstep import Lockstep, LockstepExecutor, get_rng

if TYPE_CHECKING:
    from lightning_pfl.methods.base import FederatedMethod

SEED_KEYS = {
    "both": ("model.init_args.seed", "data.init_args.seed"),
    "training": ("model.init_args.seed",),
    "split": ("data.init_args.seed",),
}
# Settings (or whole sections) that change tensor shapes, the data or the round's structure: runs
# differing by one could never share a computation, so they belong in separate jobs. Of the
# data, only the split's seed may vary within a job.
SHAPE_KEYS = (
    "model.class_path",
    "model.init_args.net",
    "model.init_args.net_args",
    "model.init_args.batch_size",
    "model.init_args.clients_per_round",
    "model.init_args.local_steps",
    "model.init_args.local_epochs",
    "model.init_args.novel_clients",
    "data",
    "trainer",
)
SHARED_DATA_KEYS = SEED_KEYS["split"]
REPORTED = (
    *dict.fromkeys(
        (entry.section, key)
        for validated in (True, False)
        for entry in closing_entries(validated)
        for key in (entry.key, entry.pooled)
    ),
    ("seconds_per_round", None),
)
SUMMARY_FILE = "job.json"


@dataclass
class Runs:
    """Several runs of this config trained together as one job (``lightning_pfl.jobs``).

    Each run is the config with one seed and one point of the grid; it gets its own run folder
    ``<logger name>/<run label>``. The job prints and writes (``<logger name>/job.json``) the
    mean and standard deviation over seeds of every reported metric for each grid point, and
    the best point by validation. Empty (the default): a single run.

    Args:
        seeds: the seeds to run (e.g. ``[0, 1, 2]``); None: the config's own seeds.
        vary: which seeds ``seeds`` sets: ``both`` (the split's ``data.init_args.seed`` and the
            training's ``model.init_args.seed``), ``training`` (same split, different
            initialization, sampling and batches) or ``split`` (different splits, the same
            training seed).
        grid: config keys (dotted, as ``--print_config`` nests them) and the values to run;
            every combination is a run. On the command line one JSON dict,
            ``--runs.grid='{"model.init_args.local_lr": [0.01, 0.05]}'``; in a config file
            ``runs: {grid: {model.init_args.local_lr: [0.01, 0.05]}}``.
    """

    seeds: list[int] | None = None
    vary: Literal["both", "training", "split"] = "both"
    # values typed Any, not list: the flag form --runs.grid.<dotted key> parses to a nested
    # dict, which expand refuses with the form that works
    grid: dict[str, Any] = field(default_factory=dict)

    @property
    def requested(self) -> bool:
        return self.seeds is not None or bool(self.grid)


@dataclass(frozen=True)
class RunSpec:
    """One run of a job: its label, its grid point and seed, and the config values it sets."""

    label: str
    point: tuple[tuple[str, Any], ...]
    seed: int | None
    overrides: dict[str, Any]


def _value_label(value: Any) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in text)


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _is_section(key: str, config: dict[str, Any]) -> bool:
    """Whether ``key`` names a section of the parser (``model``, ``model.init_args``), not one
    dict-valued setting (``model.init_args.net_args``): sections hold a class or are top-level."""
    owner = key.removesuffix(".init_args")
    return "." not in key or f"{owner}.class_path" in config


def _settings(key: str, value: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The config settings a grid value sets: a section's dict (``model.init_args: {local_lr:
    0.01}``) is split into the settings under it; a setting's value (a dict-valued one too,
    e.g. ``net_args``) is its own."""
    if key in config or not isinstance(value, Mapping) or not _is_section(key, config):
        return {key: value}
    settings: dict[str, Any] = {}
    for name, inner in value.items():
        settings |= _settings(f"{key}.{name}", inner, config)
    return settings


def _check_setting(key: str, setting: str, value: Any, config: dict[str, Any], runs: Runs) -> None:
    """Refuse a grid value's ``setting`` (``key`` itself or a setting under the section ``key``)
    that no config has, that the seeds set or that runs could not share a computation over."""
    given = f"'{key}'" if setting == key else f"'{key}' (its value sets '{setting}')"
    known = setting in config or any(k.startswith(setting + ".") for k in config)
    if known and setting not in config and _is_section(setting, config):
        example = next(k for k in config if k.startswith(setting + "."))
        raise ConfigError(
            f"runs.grid over {given}: '{setting}' is a section of the config, so its values "
            f"must be dicts of its settings ({value!r} is not); better, give each setting its "
            f"own key, e.g. {example}."
        )
    if not known:
        near = [k for k in config if k.rsplit(".", 1)[-1] == setting.rsplit(".", 1)[-1]]
        hint = f" (did you mean {', '.join(near)}?)" if near else ""
        raise ConfigError(
            f"runs.grid over {given}: unknown config key '{setting}'{hint}; give keys as "
            "--print_config nests them, e.g. model.init_args.local_lr."
        )
    if setting in (SEED_KEYS[runs.vary] if runs.seeds is not None else ()):
        raise ConfigError(
            f"runs.grid over {given} sets '{setting}', which runs.seeds (vary: {runs.vary}) "
            "sets already; give the seeds in one place."
        )
    if setting not in SHARED_DATA_KEYS and any(_under(setting, s) for s in SHAPE_KEYS):
        raise ConfigError(
            f"runs.grid over {given}: runs that differ by '{setting}' change tensor shapes, the "
            "data or the round's structure and could not share a computation; run each value "
            "as its own job (or its own config)."
        )


def _canonical(value: Any) -> str:
    """``value`` as JSON with numbers in one form (``1`` == ``1.0``): equal values, equal text."""

    def plain(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, Mapping):
            return {k: plain(x) for k, x in v.items()}
        return [plain(x) for x in v] if isinstance(v, (list, tuple)) else v

    return json.dumps(plain(value), sort_keys=True)


def _grid_settings(runs: Runs, config: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The settings each value of each grid key sets, every one checked."""
    grid: dict[str, list[dict[str, Any]]] = {}
    for key, values in runs.grid.items():
        if key not in config and not any(k.startswith(key + ".") for k in config):
            _check_setting(key, key, None, config, runs)  # unknown: refused by its own name
        if isinstance(values, Mapping):
            example = json.dumps(flatten(values, key + "."))
            raise ConfigError(
                f"runs.grid.{key} = {values}: a grid key names a whole dotted setting, and a "
                "flag --runs.grid.<dotted key> cannot give one (the parser splits the key at its "
                "first dot, and a second such flag would replace the first); give the grid as "
                f"one JSON dict, --runs.grid='{example}', or in a config file as "
                "runs: {grid: {<dotted key>: [values]}}."
            )
        if not isinstance(values, list) or not values:
            raise ConfigError(f"runs.grid.{key} must be a non-empty list of values.")
        grid[key] = [_settings(key, value, config) for value in values]
        for sets in grid[key]:
            for setting, inner in sets.items():
                _check_setting(key, setting, inner, config, runs)
        seen: dict[str, int] = {}
        for index, value in enumerate(values):
            if (first := seen.setdefault(_canonical(value), index)) != index:
                first_value = values[first]
                equal = (
                    f" ({first_value!r} == {value!r})" if repr(first_value) != repr(value) else ""
                )
                raise ConfigError(
                    f"runs.grid.{key} = {values} repeats a value{equal}: each run must differ."
                )
    for (key, per_value), (other, other_per_value) in itertools.combinations(grid.items(), 2):
        for setting, other_setting in itertools.product(
            {s for d in per_value for s in d}, {s for d in other_per_value for s in d}
        ):
            if _under(setting, other_setting) or _under(other_setting, setting):
                both = max(setting, other_setting, key=len)
                raise ConfigError(
                    f"runs.grid keys '{key}' and '{other}' both set '{both}': a run would take "
                    "one key's value and drop the other's; give each setting in one key."
                )
    return grid


def _check_distinct(specs: list[RunSpec], config: dict[str, Any]) -> None:
    """Refuse two runs that would be the same run, or write the same folder."""
    settings = sorted({s for spec in specs for s in spec.overrides})
    runs: dict[str, RunSpec] = {}
    folders: dict[str, RunSpec] = {}
    for spec in specs:
        values = {s: spec.overrides.get(s, config.get(s)) for s in settings}
        if (same := runs.setdefault(_canonical(values), spec)) is not spec:
            raise ConfigError(
                f"runs.grid gives two runs with the same settings ({same.label} and "
                f"{spec.label}: {dict(spec.point)} sets what {dict(same.point)} sets, the "
                "config's own values included); each run must differ: drop one of them."
            )
        if (other := folders.setdefault(spec.label, spec)) is not spec:
            raise ConfigError(
                f"runs.grid: the runs {dict(other.point)} and {dict(spec.point)} would share "
                f"the folder '{spec.label}' (run folders keep letters, digits, '.' and '-' of "
                "a value and write '_' for the rest); give values that differ in those."
            )


def expand(runs: Runs, config: dict[str, Any]) -> list[RunSpec]:
    """The runs of ``runs`` over the flattened resolved ``config``; bad requests are refused
    with one paragraph each (nothing has been written yet)."""
    if runs.seeds is not None:
        if not runs.seeds:
            raise ConfigError("runs.seeds is empty: give at least one seed, or leave it unset.")
        if len(set(runs.seeds)) != len(runs.seeds):
            raise ConfigError(f"runs.seeds = {runs.seeds} repeats a seed: each run must differ.")
    seed_keys = SEED_KEYS[runs.vary] if runs.seeds is not None else ()
    grid = _grid_settings(runs, config)
    keys = list(grid)
    specs = []
    for indices in itertools.product(*(range(len(grid[k])) for k in keys)):
        point = tuple((k, runs.grid[k][i]) for k, i in zip(keys, indices, strict=True))
        overrides: dict[str, Any] = {}
        parts = []
        for (key, value), index in zip(point, indices, strict=True):
            sets = grid[key][index]
            overrides |= sets
            if sets.keys() == {key} or not sets:
                parts.append(f"{key.rsplit('.', 1)[-1]}_{_value_label(value)}")
            else:  # a section's dict: named by the settings it sets
                parts += [f"{s.rsplit('.', 1)[-1]}_{_value_label(v)}" for s, v in sets.items()]
        for seed in runs.seeds if runs.seeds is not None else [None]:
            seeded = overrides | ({k: seed for k in seed_keys} if seed is not None else {})
            label = "-".join(parts + ([f"seed_{seed}"] if seed is not None else []))
            specs.append(RunSpec(label, point, seed, seeded))
    _check_distinct(specs, config)
    return specs


class JobMember(Callback):
    """Joins a run to its job: installs the shared executor and passes the job's stop signal
    to the run's checkpoint callback (signals reach only the job's main thread)."""

    def __init__(self, job: Job, index: int) -> None:
        self.job, self.index = job, index

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        method: FederatedMethod = pl_module  # type: ignore[assignment]
        method.executor = LockstepExecutor(self.job.lockstep, self.index, method.executor)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        checkpoint = trainer.checkpoint_callback
        if self.job.signal is not None and getattr(checkpoint, "_signal", 0) is None:
            checkpoint._signal = self.job.signal  # type: ignore[union-attr]


@dataclass
class Job:
    """The runs of one command: built and checked first, then trained in lockstep."""

    specs: list[RunSpec]
    save_dir: Path
    name: str
    select_metric: str
    lockstep: Lockstep = field(init=False)
    members: list[Any] = field(init=False)  # each run's CLI
    signal: int | None = None

    @property
    def folder(self) -> Path:
        """The job's folder: the runs' folders and ``job.json``."""
        return self.save_dir / self.name

    def run(self, build: Callable[[int, RunSpec, Callback], Any]) -> dict[str, Any]:
        """``build(index, spec, member_callback)`` returns a CLI ready to ``fit``."""
        clis, rng_states = [], []
        for index, spec in enumerate(self.specs):
            clis.append(build(index, spec, JobMember(self, index)))
            rng_states.append(get_rng())
        self.members = clis
        self.lockstep = Lockstep(len(clis), rng_states)
        labels = ", ".join(s.label for s in self.specs)
        rank_zero_info(f"job: {len(clis)} runs of one config trained together ({labels})")
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            with shared_loads():  # the runs read one in-memory copy of their dataset
                outcomes = self.lockstep.run([cli.fit_now for cli in clis])
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if self.lockstep.apart_reasons:
            rank_zero_info(
                "job: some runs trained apart because "
                + "; ".join(sorted(self.lockstep.apart_reasons))
            )
        failures = [(s, o) for s, o in zip(self.specs, outcomes, strict=True) if o is not None]
        interrupted = [o for _, o in failures if isinstance(o, RunInterrupted)]
        if interrupted:
            raise RunInterrupted(
                f"{len(interrupted)} of {len(self.specs)} runs stopped and saved last.ckpt; "
                "resume the job with the same command and --ckpt_path last.",
                interrupted[0].exit_code - 128,
            )
        summary = summarize(self.specs, [cli.results_path for cli in clis], self.select_metric)
        summary["failed"] = {s.label: f"{type(o).__name__}: {o}" for s, o in failures}
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str))
        print(format_summary(summary, self.folder / SUMMARY_FILE))
        if failures:
            raise failures[0][1]
        return summary

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signal = signum


def _read(results: dict[str, Any], section: str, key: str | None) -> float | None:
    value = results.get(section)
    if key is not None:
        value = value.get(key) if isinstance(value, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def summarize(
    specs: Sequence[RunSpec], results_paths: Sequence[Path | None], select_metric: str
) -> dict[str, Any]:
    """Mean and population std over seeds of every reported metric per grid point, and the
    best point by the mean validation ``select_metric`` at the best round."""
    # keyed by the point's canonical JSON: grid values may be lists or dicts (FedU's adjacency)
    points: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    for spec, path in zip(specs, results_paths, strict=True):
        if path is None or not path.exists():
            continue
        point = dict(spec.point)
        entry = points.setdefault(_canonical(point), (point, []))
        entry[1].append(json.loads(path.read_text()))
    rows = []
    for point, results in points.values():
        row: dict[str, Any] = {"point": point, "runs": len(results)}
        for section, key in REPORTED + (("val_at_best", select_metric),):
            values = [v for r in results if (v := _read(r, section, key)) is not None]
            if values:
                name = f"{section}.{key}" if key else section
                row[name] = {"mean": statistics.fmean(values), "std": statistics.pstdev(values)}
        rows.append(row)
    selector = f"val_at_best.{select_metric}"
    scored = [r for r in rows if selector in r]
    best = max(scored, key=lambda r: r[selector]["mean"]) if scored else None
    return {
        "runs": [s.label for s in specs],
        "select_metric": selector,
        "points": rows,
        "best_point": best["point"] if best else None,
    }


def format_summary(summary: dict[str, Any], path: Path) -> str:
    """The job's closing table: a run's closing entries (:func:`~lightning_pfl.console.
    closing_entries`: test accuracy at the best-validation round and at the last round; without
    validation, when no run has a best round, the mean over the last evaluations and the best
    evaluation in the best round's place), as mean +- std over seeds per grid point."""
    validated = any("test_at_best_val.acc" in row for row in summary["points"])
    columns = [
        (f"{entry.section}.{key}", title)
        for entry in closing_entries(validated)
        for key, title in ((entry.key, f"{entry.title} acc"), (entry.pooled, "pooled"))
    ]
    lines = [f"job summary ({path}): mean +- std over seeds, accuracy in %"]
    lines.append(" | ".join(["grid point", "runs"] + [title for _, title in columns]))
    for row in summary["points"]:
        point = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in row["point"].items())
        cells = [point or "(config)", str(row["runs"])]
        for name, _ in columns:
            stat = row.get(name)
            cells.append(f"{100 * stat['mean']:.2f} +- {100 * stat['std']:.2f}" if stat else "-")
        lines.append(" | ".join(cells))
    if summary["best_point"] is not None:
        lines.append(f"best by {summary['select_metric']}: {summary['best_point'] or '(config)'}")
    return "\n".join(lines)
