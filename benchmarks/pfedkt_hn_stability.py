"""Does pFedKT's local-HN step stay stable? The same clients visited a few times, no server step.

On the FashionMNIST protocol of pFedKT's Table 1 (50 clients, 2 classes each, 8:1:1 holdout,
the Table 2 CNN, client SGD lr 1e-2 / momentum 0.9 / wd 5e-5, batch 64), clients 0-4 are
trained ``--visits`` times in a row (round r = visit r + 1; the global model stays omega^0, so
only the private models and the local HNs move). Per visit it records, over the five clients,
the largest local training loss, the ratio of the standard deviation of the PM a client starts
from to omega^0's (per tensor; visit 1 starts from omega^0 itself), the largest absolute
value in it, and the validation accuracy of the trained PMs. One thread.

    python -m benchmarks.pfedkt_hn_stability --root /work/shared/datasets --epochs 1 \\
        --visits 4 --hn_parametrization paper --hn_lr 5e-3 \\
        --out benchmarks/results/fashion_mnist_pfedkt_hn_stability/paper_lr5e-3_e1.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

from lightning_pfl import FederatedDataModule
from lightning_pfl.methods import PFedKT
from lightning_pfl.partition import ClassesPerClient


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--visits", type=int, default=3)
    parser.add_argument("--hn_parametrization", default="paper")
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
        hn_lr=args.hn_lr,
    )
    method.attach_data(dm)
    clients = torch.arange(5)
    omega = {n: t.detach() for n, t in method.net.named_parameters()}
    visits = []
    for r in range(args.visits):
        start, _ = method.private_start(clients, method.store.gather("pm", clients, method.device))
        began = time.perf_counter()
        loss = method.run_round(r, clients)
        seconds = time.perf_counter() - began
        with torch.inference_mode():
            correct, total, _ = method.evaluate(clients, "val")
        visits.append(
            {
                "visit": r + 1,
                "start_std_over_omega0_std": {
                    n: float(start[n].std() / omega[n].std()) for n in omega
                },
                "start_max_abs": float(max(t.abs().max() for t in start.values())),
                "max_client_loss": float(loss.max()),
                "val_acc": (correct / total).tolist(),
                "seconds": seconds,
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
        "hn_lr": args.hn_lr,
        "local_epochs": args.epochs,
        "commit": commit,
        "device": "cpu, 1 thread",
        "visits": visits,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
