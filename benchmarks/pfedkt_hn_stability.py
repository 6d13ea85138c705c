"""Does pFedKT's local-HN step stay stable? The same clients visited a few times, no server step.

On the FashionMNIST protocol of pFedKT's Table 1 (50 clients, 2 classes each, 8:1:1 holdout,
the Table 2 CNN, client SGD lr 1e-2 / momentum 0.9 / wd 5e-5, batch 64), clients 0-4 are
trained ``--visits`` times in a row (round r = visit r + 1; the global model stays omega^0, so
only the private models and the local HNs move). One thread.

Before the visits it records the step's largest gain: hn_lr times the largest eigenvalue of
J J^T (J = d HN output / d phi at client 0's initial phi, by power iteration), divided by the
number of chunks for ``--hn_reduction mean``. From a client's second visit the HN step is a
gradient step on 0.5 ||HN(phi) - theta~||^2, which overshoots along that direction when the
gain is above 2. Per visit, per client: the largest local loss and whether it is finite; the
standard deviation of the PM a client starts from (omega^0 at visit 1, HN(phi) afterwards) and
of the trained PM theta~, over omega^0's; the local move ||start - theta~||; the HN's fit
||HN(phi) - theta~|| before and after its step (norms over ||omega^0||); how far the step moved
the HN's output, over the local move; the validation accuracy of the start and trained PMs.

    python -m benchmarks.pfedkt_hn_stability --root /work/shared/datasets --epochs 10 \\
        --visits 4 --hn_parametrization scaled --hn_reduction mean --hn_lr 5e-3 \\
        --out benchmarks/results/fashion_mnist_pfedkt_hn_stability/scaled_mean_lr5e-3_e10.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch
from torch import Tensor
from torch.func import jvp, vjp, vmap

from lightning_pfl import FederatedDataModule
from lightning_pfl.engine import Params, TrainResult
from lightning_pfl.methods import PFedKT
from lightning_pfl.partition import ClassesPerClient


def step_gain(method: PFedKT, phi: Params, iterations: int = 30) -> float:
    """hn_lr * the largest eigenvalue of J J^T, reduced as the method's HN step is."""
    v = torch.randn(method._hn_template[0].numel, generator=torch.Generator().manual_seed(0))
    pullback = vjp(method.generate, phi)[1]
    eigenvalue = 0.0
    for _ in range(iterations):
        v = v / v.norm()
        image = jvp(method.generate, (phi,), pullback(v))[1]
        eigenvalue = float(v @ image)
        v = image
    chunks = method._hn_template[0].num_chunks if method.hp.hn_reduction == "mean" else 1
    return method.hp.hn_lr * eigenvalue / chunks


def rounded(values: Tensor, digits: int = 3) -> list[float]:
    return [round(float(v), digits) for v in values]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--visits", type=int, default=4)
    parser.add_argument("--hn_parametrization", default="scaled")
    parser.add_argument("--hn_reduction", default="mean")
    parser.add_argument("--hn_lr", type=float, default=5e-3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dm = FederatedDataModule(
        "fashion_mnist",
        num_clients=50,
        partition=ClassesPerClient(2),
        root=args.root,
        eval_split="holdout",
        val_fraction=0.1,
        test_fraction=0.1,
    )
    dm.setup("fit")
    method = PFedKT(
        num_clients=50,
        num_classes=dm.num_classes,
        input_shape=dm.input_shape,
        net="kt_cnn",
        clients_per_round=5,
        local_epochs=args.epochs,
        hn_parametrization=args.hn_parametrization,
        hn_reduction=args.hn_reduction,
        hn_lr=args.hn_lr,
    )
    method.attach_data(dm)
    clients = torch.arange(5)
    names = list(method.arch.shapes)
    omega = torch.cat([p.detach().flatten() for p in method.net.parameters()])
    gain = step_gain(method, {k: v[0] for k, v in method.store.fields["hn"].items()})
    print(json.dumps({"step_gain": gain}), flush=True)
    trained: list[TrainResult] = []
    local_train = method.local_train

    def recorded(*a: object, **k: object) -> TrainResult:
        trained.append(local_train(*a, **k))  # type: ignore[arg-type]
        return trained[-1]

    method.local_train = recorded  # type: ignore[method-assign]

    def generated() -> Tensor:
        return vmap(method.generate)({k: v[clients] for k, v in method.store.fields["hn"].items()})

    visits = []
    for r in range(args.visits):
        before = generated()
        visited = method.store.gather("visited", clients, method.device)["visited"]
        start = torch.where(visited[:, None], before, omega[None])
        with torch.inference_mode():
            params = method._hn_template[0].unflatten(start)
            start_correct, start_total, _ = method.evaluate_clients(clients, "val", params)
        began = time.perf_counter()
        loss = method.run_round(r, clients)
        seconds = time.perf_counter() - began
        theta = torch.cat([trained[-1].params[n].flatten(1) for n in names], 1)
        after = generated()
        with torch.inference_mode():
            correct, total, _ = method.evaluate(clients, "val")
        move = (start - theta).norm(dim=1)
        fit_before = (before - theta).norm(dim=1) / omega.norm()
        fit_after = (after - theta).norm(dim=1) / omega.norm()
        visits.append(
            {
                "visit": r + 1,
                "max_client_loss": float(loss.max()),
                "loss_finite": bool(torch.isfinite(loss).all()),
                "start_std_over_omega0_std": rounded(start.std(1) / omega.std(), 2),
                "trained_std_over_omega0_std": rounded(theta.std(1) / omega.std(), 2),
                "local_move_over_omega0_norm": rounded(move / omega.norm()),
                "hn_fit_before_over_omega0_norm": rounded(fit_before),
                "hn_fit_after_over_omega0_norm": rounded(fit_after),
                "hn_output_move_over_local_move": rounded((after - before).norm(dim=1) / move, 2),
                "start_val_acc": rounded(start_correct / start_total),
                "val_acc": rounded(correct / total),
                "seconds": round(seconds, 1),
            }
        )
        print(json.dumps(visits[-1]), flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "what": "pFedKT local-HN stability, clients 0-4 of the FashionMNIST Table 1 protocol",
        "hn_parametrization": args.hn_parametrization,
        "hn_reduction": args.hn_reduction,
        "hn_lr": args.hn_lr,
        "local_epochs": args.epochs,
        "step_gain": gain,
        "commit": commit,
        "device": "cpu, 1 thread",
        "visits": visits,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
