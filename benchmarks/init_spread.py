"""Do the zoo's networks depend on their input at initialization? (the VGG-8 collapse of issue 10)

For every network of the model zoo, every input shape and a few seeds, builds the network twice:
as the zoo builds it (``zoo``: He init for VGG-8 and the SqueezeNets, see
:func:`lightning_pfl.models.zoo.he_init`) and with every conv and linear layer reset to PyTorch's
default layer init (``pytorch_default``: ``reset_parameters()``, what the zoo used before commit
6ac5184). It reports the logits' spread over standard-normal inputs: the standard deviation over
a batch of each logit, averaged over logits, relative to the inputs' (1), with batch norm (the
ResNets) in training mode as the first local step sees it. A spread near 0 means
the network predicts the same logits for every input, so local SGD starts without a gradient
that tells inputs apart.

    python -m benchmarks.init_spread --out benchmarks/results/init_spread.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from benchmarks.accuracy import environment
from lightning_pfl.models.targets import build_network
from lightning_pfl.models.zoo import ZOO_NETWORKS

NETWORKS = tuple(ZOO_NETWORKS)
SHAPES = ((1, 28, 28), (3, 32, 32), (3, 64, 64))
Init = Literal["zoo", "pytorch_default"]


@torch.no_grad()
def logit_spread(
    name: str, shape: tuple[int, ...], init: Init, seed: int, batch: int = 128
) -> float:
    """Mean over logits of their standard deviation over a batch of N(0, 1) inputs."""
    torch.manual_seed(seed)
    net = build_network(name, shape, 10)
    if init == "pytorch_default":
        for module in net.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                module.reset_parameters()
    net.train()  # batch norm normalizes with batch statistics, as in the first local step
    inputs = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(seed))
    return float(net(inputs).std(0).mean())


def measure(seeds: int) -> list[dict[str, Any]]:
    rows = []
    for name in NETWORKS:
        for shape in SHAPES:
            for init in ("zoo", "pytorch_default"):
                spreads = [logit_spread(name, shape, init, seed) for seed in range(seeds)]
                rows.append(
                    {
                        "network": name,
                        "input_shape": list(shape),
                        "init": init,
                        "logit_spread_min": min(spreads),
                        "logit_spread_max": max(spreads),
                        "seeds": seeds,
                    }
                )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'network':14s} {'input':10s} {'zoo init':>21s} {'pytorch default':>21s}")
    by_key = {(r["network"], tuple(r["input_shape"]), r["init"]): r for r in rows}
    for name in NETWORKS:
        for shape in SHAPES:
            cells = []
            for init in ("zoo", "pytorch_default"):
                row = by_key[name, shape, init]
                cells.append(f"{row['logit_spread_min']:9.2e}-{row['logit_spread_max']:9.2e}")
            print(f"{name:14s} {'x'.join(map(str, shape)):10s} {cells[0]:>21s} {cells[1]:>21s}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default: 3)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    rows = measure(args.seeds)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
