"""Accuracy benchmark: every method with a config, on identical seeded splits, several seeds.

Settings (``--setting``), each a folder of configs, one per method:

- ``digits`` (no download): ``configs/digits/*.yaml``, 10 clients, on two splits: pathological
  (2 classes per client) and Dirichlet(0.3).
- ``fashion_mnist``: ``configs/fashion_mnist/*.yaml`` with FashionMNIST under ``--root``, the
  pFedHN setting (50 clients, 2 classes each).
- ``fashion_mnist_dirichlet``: the same configs with Dirichlet(0.3) over 100 clients and 10% of
  them (10) per round.
- ``fashion_mnist_mlp``: ``configs/fashion_mnist_mlp/*.yaml``, pFedHN's MNIST protocol (MLP
  target, 2 classes per client, one client per round) at 10, 50 and 100 clients on FashionMNIST.
- ``fashion_mnist_hn_update``: ``configs/fashion_mnist_hn_update/*.yaml``, pFedHN's two server
  updates with 10 clients per round (``hn_update: mean`` and ``per_client``).
- ``fashion_mnist_mh``: ``configs/fashion_mnist_mh/*.yaml``, MH-pFedHN's setting reduced for a
  CPU: 50 clients with a heterogeneous model zoo (and a homogeneous one), 75/25 holdout, on
  non-IID_1 (2 classes per client) and non-IID_2 (Dirichlet(0.01), at least 40 samples each).
- ``digits_100clients``: ``configs/digits_100clients/*.yaml``, the same protocol on digits with
  100 clients (no download).
- ``privacy_digits``: ``configs/privacy/digits/*.yaml``, FedAvg, FedPer, pFedHN and MH-pFedHN with
  client-level DP at two noise multipliers in the digits setting (docs/privacy.md); rows carry
  the run's ``privacy`` record (epsilon at delta). ``fashion_mnist_privacy`` (and ``_reduced``,
  100 rounds): the same on FashionMNIST, ``configs/privacy/fashion_mnist*/``.
- ``conditions``: ``configs/conditions/*.yaml``, the digits setting's pathological split with
  unreliable clients (drop rate 0.3, or stragglers; docs/conditions.md).
- ``fashion_mnist_pfedhn_table1``: ``configs/fashion_mnist_pfedhn_table1/*.yaml``, pFedHN's
  Table 1 protocol in full (50 clients, 2 classes each, 5,000 rounds of one client) on
  FashionMNIST for pFedHN, Local and FedAvg (fact entries in ``configs/papers/pfedhn.yaml``).
- ``fashion_mnist_pfedkt_table1``: ``configs/fashion_mnist_pfedkt_table1/*.yaml``, pFedKT's
  Table 1 protocol in full (50 clients, E = 10, 5 clients per round, 500 rounds) on FashionMNIST
  for pFedKT, Local and FedAvg (``configs/papers/pfedkt.yaml``).
- ``fashion_mnist_novel``: ``configs/fashion_mnist_novel/*.yaml``, pFedHN's novel-client
  protocol (section 5.3) reduced for a CPU: 90 training clients drawing Dir(0.1) class
  proportions and 10 novel ones, one split per novel alpha (``novel_alpha_0.1``, ``_0.25``,
  ``_0.5``, ``_1.0``); rows carry the ``NovelClients`` entry (``novel_clients``).
- ``fashion_mnist_mlp_5000rounds``: ``configs/fashion_mnist_mlp_5000rounds/*.yaml``, pFedHN's
  100-client MNIST protocol in full (5,000 rounds) on FashionMNIST with the hypernetwork
  parametrizations compared in docs/results.md.

Every row also records the accuracy of the trivial personalized classifier on the same split:
each client predicts the most frequent class of its own training data for every test sample
(``test_acc_majority_class``, mean over clients, and ``test_acc_weighted_majority_class``), the
floor a personalized method has to clear on that split.

Every row also records the training stability: the largest per-round mean local loss after round
100 (``train_loss_max_after_100``) and the number of those rounds above 5
(``rounds_loss_above_5_after_100``), read from the run's TensorBoard ``train/loss``.

Every run goes through the CLI (``fit``, then test) and its ``results.json`` is collected. Rows
(one per split and seed) go to ``<out-dir>/<setting>/<config name>.json``, one file per method,
with the environment and the command that last wrote the file; each row names its ``device``,
``torch``, ``commit`` and ``cli``, the arguments that train it again (``python cli.py *cli`` at
that commit; a resumed run's are those of one that was not interrupted). Rows of the same
split and seed are replaced, others kept, so methods and seeds can be run separately, also on
different machines. ``python -m benchmarks.report DIR`` renders a folder as a table with the
mean and standard deviation over seeds.

With ``--resume`` and the ``--log-dir`` of an interrupted benchmark, every run that left a
``checkpoints/last.ckpt`` there goes on from it (``--ckpt_path last``: the same run folder, the
config checked against the checkpoint's) instead of starting over; the others start fresh.

With ``--jobs N``, each run (method, seed, split) is a process of its own, N at a time, on the
same device (on one GPU, many small runs share it well: 14 at once on an H100 in
docs/results.md; on a CPU give each one thread, ``OMP_NUM_THREADS=1`` and ``--extra
--model.init_args.client_threads=1``). Each run's console output goes to
``<log-dir>/<run>.log`` (appended to when resumed); this process alone writes the out files,
as each run ends. SIGINT or SIGTERM to it is passed on to the running runs, which save
``last.ckpt`` and stop, and no new run starts: ``--resume`` with the same ``--log-dir`` goes
on with the unfinished ones.

Without ``--jobs``, several ``--seeds`` of a method and split are one job of the CLI
(``--runs.seeds``, :mod:`lightning_pfl.jobs`): the runs' local training is shared, each run
keeps its own folder ``<log-dir>/<setting>-<split>-<method>/seed_<seed>`` and row, and a row's
``cli`` trains that run alone (the same result, up to float rounding on the vmap and threaded
paths). ``--seeds-apart`` runs them one after another instead. SIGINT or SIGTERM stops the
run (or job) after its round with ``last.ckpt`` saved; the benchmark prints the run's paragraph
and how to go on, and exits with 128 + the signal number, as the CLI does.

    python -m benchmarks.accuracy --setting digits --seeds 0 1 2
    python -m benchmarks.accuracy --setting digits --methods fedprox --seeds 0 1 2
    python -m benchmarks.accuracy --setting fashion_mnist --root /data --rounds-scale 0.2
    python -m benchmarks.accuracy --setting digits --log-dir runs --resume   # after a stop
    python -m benchmarks.accuracy --setting digits --seeds 0 1 2 --jobs 8    # 8 runs at once
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_pfl.cli import run
from lightning_pfl.errors import RunInterrupted
from lightning_pfl.experiment import checkpointed_versions
from lightning_pfl.messages import report, user_error

REPO = Path(__file__).resolve().parents[1]
DIRICHLET = [
    "--data.init_args.partition=Dirichlet",
    "--data.init_args.partition.init_args.alpha=0.3",
    "--data.init_args.partition.init_args.min_samples=20",
]
SETTINGS: dict[str, tuple[str, dict[str, list[str]]]] = {
    "digits": (
        "digits",
        {
            "pathological": [
                "--data.init_args.partition=ClassesPerClient",
                "--data.init_args.partition.init_args.classes=2",
            ],
            "dirichlet": DIRICHLET,
        },
    ),
    "fashion_mnist": ("fashion_mnist", {"pathological": []}),
    "fashion_mnist_mlp": ("fashion_mnist_mlp", {"pathological": []}),
    "digits_100clients": ("digits_100clients", {"pathological": []}),
    # the digits setting's pathological split with unreliable clients (docs/conditions.md)
    "conditions": ("conditions", {"pathological": []}),
    "fashion_mnist_hn_update": ("fashion_mnist_hn_update", {"pathological": []}),
    # pFedHN section 5.3: the four novel-client concentrations, the training clients' alpha 0.1
    "fashion_mnist_novel": (
        "fashion_mnist_novel",
        {
            f"novel_alpha_{alpha}": [f"--data.init_args.partition.init_args.novel_alpha={alpha}"]
            for alpha in ("0.1", "0.25", "0.5", "1.0")
        },
    ),
    "fashion_mnist_pfedhn_table1": ("fashion_mnist_pfedhn_table1", {"pathological": []}),
    "fashion_mnist_pfedkt_table1": ("fashion_mnist_pfedkt_table1", {"pathological": []}),
    "fashion_mnist_mlp_5000rounds": ("fashion_mnist_mlp_5000rounds", {"pathological": []}),
    "fashion_mnist_mh": (
        "fashion_mnist_mh",
        {
            "pathological": [],
            "dirichlet": [
                "--data.init_args.partition=Dirichlet",
                "--data.init_args.partition.init_args.alpha=0.01",
                "--data.init_args.partition.init_args.min_samples=40",
            ],
        },
    ),
    "privacy_digits": ("privacy/digits", {"pathological": []}),
    "fashion_mnist_privacy": ("privacy/fashion_mnist", {"pathological": []}),
    "fashion_mnist_privacy_reduced": ("privacy/fashion_mnist_reduced", {"pathological": []}),
    "fashion_mnist_dirichlet": (
        "fashion_mnist",
        {
            "dirichlet": [
                *DIRICHLET,
                "--data.init_args.num_clients=100",
                "--model.init_args.clients_per_round=10",
            ]
        },
    ),
}


def run_one(
    config: Path,
    extra: list[str],
    log_dir: Path,
    name: str,
    callbacks: list[Callback] | None = None,
) -> dict[str, Any]:
    args = [
        "fit",
        f"--config={config}",
        f"--trainer.logger.init_args.save_dir={log_dir}",
        f"--trainer.logger.init_args.name={name}",
        "--trainer.enable_progress_bar=false",
        *extra,
    ]
    return finished_run(run(args, callbacks))


def finished_run(cli: Any) -> dict[str, Any]:
    """A finished run's ``results.json`` with its training stability and majority-class floor."""
    assert cli.trainer.log_dir is not None, "the benchmark runs always have a logger"
    run_dir = Path(cli.trainer.log_dir)
    with open(run_dir / "results.json") as f:
        result: dict[str, Any] = json.load(f)
    result["stability"] = training_stability(run_dir)
    result["majority_class"] = majority_class_accuracy(cli.datamodule.partition_counts())
    return result


