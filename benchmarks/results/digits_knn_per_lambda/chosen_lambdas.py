"""Each client's lambda_m chosen on its validation split at the last round of the digits runs.

    python benchmarks/results/digits_knn_per_lambda/chosen_lambdas.py LOG_DIR > OUT.json

LOG_DIR: the ``--log-dir`` of ``python -m benchmarks.accuracy --setting digits --methods
knn_per --seeds 0 1 2 --rounds-scale 0.5`` (its runs' ``checkpoints/last.ckpt``): the default
temperature gives ``chosen_lambdas.json``; ``--extra --model.init_args.temperature=1.0`` gives
``chosen_lambdas_temperature_1.json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from torch.func import vmap

from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.losses import interpolate_with_knn
from lightning_pfl.methods.knn_per import KNNPer
from lightning_pfl.partition import ClassesPerClient, Dirichlet

LINKED = ("num_clients", "num_classes", "input_shape")
PROBES = (0.0, 0.5, 1.0)  # lambdas whose pooled validation accuracy is recorded


def chosen(run: Path) -> dict[str, object]:
    config = yaml.safe_load((run / "config.yaml").read_text())
    data_args = dict(config["data"]["init_args"])
    partition = data_args.pop("partition")
    kind = {"ClassesPerClient": ClassesPerClient, "Dirichlet": Dirichlet}
    name = partition["class_path"].rsplit(".", 1)[-1]
    data = FederatedDataModule(**data_args, partition=kind[name](**partition["init_args"]))
    data.setup("fit")
    model_args = {k: v for k, v in config["model"]["init_args"].items() if k not in LINKED}
    method = KNNPer(
        num_clients=data.num_clients,
        num_classes=data.num_classes,
        input_shape=data.input_shape,
        **model_args,
    )
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    method.load_state_dict(checkpoint["state_dict"])
    method.attach_data(data)
    clients = torch.arange(data.num_clients)
    with torch.inference_mode():
        params = method.personalized_params(clients)
        largest, hits, samples = [], dict.fromkeys(PROBES, 0.0), 0.0
        for index, weight in data.eval_blocks(clients, "val", method.hp.eval_batch_size):
            x, y = data.fetch(index)
            logits, knn = vmap(method.outputs)(params, x)
            largest.append(knn.max(-1).values[weight > 0])
            for knn_weight in PROBES:
                right = interpolate_with_knn(logits, knn, knn_weight).argmax(-1) == y
                hits[knn_weight] += float((right * weight).sum())
            samples += float(weight.sum())
    top = torch.cat(largest)
    return {
        "round": checkpoint["pfl"]["round"],
        "temperature": method.hp.temperature,
        "lambda_per_client": [round(float(w), 2) for w in params["memory.knn_weight"]],
        "val_knn_largest_probability_mean": round(float(top.mean()), 4),
        "val_share_knn_largest_probability_above_0.99": round(
            float((top > 0.99).float().mean()), 4
        ),
        "val_pooled_acc_at_lambda": {str(w): round(h / samples, 4) for w, h in hits.items()},
    }


def main(log_dir: Path) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    runs = []
    for run in sorted(log_dir.glob("digits-*-knn_per/seed_*/version_0")):
        split = run.parent.parent.name.split("-")[1]
        seed = int(run.parent.name.split("_")[1])
        runs.append({"split": split, "seed": seed, **chosen(run)})
    note = (
        "kNN-Per's lambda_m per client (knn_weight: null, the grid of 101 values in [0, 1]), "
        "chosen on each client's validation split with the global model and memory of the last "
        "round (the paper's protocol: lambda fitted for the trained global model) of the digits "
        "runs (configs/digits/knn_per.yaml, --rounds-scale 0.5), at each run's kernel "
        "temperature (null: the feature dimension D = 64 of digits_cnn, the default); made by "
        "chosen_lambdas.py"
    )
    print(json.dumps({"note": note, "commit": commit, "runs": runs}, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
