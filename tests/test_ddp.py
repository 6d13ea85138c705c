"""Two CPU processes (gloo) under Lightning's DDP give the single-process result.

Both runs use one CPU thread per process: CPU kernels round differently with different thread
counts (Lightning gives each DDP rank a share of the cores), and a chaotic trajectory (the quick
start's loss spike at round 5) turns such 1e-7 differences into visible gaps within rounds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_pfl.cli import run

ROOT = Path(__file__).parents[1]


def fit(config: Path, save_dir: Path, *extra: str, processes: int = 1) -> tuple[dict, dict]:  # type: ignore[type-arg]
    """Fit ``config`` for 3 rounds with one CPU thread per process: in this process (the
    reference), or as a fresh interpreter launching ``processes`` DDP ranks."""
    args = [
        "fit",
        f"--config={config}",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.enable_progress_bar=false",
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        "--test_after_fit=false",
        "--model.init_args.log_figures=false",
        *extra,
    ]
    if processes == 1:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            run(args)
        finally:
            torch.set_num_threads(threads)
    else:
        ddp = ["--trainer.strategy=ddp", f"--trainer.devices={processes}"]
        command = [sys.executable, str(ROOT / "cli.py"), *args, *ddp]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            command, cwd=save_dir.parent, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
    run_dir = save_dir / "conf" / config.stem / "version_0"
    results = json.loads((run_dir / "results.json").read_text())
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    return results, state


UNEQUAL = [  # 5 of 7 clients per round (odd: a padding slot on rank 1), unequal client sizes
    "--data.init_args.num_clients=7",
    "--model.init_args.clients_per_round=5",
    "--model.init_args.local_epochs=1",
    "--data.init_args.partition=Dirichlet",
    "--data.init_args.partition.init_args.alpha=0.5",
]


# drops and stragglers (docs/conditions.md): every rank must mask the same clients and steps
UNRELIABLE = '--model.init_args.conditions={"drop_rate": 0.4, "stragglers": {"rate": 0.5}}'


@pytest.mark.parametrize(
    ("method", "extra"),
    # pFedHN on an odd number of unequal clients with drops and stragglers goes through the
    # plain rank split with a padding slot, unequal clients and masks on top
    [
        ("fedsimsup", ["--model.init_args.clients_per_round=3"]),
        ("pfedhn", [*UNEQUAL, UNRELIABLE]),
    ],
    ids=["fedsimsup", "pfedhn-odd-unequal-unreliable"],
)
def test_two_process_ddp_equals_single_process(
    method: str, extra: list[str], tmp_path: Path
) -> None:
    config = ROOT / "tests" / "conf" / f"{method}.yaml"
    single, single_state = fit(config, tmp_path / "single", *extra)
    ddp, ddp_state = fit(config, tmp_path / "ddp", *extra, "--trainer.accelerator=cpu", processes=2)
    for name, tensor in single_state["state_dict"].items():
        torch.testing.assert_close(
            ddp_state["state_dict"][name], tensor, rtol=1e-4, atol=1e-5, msg=name
        )
    for field, tensors in single_state["pfl"]["client_state"].items():
        for name, tensor in tensors.items():
            torch.testing.assert_close(
                ddp_state["pfl"]["client_state"][field][name], tensor, rtol=1e-4, atol=1e-5
            )
    assert ddp["val_last"]["acc"] == pytest.approx(single["val_last"]["acc"], abs=1e-6)
    assert ddp["val_last"]["loss"] == pytest.approx(single["val_last"]["loss"], rel=1e-4)
    assert ddp["comm_bytes_up_total"] == single["comm_bytes_up_total"]