def run_seeds(
    config: Path, extra: list[str], log_dir: Path, name: str, seeds: list[int]
) -> list[dict[str, Any]]:
    """The runs of ``seeds`` (split and training seed) as one job (``--runs.seeds``): their
    local training shared, each run's folder ``<name>/seed_<seed>``; rows in seed order."""
    args = [
        "fit",
        f"--config={config}",
        f"--trainer.logger.init_args.save_dir={log_dir}",
        f"--trainer.logger.init_args.name={name}",
        *extra,
        f"--runs.seeds={json.dumps(seeds)}",
    ]
    job = run(args).job
    assert job is not None
    return [finished_run(member) for member in job.members]


def majority_class_accuracy(counts: dict[str, np.ndarray]) -> dict[str, float]:
    """Test accuracy when each client predicts the most frequent class of its training split.

    ``counts``: client x class sample counts per split (``partition_counts()``). Returns the
    mean over clients with test samples (``acc``) and the sample-weighted one.
    """
    train, test = np.asarray(counts["train"]), np.asarray(counts["test"])
    has_test = test.sum(1) > 0
    hits = test[np.arange(len(test)), train.argmax(1)][has_test]
    sizes = test.sum(1)[has_test]
    return {"acc": float((hits / sizes).mean()), "acc_weighted": float(hits.sum() / sizes.sum())}


