"""LEAF's Shakespeare and FEMNIST: one client per user of LEAF's JSON files."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lightning_pfl.datasets.files import DatasetArrays, DatasetNotFoundError
from lightning_pfl.errors import ConfigError

# LEAF's Shakespeare alphabet (its ``language_utils.ALL_LETTERS``): 80 characters, ids 0..79.
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
LEAF_SPLITS = ("all_data", "train", "test")


def leaf_loader(name: str) -> Callable[..., DatasetArrays]:
    """Loader of LEAF's ``name`` (shakespeare, femnist) JSON files: one client per user.

    Reads every ``*.json`` under ``{root}/leaf/{name}/data/all_data`` (LEAF's preprocessing
    without ``--split``), else under ``.../data/train`` and ``.../data/test`` together (each
    user's samples are pooled; the DataModule's ``holdout`` split then deals them 80/20 with
    ``test_fraction: 0.2``). Each file is LEAF's ``{"users": [...], "num_samples": [...],
    "user_data": {user: {"x": [...], "y": [...]}}}``. ``num_clients`` users with at least
    ``min_samples`` samples are drawn at random (seeded), LEAF's sampling of a fraction of its
    users. Shakespeare inputs are the 80 character ids of each line (int64), the label the next
    character's id; FEMNIST inputs are 28x28 uint8 images, labels 0..61.
    """

    def load(
        root: str,
        download: bool,
        num_clients: int = 10,
        seed: int = 0,
        min_samples: int = 2,
        **_: Any,
    ) -> DatasetArrays:
        import json

        base = os.path.join(root, "leaf", name, "data")
        folders = [os.path.join(base, "all_data")]
        if not os.path.isdir(folders[0]):
            folders = [os.path.join(base, "train"), os.path.join(base, "test")]
        files = [
            os.path.join(f, n)
            for f in folders
            if os.path.isdir(f)
            for n in sorted(os.listdir(f))
            if n.endswith(".json")
        ]
        if not files:
            raise DatasetNotFoundError(
                f"Dataset '{name}' (LEAF) not found under root '{root}'. Expected LEAF's JSON "
                f'files ({{"users", "num_samples", "user_data"}}) in\n  {base}/all_data/'
                f"*.json\nor in\n  {base}/train/*.json and {base}/test/*.json\n(run LEAF's "
                f"data/{name}/preprocess.sh and copy its data/ folder there)."
            )
        users: dict[str, tuple[list[Any], list[Any]]] = {}
        for path in files:
            with open(path) as f:
                content = json.load(f)
            for user, data in content["user_data"].items():
                xs, ys = users.setdefault(user, ([], []))
                xs.extend(data["x"])
                ys.extend(data["y"])
        names = sorted(u for u, (_, ys) in users.items() if len(ys) >= min_samples)
        if num_clients > len(names):
            raise ConfigError(
                f"LEAF '{name}' under '{base}' has {len(names)} users with at least "
                f"{min_samples} samples; data.init_args.num_clients = {num_clients} is more."
            )
        chosen = sorted(np.random.default_rng(seed).choice(len(names), num_clients, False))
        xs, ys, owners = [], [], []
        for client, i in enumerate(chosen):
            x, y = users[names[i]]
            xs.extend(x)
            ys.extend(y)
            owners.extend([client] * len(y))
        if name == "shakespeare":
            ids = {c: i for i, c in enumerate(LEAF_LETTERS)}
            inputs = torch.tensor([[ids.get(c, 0) for c in line] for line in xs])
            labels = torch.tensor([ids.get(c, 0) for c in ys])
        else:
            pixels = np.asarray(xs, dtype=np.float32).reshape(-1, 1, 28, 28)
            inputs = torch.from_numpy(np.rint(np.clip(pixels, 0, 1) * 255).astype(np.uint8))
            labels = torch.tensor(ys, dtype=torch.int64)
        return DatasetArrays(
            train_x=inputs,
            train_y=labels.long(),
            test_x=inputs[:0],
            test_y=labels[:0].long(),
            train_clients=torch.tensor(owners, dtype=torch.int64),
        )

    return load
