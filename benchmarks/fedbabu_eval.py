"""Why does FedBABU's evaluation swing? Its fine-tuned models, client by client (issue 46).

Trains FedBABU exactly as the digits accuracy benchmark's Dirichlet(0.3) row of ``--seed``
(configs/digits/fedbabu.yaml, 150 rounds, the same client sampling and seeds as the CLI, one
thread; ``--setting fashion_mnist``: configs/fashion_mnist/fedbabu.yaml's pathological row,
FashionMNIST under ``--root``) and, at every evaluation round of that run (``--eval_every``;
digits: rounds 0, 12, ..., 144, 150), evaluates each client on its test split with:

- ``before``: the global model as sent (trained body, initial head), not fine-tuned;
- ``default``: the personalized model the method evaluates (tau fine-tuning epochs, batches
  seeded by the round);
- ``batch_seed_k``: the same fine-tuning with other batches (round index + 100000 k);
- ``perturbed_k``: the same fine-tuning (same batches) of the global model plus independent
  N(0, (1e-6)^2) noise on every parameter (about the size of GPU float nondeterminism);
- ``finetune_<spec>``: the fine-tuning of ``--variants lr:momentum:wd:clip[:part]`` (wd 0 /
  clip none: the reference notebook's optimizer, SGD with momentum only; part ``full``,
  ``head`` or ``body``, default ``full``).

``--finetune_lr`` / ``--finetune_momentum`` set the method's own fine-tuning (``none``: the
local SGD's, the default before issue 46).

Per client and model: test accuracy, whether the test loss is finite, the share of its test
predictions falling in the most predicted class (1.0: collapsed to one class), and for the
fine-tuned models the training loss after fine-tuning. The reference for the swing is the
global mean (``acc``, as the benchmark's) of each model.

    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.fedbabu_eval --seed 0 \\
        --out benchmarks/results/digits_fedbabu_eval/seed0.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl import FederatedDataModule
from lightning_pfl.datamodule import Split
from lightning_pfl.engine import Params, SGDConfig, derive_seed
from lightning_pfl.methods.fedbabu import FedBABU
from lightning_pfl.partition import ClassesPerClient, Dirichlet
from lightning_pfl.streams import DROPOUT_STREAM


@torch.no_grad()
def client_stats(
    method: FedBABU, clients: Tensor, params: Params, split: Split
) -> dict[str, Tensor]:
    """Per-client accuracy, mean loss and the share of the most predicted class on ``split``."""
    data = method.data
    by_size = data.by_size(clients, split)
    params = by_size.sort(params)
    classes = method.hp.num_classes
    sums = torch.zeros(len(clients), 3)
    predicted = torch.zeros(len(clients), classes)
    for k, x, y, weight in by_size.blocks(method.hp.eval_batch_size):
        logits = method.client_logits({n: v[:k] for n, v in params.items()}, x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view_as(weight)
        hits = (logits.argmax(-1) == y).float()
        sums[:k] += torch.stack([hits * weight, weight, loss * weight], -1).sum(1)
        predicted[:k] += (F.one_hot(logits.argmax(-1), classes) * weight[..., None]).sum(1)
    sums = by_size.unsort(sums)
    predicted = by_size.unsort(predicted)
    total = sums[:, 1]
    return {
        "acc": sums[:, 0] / total,
        "loss": sums[:, 2] / total,
        "top_class_share": predicted.max(1).values / total,
    }


def summary(method: FedBABU, clients: Tensor, params: Params, tuned: bool) -> dict[str, object]:
    test = client_stats(method, clients, params, "test")
    out: dict[str, object] = {
        "acc": round(float(test["acc"].mean()), 4),
        "client_acc": [round(float(a), 3) for a in test["acc"]],
        "test_loss_finite": [bool(torch.isfinite(v)) for v in test["loss"]],
        "top_class_share": [round(float(a), 2) for a in test["top_class_share"]],
    }
    if tuned:
        train = client_stats(method, clients, params, "train")
        out["train_loss"] = [float(f"{float(v):.3g}") for v in train["loss"]]
        out["train_acc"] = [round(float(a), 3) for a in train["acc"]]
    return out


def optional_float(text: str) -> float | None:
    return None if text == "none" else float(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setting", choices=["digits", "fashion_mnist"], default="digits")
    parser.add_argument("--root", default="data", help="FashionMNIST's folder (fashion_mnist)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--eval_every", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--noise", type=float, default=1e-6)
    parser.add_argument(
        "--variants", nargs="*", default=["0.005:0.9:0:none", "0.0005:0.9:0:none", "0.05:0:0:none"]
    )
    parser.add_argument("--finetune_lr", type=optional_float, default=1e-3)
    parser.add_argument("--finetune_momentum", type=optional_float, default=0.9)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.setting == "digits":
        dm = FederatedDataModule(
            "digits",
            num_clients=10,
            partition=Dirichlet(alpha=0.3, min_samples=20),
            val_fraction=0.15,
            seed=args.seed,
        )
        # configs/digits/fedbabu.yaml with the benchmark's --model.init_args.client_threads=1
        model: dict[str, Any] = {"net": "digits_cnn", "local_steps": 20, "batch_size": 32}
        model["local_lr"] = 0.05
    else:
        dm = FederatedDataModule(
            "fashion_mnist",
            root=args.root,
            num_clients=50,
            partition=ClassesPerClient(2),
            val_fraction=0.16666667,
            seed=args.seed,
        )
        # configs/fashion_mnist/fedbabu.yaml
        model = {"net": "cnn", "local_steps": 50, "batch_size": 64, "local_lr": 0.005}
    dm.setup("fit")
    method = FedBABU(
        num_clients=dm.num_clients,
        num_classes=dm.num_classes,
        input_shape=dm.input_shape,
        clients_per_round=5,
        local_momentum=0.9,
        local_weight_decay=5e-5,
        local_max_grad_norm=50.0,
        finetune_epochs=5,
        finetune_part="full",
        finetune_lr=args.finetune_lr,
        finetune_momentum=args.finetune_momentum,
        client_threads=1,
        seed=args.seed,
        **model,
    )
    method.attach_data(dm)
    optimizer = method.configure_server_optimizer()
    clients = torch.arange(dm.num_clients)
    head = method.arch.head_names
    parts = {
        "full": tuple(method.arch.shapes),
        "head": head,
        "body": tuple(n for n in method.arch.shapes if n not in head),
    }
    evals = sorted({*range(0, args.rounds, args.eval_every), args.rounds})
    records = []
    for r in range(args.rounds + 1):
        if r in evals:
            sent = method.payload(clients) | method.frozen_head(clients)
            record: dict[str, object] = {"round": r}
            record["before"] = summary(method, clients, sent, False)
            names, sgd = method.finetuned_names(), method.finetune_sgd()
            tuned = method.finetune(sent, clients, r, names, sgd)
            record["default"] = summary(method, clients, tuned, True)
            for k in range(1, args.repeats + 1):
                tuned = method.finetune(sent, clients, r + 100000 * k, names, sgd)
                record[f"batch_seed_{k}"] = summary(method, clients, tuned, True)
            for k in range(1, args.repeats + 1):
                generator = torch.Generator().manual_seed(k)
                noisy = {
                    n: t + args.noise * torch.randn(t.shape, generator=generator)
                    for n, t in sent.items()
                }
                tuned = method.finetune(noisy, clients, r, names, sgd)
                record[f"perturbed_{k}"] = summary(method, clients, tuned, True)
            for spec in args.variants:
                lr, momentum, wd, clip, *part = spec.split(":")
                other = SGDConfig(float(lr), float(momentum), float(wd), optional_float(clip))
                tuned = method.finetune(sent, clients, r, parts[part[0] if part else "full"], other)
                record[f"finetune_{spec}"] = summary(method, clients, tuned, True)
            records.append(record)
            print(
                json.dumps({k: v["acc"] if isinstance(v, dict) else v for k, v in record.items()}),
                flush=True,
            )
        if r == args.rounds:
            break
        optimizer.zero_grad()
        sampled = method.sample_clients(r)
        with torch.random.fork_rng():
            torch.manual_seed(derive_seed(method.hp.seed, r, DROPOUT_STREAM))
            method.run_round(r, sampled)
        optimizer.step()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "what": f"FedBABU {args.setting} evaluation, per client, before and after fine-tuning "
        f"(configs/{args.setting}/fedbabu.yaml, the accuracy benchmark's row)",
        "setting": args.setting,
        "seed": args.seed,
        "rounds": args.rounds,
        "noise_std": args.noise,
        "finetune_lr": args.finetune_lr,
        "finetune_momentum": args.finetune_momentum,
        "variants": "finetune_<lr>:<momentum>:<weight decay>:<clip>[:<part>] (5 epochs)",
        "commit": commit,
        "device": "cpu, 1 thread",
        "train_samples": [int(n) for n in dm.num_samples("train")],
        "evaluations": records,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
