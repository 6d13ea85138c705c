"""Why is FedPer's K_P = 2 below K_P = 1 on digits Dirichlet(0.3)? Client by client.

Trains FedPer as the digits accuracy benchmark's Dirichlet(0.3) rows (``--split pathological``:
its 2-classes-per-client rows; configs/digits/fedper.yaml:
10 clients, 5 per round, 20 local steps of batch 32 at lr 0.05, pFedHN's inner-loop SGD, 150
rounds, validation every 12 rounds; one thread, the same seeded sampling and batches as the CLI)
for each ``--personal_layers`` K_P and each ``--variants lr:steps`` of the local work, and at
the best-validation round (the benchmark's selection: the first round with the highest mean
validation accuracy over clients) records:

- per client: training samples, classes present in its training split, train / validation /
  test accuracy and test loss of its personalized model (global base + personal layers);
- the test accuracy split by how many training samples the client holds of the test sample's
  class (``by_train_count``: bins 0, 1-4, 5-19, 20+; correct / total summed over clients);
- linear probes of the shared layers (``probes``; a 10-class logistic regression on frozen
  features, standardized on the training samples, L-BFGS, weight decay ``--probe_decay``):
  ``conv_pooled`` on the convolutional output (the base of K_P = 2, the lower part of K_P = 1's)
  trained on every client's training samples together, and ``conv_per_client`` trained on each
  client's own; with K_P = 1 also ``fc1_pooled`` / ``fc1_per_client`` on the shared hidden
  layer's output. Test accuracy, mean over clients as the benchmark's ``acc``.

    nice -n 10 env OMP_NUM_THREADS=1 python -m benchmarks.fedper_kp --seeds 0 1 2 \\
        --out benchmarks/results/digits_fedper_kp/diagnosis.json
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
from lightning_pfl.methods.fedper import FedPer
from lightning_pfl.partition import ClassesPerClient, Dirichlet
from lightning_pfl.streams import DROPOUT_STREAM

BINS = ((0, 0), (1, 4), (5, 19), (20, 10**9))


def client_data(dm: FederatedDataModule, client: int, split: Split) -> tuple[Tensor, Tensor]:
    """Every sample of ``client`` in ``split`` (one evaluation block holding all of them)."""
    ((index, weight),) = list(dm.eval_blocks(torch.tensor([client]), split, 10**6))
    keep = weight[0] > 0
    return dm.fetch(index[0][keep])


def conv_features(p: Params, x: Tensor) -> Tensor:
    """``digits_cnn``'s convolutional output (the input of ``fc1``), flattened."""
    x = F.max_pool2d(F.relu(F.conv2d(x, p["conv1.weight"], p["conv1.bias"], padding=1)), 2)
    x = F.max_pool2d(F.relu(F.conv2d(x, p["conv2.weight"], p["conv2.bias"], padding=1)), 2)
    return x.flatten(1)


def hidden_features(p: Params, x: Tensor) -> Tensor:
    """``digits_cnn``'s hidden layer output (the input of the classifier ``fc2``)."""
    return F.relu(F.linear(conv_features(p, x), p["fc1.weight"], p["fc1.bias"]))


