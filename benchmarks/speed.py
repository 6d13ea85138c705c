"""Speed benchmark: seconds per round of the engine's paths against a plain PyTorch loop.

Workloads (``--workload``):

- ``cifar_cnn``: the pFedHN CIFAR CNN on random CIFAR-shaped images, ``--steps`` local steps of
  batch ``--batch`` per client (every client holds one batch: the same work per client at any
  total number of clients).
- ``digits_cnn``: the quick start's small CNN (``net: digits_cnn``) on random digits-shaped
  (1x8x8) images, ``--steps`` local steps of batch ``--batch`` per client, as ``cifar_cnn``.
- ``lenet5_mnist``: LeNet-5 on random MNIST-shaped (1x28x28) images, one local epoch of
  ``--batches-per-epoch`` batches of ``--batch`` per client (FedAvg's usual local work).
- ``cifar_vit``: FedTP's ViT (``net: vit``: patch 4, dim 128, 8 heads, depth 8, dropout 0.1) on
  random CIFAR-shaped images, ``--steps`` local steps of batch ``--batch`` per client; for
  ``--methods FedTP`` (a FedTP round: the hypernetwork generates every sampled client's qkv
  weights, local training, FedAvg of the rest and the hypernetwork step). The ViT has dropout,
  so the ``threaded`` path (deterministic steps only) is skipped for it.

Paths (``--paths``): ``reference`` is what the popular PFL libraries do: one ``nn.Module``
per client with ``torch.optim.SGD``, clients one after another (FedAvg only). The engine's
paths: ``default`` (no speed setting: what a config gets), ``sequential`` (clients one by one,
``vectorize: false, client_threads: 1``), ``threaded`` (the per-client loop on every usable
core, ``client_threads``; CPU), ``vectorized`` (one vmap), each optionally ``-compiled``
(``compile_step``) and/or ``-graphs`` (the whole round's local training recorded as one CUDA
graph and replayed, ``cuda_graphs``; CUDA only). Every path trains the same clients on the same
batches. Rounds are timed by calling the method's round directly (server step included,
evaluation excluded) after one warm-up round, which includes compilation and graph recording
and is reported apart; the paths of a setting take turns round by round, and each reports the
median of its rounds.

``--job N`` times ``N`` one-client-per-round pFedHN runs (seeds 0..N-1; with ``--job-lrs`` every
seed at every local learning rate, ``--runs.grid``) through ``lightning-pfl fit`` as one job
(``--runs.seeds``, the runs' local training shared) against the same runs one after another,
wall clock of the whole command each (building, data, training, no validation; on a GPU after
one untimed warm-up run, with peak device memory of one run alone and of the job per run);
``--job-alone-sample K`` times only the first K runs alone and scales their time to all N (the
row says ``one_after_another_timed_runs``),
on ``--job-configs`` (default: the digits protocol; add
``configs/fashion_mnist_pfedhn_table1/pfedhn.yaml`` with ``--job-root`` for FashionMNIST), and
reports run-rounds per second of both and their ratio, with the machine's 1-minute load average
before each side and after the job (other work on shared cores slows either side).

``--e2e`` adds the end-to-end time per round of ``lightning-pfl fit`` itself (Lightning's loop,
logging and the per-round checks included, validation excluded) for pFedHN with one client per
round on the CIFAR CNN (the paper's setting), per path.

Prints a table and writes JSON (seconds per round, client updates per second, achieved FLOP/s,
peak device memory, the speed-up over ``reference`` and ``sequential`` in the same run).

    python -m benchmarks.speed --device cpu --workload lenet5_mnist --methods FedAvg \
        --clients 20 --paths reference sequential vectorized vectorized-compiled \
        --out benchmarks/results/speed_cpu.json
    python -m benchmarks.speed --device cuda --e2e --out benchmarks/results/speed_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.accuracy import environment
from lightning_pfl import FederatedDataModule
from lightning_pfl.datasets.registry import DATASETS, DatasetArrays, DatasetSpec
from lightning_pfl.engine import Architecture
from lightning_pfl.execution import usable_cores
from lightning_pfl.methods import FedAvg, FederatedMethod, Local, PFedHN
from lightning_pfl.methods.fedtp import FedTP
from lightning_pfl.models import build_network
from lightning_pfl.partition import IID

METHODS: dict[str, type[FederatedMethod]] = {
    "FedAvg": FedAvg,
    "pFedHN": PFedHN,
    "Local": Local,
    "FedTP": FedTP,
}
ENGINE_PATHS = [
    "default",
    "sequential",
    "threaded",
    "vectorized",
    "sequential-compiled",
    "vectorized-compiled",
    "sequential-graphs",
    "vectorized-graphs",
    "vectorized-compiled-graphs",
]
PATHS = ["reference", *ENGINE_PATHS]
WORKLOADS: dict[str, dict[str, Any]] = {
    "cifar_cnn": {"net": "cnn", "shape": (3, 32, 32)},
    "lenet5_mnist": {"net": "lenet5", "shape": (1, 28, 28)},
    "digits_cnn": {"net": "digits_cnn", "shape": (1, 8, 8)},
    "cifar_vit": {"net": "vit", "shape": (3, 32, 32)},
}


def _random_images(shape: tuple[int, ...]) -> Any:
    def load(root: str, download: bool, seed: int = 0, train_size: int = 0, **_: Any) -> Any:
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 256, (train_size, *shape), generator=g, dtype=torch.uint8)
        y = torch.randint(0, 10, (train_size,), generator=g)
        return DatasetArrays(x, y, x[:0], y[:0])

    return load


for _name, _workload in WORKLOADS.items():  # timing data, registered for this script only
    DATASETS[f"random_{_name}"] = DatasetSpec(
        f"random_{_name}", 10, _workload["shape"], _random_images(_workload["shape"])
    )


def samples_per_client(args: argparse.Namespace) -> int:
    if args.workload == "lenet5_mnist":
        return args.batch * args.batches_per_epoch
    return args.batch


def flops_per_client_step(args: argparse.Namespace) -> int:
    """FLOPs of one forward + backward of the workload's network on one batch."""
    workload = WORKLOADS[args.workload]
    net = build_network(workload["net"], workload["shape"], 10)
    x, y = torch.randn(args.batch, *workload["shape"]), torch.randint(0, 10, (args.batch,))
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(net(x), y).backward()
    return int(counter.get_total_flops())


