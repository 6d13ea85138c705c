"""What collapses when MOON's output layer reads the projection on the digits benchmark?

Trains ``configs/digits/moon.yaml`` (10 clients, 5 per round, 20 local steps of batch 32,
SGD momentum 0.9, weight decay 5e-5, clip 50) round by round as the Trainer does (same client
sampling, batches and server step, so its evaluations equal the CLI's), with the overrides
given (``--classifier_input``, ``--mu``, ``--local_lr``, ``--local_momentum``,
``--local_weight_decay``), and records
after every round, for the global model on every client's training samples:

- the round's mean local training loss and each sampled client's;
- each sampled client's CE on its whole training set at the received model and at its
  locally trained model (does its local training fit its own two classes?);
- the representation h (the network's features, after its ReLU) and the projection's hidden
  layer (after its ReLU): the fraction of units that are zero on every training sample (dead),
  and the mean norm of h, of z (the projection's output) and of the logits;
- per part (encoder, projection, output layer or the network's classifier): the norm of the
  global weights, of the round's aggregated update, and the mean over the sampled clients of
  ||w_i - w|| (the local move) and of the gradient norm of the client's CE at the received
  model on its whole training set;
- with ``--sharpness_every k``, every k rounds: the largest-magnitude Hessian eigenvalue
  (sharpness) of each sampled client's CE on its training set at the received model
  (``start_sharpness``); heavy-ball SGD at lr eta and momentum beta is stable on a quadratic
  only below 2 (1 + beta) / eta (76 at the benchmark's 0.05 and 0.9, 380 at 0.01, 40 at
  0.05 without momentum);
- the global model's test accuracy (mean over clients, as the CLI's ``acc``) and per client,
  the share of the pooled test predictions falling in the classes of the round's sampled
  clients (against their share of the test samples), and the accuracy on the samples of
  those classes and of the others.

    python -m benchmarks.moon_collapse --seed 2 --classifier_input projection \\
        --out benchmarks/results/digits_moon_collapse/projection_lr0.05_seed2.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import Tensor
from torch.func import grad, jvp

from benchmarks.accuracy import environment
from lightning_pfl import FederatedDataModule
from lightning_pfl.engine import Params, TrainResult, derive_seed, weighted_cross_entropy
from lightning_pfl.methods.moon import MOON, OUT, PROJ
from lightning_pfl.partition import ClassesPerClient, Dirichlet
from lightning_pfl.streams import DROPOUT_STREAM


def part_of(name: str, head: tuple[str, ...]) -> str:
    if name.startswith(PROJ):
        return "projection"
    if name.startswith(OUT) or name in head:
        return "classifier"
    return "encoder"


def norms(params: Params, head: tuple[str, ...], stacked: bool) -> dict[str, Tensor]:
    """L2 norm of each part (per client when ``stacked``)."""
    sq: dict[str, Tensor] = {}
    for n, t in params.items():
        flat = t.flatten(1) if stacked else t.flatten()
        value = flat.pow(2).sum(-1)
        key = part_of(n, head)
        sq[key] = sq.get(key, 0) + value
    return {k: v.sqrt() for k, v in sq.items()}


def top_eigenvalue(loss: Callable[[Params], Tensor], at: Params, iterations: int = 30) -> float:
    """The largest-magnitude Hessian eigenvalue of ``loss`` at ``at``, by power iteration on
    Hessian-vector products."""
    generator = torch.Generator().manual_seed(0)
    v = {n: torch.randn(t.shape, generator=generator) for n, t in at.items()}
    eigenvalue = 0.0
    for _ in range(iterations):
        length = torch.stack([t.pow(2).sum() for t in v.values()]).sum().sqrt()
        v = {n: t / length for n, t in v.items()}
        image = jvp(grad(loss), (at,), (v,))[1]
        eigenvalue = float(torch.stack([(image[n] * v[n]).sum() for n in v]).sum())
        v = image
    return eigenvalue


def one_round_a_line(record: dict[str, object]) -> str:
    """``record`` as indented JSON whose ``rounds`` list holds one round per line."""
    head = json.dumps({k: v for k, v in record.items() if k != "rounds"}, indent=1)
    rounds = ",\n".join(json.dumps(r) for r in record["rounds"])  # type: ignore[attr-defined]
    return head[:-2] + ',\n "rounds": [\n' + rounds + "\n ]\n}\n"


def rounded(x: float | Tensor, digits: int = 4) -> float:
    return round(float(x), digits)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--split", choices=["pathological", "dirichlet"], default="pathological")
    parser.add_argument("--classifier_input", default="projection")
    parser.add_argument("--mu", type=float, default=1.0)
    parser.add_argument("--local_lr", type=float, default=0.05)
    parser.add_argument("--local_momentum", type=float, default=0.9)
    parser.add_argument("--local_weight_decay", type=float, default=5e-5)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument(
        "--sharpness_every",
        type=int,
        default=0,
        help="every this many rounds, the largest Hessian eigenvalue of each sampled client's "
        "CE at the received model (0: never)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = environment()  # the code that trains, before any later checkout
    partition = (
        ClassesPerClient(2) if args.split == "pathological" else Dirichlet(0.3, min_samples=20)
    )
    dm = FederatedDataModule(
        "digits", num_clients=10, partition=partition, val_fraction=0.15, seed=args.seed
    )
    dm.setup("fit")
    # configs/digits/moon.yaml's model arguments
    method = MOON(
        num_clients=dm.num_clients,
        num_classes=dm.num_classes,
        input_shape=dm.input_shape,
        local_epochs=None,
        local_max_grad_norm=50.0,
        local_weight_decay=args.local_weight_decay,
        local_momentum=args.local_momentum,
        mu=args.mu,
        temperature=0.5,
        classifier_input=args.classifier_input,
        net="digits_cnn",
        clients_per_round=5,
        local_steps=20,
        batch_size=32,
        local_lr=args.local_lr,
        seed=args.seed,
    )
    method.attach_data(dm)
    optimizer = method.configure_server_optimizer()
    head = method.arch.head_names
    everyone = torch.arange(dm.num_clients)
    train_index, train_weight = next(dm.eval_blocks(everyone, "train", 10**6))
    train_x, train_y = dm.fetch(train_index)
    train_mask = train_weight.bool()
    test_index, test_weight = next(dm.eval_blocks(everyone, "test", 10**6))
    test_x, test_y = dm.fetch(test_index)
    test_mask = test_weight.bool()
    classes_of = [set(dm.partition_counts()["train"][c].nonzero()[0].tolist()) for c in everyone]
    trained: list[Params] = []
    local_train = method.local_train

    def recorded(*a: object, **k: object) -> TrainResult:
        result = local_train(*a, **k)  # type: ignore[arg-type]
        trained.append(result.params)
        return result

    method.local_train = recorded  # type: ignore[method-assign]

    def ce_of(params: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        return weighted_cross_entropy(method.represent(params, x, train=True)[1], y, w)

    def client_ce(params: Params, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        return ce_of(params, *batch)

    def snapshot(state: Params) -> tuple[dict[str, object], Tensor, Tensor]:
        """The global model on every client's training and test samples: statistics, and its
        prediction and hit of each pooled test sample."""
        net = {n: t for n, t in state.items() if not n.startswith((PROJ, OUT))}
        proj = {n[len(PROJ) :]: t for n, t in state.items() if n.startswith(PROJ)}
        with torch.no_grad():
            x = train_x[train_mask]
            h = method.arch.features(net, x)
            hidden = torch.relu(torch.nn.functional.linear(h, proj["0.weight"], proj["0.bias"]))
            z, logits = method.represent(state, x)
            test_logits = torch.stack([method.represent(state, xc)[1] for xc in test_x])
        predicted = test_logits.argmax(-1)
        hits = (predicted == test_y).float() * test_weight
        per_client = hits.sum(1) / test_weight.sum(1)
        return (
            {
                "dead_h": rounded((h.amax(0) == 0).float().mean()),
                "dead_projection_hidden": rounded((hidden.amax(0) == 0).float().mean()),
                "h_norm": rounded(h.norm(dim=-1).mean(), 3),
                "z_norm": rounded(z.norm(dim=-1).mean(), 3),
                "logit_norm": rounded(logits.norm(dim=-1).mean(), 3),
                "test_acc": rounded(per_client.mean()),
                "test_acc_per_client": [rounded(a, 3) for a in per_client],
            },
            predicted[test_mask],
            hits[test_mask],
        )

    rounds: list[dict[str, object]] = []
    state = method.global_state()
    before = snapshot(state)[0]
    print(json.dumps(before))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "what": "MOON on configs/digits/moon.yaml, the global model after every round",
        "split": args.split,
        "seed": args.seed,
        "classifier_input": args.classifier_input,
        "mu": args.mu,
        "local_lr": args.local_lr,
        "local_momentum": args.local_momentum,
        "local_weight_decay": args.local_weight_decay,
        "environment": started,
        "device": "cpu, 1 thread",
        "seconds": 0.0,
        "round_0": before,
        "rounds": rounds,  # written after every round: an interrupted run keeps its rounds
    }
    began = time.perf_counter()
    for r in range(args.rounds):
        clients = method.sample_clients(r)
        start = {n: t.clone() for n, t in state.items()}
        grads, sharpness, batches = [], [], []
        for c in clients.tolist():
            rows = train_mask[c]
            batch = (train_x[c][rows], train_y[c][rows], torch.ones(int(rows.sum())))
            batches.append(batch)
            grads.append(norms(grad(ce_of)(start, *batch), head, stacked=False))
            if args.sharpness_every and r % args.sharpness_every == 0:
                sharpness.append(top_eigenvalue(partial(client_ce, batch=batch), start))
        optimizer.zero_grad()
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(derive_seed(method.hp.seed, r, DROPOUT_STREAM))
            losses = method.run_round(r, clients)
        optimizer.step()
        state = method.global_state()
        moved = {n: trained[-1][n] - start[n] for n in start}
        local_move = norms(moved, head, stacked=True)
        with torch.no_grad():
            ce_before = [ce_of(start, *b) for b in batches]
            ce_after = [
                ce_of({n: t[k] for n, t in trained[-1].items()}, *b) for k, b in enumerate(batches)
            ]
        update = norms({n: state[n] - start[n] for n in start}, head, stacked=False)
        weights = norms(state, head, stacked=False)
        now, predicted, hits = snapshot(state)
        sampled_classes = sorted(set().union(*(classes_of[c] for c in clients.tolist())))
        in_sampled = torch.isin(test_y[test_mask], torch.tensor(sampled_classes))
        row = {
            "round": r + 1,
            "clients": clients.tolist(),
            "sampled_classes": sampled_classes,
            "loss": rounded(losses.mean()),
            "client_loss": [rounded(v) for v in losses],
            "client_ce_at_received": [rounded(v) for v in ce_before],
            "client_ce_after_local_training": [rounded(v) for v in ce_after],
            **now,
            "predicted_in_sampled_classes": rounded(
                torch.isin(predicted, torch.tensor(sampled_classes)).float().mean(),
                3,
            ),
            "test_share_of_sampled_classes": rounded(in_sampled.float().mean(), 3),
            "acc_on_sampled_classes": rounded(hits[in_sampled].mean(), 3),
            "acc_on_other_classes": rounded(hits[~in_sampled].mean(), 3),
            "weight_norm": {k: rounded(v, 3) for k, v in weights.items()},
            "update_norm": {k: rounded(v, 4) for k, v in update.items()},
            "local_move_mean": {k: rounded(v.mean(), 4) for k, v in local_move.items()},
            "start_sharpness": [rounded(v, 2) for v in sharpness],
            "start_grad_norm_mean": {
                k: rounded(sum(g[k] for g in grads) / len(grads), 4) for k in grads[0]
            },
        }
        rounds.append(row)
        record["seconds"] = round(time.perf_counter() - began, 1)
        args.out.write_text(one_round_a_line(record))
        print(json.dumps({k: row[k] for k in ("round", "loss", "test_acc", "z_norm")}), flush=True)


if __name__ == "__main__":
    main()