def linear_probe(x: Tensor, y: Tensor, classes: int, decay: float) -> tuple[Tensor, Tensor]:
    """Multinomial logistic regression on standardized ``x`` (full batch, L-BFGS)."""
    mean, std = x.mean(0), x.std(0).clamp_min(1e-6) if len(x) > 1 else torch.ones(x.shape[1])
    z = (x - mean) / std
    weight = torch.zeros(x.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=300, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(z @ weight + bias, y) + decay * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return (weight.detach() / std[:, None]), (bias - (mean / std) @ weight).detach()


def probe_accuracy(
    dm: FederatedDataModule, features: Any, params: list[Params], decay: float
) -> dict[str, Any]:
    """Test accuracy (per client and mean) of probes on ``features(params[c], x)``: one probe
    on every client's training samples pooled, and one per client on its own."""
    clients = range(dm.num_clients)
    with torch.no_grad():
        train = [
            (features(params[c], x), y) for c in clients for x, y in [client_data(dm, c, "train")]
        ]
        test = [
            (features(params[c], x), y) for c in clients for x, y in [client_data(dm, c, "test")]
        ]
    pooled = linear_probe(
        torch.cat([f for f, _ in train]), torch.cat([y for _, y in train]), dm.num_classes, decay
    )
    out: dict[str, Any] = {}
    for name in ("pooled", "per_client"):
        accs = []
        for c in clients:
            w, b = pooled if name == "pooled" else linear_probe(*train[c], dm.num_classes, decay)
            f, y = test[c]
            accs.append(float(((f @ w + b).argmax(-1) == y).float().mean()))
        out[name] = {
            "acc": round(sum(accs) / len(accs), 4),
            "client_acc": [round(a, 3) for a in accs],
        }
    return out


@torch.no_grad()
def accuracy(method: FedPer, params: Params, x: Tensor, y: Tensor) -> tuple[Tensor, float]:
    logits = method.arch(params, x).float()
    return logits.argmax(-1) == y, float(F.cross_entropy(logits, y))


def client_records(method: FedPer, dm: FederatedDataModule, params: list[Params]) -> dict[str, Any]:
    counts = torch.as_tensor(dm.partition_counts()["train"])
    bins = torch.zeros(len(BINS), 2)
    clients = []
    for c in range(dm.num_clients):
        record: dict[str, Any] = {
            "client": c,
            "n_train": int(counts[c].sum()),
            "train_classes": int((counts[c] > 0).sum()),
        }
        for split in ("train", "val", "test"):
            x, y = client_data(dm, c, split)
            hits, loss = accuracy(method, params[c], x, y)
            record[f"{split}_acc"] = round(float(hits.float().mean()), 4)
            if split == "test":
                record["test_loss"] = round(loss, 4)
                record["n_test"] = len(y)
                have = counts[c][y]
                for i, (low, high) in enumerate(BINS):
                    inside = (have >= low) & (have <= high)
                    bins[i] += torch.stack([hits[inside].float().sum(), inside.float().sum()])
        clients.append(record)
    return {
        "acc": round(sum(r["test_acc"] for r in clients) / len(clients), 4),
        "clients": clients,
        "by_train_count": {
            f"{low}-{high}" if high < 10**9 else f"{low}+": [int(bins[i, 0]), int(bins[i, 1])]
            for i, (low, high) in enumerate(BINS)
        },
    }


def train(
    dm: FederatedDataModule,
    seed: int,
    personal_layers: int,
    lr: float,
    steps: int,
    rounds: int,
    every: int,
) -> tuple[FedPer, int, float, list[Params]]:
    """The benchmark's run; returns the method, the best round, its mean validation accuracy
    and the per-client personalized models of that round."""
    method = FedPer(
        num_clients=dm.num_clients,
        num_classes=dm.num_classes,
        input_shape=dm.input_shape,
        personal_layers=personal_layers,
        net="digits_cnn",
        clients_per_round=5,
        local_steps=steps,
        batch_size=32,
        local_lr=lr,
        local_momentum=0.9,
        local_weight_decay=5e-5,
        local_max_grad_norm=50.0,
        client_threads=1,
        seed=seed,
    )
    method.attach_data(dm)
    optimizer = method.configure_server_optimizer()
    clients = torch.arange(dm.num_clients)
    best: tuple[int, float, list[Params]] = (-1, -1.0, [])
    for r in range(rounds + 1):
        if r % every == 0 or r == rounds:
            stacked = method.personalized_params(clients)
            params = [{n: v[c].clone() for n, v in stacked.items()} for c in range(dm.num_clients)]
            val = (
                sum(
                    float(accuracy(method, params[c], *client_data(dm, c, "val"))[0].float().mean())
                    for c in range(dm.num_clients)
                )
                / dm.num_clients
            )
            if val > best[1]:
                best = (r, val, params)
        if r == rounds:
            break
        optimizer.zero_grad()
        sampled = method.sample_clients(r)
        with torch.random.fork_rng():
            torch.manual_seed(derive_seed(seed, r, DROPOUT_STREAM))
            method.run_round(r, sampled)
        optimizer.step()
    return method, *best


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per local work ``lr:steps`` and K_P, over seeds: the benchmark's accuracy (mean over
    clients), the pooled one, the mean train accuracy and test loss over clients, the test
    accuracy by the class's training count, the probes; and per client K_P = 2 minus K_P = 1
    (same seed) against the client's training samples per class present."""
    out: dict[str, Any] = {}
    for lr, steps in dict.fromkeys((r["local_lr"], r["local_steps"]) for r in runs):
        work = [r for r in runs if (r["local_lr"], r["local_steps"]) == (lr, steps)]
        entry: dict[str, Any] = {}
        for k in sorted({r["personal_layers"] for r in work}):
            mine = [r for r in work if r["personal_layers"] == k]
            clients = [c for r in mine for c in r["clients"]]
            bins = {
                b: [sum(r["by_train_count"][b][i] for r in mine) for i in (0, 1)]
                for b in mine[0]["by_train_count"]
            }
            entry[f"personal_layers_{k}"] = {
                "acc_per_seed": [r["acc"] for r in mine],
                "acc": round(sum(r["acc"] for r in mine) / len(mine), 4),
                "pooled_acc": round(
                    sum(c["test_acc"] * c["n_test"] for c in clients)
                    / sum(c["n_test"] for c in clients),
                    4,
                ),
                "train_acc": round(sum(c["train_acc"] for c in clients) / len(clients), 4),
                "test_loss": round(sum(c["test_loss"] for c in clients) / len(clients), 4),
                "by_train_count": {b: [*v, round(v[0] / max(v[1], 1), 4)] for b, v in bins.items()},
                "probes": {
                    name: round(sum(r["probes"][name]["acc"] for r in mine) / len(mine), 4)
                    for name in mine[0]["probes"]
                },
            }
        pairs = [
            (one, two)
            for r1 in work
            for r2 in work
            if r1["personal_layers"] == 1
            and r2["personal_layers"] == 2
            and r1["seed"] == r2["seed"]
            for one, two in zip(r1["clients"], r2["clients"], strict=True)
        ]
        if pairs:
            per_class = torch.tensor([a["n_train"] / a["train_classes"] for a, _ in pairs])
            delta = torch.tensor([b["test_acc"] - a["test_acc"] for a, b in pairs])
            median = float(per_class.median())
            low = per_class < median
            entry["kp2_minus_kp1_per_client"] = {
                "clients": len(pairs),
                "median_train_samples_per_class": round(median, 2),
                "mean_delta_below_median": round(float(delta[low].mean()), 4),
                "mean_delta_at_or_above_median": round(float(delta[~low].mean()), 4),
                "corr_delta_train_samples_per_class": round(
                    float(torch.corrcoef(torch.stack([per_class, delta]))[0, 1]), 3
                ),
                "clients_with_higher_test_loss": sum(
                    b["test_loss"] > a["test_loss"] for a, b in pairs
                ),
            }
        out[f"lr_{lr}_steps_{steps}"] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--split", choices=["dirichlet", "pathological"], default="dirichlet")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--personal_layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--variants", nargs="+", default=["0.05:20"], help="local lr:steps")
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--eval_every", type=int, default=12)
    parser.add_argument("--probe_decay", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--summarize", action="store_true", help="only (re)compute the summary of --out's runs"
    )
    args = parser.parse_args()
    if args.summarize:
        result = json.loads(args.out.read_text())
        result["summary"] = summarize(result["runs"])
        result["summary_environment"] = environment()
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        return
    torch.set_num_threads(1)
    started = environment()  # the code that trains, before any later checkout
    runs = []
    for seed in args.seeds:
        dm = FederatedDataModule(
            "digits",
            num_clients=10,
            partition=Dirichlet(alpha=0.3, min_samples=20)
            if args.split == "dirichlet"
            else ClassesPerClient(2),
            val_fraction=0.15,
            seed=seed,
        )
        dm.setup("fit")
        for spec in args.variants:
            lr, steps = float(spec.split(":")[0]), int(spec.split(":")[1])
            for k in args.personal_layers:
                method, best_round, val, params = train(
                    dm, seed, k, lr, steps, args.rounds, args.eval_every
                )
                run: dict[str, Any] = {
                    "seed": seed,
                    "personal_layers": k,
                    "local_lr": lr,
                    "local_steps": steps,
                    "best_round": best_round,
                    "val_acc_at_best": round(val, 4),
                    **client_records(method, dm, params),
                }
                probes = {"conv": conv_features} | ({"fc1": hidden_features} if k == 1 else {})
                run["probes"] = {
                    f"{name}_{kind}": result
                    for name, features in probes.items()
                    for kind, result in probe_accuracy(
                        dm, features, params, args.probe_decay
                    ).items()
                }
                runs.append(run)
                print(
                    json.dumps(
                        {k: v for k, v in run.items() if k not in ("clients",)}
                        | {"probes": {n: p["acc"] for n, p in run["probes"].items()}}
                    ),
                    flush=True,
                )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "what": f"FedPer on digits {args.split} (configs/digits/fedper.yaml, the accuracy "
        "benchmark's rows), per client at the best-validation round, for K_P = "
        "personal_layers and local work lr:steps",
        "environment": started,
        "split": args.split,
        "device": "cpu, 1 thread",
        "rounds": args.rounds,
        "eval_every": args.eval_every,
        "probe_decay": args.probe_decay,
        "runs": runs,
        "summary": summarize(runs),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