def training_stability(run_dir: Path, after: int = 100, threshold: float = 5.0) -> dict[str, Any]:
    """The largest logged ``train/loss`` after round ``after``, and rounds above ``threshold``."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss") if e.step > after]
    return {
        f"train_loss_max_after_{after}": max(losses, default=None),
        f"rounds_loss_above_{threshold:g}_after_{after}": sum(v > threshold for v in losses),
    }


def summarize(
    method: str,
    split: str,
    seed: int,
    result: dict[str, Any],
    commit: str,
    cli: list[str],
) -> dict[str, Any]:
    """One row of a results file; ``cli`` is the run's CLI arguments (``python cli.py *cli``
    trains it again at ``commit``), without where the run logged or that it was resumed."""
    best, last = result["test_at_best_val"] or {}, result["test_last"] or {}
    return {
        "commit": commit,
        "cli": cli,
        "method": method,
        "class": result["method"],
        "split": split,
        "seed": seed,
        "rounds": result["rounds"],
        "stopped_by": result.get("stopped_by"),
        "best_round": result["best_round"],
        "select_metric": result["select_metric"],
        "val_acc_at_best": (result.get("val_at_best") or {}).get("acc"),
        "test_acc_at_best_val": best.get("acc"),
        "test_acc_weighted_at_best_val": best.get("acc_weighted"),
        "test_acc_last": last.get("acc"),
        "test_acc_weighted_last": last.get("acc_weighted"),
        # the papers' summaries over evaluations (lightning_pfl.metrics.over_evaluations)
        "test_max_over_evals": result.get("test_max_over_evals"),
        "test_last_evals": result.get("test_last_evals"),
        "eval_history": result.get("eval_history"),
        **({"paper": result["paper"]} if "paper" in result else {}),
        # per client group (e.g. arch_<name> of model-heterogeneous methods), mean over clients
        "test_group_acc_at_best_val": {
            key.removesuffix("/acc"): value for key, value in best.items() if key.endswith("/acc")
        },
        "seconds_per_round": result["seconds_per_round"],
        "comm_bytes_total": result["comm_bytes_down_total"] + result["comm_bytes_up_total"],
        # local / server FLOPs, local steps taken, clients that reported back (RoundCosts)
        **({"costs": result["costs"]} if "costs" in result else {}),
        "test_acc_majority_class": result["majority_class"]["acc"],
        "test_acc_weighted_majority_class": result["majority_class"]["acc_weighted"],
        **result["stability"],
        **({"novel_clients": result["novel_clients"]} if "novel_clients" in result else {}),
        **({"privacy": result["privacy"]} if "privacy" in result else {}),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_threads": torch.get_num_threads(),
        # float rounding on a CPU follows the kernels ATen dispatches to (AVX2, AVX512, ...)
        # and the processor: runs reproduce bit for bit only where both match
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": _cpu_model(),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
    }


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


COLUMNS = (  # header, width, row -> text
    ("split", 13, lambda r: r["split"]),
    ("method", 14, lambda r: r["method"]),
    ("seed", 4, lambda r: str(r["seed"])),
    ("rounds", 6, lambda r: str(r["rounds"])),
    ("acc@best", 9, lambda r: _percent(r["test_acc_at_best_val"])),
    ("wacc@best", 9, lambda r: _percent(r["test_acc_weighted_at_best_val"])),
    ("acc@last", 9, lambda r: _percent(r["test_acc_last"])),
    ("s/round", 8, lambda r: f"{r['seconds_per_round']:.4f}"),
)


def print_table(rows: list[dict[str, Any]]) -> None:
    header = " ".join(f"{name:>{width}}" for name, width, _ in COLUMNS)
    print(header)
    print("-" * len(header))
    for r in rows:
        print(" ".join(f"{cell(r):>{width}}" for _, width, cell in COLUMNS))


def scaled_trainer_args(config: Path, scale: float) -> list[str]:
    """``max_steps`` and ``val_check_interval`` of ``config`` multiplied by ``scale``."""
    with open(config) as f:
        trainer = yaml.safe_load(f).get("trainer", {})
    rounds = max(1, int(round(int(trainer.get("max_steps", 100)) * scale)))
    interval = int(trainer.get("val_check_interval", 10))
    interval = min(rounds, max(1, int(round(interval * scale))))
    return [f"--trainer.max_steps={rounds}", f"--trainer.val_check_interval={interval}"]


def run_arguments(
    config: Path, data: list[str], seed: int | None, scale: float, extra: list[str]
) -> list[str]:
    """CLI arguments of one benchmark run: ``data`` (root and split), ``seed`` for the split
    and the model (None: set by the job), the config's rounds scaled by ``scale``, then
    ``extra``."""
    seeds = [f"--data.init_args.seed={seed}", f"--model.init_args.seed={seed}"]
    return [
        *data,
        *(seeds if seed is not None else []),
        *scaled_trainer_args(config, scale),
        *extra,
    ]


def run_name(setting: str, split: str, method: str, seed: int | None) -> str:
    """A run's name: its folder under ``--log-dir`` (where ``--resume`` looks for it); a job's
    (seed None) holds its runs' folders."""
    return f"{setting}-{split}-{method}" + (f"-s{seed}" if seed is not None else "")


