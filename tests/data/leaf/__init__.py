"""Tiny LEAF datasets in LEAF's own JSON layout, written by a seeded script (for the tests).

``write_leaf(root, "shakespeare")`` writes ``{root}/leaf/shakespeare/data/train/*.json`` and
``.../test/*.json`` (or ``all_data/*.json`` with ``layout="all_data"``) exactly as LEAF's
preprocessing does: ``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...],
"y": [...]}}}``; Shakespeare samples are 80-character lines with the next character as label,
FEMNIST samples 784 floats in [0, 1] with labels 0..61. Run as a script to write them under a
folder: ``python -m tests.data.leaf OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

import numpy as np

LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def _user_samples(name: str, rng: np.random.Generator, count: int) -> dict[str, list[Any]]:
    if name == "shakespeare":
        text = "".join(rng.choice(list(LETTERS[1:]), count + 80))
        return {"x": [text[i : i + 80] for i in range(count)], "y": list(text[80 : 80 + count])}
    return {
        "x": [rng.random(784).round(3).tolist() for _ in range(count)],
        "y": rng.integers(0, 62, count).tolist(),
    }


def write_leaf(
    root: str | Path,
    name: Literal["shakespeare", "femnist"],
    users: int = 6,
    seed: int = 0,
    layout: Literal["split", "all_data"] = "split",
    files: int = 2,
) -> list[int]:
    """Write ``users`` users (5 to 14 samples each) in ``files`` JSON files; return the counts."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(5, 15, users).tolist()
    data = {f"user_{u:03d}": _user_samples(name, rng, c) for u, c in enumerate(counts)}
    parts = ["all_data"] if layout == "all_data" else ["train", "test"]
    for part in parts:
        folder = Path(root) / "leaf" / name / "data" / part
        folder.mkdir(parents=True, exist_ok=True)
        for k in range(files):
            mine = list(data)[k::files]
            content: dict[str, Any] = {"users": mine, "num_samples": [], "user_data": {}}
            for user in mine:
                x, y = data[user]["x"], data[user]["y"]
                cut = int(0.8 * len(y)) if layout == "split" else len(y)
                lo, hi = (0, cut) if part in ("all_data", "train") else (cut, len(y))
                content["user_data"][user] = {"x": x[lo:hi], "y": y[lo:hi]}
                content["num_samples"].append(hi - lo)
            (folder / f"{name}_{part}_{k}.json").write_text(json.dumps(content))
    return counts


if __name__ == "__main__":
    for dataset in ("shakespeare", "femnist"):
        write_leaf(sys.argv[1] if len(sys.argv) > 1 else "data", dataset)
