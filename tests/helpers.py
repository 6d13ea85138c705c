"""Checks every method's tests reuse: the CLI round trip, vectorized == sequential, exact resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning import Callback, Trainer

from lightning_pfl.cli import PFLCLI, run
from lightning_pfl.engine import TrainResult
from lightning_pfl.methods import FederatedMethod
from tests.conftest import build, digits_data, fit

CONF = Path(__file__).parent / "conf"


def cli_run(
    config: Path,
    save_dir: Path,
    *extra: str,
    subcommand: str = "fit",
    figures: bool = False,
    callbacks: list[Callback] | None = None,
) -> PFLCLI:
    """Run the CLI in-process (with the trainer's ``callbacks`` added); without the figures
    (``log_figures``, about half of a short run's time) unless ``figures``."""
    args = [
        subcommand,
        f"--config={config}",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--trainer.enable_progress_bar=false",
        f"--model.init_args.log_figures={str(figures).lower()}",
        *extra,
    ]
    return run(args, callbacks=callbacks)


def cli(
    config: Path,
    save_dir: Path,
    *extra: str,
    subcommand: str = "fit",
    figures: bool = False,
    callbacks: list[Callback] | None = None,
) -> dict[str, Any]:
    """:func:`cli_run`, returning the run's ``results.json``."""
    return results_of(
        cli_run(
            config, save_dir, *extra, subcommand=subcommand, figures=figures, callbacks=callbacks
        )
    )


def results_of(instance: PFLCLI) -> dict[str, Any]:
    """The ``results.json`` that the CLI run ``instance`` wrote."""
    assert instance.results_path is not None, "the run wrote no results.json"
    return json.loads(instance.results_path.read_text())  # type: ignore[no-any-return]


def run_dir(save_dir: Path, config: Path, version: int = 0) -> Path:
    """The folder of a run of ``config`` (a file under tests/conf) under ``save_dir``."""
    return save_dir / config.parent.name / config.stem / f"version_{version}"


def capture_local_training(method: FederatedMethod) -> list[TrainResult]:
    """Record every ``local_train`` result of ``method`` (to check the server's use of them)."""
    results: list[TrainResult] = []
    original = method.local_train

    def wrapped(*args: Any, **kwargs: Any) -> TrainResult:
        results.append(original(*args, **kwargs))
        return results[-1]

    method.local_train = wrapped  # type: ignore[method-assign]
    return results


def assert_vectorized_equals_sequential(
    cls: type[FederatedMethod],
    rounds: int = 3,
    num_clients: int = 6,
    data_kwargs: dict[str, Any] | None = None,
    **method_kwargs: Any,
) -> None:
    """``rounds`` rounds client by client (the reference), vmapped and, for a deterministic
    client step, with clients in two worker threads end in the same server and client state,
    and evaluate alike (a flipped argmax allowed per client)."""
    method_kwargs.setdefault("clients_per_round", 3)

    def trained(**path: Any) -> FederatedMethod:
        dm = digits_data(num_clients, **(data_kwargs or {}))
        method = build(cls, dm, **path, **method_kwargs)
        fit(method, dm, rounds=rounds)
        return method

    reference = trained(vectorize=False, client_threads=1)
    others = {"vmap": trained(vectorize=True)}
    if not reference.arch.stochastic:
        others["threads"] = trained(vectorize=False, client_threads=2)
    slow, slow_store = reference.state_dict(), reference.store.state_dict()
    clients = torch.arange(num_clients - reference.hp.novel_clients)
    with torch.inference_mode():
        slow_eval = reference.evaluate(clients, "test")
    for path, method in others.items():
        with torch.inference_mode():
            correct, total, loss = method.evaluate(clients, "test")
        torch.testing.assert_close(
            correct, slow_eval[0], rtol=0, atol=1, msg=lambda m, p=path: f"{p}: correct: {m}"
        )
        assert torch.equal(total, slow_eval[1]), path
        torch.testing.assert_close(
            loss, slow_eval[2], rtol=1e-4, atol=1e-4, msg=lambda m, p=path: f"{p}: loss: {m}"
        )
        fast, fast_store = method.state_dict(), method.store.state_dict()
        # the threaded loop convolves channels-last images, another kernel: after 3 rounds
        # pFedGP's conv1 weights differed from the NCHW reference by up to 1.9e-5 (AMD EPYC),
        # where one round moves them by 1.1e-2 (median; measured)
        atol = 1e-4 if path == "threads" else 1e-5
        for name in fast:
            torch.testing.assert_close(
                fast[name],
                slow[name],
                rtol=1e-4,
                atol=atol,
                msg=lambda m, where=f"{path}: {name}": f"{where}: {m}",
            )
        for field, tensors in fast_store.items():
            for name in tensors:
                torch.testing.assert_close(
                    tensors[name],
                    slow_store[field][name],
                    rtol=1e-4,
                    atol=atol,
                    msg=lambda m, where=f"{path}: {field} {name}": f"{where}: {m}",
                )


class KeepCheckpoint(Callback):
    """Copy the run's ``last.ckpt`` to ``to`` as round ``after`` saved it (when the next round
    starts)."""

    def __init__(self, after: int, to: Path) -> None:
        self.after, self.to = after, to

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.after:
            checkpoint = trainer.checkpoint_callback
            assert checkpoint is not None and checkpoint.last_model_path
            shutil.copyfile(checkpoint.last_model_path, self.to)


def assert_resume_is_exact(
    config: Path, tmp_path: Path, *extra: str, stopped: bool = False, tested: bool = False
) -> PFLCLI:
    """6 rounds in one go == its round-3 checkpoint resumed to round 6 in a new run folder
    (results and state); ``stopped``: == a run stopped by ``max_steps`` at round 3 that goes
    on with ``--ckpt_path last`` (the end-of-fit path; one run more); ``tested``: both runs
    test after fit, and their test results are compared too. Returns the run in one go (under
    ``tmp_path / "straight"``)."""
    common = ["--trainer.val_check_interval=3", f"--test_after_fit={str(tested).lower()}"]
    common += extra
    resumed_dir = tmp_path / "resumed"
    if stopped:
        instance = cli_run(config, tmp_path / "straight", "--trainer.max_steps=6", *common)
        cli(config, resumed_dir, "--trainer.max_steps=3", *common)
        start = "last"
    else:
        kept = tmp_path / "round3.ckpt"
        instance = cli_run(
            config,
            tmp_path / "straight",
            "--trainer.max_steps=6",
            "--checkpoint.every_n_rounds=3",
            *common,
            callbacks=[KeepCheckpoint(3, kept)],
        )
        start = str(kept)
    straight = results_of(instance)
    resumed = cli(config, resumed_dir, "--trainer.max_steps=6", f"--ckpt_path={start}", *common)
    keys = ("rounds", "val_last", "best_round", "val_at_best", "test_at_best_val", "eval_history")
    for key in (*keys, "test_max_over_evals", "test_last_evals", "test_last"):
        assert resumed[key] == straight[key], key
    assert resumed["comm_bytes_up_total"] == straight["comm_bytes_up_total"]
    a = torch.load(run_dir(tmp_path / "straight", config) / "checkpoints" / "last.ckpt")
    b = torch.load(run_dir(resumed_dir, config) / "checkpoints" / "last.ckpt")
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    for field, tensors in a["pfl"]["client_state"].items():
        for name, tensor in tensors.items():
            assert torch.equal(tensor, b["pfl"]["client_state"][field][name]), (field, name)
    assert str(a["optimizer_states"]) == str(b["optimizer_states"])
    return instance


def bias_only(method: FederatedMethod, bias: list[float]) -> dict[str, torch.Tensor]:
    """Parameters of ``method``'s ``digits_cnn`` whose logits are ``bias`` for every input (all
    weights zero)."""
    params = {n: torch.zeros_like(t) for n, t in method.arch.initial_params().items()}
    params["fc2.bias"] = torch.tensor(bias)
    return params


def assert_same_trained_state(a: FederatedMethod, b: FederatedMethod, store: bool = True) -> None:
    """``a`` and ``b`` hold bit-identical tensors: every module tensor, and with ``store`` every
    per-client field of the client store."""
    for key, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[key]), key
    if store:
        for field, tensors in a.store.state_dict().items():
            for key, tensor in tensors.items():
                assert torch.equal(tensor, b.store.state_dict()[field][key]), (field, key)


def round_updates_beyond(
    method: FederatedMethod, clip: float
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Run round 0 and return each sampled client's update (trained - received, [C, ...]) and
    its norm, asserting every update is longer than ``clip`` (so that a DP clip binds)."""
    trained = capture_local_training(method)
    before = {n: p.detach().clone() for n, p in method.net.named_parameters()}
    method.run_round(0, method.sample_clients(0))
    deltas = {n: trained[0].params[n] - before[n] for n in before}
    norms = torch.cat([d.flatten(1) for d in deltas.values()], 1).norm(dim=1)
    assert (norms > clip).all(), "the check needs updates that the clip shortens"
    return deltas, norms
