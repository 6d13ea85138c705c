"""Evaluation benchmark: the engine's ragged evaluation blocks against padding every client.

Evaluating clients together pads every client of a block to the same number of samples. The
engine orders clients by sample count and shrinks each block to the clients that still have
samples (:meth:`FederatedDataModule.ragged_eval_blocks`); ``padded`` is the plain alternative,
every client of an evaluation chunk padded to the chunk's largest one
(:meth:`FederatedDataModule.eval_blocks`), with the same vmapped prediction. Both evaluate every
client of a Dirichlet split (by default the accuracy benchmark's: alpha 0.3, at least 20
training samples, 1/6 for validation) on ``--split`` through the data module's evaluation
chunks, as a validation or test pass does, with FedAvg's untrained model (``--net``), and must
agree on every client's correct count, sample count and loss.

Per path: the median seconds of ``--repeats`` passes (the paths take turns), the samples the
network computed over the real ones (``computed_per_real``), the number of network calls
(blocks) and the agreement. Prints a table
and writes JSON.

    python -m benchmarks.evaluation --out benchmarks/results/evaluation_cpu_digits.json
    python -m benchmarks.evaluation --dataset fashion_mnist --root /data --clients 100 \
        --net cnn --out benchmarks/results/evaluation_cpu_fashion_mnist.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap

from benchmarks.accuracy import environment
from lightning_pfl import FederatedDataModule
from lightning_pfl.methods import FedAvg
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.partition import Dirichlet

PATHS = ("ragged", "padded")


@torch.no_grad()
def padded_evaluate(method: FederatedMethod, clients: Tensor, split: str) -> Tensor:
    """``[3, C]`` correct, samples and loss sums, every client padded to the largest one."""
    params = method.personalized_params(clients)
    sums = torch.zeros(3, len(clients))
    for index, weight in method.data.eval_blocks(clients, split, method.hp.eval_batch_size):  # type: ignore[arg-type]
        x, y = method.data.fetch(index)
        logits = vmap(method.predict)(params, x).float()
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        hits = (logits.argmax(-1) == y).float()
        sums += torch.stack([hits * weight, weight, loss.view_as(weight) * weight]).sum(2)
    return sums


def ragged_evaluate(method: FederatedMethod, clients: Tensor, split: str) -> Tensor:
    return torch.stack(method.evaluate_clients(clients, split))  # type: ignore[arg-type]


def computed_work(data: FederatedDataModule, clients: Tensor, split: Any, block: int) -> dict:
    """Per path, the samples the network computes for ``clients`` (padding included) and its
    number of calls (blocks)."""
    weights = {
        "ragged": [w for _, _, _, w in data.by_size(clients, split).blocks(block)],
        "padded": [w for _, w in data.eval_blocks(clients, split, block)],
    }
    return {path: (sum(w.numel() for w in ws), len(ws)) for path, ws in weights.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--root", default="data")
    parser.add_argument("--clients", type=int, default=30)
    parser.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration")
    parser.add_argument("--min-samples", type=int, default=20, help="training samples per client")
    parser.add_argument("--val-fraction", type=float, default=1 / 6)
    parser.add_argument("--net", default="digits_cnn")
    parser.add_argument("--split", choices=["val", "test"], default="test")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    data = FederatedDataModule(
        args.dataset,
        num_clients=args.clients,
        partition=Dirichlet(args.alpha, args.min_samples),
        val_fraction=args.val_fraction,
        root=args.root,
    )
    data.setup("fit")
    method = FedAvg(
        num_clients=args.clients,
        num_classes=data.num_classes,
        input_shape=data.input_shape,
        net=args.net,
        vectorize=True,
    )
    method.attach_data(data)
    chunks = data.client_chunks()
    evaluate = {"ragged": ragged_evaluate, "padded": padded_evaluate}
    results = {
        path: torch.cat([evaluate[path](method, c, args.split) for c in chunks], 1)
        for path in PATHS
    }
    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    for _ in range(args.repeats):
        for path in PATHS:
            start = time.perf_counter()
            for chunk in chunks:
                evaluate[path](method, chunk, args.split)
            seconds[path].append(time.perf_counter() - start)

    real = int(data.num_samples(args.split).sum())
    block = method.hp.eval_batch_size
    per_chunk = [computed_work(data, chunk, args.split, block) for chunk in chunks]
    computed = {path: sum(c[path][0] for c in per_chunk) for path in PATHS}
    calls = {path: sum(c[path][1] for c in per_chunk) for path in PATHS}
    counts = data.num_samples(args.split)
    rows = []
    for path in PATHS:
        difference = (results[path] - results["padded"]).abs()
        rows.append(
            {
                "path": path,
                "seconds": statistics.median(seconds[path]),
                "seconds_all": seconds[path],
                "computed_samples": computed[path],
                "computed_per_real": computed[path] / real,
                "network_calls": calls[path],
                "same_counts_as_padded": bool(
                    torch.equal(results[path][:2], results["padded"][:2])
                ),
                "max_loss_difference_to_padded": float(difference[2].max()),
            }
        )
    padded_seconds = rows[1]["seconds"]
    for row in rows:
        row["speedup_over_padded"] = padded_seconds / row["seconds"]
    result: dict[str, Any] = {
        "benchmark": "evaluation",
        "dataset": args.dataset,
        "clients": args.clients,
        "partition": f"Dirichlet({args.alpha}, min_samples={args.min_samples})",
        "val_fraction": args.val_fraction,
        "split": args.split,
        "net": args.net,
        "eval_batch_size": block,
        "eval_clients_per_batch": data.eval_clients_per_batch,
        "real_samples": real,
        "largest_client": int(counts.max()),
        "mean_client": float(counts.float().mean()),
        "threads": args.threads,
        "repeats": args.repeats,
        "environment": environment(),
        "rows": rows,
    }
    print(
        f"{args.dataset}, {args.clients} clients, {result['partition']}, {args.split}: "
        f"{real} samples, largest client {result['largest_client']}, "
        f"mean {result['mean_client']:.1f}"
    )
    print(
        "| path | s per pass | computed / real samples | network calls | speed-up "
        "| same counts | max loss diff |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['path']} | {row['seconds']:.3f} | {row['computed_per_real']:.2f} | "
            f"{row['network_calls']} | {row['speedup_over_padded']:.2f}x | "
            f"{row['same_counts_as_padded']} | "
            f"{row['max_loss_difference_to_padded']:.2e} |"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
