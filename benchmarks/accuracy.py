"""Accuracy benchmark: every method with a config, on identical seeded splits.

Without ``--root``: digits (bundled with scikit-learn), pathological (2 classes per client) and
Dirichlet(0.3) splits, configs ``configs/digits/*.yaml``.
With ``--root DIR``: FashionMNIST from DIR in the pFedHN setting (50 clients, 2 classes each,
``configs/fashion_mnist/*.yaml``); ``--rounds-scale`` shrinks the rounds to fit a time budget.

Every run goes through the CLI (``fit`` then test) and its ``results.json`` is collected. The
script prints a table and writes one JSON file: the personalized test accuracy at the round with
the best validation accuracy (mean over clients and sample-weighted), the same at the last
round, and seconds per round. Each row records the commit it ran from; ``--merge`` adds or
replaces rows in an existing file instead of overwriting it.

    python -m benchmarks.accuracy --out benchmarks/results/digits.json
    python -m benchmarks.accuracy --methods FedSimSup --merge --out benchmarks/results/digits.json
    python -m benchmarks.accuracy --root ../shared/datasets --rounds-scale 0.3 \
        --out benchmarks/results/fashion_mnist.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_pfl.cli import run

REPO = Path(__file__).resolve().parents[1]
METHODS = {
    "Local": "local",
    "FedAvg": "fedavg",
    "pFedHN": "pfedhn",
    "pFedHN-PC": "pfedhn_pc",
    "pFedKT": "pfedkt",
    "FedSimSup": "fedsimsup",
}
SPLITS = {
    "pathological": [
        "--data.init_args.partition=ClassesPerClient",
        "--data.init_args.partition.init_args.classes=2",
    ],
    "dirichlet": [
        "--data.init_args.partition=Dirichlet",
        "--data.init_args.partition.init_args.alpha=0.3",
        "--data.init_args.partition.init_args.min_samples=20",
    ],
}


def run_one(config: Path, extra: list[str], log_dir: Path, name: str) -> dict[str, Any]:
    args = [
        "fit",
        f"--config={config}",
        f"--trainer.logger.init_args.save_dir={log_dir}",
        f"--trainer.logger.init_args.name={name}",
        "--trainer.enable_progress_bar=false",
        *extra,
    ]
    cli = run(args)
    with open(Path(cli.trainer.log_dir) / "results.json") as f:
        return json.load(f)


def summarize(
    method: str, split: str, seed: int, result: dict[str, Any], commit: str
) -> dict[str, Any]:
    best, last = result["test_at_best_val"] or {}, result["test_last"] or {}
    return {
        "commit": commit,
        "method": method,
        "split": split,
        "seed": seed,
        "rounds": result["rounds"],
        "best_round": result["best_round"],
        "test_acc_at_best_val": best.get("acc"),
        "test_acc_weighted_at_best_val": best.get("acc_weighted"),
        "test_acc_last": last.get("acc"),
        "test_acc_weighted_last": last.get("acc_weighted"),
        "seconds_per_round": result["seconds_per_round"],
        "comm_bytes_total": result["comm_bytes_down_total"] + result["comm_bytes_up_total"],
    }


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
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
    }


COLUMNS = (  # header, width, row -> text
    ("split", 13, lambda r: r["split"]),
    ("method", 10, lambda r: r["method"]),
    ("rounds", 6, lambda r: str(r["rounds"])),
    ("acc@best", 9, lambda r: f"{100 * r['test_acc_at_best_val']:.2f}%"),
    ("wacc@best", 9, lambda r: f"{100 * r['test_acc_weighted_at_best_val']:.2f}%"),
    ("acc@last", 9, lambda r: f"{100 * r['test_acc_last']:.2f}%"),
    ("s/round", 8, lambda r: f"{r['seconds_per_round']:.4f}"),
)


def print_table(rows: list[dict[str, Any]]) -> None:
    header = " ".join(f"{name:>{width}}" for name, width, _ in COLUMNS)
    print(header)
    print("-" * len(header))
    for r in rows:
        print(" ".join(f"{cell(r):>{width}}" for _, width, cell in COLUMNS))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--root", help="folder with FashionMNIST/raw (runs the FashionMNIST setting)"
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--rounds-scale", type=float, default=1.0, help="multiply every config's rounds"
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--log-dir", default=str(REPO / "benchmarks" / "runs"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of --out that this run does not redo (same method, split, seed)",
    )
    args = parser.parse_args()
    started = environment()  # the code and time the runs start from

    if args.root:
        config_dir, splits = REPO / "configs" / "fashion_mnist", {"pathological": []}
        base = [f"--data.init_args.root={args.root}"]
    else:
        config_dir, splits, base = REPO / "configs" / "digits", SPLITS, []
    rows = []
    for seed in args.seeds:
        for split, split_args in splits.items():
            for method in args.methods:
                config = config_dir / f"{METHODS[method]}.yaml"
                if not config.exists():
                    print(f"skipping {method}: no {config}")
                    continue
                rounds = _scaled_rounds(config, args.rounds_scale)
                extra = [
                    *base,
                    *split_args,
                    f"--data.init_args.seed={seed}",
                    f"--model.init_args.seed={seed}",
                    f"--trainer.max_steps={rounds}",
                ]
                result = run_one(
                    config,
                    extra,
                    Path(args.log_dir),
                    f"{config_dir.name}-{split}-{METHODS[method]}-s{seed}",
                )
                rows.append(summarize(method, split, seed, result, started["commit"]))
                print_table(rows[-1:])
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        previous = [{"commit": old["environment"]["commit"], **r} for r in old["rows"]]
        redone = {(r["method"], r["split"], r["seed"]) for r in rows}
        kept = [r for r in previous if (r["method"], r["split"], r["seed"]) not in redone]
        order = list(METHODS)
        rows = sorted(
            kept + rows,
            key=lambda r: (r["seed"], r["split"] != "pathological", order.index(r["method"])),
        )
    print()
    print_table(rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "benchmark": "accuracy",
                "setting": config_dir.name,
                "environment": started,
                "command": sys.argv,
                "rows": rows,
            },
            f,
            indent=2,
        )


def _scaled_rounds(config: Path, scale: float) -> int:
    import yaml

    with open(config) as f:
        rounds = int(yaml.safe_load(f)["trainer"]["max_steps"])
    return max(1, int(round(rounds * scale)))


if __name__ == "__main__":
    main()
