"""FedPHP's two KD losses on digits Dirichlet(0.3): what the history models (HPMs) become.

Trains FedPHP as the digits accuracy benchmark's Dirichlet(0.3) rows (configs/digits/fedphp.yaml:
10 clients, 5 per round, 20 local steps of batch 32 at lr 0.05, pFedHN's inner-loop SGD, 150
rounds, T of mu_k = 150, validation every 12 rounds; one thread, the same seeded sampling and
batches as the CLI) for each ``--variants distillation:lambda:temperature``, and at every
evaluation round records, over the clients' HPMs (the personalized models):

- ``val_acc`` / ``test_acc``: mean over clients, as the benchmark's ``acc``;
- ``test_loss``: mean over clients of the HPM's test cross-entropy;
- ``train_max_prob``: mean over clients of the HPM's mean largest softmax probability on its
  own training samples (how confident the model the local models are distilled from is);
- ``train_margin``: the same for the logit of the true class minus the largest other logit;
- ``teacher_max_prob``: the same for ``softmax(v / T)``, the soft target KD hands the student.

At the best-validation round (the first with the highest ``val_acc``, the benchmark's selection)
it also records each client's test accuracy and the test accuracy by how many training samples
the client holds of the test sample's class (``by_train_count``: bins 1-4, 5-19, 20+).

    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.fedphp_kd --seeds 0 1 2 \\
        --out benchmarks/results/digits_fedphp_kd/hpm/diagnosis.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.accuracy import environment
from lightning_pfl import FederatedDataModule
from lightning_pfl.datamodule import Split
from lightning_pfl.engine import Params, derive_seed
from lightning_pfl.methods.fedphp import FedPHP
from lightning_pfl.partition import Dirichlet
from lightning_pfl.streams import DROPOUT_STREAM

BINS = ((1, 4), (5, 19), (20, 10**9))


def client_data(dm: FederatedDataModule, client: int, split: Split) -> tuple[Tensor, Tensor]:
    """Every sample of ``client`` in ``split`` (one evaluation block holding all of them)."""
    ((index, weight),) = list(dm.eval_blocks(torch.tensor([client]), split, 10**6))
    return dm.fetch(index[0][weight[0] > 0])


@torch.no_grad()
def hpm_stats(method: FedPHP, dm: FederatedDataModule) -> tuple[dict[str, Any], list[Tensor]]:
    """The evaluation round's statistics (means over clients) and each client's test hits."""
    stacked = method.personalized_params(torch.arange(dm.num_clients))
    sums = torch.zeros(6)
    hits = []
    for c in range(dm.num_clients):
        params: Params = {n: v[c] for n, v in stacked.items()}
        x, y = client_data(dm, c, "val")
        val = (method.arch(params, x).argmax(-1) == y).float().mean()
        x, y = client_data(dm, c, "test")
        logits = method.arch(params, x).float()
        hits.append(logits.argmax(-1) == y)
        loss = F.cross_entropy(logits, y)
        x, y = client_data(dm, c, "train")
        logits = method.arch(params, x).float()
        others = logits.scatter(1, y[:, None], float("-inf"))
        margin = logits.gather(1, y[:, None])[:, 0] - others.max(-1).values
        teacher = F.softmax(logits / method.hp.temperature, -1).max(-1).values
        sums += torch.stack(
            [
                val,
                hits[-1].float().mean(),
                loss,
                F.softmax(logits, -1).max(-1).values.mean(),
                margin.mean(),
                teacher.mean(),
            ]
        )
    names = ("val_acc", "test_acc", "test_loss", "train_max_prob", "train_margin")
    means = (sums / dm.num_clients).tolist()
    return {n: round(v, 4) for n, v in zip((*names, "teacher_max_prob"), means, strict=True)}, hits


def by_train_count(dm: FederatedDataModule, hits: list[Tensor]) -> dict[str, list[int]]:
    counts = torch.as_tensor(dm.partition_counts()["train"])
    out = {}
    for low, high in BINS:
        correct = total = 0
        for c, h in enumerate(hits):
            have = counts[c][client_data(dm, c, "test")[1]]
            inside = (have >= low) & (have <= high)
            correct += int(h[inside].sum())
            total += int(inside.sum())
        out[f"{low}-{high}" if high < 10**9 else f"{low}+"] = [correct, total]
    return out


def train(
    dm: FederatedDataModule, seed: int, variant: str, rounds: int, every: int
) -> dict[str, Any]:
    distillation, lam, temperature = variant.split(":")
    method = FedPHP(
        num_clients=dm.num_clients,
        num_classes=dm.num_classes,
        input_shape=dm.input_shape,
        distillation=distillation,  # type: ignore[arg-type]
        lam=float(lam),
        temperature=float(temperature),
        total_rounds=rounds,  # the CLI's trainer.max_steps
        net="digits_cnn",
        clients_per_round=5,
        local_steps=20,
        batch_size=32,
        local_lr=0.05,
        local_momentum=0.9,
        local_weight_decay=5e-5,
        local_max_grad_norm=50.0,
        client_threads=1,
        seed=seed,
    )
    method.attach_data(dm)
    optimizer = method.configure_server_optimizer()
    history = []
    best: dict[str, Any] = {"val_acc": -1.0}
    for r in range(rounds + 1):
        if r % every == 0 or r == rounds:
            stats, hits = hpm_stats(method, dm)
            history.append({"round": r, **stats})
            if stats["val_acc"] > best["val_acc"]:
                best = {
                    "round": r,
                    **stats,
                    "client_test_acc": [round(float(h.float().mean()), 3) for h in hits],
                    "by_train_count": by_train_count(dm, hits),
                }
        if r == rounds:
            break
        optimizer.zero_grad()
        sampled = method.sample_clients(r)
        with torch.random.fork_rng():
            torch.manual_seed(derive_seed(seed, r, DROPOUT_STREAM))
            method.run_round(r, sampled)
        optimizer.step()
    return {"seed": seed, "variant": variant, "best": best, "history": history}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["tempered_teacher:0.1:4", "hinton:0.1:4"],
        help="distillation:lambda:temperature",
    )
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--eval_every", type=int, default=12)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = environment()  # the code that trains, before any later checkout
    runs = []
    for seed in args.seeds:
        dm = FederatedDataModule(
            "digits",
            num_clients=10,
            partition=Dirichlet(alpha=0.3, min_samples=20),
            val_fraction=0.15,
            seed=seed,
        )
        dm.setup("fit")
        for variant in args.variants:
            run = train(dm, seed, variant, args.rounds, args.eval_every)
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "history"}), flush=True)
    summary = {}
    for variant in args.variants:
        mine = [r["best"] for r in runs if r["variant"] == variant]
        keys = ("test_acc", "test_loss", "train_max_prob", "train_margin", "teacher_max_prob")
        summary[variant] = {k: round(sum(b[k] for b in mine) / len(mine), 4) for k in keys} | {
            "test_acc_per_seed": [b["test_acc"] for b in mine],
            "by_train_count": {
                b: [sum(m["by_train_count"][b][i] for m in mine) for i in (0, 1)]
                for b in mine[0]["by_train_count"]
            },
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "what": "FedPHP on digits Dirichlet(0.3) (configs/digits/fedphp.yaml, the accuracy "
        "benchmark's rows): the HPMs at every evaluation round, per distillation:lambda:T; "
        "summary: means over seeds at the best-validation round",
        "environment": started,
        "device": "cpu, 1 thread",
        "rounds": args.rounds,
        "eval_every": args.eval_every,
        "summary": summary,
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
