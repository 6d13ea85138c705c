"""Why does pFedKT stay under Local on pFedKT's Table 1 protocol? Variants that differ in one part.

A reduced CPU version of the FashionMNIST Table 1 protocol (docs/methods.md, pFedKT):
``configs/fashion_mnist_pfedkt_table1/{pfedkt,local}.yaml`` on the 10-client split (2 classes
each, 8:1:1 holdout, about 5,600 training images a client), E = 2 (175 local steps a visit, as
E = 10 on the 50-client split's 1,120), the paper's client SGD and model, evaluation every
round. Clients 5-9 are held out (``novel_clients``), so clients 0-4 train in every round and
every round after the first is a later visit of every client: the part of the protocol where
pFedKT falls under Local. Variants, each through the CLI:

- ``local``: Local (each client continues its own model, its SGD momentum kept across visits).
- ``pfedkt``: pFedKT, the library default (ablation D: HN + l_con, mu = 0.001).
- ``pfedkt_b``: Table 11's case B (HN only, CE): pFedKT without l_con.
- ``pfedkt_last_pm``: pFedKT whose every visit starts from the client's last trained PM instead
  of HN_i(phi_i) (a diagnostic, :class:`LastPMStart`; everything else as ``pfedkt``).
- ``pfedkt_omega0``: pFedKT whose every visit starts from omega^0, the global model's
  initialization (:class:`Omega0Start`): a restart from a proper initialization.

Every variant records per visit (:class:`VisitRecord`) the test and validation accuracy of the
model the client starts from and of the one it trained, and after the last round each client's
test accuracy. Prints a table, writes JSON with :func:`benchmarks.accuracy.environment`.

``--full-protocol`` instead reads the committed GPU runs of the full protocol
(``benchmarks/results/fashion_mnist_pfedkt_table1/{local,pfedkt}.json``, seed 0) and replays
their client sampling (``sample_clients``' seeded permutation) to set, per round, the gap
between Local and pFedKT beside how many clients had been visited 0, 1 and 2+ times.

    OMP_NUM_THREADS=1 python -m benchmarks.pfedkt_gap --root /work/shared/datasets \\
        --out benchmarks/results/fashion_mnist_pfedkt_gap/gap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.accuracy import environment
from lightning_pfl.cli import run
from lightning_pfl.engine import Params, TrainResult, derive_seed
from lightning_pfl.methods import Local, PFedKT
from lightning_pfl.streams import CLIENT_STREAM

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "fashion_mnist_pfedkt_table1"
FULL_RUNS = REPO / "benchmarks" / "results" / "fashion_mnist_pfedkt_table1"
MODULE = "benchmarks.pfedkt_gap"
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "local": ("local.yaml", [f"--model.class_path={MODULE}.RecordedLocal"]),
    "pfedkt": ("pfedkt.yaml", [f"--model.class_path={MODULE}.RecordedPFedKT"]),
    "pfedkt_b": (
        "pfedkt.yaml",
        [f"--model.class_path={MODULE}.RecordedPFedKT", "--model.init_args.ablation=B"],
    ),
    "pfedkt_last_pm": ("pfedkt.yaml", [f"--model.class_path={MODULE}.LastPMStart"]),
    "pfedkt_omega0": ("pfedkt.yaml", [f"--model.class_path={MODULE}.Omega0Start"]),
}


class VisitRecord:
    """Records, for every ``local_train`` call, the clients' test and validation accuracy of
    the model they start from and of the model they trained (read after the run)."""

    visits: list[tuple[int, Tensor, Tensor, Tensor]]

    def accuracy(self, clients: Tensor, params: Params) -> Tensor:
        """[clients, 2]: test and validation accuracy of ``params``."""
        method: Any = self
        out = []
        for split in ("test", "val"):
            correct, total, _ = method.evaluate_clients(clients, split, params)
            out.append(correct / total)
        return torch.stack(out, 1)

    def local_train(self, params: Params, clients: Tensor, round_idx: int, **kwargs: Any) -> Any:
        start = self.accuracy(clients, params)
        result: TrainResult = super().local_train(  # type: ignore[misc]
            params, clients, round_idx, **kwargs
        )
        trained = self.accuracy(clients, result.params)
        if not hasattr(self, "visits"):
            self.visits = []
        self.visits.append((round_idx, clients.clone(), start, trained))
        return result


class RecordedLocal(VisitRecord, Local):
    """Local with :class:`VisitRecord`."""


class RecordedPFedKT(VisitRecord, PFedKT):
    """pFedKT with :class:`VisitRecord`."""


class LastPMStart(RecordedPFedKT):
    """Diagnostic: every visit starts from the client's last trained PM (omega^0 before its
    first), not from HN_i(phi_i); the HN is still stepped, and unused."""

    def private_start(self, clients: Tensor, stored: Params) -> tuple[Params, Params]:
        return stored, self.store.gather("hn", clients, self.device)


class Omega0Start(RecordedPFedKT):
    """Diagnostic: every visit starts from omega^0 (the global model's initialization), not
    from HN_i(phi_i); the HN is still stepped, and unused."""

    def private_start(self, clients: Tensor, stored: Params) -> tuple[Params, Params]:
        omega0 = self.arch.initial_params()
        start = {n: t.to(self.device).expand_as(stored[n]).clone() for n, t in omega0.items()}
        return start, self.store.gather("hn", clients, self.device)


def rounded(values: Tensor | list[float], digits: int = 4) -> list[float]:
    return [round(float(v), digits) for v in values]


def visit_rows(method: VisitRecord) -> list[dict[str, Any]]:
    """One row per client visit: round, client, which visit of that client, start and trained
    test / validation accuracy."""
    rows, count = [], {}
    for round_idx, clients, start, trained in method.visits:
        for i, client in enumerate(clients.tolist()):
            count[client] = count.get(client, 0) + 1
            rows.append(
                {
                    "round": round_idx + 1,
                    "client": client,
                    "visit": count[client],
                    "start_test": round(float(start[i, 0]), 4),
                    "start_val": round(float(start[i, 1]), 4),
                    "trained_test": round(float(trained[i, 0]), 4),
                    "trained_val": round(float(trained[i, 1]), 4),
                }
            )
    return rows


def run_variant(variant: str, seed: int, root: str, rounds: int, log_dir: Path) -> dict[str, Any]:
    config, extra = VARIANTS[variant]
    cli_args = [
        f"--config={CONFIGS / config}",
        *extra,
        f"--data.init_args.root={root}",
        "--data.init_args.num_clients=10",
        "--model.init_args.novel_clients=5",
        f"--data.init_args.seed={seed}",
        f"--model.init_args.seed={seed}",
        "--model.init_args.local_epochs=2",
        "--model.init_args.client_threads=1",
        "--model.init_args.last_evals=3",
        f"--trainer.max_steps={rounds}",
        "--trainer.val_check_interval=1",
    ]
    cli = run(
        [
            "fit",
            *cli_args,
            f"--trainer.logger.init_args.save_dir={log_dir}",
            f"--trainer.logger.init_args.name={variant}-s{seed}",
            "--trainer.enable_progress_bar=false",
        ]
    )
    assert cli.trainer.log_dir is not None
    results = json.loads((Path(cli.trainer.log_dir) / "results.json").read_text())
    method = cli.model
    clients = torch.arange(method.num_training_clients)
    correct, total, _ = method.evaluate_clients(clients, "test")
    best = results["test_at_best_val"] or {}
    return {
        "variant": variant,
        "class": type(method).__name__,
        "seed": seed,
        "cli": ["fit", *cli_args],
        "rounds": results["rounds"],
        "best_round": results["best_round"],
        "test_max_over_evals": results["test_max_over_evals"]["acc"],
        "test_at_best_val": best.get("acc"),
        "test_last_evals_mean": results["test_last_evals"]["acc_mean"],
        "test_last_evals_n": results["test_last_evals"]["n"],
        "test_last": (results["test_last"] or {}).get("acc"),
        "eval_history": [
            {"round": e["round"], "acc": round(e["acc"], 5)} for e in results["eval_history"]
        ],
        "final_client_test": rounded(correct / total),
        "visits": visit_rows(method),
        "seconds_per_round": results["seconds_per_round"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"{'variant':16} {'seed':>4} {'best test':>9} {'@best val':>9} {'last-3':>7} "
        f"{'later visits: start test':>24} {'trained test':>12}"
    ]
    for r in rows:
        later = [v for v in r["visits"] if v["visit"] > 1]
        start = statistics.fmean(v["start_test"] for v in later) if later else float("nan")
        trained = statistics.fmean(v["trained_test"] for v in later) if later else float("nan")
        lines.append(
            f"{r['variant']:16} {r['seed']:>4} {100 * r['test_max_over_evals']:9.2f} "
            f"{100 * r['test_at_best_val']:9.2f} {100 * r['test_last_evals_mean']:7.2f} "
            f"{100 * start:24.2f} {100 * trained:12.2f}"
        )
    return "\n".join(lines)


def paired(rows: list[dict[str, Any]], reference: str = "local") -> list[dict[str, Any]]:
    """Per variant and seed, against ``reference`` of the same seed: the mean and standard
    error of the difference in trained test accuracy over the same (round, client) visits,
    first visits and later ones apart, and over the clients' final models."""
    refs = {r["seed"]: r for r in rows if r["variant"] == reference}
    out = []
    for r in rows:
        ref = refs.get(r["seed"])
        if ref is None or r is ref:
            continue
        base = {(v["round"], v["client"]): v for v in ref["visits"]}
        entry: dict[str, Any] = {"variant": r["variant"], "seed": r["seed"], "minus": reference}
        for name, first in (("first_visits", True), ("later_visits", False)):
            diffs = [
                v["trained_test"] - base[(v["round"], v["client"])]["trained_test"]
                for v in r["visits"]
                if (v["visit"] == 1) == first
            ]
            entry[name] = mean_and_error(diffs)
        pairs = zip(r["final_client_test"], ref["final_client_test"], strict=True)
        final = [a - b for a, b in pairs]
        entry["final_clients"] = mean_and_error(final)
        out.append(entry)
    return out


def mean_and_error(values: list[float]) -> dict[str, Any]:
    n = len(values)
    error = statistics.stdev(values) / n**0.5 if n > 1 else None
    return {"n": n, "mean": statistics.fmean(values) if n else None, "stderr": error}


def full_protocol_gap() -> dict[str, Any]:
    """Per round of the committed full-protocol runs: Local's and pFedKT's test accuracy and
    the clients visited 0, 1 and 2+ times so far (50 clients, 5 a round, seed 0)."""
    history = {}
    for method in ("local", "pfedkt"):
        row = json.loads((FULL_RUNS / f"{method}.json").read_text())["rows"][0]
        assert row["seed"] == 0 and "--model.init_args.seed=0" in row["cli"], row["cli"]
        history[method] = {e["round"]: e["acc"] for e in row["eval_history"]}
    rounds = min(max(h) for h in history.values())
    visits = torch.zeros(50, dtype=torch.long)
    rows = []
    for r in range(rounds):
        generator = torch.Generator().manual_seed(derive_seed(0, r, CLIENT_STREAM))
        visits[torch.randperm(50, generator=generator)[:5]] += 1
        gap = history["local"][r + 1] - history["pfedkt"][r + 1]
        twice = int((visits >= 2).sum())
        rows.append(
            {
                "round": r + 1,
                "local": round(history["local"][r + 1], 5),
                "pfedkt": round(history["pfedkt"][r + 1], 5),
                "gap": round(gap, 5),
                "clients_unvisited": int((visits == 0).sum()),
                "clients_visited_once": int((visits == 1).sum()),
                "clients_visited_2plus": twice,
                "gap_per_client_visited_2plus": round(gap * 50 / twice, 5) if twice else None,
            }
        )
    late = [r["gap"] for r in rows if r["clients_visited_2plus"] == 50]
    return {
        "what": "Local - pFedKT test accuracy (mean over 50 clients) per round of the full "
        "protocol's committed GPU runs, with the clients visited 0, 1, 2+ times by then",
        "sources": [str((FULL_RUNS / f"{m}.json").relative_to(REPO)) for m in history],
        "rounds": rows,
        "gap_once_every_client_visited_twice": {
            "first_round": next(r["round"] for r in rows if r["clients_visited_2plus"] == 50),
            "mean": statistics.fmean(late),
            "min": min(late),
            "max": max(late),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root")
    parser.add_argument("--full-protocol", action="store_true")
    parser.add_argument("--report", action="store_true", help="only print the folder's table")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.full_protocol:
        record = {"benchmark": "pfedkt_gap", "environment": environment(), **full_protocol_gap()}
        (args.out_dir / "full_protocol_gap_by_visits.json").write_text(
            json.dumps(record, indent=1) + "\n"
        )
        for r in record["rounds"]:
            if r["round"] in (5, 10, 20, 30, 40, 50, 60, 100, 150, 200, 250, 290):
                print(json.dumps(r))
        print(json.dumps(record["gap_once_every_client_visited_twice"]))
        return
    if args.root is None and not args.report:
        parser.error("--root is required (the folder holding FashionMNIST/raw)")
    torch.set_num_threads(1)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pfedkt_gap_"))
    for variant in [] if args.report else args.variants:
        path = args.out_dir / f"{variant}.json"
        old = json.loads(path.read_text())["rows"] if path.exists() else []
        for seed in args.seeds:
            row = run_variant(variant, seed, args.root, args.rounds, log_dir)
            old = sorted([r for r in old if r["seed"] != seed] + [row], key=lambda r: r["seed"])
            record = {"benchmark": "pfedkt_gap", "environment": environment(), "rows": old}
            path.write_text(json.dumps(record, indent=1) + "\n")
            print(table([row]), flush=True)
    rows = [
        r
        for variant in VARIANTS
        if (args.out_dir / f"{variant}.json").exists()
        for r in json.loads((args.out_dir / f"{variant}.json").read_text())["rows"]
    ]
    print(table(rows))
    comparisons = paired(rows)
    for c in comparisons:
        cells = [
            f"{k} {100 * c[k]['mean']:+.2f} +- {100 * (c[k]['stderr'] or 0):.2f} (n={c[k]['n']})"
            for k in ("first_visits", "later_visits", "final_clients")
        ]
        print(f"{c['variant']} - {c['minus']} (seed {c['seed']}): " + "; ".join(cells))
    summary = {"benchmark": "pfedkt_gap", "environment": environment(), "paired": comparisons}
    (args.out_dir / "paired.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
