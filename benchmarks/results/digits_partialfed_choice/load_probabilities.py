"""PartialFed's learned load probabilities at the last round of the digits runs.

    python benchmarks/results/digits_partialfed_choice/load_probabilities.py LOG_DIR > OUT.json

LOG_DIR: the ``--log-dir`` of ``python -m benchmarks.accuracy --setting digits --methods
partialfed --seeds 0 1 2 --rounds-scale 0.5`` (its runs' ``checkpoints/last.ckpt``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml


def probabilities(run: Path) -> dict[str, object]:
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    select = checkpoint["pfl"]["client_state"]["select"]
    load = {layer: torch.sigmoid(beta) for layer, beta in select.items()}
    model = yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]
    return {
        "round": checkpoint["pfl"]["round"],
        "decision": model.get("decision"),
        "mean_load_probability": {k: round(float(p.mean()), 3) for k, p in load.items()},
        "share_of_clients_with_load_probability_at_least_0.5": {
            k: float((p >= 0.5).float().mean()) for k, p in load.items()
        },
        "load_probability_per_client": {
            k: [round(float(v), 3) for v in p] for k, p in load.items()
        },
    }


def main(log_dir: Path) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    runs = []
    for run in sorted(log_dir.glob("digits-*-partialfed/seed_*/version_0")):
        split = run.parent.parent.name.split("-")[1]
        seed = int(run.parent.name.split("_")[1])
        runs.append({"split": split, "seed": seed, **probabilities(run)})
    note = (
        "PartialFed's learned per-layer probability of loading the global layer, "
        "sigmoid(beta_l), per client after the digits runs (configs/digits/partialfed.yaml, "
        "--rounds-scale 0.5), read from each run's last checkpoint (client store field "
        "'select'); with decision: sampled each round loads layer l with this probability; "
        "made by load_probabilities.py"
    )
    print(json.dumps({"note": note, "commit": commit, "runs": runs}, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