def build(
    method: str, num_clients: int, clients_per_round: int, args: argparse.Namespace, path: str
) -> FederatedMethod:
    workload = WORKLOADS[args.workload]
    per_client = samples_per_client(args)
    data = FederatedDataModule(
        f"random_{args.workload}",
        num_clients=num_clients,
        partition=IID(),
        eval_split="holdout",
        val_fraction=0.0,
        test_fraction=1 / (per_client + 1),  # one test sample per client, never timed
        dataset_options={"train_size": (per_client + 1) * num_clients},
        seed=0,
    )
    data.setup()
    data.to(torch.device(args.device))
    # local_epochs None: FedTP defaults to 5 epochs; here every workload but LeNet-5 counts steps
    epochs: dict[str, Any] = (
        {"local_epochs": 1}
        if args.workload == "lenet5_mnist"
        else {"local_epochs": None, "local_steps": args.steps}
    )
    # FedAvg's committed timings ran pFedHN's inner-loop SGD (momentum, weight decay, clip 50),
    # the base class's; FedAvg's own default is now ClientUpdate's plain SGD
    sgd: dict[str, Any] = (
        {"local_momentum": 0.9, "local_weight_decay": 5e-5, "local_max_grad_norm": 50.0}
        if method == "FedAvg"
        else {}
    )
    model = METHODS[method](
        num_clients=num_clients,
        num_classes=10,
        input_shape=workload["shape"],
        net=workload["net"],
        clients_per_round=clients_per_round,
        batch_size=args.batch,
        local_lr=0.01,
        **path_options(path),
        offload_client_state=args.device == "cuda",
        **epochs,
        **sgd,
    )
    model.attach_data(data)
    model.to(args.device)
    model.store.to(torch.device(args.device), offload=args.device == "cuda")
    return model


