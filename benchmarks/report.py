"""Render the committed benchmark JSON files as the markdown tables of docs/.

python -m benchmarks.report benchmarks/results/digits.json benchmarks/results/fashion_mnist.json
python -m benchmarks.report benchmarks/results/speed_cpu.json
"""

from __future__ import annotations

import json
import sys
from typing import Any


def accuracy_table(result: dict[str, Any]) -> str:
    lines = [
        "| split | method | rounds | best round | test acc @ best val (mean over clients) "
        "| weighted | test acc @ last round | s/round | commit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        commit = r.get("commit", result["environment"]["commit"])[:7]
        lines.append(
            f"| {r['split']} | {r['method']} | {r['rounds']} | {r['best_round']} "
            f"| {100 * r['test_acc_at_best_val']:.2f}% "
            f"| {100 * r['test_acc_weighted_at_best_val']:.2f}% "
            f"| {100 * r['test_acc_last']:.2f}% | {r['seconds_per_round']:.3f} | {commit} |"
        )
    return "\n".join(lines)


def speed_table(result: dict[str, Any]) -> str:
    lines = [
        "| method | clients/round | path | precision | s/round | client updates/s | TFLOP/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['method']} | {r['clients_per_round']} | {r['path']} | {r['precision']} "
            f"| {r['seconds_per_round']:.3f} | {r['client_updates_per_second']:.1f} "
            f"| {r['achieved_tflops']:.4f} |"
        )
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
    return "\n".join(lines)


def main() -> None:
    for path in sys.argv[1:]:
        with open(path) as f:
            result = json.load(f)
        env = result["environment"]
        print(
            f"### `{path}` (last run: commit {env['commit'][:7]}, {env['date']}, "
            f"{env['device']}, torch {env['torch']})\n"
        )
        print(speed_table(result) if result["benchmark"] == "speed" else accuracy_table(result))
        print()


if __name__ == "__main__":
    main()
