"""How different are the models a hypernetwork generates for different clients? (PeFLL vs pFedHN)

Reads the ``last.ckpt`` of digits benchmark runs (``benchmarks.accuracy --setting digits
--splits pathological``) and reports, at initialization and after training:

- ``model_spread``: mean over clients of ||theta_i - theta_mean|| / ||theta_mean|| over all
  generated tensors (0: every client gets the same model, i.e. no personalization);
- ``descriptor_spread`` (PeFLL): the same ratio for the clients' mean embeddings over their
  training data (the descriptors before PeFLL's standardization);
- ``val_acc``: validation accuracy, mean over clients, of the models evaluation uses.

"At initialization" is after PeFLL's descriptor standardization, which fit runs before round 0.

    python -m benchmarks.pefll_spread --seed 0 \\
        --pefll <log-dir>/digits-pathological-pefll-s0/version_0/checkpoints/last.ckpt \\
        --pfedhn <log-dir>/digits-pathological-pfedhn-s0/version_0/checkpoints/last.ckpt \\
        --out benchmarks/results/digits_pefll_diagnosis/spread.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks.accuracy import environment
from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.methods.pefll import PeFLL
from lightning_pfl.methods.pfedhn import PFedHN
from lightning_pfl.partition import ClassesPerClient

CONFIGS = Path(__file__).parents[1] / "configs" / "digits"


def build(name: str, seed: int) -> FederatedMethod:
    """The method of ``configs/digits/<name>.yaml`` on its pathological split, seeded."""
    config = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    data = config["data"]["init_args"]
    dm = FederatedDataModule(
        "digits",
        num_clients=data["num_clients"],
        partition=ClassesPerClient(data["partition"]["init_args"]["classes"]),
        val_fraction=data["val_fraction"],
        seed=seed,
    )
    dm.setup("fit")
    cls = {"pefll": PeFLL, "pfedhn": PFedHN}[name]
    method = cls(
        num_clients=dm.num_clients,
        num_classes=dm.num_classes,
        input_shape=dm.input_shape,
        seed=seed,
        **config["model"]["init_args"],
    )
    method.attach_data(dm)
    return method.eval()


def relative_spread(rows: torch.Tensor) -> float:
    """Mean over rows of ||row - mean row|| / ||mean row||."""
    mean = rows.mean(0, keepdim=True)
    return float(((rows - mean).norm(dim=1) / mean.norm()).mean())


@torch.no_grad()
def measure(method: FederatedMethod) -> dict[str, Any]:
    clients = torch.arange(method.num_training_clients)
    params = method.personalized_params(clients)
    correct, total, _ = method.evaluate_clients(clients, "val")
    row: dict[str, Any] = {
        "model_spread": relative_spread(torch.cat([t.flatten(1) for t in params.values()], 1)),
        "val_acc": float((correct / total).mean()),
    }
    if isinstance(method, PeFLL):
        row["descriptor_spread"] = relative_spread(method.mean_embeddings(clients))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pefll", type=Path, required=True)
    parser.add_argument("--pfedhn", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results: dict[str, Any] = {"environment": environment(), "seed": args.seed, "rows": {}}
    for name, checkpoint in (("pefll", args.pefll), ("pfedhn", args.pfedhn)):
        method = build(name, args.seed)
        if isinstance(method, PeFLL):
            method.calibrate_descriptors()  # what fit does before round 0 (a no-op when off)
        results["rows"][f"{name}_init"] = measure(method)
        saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
        method.load_state_dict(saved["state_dict"])
        method.on_load_checkpoint(saved)
        results["rows"][f"{name}_trained"] = {"round": saved["pfl"]["round"], **measure(method)}
    for key, row in results["rows"].items():
        print(f"{key:16s}", "  ".join(f"{k} {v:.3g}" for k, v in row.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