def path_options(path: str) -> dict[str, Any]:
    """The method arguments of an engine path (``default``: what a config that sets none gets)."""
    if path == "default":
        return {}
    return {
        "vectorize": "vectorized" in path or path == "reference",
        "compile_step": "compiled" in path,
        "cuda_graphs": "graphs" in path,
        "client_threads": usable_cores() if path == "threaded" else 1,
    }


def reference_round(model: FederatedMethod, round_idx: int) -> None:
    """FedAvg as the popular libraries write it: a module and torch.optim.SGD per client."""
    assert isinstance(model, FedAvg)
    h = model.hp
    clients = model.sample_clients(round_idx)
    batches = model.draw_batches(clients, round_idx)
    states = []
    for c in range(len(clients)):
        net = copy.deepcopy(model.net)
        optimizer = torch.optim.SGD(
            net.parameters(),
            lr=h.local_lr,
            momentum=h.local_momentum,
            weight_decay=h.local_weight_decay,
        )
        for s in range(batches.active.shape[1]):
            real = batches.weight[c, s] > 0
            x, y = model.data.fetch(batches.index[c, s][real])
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
            if h.local_max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), h.local_max_grad_norm)
            optimizer.step()
        states.append(net.state_dict())
    weights = model.client_weights(clients)
    with torch.no_grad():
        for name, p in model.net.named_parameters():
            p.copy_(sum(w * s[name] for w, s in zip(weights.float(), states, strict=True)))


def round_runner(
    model: FederatedMethod, precision: str, device: str, path: str
) -> Callable[[int], float]:
    """A function that runs round ``r`` of ``model`` on ``path`` and returns its seconds."""
    optimizer = model.configure_optimizers()
    autocast = (
        torch.autocast(device_type=device, dtype=torch.bfloat16)
        if precision == "bf16-mixed"
        else contextlib.nullcontext()
    )

    def one_round(r: int) -> float:
        start = time.perf_counter()
        if path == "reference":
            reference_round(model, r)
        else:
            optimizer.zero_grad()
            with autocast:
                losses = model.run_round(r, model.sample_clients(r))
            losses.sum().item()  # as the training step, one host sync per round
            optimizer.step()
        _sync(device)
        return time.perf_counter() - start

    return one_round


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(
    method: str,
    num_clients: int,
    cpr: int,
    args: argparse.Namespace,
    paths: list[str],
    precision: str,
    step_flops: int,
) -> list[dict[str, Any]]:
    """Time every path of one setting, round by round in turn, so that a machine that slows
    down or speeds up meanwhile (shared cores, clock changes) affects all paths alike; each
    path's time is the median of its timed rounds."""
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    models = {path: build(method, num_clients, cpr, args, path) for path in paths}
    runners = {path: round_runner(models[path], precision, args.device, path) for path in paths}
    first_round = {path: runner(0) for path, runner in runners.items()}
    timed: dict[str, list[float]] = {path: [] for path in paths}
    for r in range(1, args.rounds + 1):
        for path, runner in runners.items():
            timed[path].append(runner(r))
    steps = args.steps if args.workload != "lenet5_mnist" else args.batches_per_epoch
    client_steps = cpr * steps
    rows = []
    for path in paths:
        seconds = statistics.median(timed[path])
        row = {
            "method": method,
            "workload": args.workload,
            "num_clients": num_clients,
            "clients_per_round": cpr,
            "path": path,
            "precision": precision,
            "local_steps": steps,
            "batch_size": args.batch,
            "seconds_per_round": seconds,
            "round_seconds": timed[path],
            "first_round_seconds": first_round[path],
            "client_updates_per_second": client_steps / seconds,
            "achieved_tflops": step_flops * client_steps / seconds / 1e12,
            "peak_device_memory_mb": torch.cuda.max_memory_allocated() / 2**20
            if args.device == "cuda"
            else None,
            "client_state_mb": models[path].store.nbytes() / 2**20,
        }
        print(
            f"{method:<7} n={num_clients:<6} C={cpr:<4} {path:<27} {precision:<10} "
            f"{seconds:8.4f} s/round {row['client_updates_per_second']:9.1f} upd/s "
            f"{row['achieved_tflops']:7.3f} TFLOP/s",
            flush=True,
        )
        rows.append(row)
    return rows


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Speed-up of every row over the reference and the sequential path of its setting."""
    for row in rows:
        same = [
            r
            for r in rows
            if (r["method"], r["clients_per_round"], r["precision"])
            == (row["method"], row["clients_per_round"], row["precision"])
        ]
        for base in ("reference", "sequential"):
            match = [r for r in same if r["path"] == base]
            if match:
                row[f"speedup_over_{base}"] = (
                    match[0]["seconds_per_round"] / row["seconds_per_round"]
                )


class RoundClock(Callback):
    """Wall time of rounds 2..N through Lightning's fit loop (the first round warms up)."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.rounds = 0
        self.seconds = 0.0

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == 1:
            _sync("cuda" if torch.cuda.is_available() else "cpu")
            self.started = time.perf_counter()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        _sync("cuda" if torch.cuda.is_available() else "cpu")
        if self.started is not None:
            self.rounds = trainer.global_step - 1
            self.seconds = time.perf_counter() - self.started


