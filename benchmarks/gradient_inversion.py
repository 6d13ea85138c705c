"""What one upload gives away: DLG / iDLG (``lightning_pfl.attacks.GradientInversion``) against
methods with and without client-level DP, on the digits benchmark setting (10 clients, 2 classes
each, ``digits_cnn``, the models at initialization: round 0, where DLG attacks).

Each row is one (method, DP setting, victim): the victim's one-sample, one-step upload is
inverted and scored by PSNR / SSIM against the real image, and by whether iDLG read its label.
DP rows use the upload clipped to S and noised with N(0, z^2 S^2 I), the attacker that knows
every other update of the round (docs/privacy.md). pFedHN and MH-pFedHN (a zoo of one
architecture, ``digits_cnn``, so its rows compare with FedAvg's on the same network) have no DP
row: both support ``client_dp`` (MH-pFedHN with ``hn_update: mean``), but their noise is on the
hypernetwork's gradient, not on the upload, so the attack refuses them under DP. Their victims
upload the update of the model the hypernetwork generated (MH-pFedHN's Fig. 6 attacks it the
same way).

    python -m benchmarks.gradient_inversion --victims 0 1 2 --iterations 50 \\
        --out benchmarks/results/privacy_attack/digits.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.accuracy import environment
from lightning_pfl import FederatedDataModule
from lightning_pfl.attacks import GradientInversion
from lightning_pfl.methods import FedAvg, FederatedMethod, MHPFedHN, PFedHN
from lightning_pfl.partition import ClassesPerClient
from lightning_pfl.privacy import ClientDP

# (name, class, extra arguments, client_dp): the digits configs' settings
SETTINGS: list[tuple[str, type[FederatedMethod], dict[str, Any], ClientDP | None]] = [
    ("fedavg", FedAvg, {}, None),
    ("fedavg", FedAvg, {}, ClientDP(noise_multiplier=0.1, clip_norm=3.0)),
    ("fedavg", FedAvg, {}, ClientDP(noise_multiplier=1.0, clip_norm=3.0)),
    ("pfedhn", PFedHN, {"hn_feature_scale": True, "hn_head_init": "target"}, None),
    ("mh_pfedhn", MHPFedHN, {"architectures": {"cnn": {"net": "digits_cnn"}}}, None),
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--victims", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/privacy_attack/digits.json")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    data = FederatedDataModule(
        "digits", num_clients=10, partition=ClassesPerClient(2), val_fraction=0.15, seed=args.seed
    )
    data.setup("fit")
    rows = []
    for name, cls, extra, dp in SETTINGS:
        method = cls(
            num_clients=data.num_clients,
            num_classes=data.num_classes,
            input_shape=data.input_shape,
            net="digits_cnn",
            clients_per_round=5,
            local_lr=0.05,
            seed=args.seed,
            client_dp=dp,
            **extra,
        )
        method.attach_data(data)
        for victim in args.victims:
            attack = GradientInversion(client=victim, iterations=args.iterations, seed=args.seed)
            start = time.perf_counter()
            record, _, _ = attack.invert(method)
            row = {
                "method": name,
                "noise_multiplier": None if dp is None else dp.noise_multiplier,
                "clip_norm": None if dp is None else dp.clip_norm,
                "victim": victim,
                "seconds": time.perf_counter() - start,
                **record,
            }
            rows.append(row)
            print(
                f"{name} z={row['noise_multiplier']} victim {victim}: psnr {record['psnr']:.1f} "
                f"ssim {record['ssim']:.3f} label {record['labels']} -> "
                f"{record['labels_inferred']}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
