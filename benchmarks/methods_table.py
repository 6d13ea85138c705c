"""Render docs/methods.md's "Every method at a glance" table from the committed digits JSON.

One row per ``benchmarks/results/digits/<config>.json``, read from its pathological split,
seed 0 row: the class and ``rounds`` of that row, clients per round from
``configs/digits/<config>.yaml`` (``model.init_args.clients_per_round``), and bytes per sampled
client per round = ``comm_bytes_total`` / (rounds x clients per round), where
``comm_bytes_total`` is the run's ``comm_bytes_down_total + comm_bytes_up_total``
(``benchmarks.accuracy.summarize``). The last column comes from ``SEED_TABLES`` below, kept by
hand. The markdown table goes to stdout.

    python -m benchmarks.methods_table
    python -m benchmarks.methods_table --results benchmarks/results/digits --configs configs/digits
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
SPLIT = "pathological"
SEED = 0
NOT_CHECKED = "-"

# Which result tables of the five seed papers (pFedHN, ICML 2021; pFedKT, KBS 2024 / ICLR 2023
# submission; FedSimSup, ICCV 2025; MH-pFedHN, 2025; FedTP, TNNLS 2023) list the config's method.
# No seed paper's result tables could be read (only titles and abstracts of the stored copies
# were reachable), so only the paper proposing a method is named; every other config shows
# NOT_CHECKED until someone with the papers fills in the table numbers here.
SEED_TABLES: dict[str, str] = {
    "pfedhn": "pFedHN (its method)",
    "pfedhn_pc": "pFedHN (its method)",
    "pfedkt": "pFedKT (its method)",
    "fedsimsup": "FedSimSup (its method)",
    "mh_pfedhn": "MH-pFedHN (its method)",
    "mh_pfedhngd": "MH-pFedHN (its method)",
    "fedtp": "FedTP (its method)",
}

HEADER = (
    "| config | class | clients/round | rounds "
    "| bytes per sampled client per round (down + up) | seed tables |"
)


def seed_row(result: dict[str, Any], split: str = SPLIT, seed: int = SEED) -> dict[str, Any]:
    """The single row of ``split`` and ``seed`` in a result file (an error if not exactly one)."""
    rows = [r for r in result["rows"] if r["split"] == split and r["seed"] == seed]
    if len(rows) != 1:
        raise ValueError(f"{len(rows)} rows of split {split!r}, seed {seed} (expected 1)")
    return rows[0]


def clients_per_round(config: dict[str, Any]) -> int:
    """``model.init_args.clients_per_round`` of a parsed config."""
    return int(config["model"]["init_args"]["clients_per_round"])


def bytes_per_client_round(row: dict[str, Any], clients: int) -> float:
    """Down + up bytes of the whole run divided by rounds x clients per round."""
    return float(row["comm_bytes_total"]) / (int(row["rounds"]) * clients)


def table_row(name: str, row: dict[str, Any], clients: int, seed_tables: str) -> str:
    per_client = bytes_per_client_round(row, clients)
    return (
        f"| {name} | `{row['class']}` | {clients} | {row['rounds']} "
        f"| {round(per_client):,} | {seed_tables} |"
    )


def render(results: Path, configs: Path, seed_tables: dict[str, str] | None = None) -> str:
    """The markdown table, one row per result file in ``results``, in file-name order."""
    seed_tables = SEED_TABLES if seed_tables is None else seed_tables
    lines = [HEADER, "|---|---|---|---|---|---|"]
    for path in sorted(results.glob("*.json")):
        name = path.stem
        row = seed_row(json.loads(path.read_text()))
        config = yaml.safe_load((configs / f"{name}.yaml").read_text())
        lines.append(
            table_row(name, row, clients_per_round(config), seed_tables.get(name, NOT_CHECKED))
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks/results/digits")
    parser.add_argument("--configs", type=Path, default=REPO / "configs/digits")
    args = parser.parse_args()
    print(render(args.results, args.configs))


if __name__ == "__main__":
    main()