def end_to_end(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """pFedHN, one client per round, through ``lightning-pfl fit`` (validation off)."""
    from lightning_pfl.cli import run

    config = (
        Path(__file__).resolve().parents[1] / "configs" / "pfedhn" / "table1_cifar10_50clients.yaml"
    )
    clock = RoundClock()
    with tempfile.TemporaryDirectory() as logs:
        cli = run(
            [
                "fit",
                f"--config={config}",
                "--data.init_args.dataset=random_cifar10",
                "--data.init_args.dataset_options={train_size: 20000, test_size: 1000}",
                f"--trainer.max_steps={args.e2e_rounds}",
                f"--trainer.val_check_interval={args.e2e_rounds}",
                "--trainer.limit_val_batches=0",
                f"--trainer.accelerator={'gpu' if args.device == 'cuda' else 'cpu'}",
                "--trainer.enable_progress_bar=false",
                f"--trainer.logger.init_args.save_dir={logs}",
                "--test_after_fit=false",
                *(f"--model.init_args.{k}={v}" for k, v in path_options(path).items()),
                "--checkpoint.every_n_rounds=0",
                "--checkpoint.every_minutes=null",
            ],
            callbacks=[clock],
        )
        training_step = cli.model.results()["seconds_per_round"]
    row = {
        "path": path,
        "rounds": clock.rounds,
        "end_to_end_seconds_per_round": clock.seconds / max(clock.rounds, 1),
        "training_step_seconds_per_round": training_step,
    }
    print(
        f"end to end pFedHN 1 client {path:<27} {row['end_to_end_seconds_per_round']:.4f} s/round "
        f"(training step {row['training_step_seconds_per_round']:.4f})",
        flush=True,
    )
    return row


def job_speed(args: argparse.Namespace, config: str) -> dict[str, Any]:
    """``args.job`` runs of ``config`` as one job and one after another (wall clock)."""
    from lightning_pfl.cli import run

    seeds = list(range(args.job))
    lrs: list[float | None] = list(args.job_lrs) if args.job_lrs else [None]
    common = [
        "fit",
        f"--config={config}",
        "--model.init_args.clients_per_round=1",
        f"--trainer.max_steps={args.job_rounds}",
        f"--trainer.val_check_interval={args.job_rounds}",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--test_after_fit=false",
        "--checkpoint.every_n_rounds=0",
        "--checkpoint.every_minutes=null",
        *([f"--data.init_args.root={args.job_root}"] if args.job_root else []),
    ]
    alone_runs = [(seed, lr) for seed in seeds for lr in lrs]
    timed_alone = alone_runs[: args.job_alone_sample or None]
    cuda = torch.cuda.is_available() and args.device == "cuda"
    with tempfile.TemporaryDirectory() as logs:
        if cuda:  # the CUDA context and kernels' first loads count against neither side
            run([*common, f"--trainer.logger.init_args.save_dir={logs}/warm_up"])
            torch.cuda.reset_peak_memory_stats()
        # the machine's 1-minute load average around each side: other work on shared cores
        load = {"before_one_after_another": os.getloadavg()[0]}
        start = time.perf_counter()
        clocks = []
        for seed, lr in timed_alone:
            began = time.perf_counter()
            clocks.append(RoundClock())
            run(
                [
                    *common,
                    f"--trainer.logger.init_args.save_dir={logs}/alone_{seed}_{lr}",
                    f"--model.init_args.seed={seed}",
                    f"--data.init_args.seed={seed}",
                    *([f"--model.init_args.local_lr={lr}"] if lr is not None else []),
                ],
                callbacks=[clocks[-1]],
            )
            print(f"run alone, seed {seed}: {time.perf_counter() - began:.1f} s", flush=True)
        # the runs differ only by seed or lr: the untimed ones cost what the timed ones did
        alone = (time.perf_counter() - start) * len(alone_runs) / len(timed_alone)
        alone_memory = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        grid = [f'--runs.grid={{"model.init_args.local_lr": {lrs}}}'] if args.job_lrs else []
        load["before_job"] = os.getloadavg()[0]
        start = time.perf_counter()
        cli = run(
            [
                *common,
                f"--trainer.logger.init_args.save_dir={logs}/job",
                f"--runs.seeds={seeds}",
                *grid,
            ]
        )
        together = time.perf_counter() - start
        load["after_job"] = os.getloadavg()[0]
    assert cli.job is not None
    lockstep = cli.job.lockstep
    runs = len(seeds) * len(lrs)
    run_rounds = runs * args.job_rounds
    # rounds 2..N: a run alone from its second round's start to its end (RoundClock); the job
    # from its second round's shared computation to its last (one job round between two)
    alone_round = sum(c.seconds for c in clocks) / sum(c.rounds for c in clocks)
    marks = lockstep.trained_at
    job_round = (marks[-1] - marks[1]) / (len(marks) - 2) if len(marks) > 2 else None
    row = {
        "config": config,
        "runs": runs,
        "seeds": seeds,
        "local_lrs": args.job_lrs,
        "rounds": args.job_rounds,
        "one_after_another_seconds": alone,
        "one_after_another_timed_runs": len(timed_alone),
        "job_seconds": together,
        "one_after_another_run_rounds_per_second": run_rounds / alone,
        "job_run_rounds_per_second": run_rounds / together,
        "throughput_ratio": alone / together,
        "one_run_alone_seconds_per_round_after_the_first": alone_round,
        "job_seconds_per_round_after_the_first": job_round,
        "job_seconds_before_the_first_computation": marks[0] - start if marks else None,
        "throughput_ratio_after_the_first_round": (
            alone_round * runs / job_round if job_round else None
        ),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": load,
        "jobs_handed_in": lockstep.submissions,
        "computations": lockstep.groups_trained,
        "trained_apart_because": sorted(lockstep.apart_reasons),
        "peak_device_memory_mb_one_run_alone": alone_memory,
        "peak_device_memory_mb_job_per_run": (
            torch.cuda.max_memory_allocated() / 2**20 / runs if cuda else None
        ),
    }
    print(
        f"job of {runs} x {args.job_rounds} rounds, {config}: one after another "
        f"{alone:.1f} s, as one job {together:.1f} s: {row['throughput_ratio']:.2f}x; "
        f"rounds after the first: {1e3 * alone_round:.1f} ms a run alone, "
        f"{1e3 * (job_round or float('nan')):.1f} ms a job round: "
        f"{row['throughput_ratio_after_the_first_round'] or float('nan'):.2f}x; load average "
        + ", ".join(f"{k} {v:.2f}" for k, v in load.items()),
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="cifar_cnn")
    parser.add_argument("--methods", nargs="+", default=["FedAvg", "pFedHN"], choices=list(METHODS))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 10, 50, 100])
    parser.add_argument("--num-clients", type=int, default=100, help="total clients")
    parser.add_argument("--steps", type=int, default=50, help="local steps (cifar_cnn, digits_cnn)")
    parser.add_argument("--batches-per-epoch", type=int, default=40, help="(lenet5_mnist)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument(
        "--paths",
        nargs="+",
        default=["reference", "default", "sequential", "threaded", "vectorized"],
        choices=PATHS,
    )
    parser.add_argument("--total-clients", type=int, nargs="*", default=[])
    parser.add_argument("--curve-clients-per-round", type=int, default=10)
    parser.add_argument("--e2e", action="store_true", help="also time lightning-pfl fit")
    parser.add_argument("--e2e-rounds", type=int, default=200)
    parser.add_argument("--e2e-paths", nargs="+", default=["vectorized", "vectorized-graphs"])
    parser.add_argument("--job", type=int, default=0, help="runs of a job (0: no job timing)")
    parser.add_argument("--job-rounds", type=int, default=50)
    parser.add_argument(
        "--job-alone-sample",
        type=int,
        default=0,
        help="time only the first K runs one after another and scale to all N (0: all)",
    )
    parser.add_argument(
        "--job-lrs",
        type=float,
        nargs="+",
        default=None,
        help="a local_lr grid: the job trains every seed at every value (--runs.grid)",
    )
    parser.add_argument("--job-configs", nargs="+", default=["configs/digits/pfedhn.yaml"])
    parser.add_argument("--job-root", default=None, help="data.init_args.root of the job runs")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    started = environment()

    step_flops = flops_per_client_step(args)
    workload = WORKLOADS[args.workload]
    # the threaded loop needs deterministic steps (no dropout), as the engine decides it
    stochastic = Architecture(build_network(workload["net"], workload["shape"], 10)).stochastic
    rows = []
    for method in args.methods:
        paths = [
            path
            for path in dict.fromkeys(args.paths)
            if (path != "reference" or method == "FedAvg")
            and ("graphs" not in path or args.device == "cuda")
            and (path != "threaded" or (args.device == "cpu" and not stochastic))
        ]
        for cpr in args.clients:
            for precision in args.precisions:
                rows += measure(method, args.num_clients, cpr, args, paths, precision, step_flops)
    add_speedups(rows)
    curve = [
        row
        for method in args.methods
        for total in args.total_clients
        for row in measure(
            method, total, args.curve_clients_per_round, args, ["vectorized"], "32-true", step_flops
        )
    ]
    e2e = [end_to_end(args, path) for path in args.e2e_paths] if args.e2e else []
    jobs = [job_speed(args, config) for config in args.job_configs] if args.job else []
    result = {
        "benchmark": "speed",
        "environment": started,
        "device": args.device,
        "flops_per_client_step": step_flops,
        "rows": rows,
        "total_clients_curve": curve,
        "end_to_end": e2e,
        "jobs": jobs,
        "args": vars(args),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
