"""Which CFL clusters lose accuracy after their split on the digits benchmark, and why?

Trains ``configs/digits/cfl.yaml`` (10 clients with 2 classes each, 5 per round, 20 local
steps of batch 32 at lr 0.05, a fresh client SGD each round with momentum 0.9, weight decay
5e-5, clip 50) with ``--eps_2`` (default 1.0) round by round as the Trainer does (same client
sampling, batches and updates, so its evaluations equal the CLI's), and records:

- each split: the round, the cluster split, the members of both halves with their classes,
  the round's mean and largest update norms of the cluster (its sampled members) and the
  cosine similarities of the members' latest updates;
- after every round, per client, with its cluster's model: the cluster, the training loss and
  accuracy on all its training samples, the test accuracy, the share of its test samples
  predicted as each of its two classes (and as any other class), the fraction of the hidden
  layer's units (the representation, after its ReLU) that are zero on every one of its
  training samples (dead), and the mean norm of that representation;
- per round: the sampled clients, their local losses and update norms, and the mean test
  accuracy over clients (the CLI's ``acc``).

``--all_clients_from R``: from round index R on every client trains every round (the paper's
participation), continuing the state the 5-of-10 rounds reached; the rounds before R are the
same as without it.

    python -m benchmarks.cfl_collapse --seed 2 \\
        --out benchmarks/results/digits_cfl_collapse/fresh_sgd_eps_2_1.0_seed2.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.accuracy import environment
from benchmarks.moon_collapse import one_round_a_line
from lightning_pfl import FederatedDataModule
from lightning_pfl.engine import derive_seed
from lightning_pfl.methods.cfl import CFL
from lightning_pfl.partition import ClassesPerClient
from lightning_pfl.streams import DROPOUT_STREAM


def rounded(x: float | torch.Tensor, digits: int = 4) -> float:
    return round(float(x), digits)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--eps_2", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument(
        "--all_clients_from",
        type=int,
        default=None,
        help="from this round index on, every client trains every round (the counterfactual "
        "of full participation from a state reached with 5 of 10)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = environment()  # the code that trains, before any later checkout
    dm = FederatedDataModule(
        "digits",
        num_clients=10,
        partition=ClassesPerClient(2),
        val_fraction=0.15,
        seed=args.seed,
    )
    dm.setup("fit")
    # configs/digits/cfl.yaml's model arguments
    method = CFL(
        num_clients=dm.num_clients,
        num_classes=dm.num_classes,
        input_shape=dm.input_shape,
        eps_2=args.eps_2,
        local_max_grad_norm=50.0,
        local_weight_decay=5e-5,
        keep_client_optimizer=False,
        lr_decay=1.0,
        net="digits_cnn",
        clients_per_round=5,
        local_steps=20,
        batch_size=32,
        local_lr=0.05,
        seed=args.seed,
    )
    method.attach_data(dm)
    everyone = torch.arange(dm.num_clients)
    counts = dm.partition_counts()["train"]
    classes = [sorted(counts[c].nonzero()[0].tolist()) for c in range(dm.num_clients)]
    train_index, train_weight = next(dm.eval_blocks(everyone, "train", 10**6))
    train_x, train_y = dm.fetch(train_index)
    test_index, test_weight = next(dm.eval_blocks(everyone, "test", 10**6))
    test_x, test_y = dm.fetch(test_index)

    splits: list[dict[str, object]] = []
    round_now = [0]
    bipartition = method.bipartition

    def recorded(c: int) -> None:
        members = (method.cluster_of == c).nonzero().flatten()
        update = method.store.gather("update", members, method.device)
        unit = F.normalize(update["delta"].double(), dim=1, eps=1e-12)
        bipartition(c)
        after = method.cluster_of[members]
        splits.append(
            {
                "round": round_now[0] + 1,
                "cluster": c,
                "members": members.tolist(),
                "members_seen": [bool(s) for s in update["seen"] > 0],
                "stay": [
                    (m, classes[m])
                    for m, k in zip(members.tolist(), after.tolist(), strict=True)
                    if k == c
                ],
                "leave": [
                    (m, classes[m])
                    for m, k in zip(members.tolist(), after.tolist(), strict=True)
                    if k != c
                ],
                "update_norms": [rounded(v, 3) for v in update["delta"].norm(dim=1)],
                "cosine": [[rounded(v, 3) for v in row] for row in unit @ unit.T],
            }
        )

    method.bipartition = recorded  # type: ignore[method-assign]

    def clients_now() -> list[dict[str, object]]:
        """Every client on its cluster's model."""
        params = method.personalized_params(everyone)
        rows = []
        with torch.no_grad():
            for c in range(dm.num_clients):
                one = {n: t[c] for n, t in params.items()}
                keep = train_weight[c].bool()
                x, y = train_x[c][keep], train_y[c][keep]
                h = method.arch.features(one, x)
                logits = method.arch.classify(one, h)
                keep_test = test_weight[c].bool()
                predicted = method.predict(one, test_x[c][keep_test]).argmax(-1)
                truth = test_y[c][keep_test]
                rows.append(
                    {
                        "cluster": int(method.cluster_of[c]),
                        "train_loss": rounded(F.cross_entropy(logits, y)),
                        "train_acc": rounded((logits.argmax(-1) == y).float().mean(), 3),
                        "test_acc": rounded((predicted == truth).float().mean(), 3),
                        "predicted_share": [
                            rounded((predicted == k).float().mean(), 3) for k in classes[c]
                        ],
                        "dead_h": rounded((h.amax(0) == 0).float().mean(), 3),
                        "h_norm": rounded(h.norm(dim=-1).mean(), 3),
                    }
                )
        return rows

    record_rounds: list[dict[str, object]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "what": "CFL on configs/digits/cfl.yaml, every client on its cluster's model per round",
        "seed": args.seed,
        "eps_2": args.eps_2,
        "all_clients_from": args.all_clients_from,
        "classes": classes,
        "train_samples": [int(v) for v in counts.sum(1)],
        "environment": started,
        "device": "cpu, 1 thread",
        "seconds": 0.0,
        "splits": splits,
        "rounds": record_rounds,  # written after every round: an interrupted run keeps its rounds
    }
    began = time.perf_counter()
    for r in range(args.rounds):
        round_now[0] = r
        clients = method.sample_clients(r)
        if args.all_clients_from is not None and r >= args.all_clients_from:
            clients = everyone
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(derive_seed(method.hp.seed, r, DROPOUT_STREAM))
            losses = method.run_round(r, clients)
        delta = method.store.gather("update", clients, method.device)["delta"]
        per_client = clients_now()
        accuracy = [float(p["test_acc"]) for p in per_client]  # type: ignore[arg-type]
        row = {
            "round": r + 1,
            "clients": clients.tolist(),
            "client_loss": [rounded(v) for v in losses],
            "update_norm": [rounded(v, 3) for v in delta.norm(dim=1)],
            "cluster_of": method.cluster_of.tolist(),
            "test_acc": rounded(sum(accuracy) / len(accuracy)),
            "per_client": per_client,
        }
        record_rounds.append(row)
        record["seconds"] = round(time.perf_counter() - began, 1)
        args.out.write_text(one_round_a_line(record))
        print(
            json.dumps({k: row[k] for k in ("round", "cluster_of", "test_acc")}),
            flush=True,
        )


if __name__ == "__main__":
    main()
