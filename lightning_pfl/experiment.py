"""What makes two runs the same experiment, and which checkpoint a run may continue from.

An experiment is every model and data argument that changes the math, flattened to
``{"model.init_args.local_lr": 0.005, ...}`` (speed and placement settings, :data:`RUNTIME_KEYS`,
left out). A run writes it to ``experiment.json`` in its folder and into every checkpoint; a
resume or a test from a checkpoint is refused unless the two agree, up to the keys the user
allows to change. Pure functions: the CLI gives them the configs and folders.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_pfl.errors import ConfigError

# Arguments that change speed or placement but not the math: they may differ on resume.
RUNTIME_KEYS = {
    "model.init_args.vectorize",
    "model.init_args.compile_step",
    "model.init_args.cuda_graphs",
    "model.init_args.client_threads",
    "model.init_args.eval_batch_size",
    "model.init_args.last_evals",
    "model.init_args.log_figures",
    "model.init_args.offload_client_state",
    "data.init_args.root",
    "data.init_args.download",
    "data.init_args.eval_clients_per_batch",
}
EXPERIMENT_FILE = "experiment.json"
LAST_CHECKPOINT = Path("checkpoints") / "last.ckpt"


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


def experiment_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The experiment of a dumped config (its ``model`` and ``data`` sections), flattened."""
    flat = flatten({"model": config["model"], "data": config["data"]})
    return {k: v for k, v in flat.items() if k not in RUNTIME_KEYS}


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between two flat experiment descriptions."""
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: {saved.get(k, '<unset>')!r} in the checkpoint, {current.get(k, '<unset>')!r} now"
        for k in keys
        if saved.get(k, "<unset>") != current.get(k, "<unset>")
    ]


def check_same_experiment(
    saved: Mapping[str, Any] | None,
    current: Mapping[str, Any],
    allowed: Collection[str],
    source: str,
) -> None:
    """Refuse ``source`` (a checkpoint or run folder) unless its ``saved`` experiment is
    ``current`` up to the ``allowed`` keys."""
    if saved is None:
        raise ConfigError(
            f"{source} was not written by a lightning-pfl run (no experiment record); "
            "it cannot be checked against the config."
        )
    found = [d for d in differences(saved, current) if d.split(":")[0] not in allowed]
    if found:
        raise ConfigError(
            f"{source} belongs to a different experiment than this config: "
            + "; ".join(found)
            + ". Use the config it was trained with, or, if a difference is intended, list "
            "its key in --allow_changes."
        )


def checkpointed_versions(run_dir: Path) -> list[Path]:
    """The ``version_*`` folders of ``run_dir`` holding ``checkpoints/last.ckpt``, newest first
    (what ``--ckpt_path last`` resumes from)."""
    return sorted(
        (p for p in run_dir.glob("version_*") if (p / LAST_CHECKPOINT).exists()),
        key=lambda p: int(p.name.split("_")[1]) if p.name.split("_")[1].isdigit() else -1,
        reverse=True,
    )


def last_of_same_experiment(
    run_dir: Path, current: Mapping[str, Any], allowed: Collection[str]
) -> Path:
    """The newest ``version_*`` folder of ``run_dir`` whose checkpoint is of the ``current``
    experiment (``--ckpt_path last``); refused with the newest mismatch when none is."""
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
            check_same_experiment(saved, current, allowed, str(version / LAST_CHECKPOINT))
        except ConfigError as mismatch:
            if version == candidates[-1]:
                raise mismatch from None
            continue
        return version
    raise AssertionError("unreachable")


def check_checkpoint(path: Path, current: Mapping[str, Any], allowed: Collection[str]) -> None:
    """Refuse ``--ckpt_path path`` unless it is a readable checkpoint of ``current``."""
    if not path.is_file():
        raise ConfigError(f"--ckpt_path {path}: no such file.")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ConfigError(f"--ckpt_path {path} cannot be read as a checkpoint: {error}") from error
    check_same_experiment(checkpoint.get("pfl", {}).get("experiment"), current, allowed, str(path))


def version_holding(path: Path, run_dir: Path) -> str | None:
    """The ``version_*`` folder of ``run_dir`` that checkpoint ``path`` lies in, if any (a run
    continued from it writes into that folder)."""
    version_dir = path.resolve().parent.parent
    return version_dir.name if version_dir.parent == run_dir.resolve() else None


def resume_from(
    ckpt_path: str,
    subcommand: str,
    run_dir: Path | None,
    current: Mapping[str, Any],
    allowed: Collection[str],
) -> tuple[str, str | None]:
    """The checkpoint a run of ``subcommand`` given ``--ckpt_path ckpt_path`` starts from, and
    the ``version_*`` folder of ``run_dir`` (the logger's run folders; None: a logger without
    them) it writes into (None: a new one): ``last`` is the newest checkpoint of the
    ``current`` experiment, and ``fit`` from a checkpoint of ``run_dir`` continues that run in
    its own folder.

    Raises:
        ConfigError: for ``last`` outside ``fit`` or without run folders, and for a checkpoint
            that is missing, unreadable or of another experiment (up to ``allowed`` keys).
    """
    if ckpt_path == "last":
        if subcommand != "fit":
            raise ConfigError("--ckpt_path last resumes training; give a file to test.")
        if run_dir is None:
            raise ConfigError("--ckpt_path last needs the TensorBoard logger's run folders.")
        version = last_of_same_experiment(run_dir, current, allowed)
        return str(version / LAST_CHECKPOINT), version.name
    check_checkpoint(Path(ckpt_path), current, allowed)
    if subcommand == "fit" and run_dir is not None:
        return ckpt_path, version_holding(Path(ckpt_path), run_dir)
    return ckpt_path, None