def with_machine(row: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the ``device`` and ``torch`` of ``environment`` unless it names its own."""
    return {"device": environment["device"], "torch": environment["torch"], **row}


def write_rows(path: Path, rows: list[dict[str, Any]], started: dict[str, Any]) -> None:
    """Write ``rows`` to ``path``, keeping its rows of other (split, seed) pairs.

    Every row names the device and torch it ran with; a kept row written before rows did gets
    the old file's environment, so a file whose seeds ran on different machines says so.
    """
    kept: list[dict[str, Any]] = []
    if path.exists():
        old = json.loads(path.read_text())
        redone = {(r["split"], r["seed"]) for r in rows}
        kept = [
            with_machine(r, old["environment"])
            for r in old["rows"]
            if (r["split"], r["seed"]) not in redone
        ]
    new = [with_machine(r, started) for r in rows]
    merged = sorted(kept + new, key=lambda r: (r["split"], r["seed"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "accuracy",
        "setting": path.parent.name,
        "environment": started,
        "command": sys.argv,
        "rows": merged,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")


def run_in_processes(
    args: argparse.Namespace,
    runs: list[tuple[Path, int, str]],
    log_dir: Path,
    started: dict[str, Any],
) -> list[str]:
    """Run each ``(config, seed, split)`` of ``runs`` as ``python -m benchmarks.accuracy`` with
    that one method, seed and split, ``args.jobs`` at a time; merge each finished run's row into
    ``args.out_dir`` (only here, so no two processes write a file). SIGINT/SIGTERM are passed on
    to the running runs and start no new one. Returns the runs that failed or were stopped."""
    scratch = Path(tempfile.mkdtemp(prefix="pfl-benchmark-rows-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    running: set[subprocess.Popen[bytes]] = set()
    lock, stopping = threading.Lock(), threading.Event()

    def stop(signum: int, frame: object) -> None:
        stopping.set()
        with lock:
            for process in running:
                process.send_signal(signum)

    def one(run: tuple[Path, int, str]) -> tuple[str, int | None, Path]:
        config, seed, split = run
        name = run_name(args.setting, split, config.stem, seed)
        command = [sys.executable, "-m", "benchmarks.accuracy", "--setting", args.setting]
        command += ["--methods", config.stem, "--seeds", str(seed), "--splits", split]
        command += ["--rounds-scale", str(args.rounds_scale), "--log-dir", str(log_dir)]
        command += ["--out-dir", str(scratch / name)]
        command += ["--root", args.root] if args.root else []
        command += ["--resume"] if args.resume else []
        result = scratch / name / args.setting / f"{config.stem}.json"
        if stopping.is_set():
            return name, None, result
        with open(log_dir / f"{name}.log", "a") as log:  # a resumed run adds to its log
            with lock:  # a signal between the check and the start must reach this run too
                if stopping.is_set():
                    return name, None, result
                process = subprocess.Popen(
                    [*command, "--extra", *args.extra],
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # out of the terminal's process group: a Ctrl-C reaches each run once,
                    # through stop(), not also directly (a second SIGINT stops a run unsaved)
                    start_new_session=True,
                )
                running.add(process)
            code = process.wait()
        with lock:
            running.discard(process)
        return name, code, result

    failed = []
    handlers = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            for future in as_completed([pool.submit(one, run) for run in runs]):
                name, code, result = future.result()
                if code is None:
                    failed.append(name)
                    print(f"{name}: not started (stopped)")
                elif code != 0:
                    failed.append(name)
                    print(f"{name}: failed or stopped (exit code {code}), see {log_dir / name}.log")
                else:
                    rows = json.loads(result.read_text())["rows"]
                    write_rows(Path(args.out_dir) / args.setting / result.name, rows, started)
                    print_table(rows)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setting", choices=list(SETTINGS), default="digits")
    parser.add_argument("--root", help="folder holding FashionMNIST/raw (fashion_mnist settings)")
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--seeds-apart",
        action="store_true",
        help="train the seeds one after another instead of as one job (--runs.seeds)",
    )
    parser.add_argument("--rounds-scale", type=float, default=1.0)
    parser.add_argument("--methods", nargs="+", help="config names (default: every config)")
    parser.add_argument("--splits", nargs="+", help="splits of the setting (default: all)")
    parser.add_argument("--log-dir", help="where runs write their logs (default: a temp folder)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="go on from the last.ckpt of runs under --log-dir left by an interrupted benchmark",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once, each in its own process (default 1: one after another, in this one)",
    )
    parser.add_argument(
        "--extra", nargs=argparse.REMAINDER, default=[], help="more CLI arguments for every run"
    )
    args = parser.parse_args()
    if args.resume and not args.log_dir:
        parser.error("--resume needs the --log-dir of the interrupted benchmark")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: runs at once must be 1 or more")
    started = environment()
    folder, splits = SETTINGS[args.setting]
    if args.setting.startswith("fashion_mnist") and not args.root:
        parser.error(f"--setting {args.setting} needs --root (the folder holding FashionMNIST/)")
    base = [f"--data.init_args.root={args.root}"] if args.root else []
    configs = sorted((REPO / "configs" / folder).glob("*.yaml"))
    if args.methods:
        unknown = set(args.methods) - {c.stem for c in configs}
        if unknown:
            parser.error(f"no config for {sorted(unknown)} in configs/{folder}")
        configs = [c for c in configs if c.stem in args.methods]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="pfl-benchmark-"))
    print(f"run logs: {log_dir}")
    chosen = {
        split: split_args
        for split, split_args in splits.items()
        if not args.splits or split in args.splits
    }
    try:
        run_configs(args, configs, chosen, base, log_dir, started)
    except Exception as error:
        found = user_error(error)
        if found is None or os.environ.get("PFL_DEBUG") == "1":
            raise
        sys.stderr.write(report(found))
        if isinstance(found, RunInterrupted):
            sys.stderr.write(
                "benchmark: rows are written per config once all its runs finish; continue "
                f"with the same command and --resume --log-dir {log_dir}\n"
            )
        sys.exit(found.exit_code)


def run_configs(
    args: argparse.Namespace,
    configs: list[Path],
    chosen: dict[str, list[str]],
    base: list[str],
    log_dir: Path,
    started: dict[str, Any],
) -> None:
    """Train every config's runs and write its rows (``main`` after parsing)."""
    if args.jobs > 1:
        runs = [
            (config, seed, split) for config in configs for seed in args.seeds for split in chosen
        ]
        if failed := run_in_processes(args, runs, log_dir, started):
            sys.exit(
                f"{len(failed)} of {len(runs)} runs failed or were stopped: {', '.join(failed)}; "
                "the others' rows are written (--resume with this --log-dir continues stopped runs)"
            )
        return
    for config in configs:
        rows = []
        if len(args.seeds) > 1 and not args.seeds_apart:
            for split, split_args in chosen.items():
                extra = run_arguments(
                    config, base + split_args, None, args.rounds_scale, args.extra
                )
                name = run_name(args.setting, split, config.stem, None)
                if args.resume and any(
                    checkpointed_versions(p) for p in (log_dir / name).glob("*")
                ):
                    print(f"{name}: resuming the job's runs from their last.ckpt")
                    extra.append("--ckpt_path=last")
                results = run_seeds(config, extra, log_dir, name, args.seeds)
                for seed, result in zip(args.seeds, results, strict=True):
                    alone = run_arguments(
                        config, base + split_args, seed, args.rounds_scale, args.extra
                    )
                    cli = ["fit", f"--config={config.relative_to(REPO)}", *alone]
                    rows.append(summarize(config.stem, split, seed, result, started["commit"], cli))
                    print_table(rows[-1:])
            write_rows(Path(args.out_dir) / args.setting / f"{config.stem}.json", rows, started)
            continue
        for seed in args.seeds:
            for split, split_args in chosen.items():
                extra = run_arguments(
                    config, base + split_args, seed, args.rounds_scale, args.extra
                )
                name = run_name(args.setting, split, config.stem, seed)
                cli = ["fit", f"--config={config.relative_to(REPO)}", *extra]
                if args.resume and checkpointed_versions(log_dir / name):
                    print(f"{name}: resuming from its last.ckpt")
                    extra.append("--ckpt_path=last")
                result = run_one(config, extra, log_dir, name)
                rows.append(summarize(config.stem, split, seed, result, started["commit"], cli))
                print_table(rows[-1:])
        write_rows(Path(args.out_dir) / args.setting / f"{config.stem}.json", rows, started)


if __name__ == "__main__":
    main()
