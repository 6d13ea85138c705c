"""Speed benchmark: seconds per round of FedAvg and pFedHN, sequential vs vectorized clients.

The pFedHN CIFAR CNN on random CIFAR-shaped data (``random_cifar10``), ``--steps`` local steps
of batch ``--batch`` per client, for each clients-per-round value, in ``32-true`` and
``bf16-mixed``. Rounds are timed by calling the method's round directly (server step included,
evaluation excluded), after one warm-up round. Prints a table and writes JSON with seconds per
round, client updates (client-steps) per second, achieved FLOP/s and peak device memory.

``--paths`` also takes ``sequential-compiled`` and ``vectorized-compiled`` (``compile_step``;
the first round, which compiles, is reported separately and not in the mean).
``--total-clients`` adds the cost curve over the total number of clients at a fixed
``--curve-clients-per-round``: per-client state grows, the round's work must not.

    python -m benchmarks.speed --device cpu --clients 1 10 50 --steps 10 \
        --out benchmarks/results/speed_cpu.json
    python -m benchmarks.speed --device cuda --out benchmarks/results/speed_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.accuracy import environment
from lightning_pfl import FederatedDataModule
from lightning_pfl.methods import FedAvg, FederatedMethod, Local, PFedHN
from lightning_pfl.models import build_network
from lightning_pfl.partition import IID

METHODS: dict[str, type[FederatedMethod]] = {"FedAvg": FedAvg, "pFedHN": PFedHN, "Local": Local}


def flops_per_client_step(batch: int) -> int:
    """FLOPs of one forward + backward of the CNN target on one batch."""
    net = build_network("cnn", (3, 32, 32), 10)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(net(x), y).backward()
    return int(counter.get_total_flops())


PATHS = ("sequential", "vectorized", "sequential-compiled", "vectorized-compiled")


def build(
    method: str, num_clients: int, clients_per_round: int, args: argparse.Namespace, path: str
) -> FederatedMethod:
    # 80 random images per client, 64 of them for training: every client has one full batch,
    # so the work per client is the same at every total number of clients.
    data = FederatedDataModule(
        "random_cifar10",
        num_clients=num_clients,
        partition=IID(),
        eval_split="holdout",
        val_fraction=0.0,
        test_fraction=0.2,
        dataset_options={"train_size": 80 * num_clients, "test_size": 0},
        seed=0,
    )
    data.setup()
    data.to(torch.device(args.device))
    model = METHODS[method](
        num_clients=num_clients,
        num_classes=10,
        input_shape=(3, 32, 32),
        net="cnn",
        clients_per_round=clients_per_round,
        local_steps=args.steps,
        batch_size=args.batch,
        vectorize=path.startswith("vectorized"),
        compile_step=path.endswith("-compiled"),
        offload_client_state=args.device == "cuda",
    )
    model.attach_data(data)
    model.to(args.device)
    model.store.to(torch.device(args.device), offload=args.device == "cuda")
    return model


def time_rounds(
    model: FederatedMethod, rounds: int, precision: str, device: str
) -> tuple[float, float]:
    """Seconds of the first round (warm-up, compilation) and mean seconds of the next ones."""
    optimizer = model.configure_optimizers()
    autocast = (
        torch.autocast(device_type=device, dtype=torch.bfloat16)
        if precision == "bf16-mixed"
        else contextlib.nullcontext()
    )

    def one_round(r: int) -> None:
        optimizer.zero_grad()
        with autocast:
            model.run_round(r, model.sample_clients(r))
        optimizer.step()

    start = time.perf_counter()
    one_round(0)  # warm-up (allocations, kernels, compilation)
    _sync(device)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for r in range(1, rounds + 1):
        one_round(r)
    _sync(device)
    return first, (time.perf_counter() - start) / rounds


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(
    method: str,
    num_clients: int,
    cpr: int,
    args: argparse.Namespace,
    path: str,
    precision: str,
    step_flops: int,
) -> dict[str, Any]:
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = build(method, num_clients, cpr, args, path)
    first_round, seconds = time_rounds(model, args.rounds, precision, args.device)
    client_steps = cpr * args.steps
    row = {
        "method": method,
        "num_clients": num_clients,
        "clients_per_round": cpr,
        "path": path,
        "precision": precision,
        "local_steps": args.steps,
        "batch_size": args.batch,
        "seconds_per_round": seconds,
        "first_round_seconds": first_round,
        "client_updates_per_second": client_steps / seconds,
        "achieved_tflops": step_flops * client_steps / seconds / 1e12,
        "peak_device_memory_mb": torch.cuda.max_memory_allocated() / 2**20
        if args.device == "cuda"
        else None,
        "client_state_mb": model.store.nbytes() / 2**20,
    }
    print(
        f"{method:<7} n={num_clients:<6} C={cpr:<4} {path:<19} {precision:<10} "
        f"{seconds:8.4f} s/round {row['client_updates_per_second']:9.1f} upd/s "
        f"{row['achieved_tflops']:7.3f} TFLOP/s",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--methods", nargs="+", default=["FedAvg", "pFedHN"], choices=list(METHODS))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 10, 50, 100])
    parser.add_argument(
        "--num-clients", type=int, default=100, help="total clients for the main table"
    )
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument("--paths", nargs="+", default=["sequential", "vectorized"], choices=PATHS)
    parser.add_argument("--total-clients", type=int, nargs="*", default=[100, 1000, 10000])
    parser.add_argument("--curve-clients-per-round", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    started = environment()

    step_flops = flops_per_client_step(args.batch)
    rows = []
    for method in args.methods:
        for cpr in args.clients:
            for precision in args.precisions:
                for path in args.paths:
                    rows.append(
                        measure(
                            method,
                            args.num_clients,
                            cpr,
                            args,
                            path,
                            precision,
                            step_flops,
                        )
                    )
    curve = []
    for method in args.methods:
        for total in args.total_clients:
            curve.append(
                measure(
                    method,
                    total,
                    args.curve_clients_per_round,
                    args,
                    "vectorized",
                    "32-true",
                    step_flops,
                )
            )
    result = {
        "benchmark": "speed",
        "environment": started,
        "device": args.device,
        "flops_per_client_step": step_flops,
        "rows": rows,
        "total_clients_curve": curve,
        "args": vars(args),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
