"""Render the committed benchmark JSON files as the markdown tables of docs/.

python -m benchmarks.report benchmarks/results/digits          # a folder: one file per method
python -m benchmarks.report benchmarks/results/digits --compare-rounds 150   # + method x split
python -m benchmarks.report benchmarks/results/digits --paired-to local fedavg  # + per-seed gaps
python -m benchmarks.report benchmarks/results/digits --cost-figure  # + accuracy_vs_cost.png
python -m benchmarks.report benchmarks/results/speed_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _mean_std(values: Sequence[float | None]) -> str:
    present = [100 * v for v in values if v is not None]
    if not present:
        return "-"
    if len(present) == 1:
        return f"{present[0]:.2f}"
    return f"{statistics.mean(present):.2f} ± {statistics.pstdev(present):.2f}"


def _mean_std_of(values: Sequence[float | None]) -> str:
    """:func:`_mean_std`, saying how many seeds it covers when some rows have no value (e.g. a
    value found invalid and removed from its row, which keeps it as ``*_invalid``)."""
    shown = _mean_std(values)
    present = sum(v is not None for v in values)
    return shown if present in (0, len(values)) else f"{shown} ({present} of {len(values)})"


def _largest(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{max(present):.3g}" if present else "-"


def accuracy_table(files: list[dict[str, Any]]) -> str:
    """Mean ± standard deviation over seeds of every (split, method), methods in file order."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for result in files:
        for row in result["rows"]:
            groups[(row["split"], row["method"])].append(row)
    lines = [
        "| split | method | seeds | rounds | test acc @ best val, mean over clients (%) "
        "| sample-weighted (%) | test acc @ last round (%) | max train loss after round 100 "
        "| s/round | commit |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (split, method), rows in sorted(groups.items(), key=lambda item: item[0][0]):
        commits = sorted({r["commit"][:7] for r in rows})
        lines.append(
            f"| {split} | {method} | {len(rows)} "
            f"| {', '.join(str(r) for r in sorted({r['rounds'] for r in rows}))} "
            f"| {_mean_std([r['test_acc_at_best_val'] for r in rows])} "
            f"| {_mean_std([r['test_acc_weighted_at_best_val'] for r in rows])} "
            f"| {_mean_std_of([r['test_acc_last'] for r in rows])} "
            f"| {_largest([r.get('train_loss_max_after_100') for r in rows])} "
            f"| {_seconds_per_round(rows)} "
            f"| {', '.join(commits)} |"
        )
    return "\n".join(lines)


def _seconds_per_round(rows: list[dict[str, Any]]) -> str:
    """Mean seconds per round; one mean per device (named in brackets) when the seeds ran on
    different machines, since a mean across machines measures neither."""
    by_device: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        by_device[row.get("device", "")].append(row["seconds_per_round"])
    if len(by_device) == 1:
        (seconds,) = by_device.values()
        return f"{statistics.mean(seconds):.3f}"
    return ", ".join(
        f"{statistics.mean(seconds):.3f} ({device.removeprefix('NVIDIA ').split(' ')[0] or '?'})"
        for device, seconds in sorted(by_device.items())
    )


def group_table(files: list[dict[str, Any]]) -> str:
    """Mean ± std over seeds of each client group's test accuracy at the best validation
    round (``test_group_acc_at_best_val``), one line per (split, method); empty without groups."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for result in files:
        for row in result["rows"]:
            if row.get("test_group_acc_at_best_val"):
                groups[(row["split"], row["method"])].append(row)
    if not groups:
        return ""
    lines = [
        "| split | method | seeds | test acc @ best val per client group, mean over clients (%) |",
        "|---|---|---|---|",
    ]
    for (split, method), rows in sorted(groups.items(), key=lambda item: item[0][0]):
        names = list(rows[0]["test_group_acc_at_best_val"])
        cells = ", ".join(
            f"{name} {_mean_std([r['test_group_acc_at_best_val'].get(name) for r in rows])}"
            for name in names
        )
        lines.append(f"| {split} | {method} | {len(rows)} | {cells} |")
    return "\n".join(lines)


def floor_table(files: list[dict[str, Any]]) -> str:
    """The majority-class floor of each split (every client predicts the most frequent class of
    its own training data), mean ± std over the seeds whose rows carry it; the floor depends on
    the split and seed only, so each (split, seed) counts once. Empty when no row carries it."""
    floors: dict[str, dict[int, tuple[float, float]]] = defaultdict(dict)
    for result in files:
        for row in result["rows"]:
            if row.get("test_acc_majority_class") is not None:
                floors[row["split"]][row["seed"]] = (
                    row["test_acc_majority_class"],
                    row["test_acc_weighted_majority_class"],
                )
    if not floors:
        return ""
    lines = [
        "| split | seeds | majority-class floor, mean over clients (%) | sample-weighted (%) |",
        "|---|---|---|---|",
    ]
    for split, by_seed in sorted(floors.items()):
        values = list(by_seed.values())
        lines.append(
            f"| {split} | {len(values)} | {_mean_std([v[0] for v in values])} "
            f"| {_mean_std([v[1] for v in values])} |"
        )
    return "\n".join(lines)


def comparison_table(
    files: list[dict[str, Any]], rounds: int, references: tuple[str, ...] = ("fedavg", "local")
) -> str:
    """One line per method, one column group per split, over the rows run for ``rounds`` rounds:
    test accuracy at the best validation round (mean over clients; mean ± std over seeds, the
    number of seeds in brackets) and its difference in points to each reference method's mean
    over its own seeds at the same rounds ("-" where either has no row)."""
    accuracy: dict[tuple[str, str], list[float]] = defaultdict(list)
    for result in files:
        for row in result["rows"]:
            if row["rounds"] == rounds:
                accuracy[(row["method"], row["split"])].append(row["test_acc_at_best_val"])
    splits = sorted({split for _, split in accuracy})
    methods = sorted({method for method, _ in accuracy})
    header, rule = "| method |", "|---|"
    for split in splits:
        header += f" {split} (%) |" + "".join(f" vs {r} |" for r in references)
        rule += "---|" * (1 + len(references))
    lines = [header, rule]
    for method in methods:
        line = f"| {method} |"
        for split in splits:
            values = accuracy.get((method, split), [])
            line += f" {_mean_std(values)} ({len(values)}) |" if values else " - |"
            for reference in references:
                base = accuracy.get((reference, split), [])
                if values and base and method != reference:
                    difference = 100 * (statistics.mean(values) - statistics.mean(base))
                    line += f" {difference:+.2f} |"
                else:
                    line += " - |"
        lines.append(line)
    return "\n".join(lines)


def paired_table(files: list[dict[str, Any]], references: Sequence[str]) -> str:
    """One line per (split, method): test accuracy at the best validation round (mean over
    clients) of each seed, and per reference method its difference in points at each seed the
    two share with the same rounds (a seed's split is the same for every method, so these
    differences are paired), with how many of them are above zero. Rows of another length
    (rounds) are listed with it and paired only with the reference's rows of that length."""
    accuracy: dict[tuple[str, str], dict[tuple[int, int], float]] = defaultdict(dict)
    for result in files:
        for row in result["rows"]:
            key = (row["seed"], row["rounds"])
            accuracy[(row["split"], row["method"])][key] = 100 * row["test_acc_at_best_val"]
    header = "| split | method | acc per seed (%) |" + "".join(
        f" vs {r} per seed |" for r in references
    )
    lines = [header, "|---|---|---|" + "---|" * len(references)]
    for (split, method), values in sorted(accuracy.items()):
        several_lengths = len({rounds for _, rounds in values}) > 1
        line = f"| {split} | {method} | " + ", ".join(
            f"s{seed} {value:.2f}" + (f" ({rounds} rounds)" if several_lengths else "")
            for (seed, rounds), value in sorted(values.items())
        )
        for reference in references:
            base = accuracy.get((split, reference), {})
            shared = sorted(set(values) & set(base))
            if method == reference or not shared:
                line += " | -"
                continue
            differences = [values[key] - base[key] for key in shared]
            above = sum(d > 0 for d in differences)
            line += (
                " | "
                + ", ".join(f"{d:+.2f}" for d in differences)
                + f" ({above}/{len(differences)} above)"
            )
        lines.append(line + " |")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def speed_table(result: dict[str, Any]) -> str:
    """The rows of a speed result, after its `note` (a caveat added to the file) if it has one."""
    lines = [f"> {result['note']}", ""] if result.get("note") else []
    lines += [
        "| method | clients/round | path | precision | s/round | client updates/s | TFLOP/s "
        "| vs reference | vs sequential |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['method']} | {r['clients_per_round']} | {r['path']} | {r['precision']} "
            f"| {r['seconds_per_round']:.3f} | {r['client_updates_per_second']:.1f} "
            f"| {r['achieved_tflops']:.4f} | {_ratio(r.get('speedup_over_reference'))} "
            f"| {_ratio(r.get('speedup_over_sequential'))} |"
        )
    if result.get("total_clients_curve"):
        lines += [
            "",
            "| method | total clients | clients/round | s/round | client state (MB) |",
            "|---|---|---|---|---|",
        ]
        for r in result["total_clients_curve"]:
            lines.append(
                f"| {r['method']} | {r['num_clients']} | {r['clients_per_round']} "
                f"| {r['seconds_per_round']:.3f} | {r['client_state_mb']:.1f} |"
            )
    if result.get("end_to_end"):
        lines += [
            "",
            "| end to end (`lightning-pfl fit`, pFedHN, 1 client/round): path | rounds "
            "| s/round | of which training step |",
            "|---|---|---|---|",
        ]
        for r in result["end_to_end"]:
            lines.append(
                f"| {r['path']} | {r['rounds']} | {r['end_to_end_seconds_per_round']:.4f} "
                f"| {r['training_step_seconds_per_round']:.4f} |"
            )
    return "\n".join(lines)


def total_flops(row: dict[str, Any]) -> float | None:
    """Local plus server FLOPs of a row's run (``costs`` of results.json; None: not counted)."""
    costs = row.get("costs") or {}
    local = costs.get("flops_local_total")
    if local is None:
        return None
    return float(local) + float(costs.get("flops_server_total") or 0.0)


def cost_figure(files: list[dict[str, Any]], path: Path) -> Path:
    """Test accuracy at the best validation round (mean over seeds) against total bytes sent
    and received, and against total FLOPs (local training + server), one point per method and
    split; rows without a count are left out of that panel, which says how many."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for result in files:
        for row in result["rows"]:
            groups[(row["split"], row["method"])].append(row)
    axes_of = [("comm_bytes_total", "total bytes (down + up)"), ("flops", "total FLOPs")]
    figure, axes = plt.subplots(1, 2, figsize=(14, 6), squeeze=False)
    splits = sorted({split for split, _ in groups})
    markers = dict(zip(splits, "os^Dv", strict=False))
    for axis, (key, label) in zip(axes[0], axes_of, strict=True):
        missing = 0
        for (split, method), rows in sorted(groups.items()):
            xs = [r.get(key) if key != "flops" else total_flops(r) for r in rows]
            accs = [r["test_acc_at_best_val"] for r in rows]
            if any(x is None or x <= 0 for x in xs) or any(a is None for a in accs):
                missing += 1
                continue
            x = statistics.mean(float(v) for v in xs if v is not None)
            y = 100 * statistics.mean(accs)
            axis.scatter(
                x, y, marker=markers.get(split, "o"), color="C0" if split == splits[0] else "C1"
            )
            axis.annotate(method, (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        if missing == len(groups):
            axis.text(
                0.5,
                0.5,
                "no row carries this count\n(rows written before results.json had it: rerun them)",
                ha="center",
                transform=axis.transAxes,
            )
        axis.set_xscale("log")
        axis.set_xlabel(label)
        axis.set_ylabel("test acc @ best val, mean over clients (%)")
        title = f"accuracy vs {label}"
        if missing:
            title += f" ({missing} of {len(groups)} method x split without it)"
        axis.set_title(title, fontsize=9)
        axis.grid(alpha=0.3)
    for split in splits:
        axes[0][0].scatter([], [], marker=markers.get(split, "o"), label=split)
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="result folders or speed JSON files")
    parser.add_argument(
        "--compare-rounds",
        type=int,
        help="also print, for a folder, the method x split table of the rows run for this many "
        "rounds, with each method's difference to FedAvg and to Local",
    )
    parser.add_argument(
        "--paired-to",
        nargs="+",
        metavar="METHOD",
        help="also print, for a folder, each method's accuracy per seed and its per-seed "
        "differences to these methods (config names, e.g. local fedavg)",
    )
    parser.add_argument(
        "--cost-figure",
        action="store_true",
        help="also draw, for a folder, accuracy against total bytes and total FLOPs of every "
        "method into <folder>/accuracy_vs_cost.png",
    )
    args = parser.parse_args()
    for path in args.paths:
        if path.is_dir():
            files = [json.loads(p.read_text()) for p in sorted(path.glob("*.json"))]
            print(f"### `{path}` ({len(files)} methods)\n")
            print(accuracy_table(files))
            print()
            if args.cost_figure:
                print(f"![accuracy vs cost]({cost_figure(files, path / 'accuracy_vs_cost.png')})")
                print()
            if groups := group_table(files):
                print(groups)
                print()
            if floors := floor_table(files):
                print(floors)
                print()
            if args.compare_rounds is not None:
                print(comparison_table(files, args.compare_rounds))
                print()
            if args.paired_to:
                print(paired_table(files, args.paired_to))
                print()
            continue
        result = json.loads(path.read_text())
        env = result["environment"]
        print(
            f"### `{path}` (last run: commit {env['commit'][:7]}, {env['date']}, "
            f"{env['device']}, torch {env['torch']})\n"
        )
        print(speed_table(result) if result["benchmark"] == "speed" else accuracy_table([result]))
        print()


if __name__ == "__main__":
    main()
