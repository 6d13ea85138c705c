"""Which methods' evaluation depends on whether it runs under inference mode or no_grad?

Lightning validates and tests under ``torch.inference_mode`` unless told otherwise; ``fit``'s
own validation runs under ``no_grad``. Under inference mode ``torch.func`` differentiates to
zeros in torch 2.11 (pytorch/pytorch#177318), so a method that trains at evaluation
(fine-tuning, adaptation) evaluated an unadapted model in ``test`` there. The library now
evaluates under ``no_grad`` everywhere (``FederatedMethod.setup``); this audit shows, for the
torch it runs with, what inference mode would change. For every digits config under
``tests/conf``: build the method, train two rounds in-process, evaluate the test split of every
training client under ``no_grad`` and under ``inference_mode``, and compare the accuracies.

Usage: ``python -m benchmarks.inference_mode_audit [NAME ...] [--out FILE]``
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
import yaml

from lightning_pfl import methods, partition
from lightning_pfl.datamodule import FederatedDataModule
from tests.conftest import build

REPO = Path(__file__).resolve().parents[1]


def audit(name: str) -> dict[str, Any]:
    config = yaml.safe_load((REPO / "tests/conf" / f"{name}.yaml").read_text())
    data = dict(config["data"]["init_args"])
    if config["data"]["class_path"] != "FederatedDataModule" or data.get("dataset") != "digits":
        return {"config": name, "skipped": "not the digits data"}
    split = data.pop("partition", None)
    if split is not None:
        data["partition"] = getattr(partition, split["class_path"].split(".")[-1])(
            **split.get("init_args", {})
        )
    dm = FederatedDataModule(**data)
    dm.setup("fit")
    torch.manual_seed(0)
    cls = getattr(methods, config["model"]["class_path"].split(".")[-1])
    method = build(cls, dm, **(config["model"].get("init_args") or {}))
    optimizer = method.configure_server_optimizer()
    for round_idx in range(2):
        if optimizer is not None:
            optimizer.zero_grad()
        method.run_round(round_idx, method.sample_clients(round_idx))
        if optimizer is not None:
            optimizer.step()
    clients = torch.arange(method.num_training_clients)
    accuracy = {}
    for mode, context in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        with context():
            correct, total, _ = method.evaluate(clients, "test")
        accuracy[mode] = float(correct.sum() / total.sum())
    return {
        "config": name,
        "method": cls.__name__,
        "acc_no_grad": accuracy["no_grad"],
        "acc_inference_mode": accuracy["inference_mode"],
        "abs_diff": abs(accuracy["no_grad"] - accuracy["inference_mode"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="tests/conf names (default: every one)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    names = args.names or sorted(p.stem for p in (REPO / "tests/conf").glob("*.yaml"))
    rows = []
    for name in names:
        try:
            row = audit(name)
        except Exception as error:  # a config this in-process build cannot run is reported
            row = {"config": name, "error": f"{type(error).__name__}: {error}"[:200]}
        rows.append(row)
        shown = (
            row.get("skipped")
            or row.get("error")
            or (
                f"no_grad {row['acc_no_grad']:.4f}  inference_mode {row['acc_inference_mode']:.4f}"
                f"  diff {100 * row['abs_diff']:.2f} points"
            )
        )
        print(f"{name:28s} {shown}", flush=True)
    if args.out is not None:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        environment = {"commit": commit, "torch": torch.__version__}
        environment["python"] = platform.python_version()
        report = {"benchmark": "inference_mode_audit", "environment": environment, "rows": rows}
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
