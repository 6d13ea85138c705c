"""Many runs, one job: runs trained together compute what they compute alone."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml

import lightning_pfl.methods as methods
import lightning_pfl.partition as partitions
from lightning_pfl.cli import run
from lightning_pfl.engine import Architecture, cross_entropy_loss, derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.jobs import Runs, expand, format_summary, summarize
from lightning_pfl.lockstep import Lockstep, LockstepExecutor, Opaque, get_rng, signature
from lightning_pfl.methods import FederatedMethod, MHPFedHN
from lightning_pfl.methods.fedprox import proximal_loss
from lightning_pfl.models import build_network
from lightning_pfl.streams import DROPOUT_STREAM
from tests.conftest import build, digits_data
from tests.helpers import CONF

ROOT = Path(__file__).parents[1]
FEDAVG = CONF / "fedavg.yaml"
CONFIG = {
    "model.class_path": "FedAvg",
    "model.init_args.seed": 0,
    "model.init_args.local_lr": 0.05,
    "model.init_args.net_args": None,
    "model.init_args.names": None,
    "data.init_args.seed": 0,
    "data.init_args.num_clients": 4,
    "trainer.max_steps": 4,
}


# ----------------------------------------------------------------- the runs of a request
def test_seeds_and_grid_expand_to_every_combination_with_its_values() -> None:
    specs = expand(Runs(seeds=[0, 1], grid={"model.init_args.local_lr": [0.01, 0.05]}), CONFIG)
    assert [s.label for s in specs] == [
        "local_lr_0.01-seed_0",
        "local_lr_0.01-seed_1",
        "local_lr_0.05-seed_0",
        "local_lr_0.05-seed_1",
    ]
    assert specs[1].overrides == {
        "model.init_args.local_lr": 0.01,
        "model.init_args.seed": 1,
        "data.init_args.seed": 1,
    }
    assert specs[2].point == (("model.init_args.local_lr", 0.05),)
    training = expand(Runs(seeds=[3], vary="training"), CONFIG)[0].overrides
    split = expand(Runs(seeds=[3], vary="split"), CONFIG)[0].overrides
    assert training == {"model.init_args.seed": 3} and split == {"data.init_args.seed": 3}


def test_a_grid_over_a_section_sets_the_settings_in_its_dicts() -> None:
    grid = {"model.init_args": [{"local_lr": 0.01}, {"local_lr": 0.05, "seed": 3}]}
    specs = expand(Runs(grid=grid), CONFIG)
    assert [s.label for s in specs] == ["local_lr_0.01", "local_lr_0.05-seed_3"]
    assert [s.overrides for s in specs] == [
        {"model.init_args.local_lr": 0.01},
        {"model.init_args.local_lr": 0.05, "model.init_args.seed": 3},
    ]
    assert specs[0].point == (("model.init_args", {"local_lr": 0.01}),)
    # a dict-valued setting is one value, not a section
    config = {**CONFIG, "model.init_args.adapter.width": 4}
    adapter = expand(Runs(grid={"model.init_args.adapter": [{"width": 8}]}), config)[0]
    assert adapter.overrides == {"model.init_args.adapter": {"width": 8}}


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        (Runs(seeds=[]), "runs.seeds is empty"),
        (Runs(seeds=[0, 0]), "repeats a seed"),
        (Runs(grid={"model.init_args.local_rate": [0.1]}), "unknown config key"),
        (Runs(grid={"local_lr": [0.1]}), "did you mean model.init_args.local_lr"),
        (Runs(grid={"model.init_args.local_lr": []}), "non-empty list"),
        (Runs(grid={"model.init_args.local_lr": [0.1, 0.1]}), "repeats a value"),
        (Runs(grid={"model.init_args.net_args": [None, {"width": 8}]}), "change tensor shapes"),
        (Runs(grid={"data.init_args.num_clients": [4, 8]}), "change tensor shapes"),
        (Runs(grid={"trainer.max_steps": [4, 8]}), "its own job"),
        (Runs(seeds=[0, 1], grid={"model.init_args.seed": [2, 3]}), "give the seeds in one"),
        # a section's dicts: each setting they set is checked as if given as its own key
        (
            Runs(grid={"model.init_args": [{"local_lr": 0.01}, {"net_args": {"width": 8}}]}),
            r"'model.init_args' \(its value sets 'model.init_args.net_args'\): runs that differ "
            "by 'model.init_args.net_args' change tensor shapes",
        ),
        (Runs(grid={"model": [{"class_path": "FedProx"}]}), "'model.class_path' change tensor"),
        (Runs(grid={"model.init_args": [{"local_rate": 0.1}]}), "unknown config key"),
        (Runs(seeds=[0], grid={"model.init_args": [{"seed": 2}]}), "give the seeds in one"),
        (Runs(grid={"model": [1]}), "'model' is a section of the config, so its values must"),
        (Runs(grid={"data": [{"init_args": {"num_clients": 8}}]}), "change tensor shapes"),
        # runs that would be one run, or share a folder
        (Runs(grid={"model.init_args.local_lr": [1, 1.0]}), r"repeats a value \(1 == 1.0\)"),
        (Runs(grid={"model.init_args.seed": [0, 0.0]}), "repeats a value"),
        (
            Runs(grid={"model.init_args.local_lr": [0.1], "model.init_args": [{"local_lr": 0.2}]}),
            "'model.init_args.local_lr' and 'model.init_args' both set 'model.init_args.local_lr'",
        ),
        (
            Runs(grid={"model.init_args": [{"local_lr": 0.1}, {"local_lr": 0.1, "seed": 0}]}),
            "two runs with the same settings",  # seed 0 is the config's
        ),
        (
            Runs(grid={"model.init_args.names": [["fc weight"], ["fc_weight"]]}),
            "would share the folder 'names___fc_weight__'",
        ),
    ],
)
def test_bad_requests_are_refused_with_one_paragraph(runs: Runs, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        expand(runs, CONFIG)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--runs.seeds=[]"], "runs.seeds is empty"),
        (['--runs.grid={"model.init_args.nope": [1, 2]}'], "unknown config key"),
        (["--runs.seeds=[0, 1]", "--trainer.devices=2"], "trainer.devices 1"),
        (
            ['--runs.grid={"model.init_args": [{"local_lr": 0.01}, {"net_args": {"width": 8}}]}'],
            "'model.init_args.net_args' change tensor shapes",
        ),
        (['--runs.grid={"model.init_args.local_lr": [1, 1.0]}'], "repeats a value"),
        # the flag form of one key: refused with the form that works
        (
            ["--runs.grid.model.init_args.local_lr", "[0.01,0.05]"],
            re.escape("""--runs.grid='{"model.init_args.local_lr": [0.01, 0.05]}'"""),
        ),
    ],
)
def test_bad_jobs_fail_before_anything_is_written(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    args = ["fit", f"--config={FEDAVG}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=message):
        run([*args, *extra])
    assert not any(tmp_path.iterdir())


def _write_results(tmp_path: Path, specs: list[Any], accuracies: list[float]) -> list[Path]:
    paths = []
    for spec, acc in zip(specs, accuracies, strict=True):
        path = tmp_path / f"{spec.label}.json"
        results = {"val_at_best": {"acc": acc}, "test_at_best_val": {"acc": acc}}
        path.write_text(json.dumps(results))
        paths.append(path)
    return paths


def test_a_grid_over_list_values_is_summarized_per_point(tmp_path: Path) -> None:
    """List- and dict-valued grid values (FedU's adjacency, FedAvgFT's names) are grid points
    like any other: the summary groups each point's seeds and writes it as JSON."""
    graphs = [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]]]
    config = {**CONFIG, "model.init_args.adjacency": None}
    specs = expand(Runs(seeds=[0, 1], grid={"model.init_args.adjacency": graphs}), config)
    summary = summarize(specs, _write_results(tmp_path, specs, [0.5, 0.7, 0.8, 0.9]), "acc")
    points = [(p["point"], p["runs"], p["val_at_best.acc"]["mean"]) for p in summary["points"]]
    assert points == [
        ({"model.init_args.adjacency": graphs[0]}, 2, pytest.approx(0.6)),
        ({"model.init_args.adjacency": graphs[1]}, 2, pytest.approx(0.85)),
    ]
    assert summary["best_point"] == {"model.init_args.adjacency": graphs[1]}
    assert json.loads(json.dumps(summary)) == summary
    assert "adjacency=[[1.0, 1.0], [1.0, 1.0]]" in format_summary(summary, tmp_path / "job.json")


# ----------------------------------------------------------------- what may share a computation
def test_losses_compare_by_code_and_constants() -> None:
    def arch() -> Architecture:
        return Architecture(build_network("digits_cnn", (1, 8, 8), 10))

    assert signature(cross_entropy_loss(arch())) == signature(cross_entropy_loss(arch()))
    names = ("a",)
    same = [proximal_loss(cross_entropy_loss(arch()), 0.1, names) for _ in range(2)]
    assert signature(same[0]) == signature(same[1])
    other_mu = proximal_loss(cross_entropy_loss(arch()), 0.2, names)
    assert signature(other_mu) != signature(same[0])
    wider = Architecture(build_network("digits_cnn", (1, 8, 8), 10, width=8))
    assert signature(cross_entropy_loss(wider)) != signature(cross_entropy_loss(arch()))
    captured = torch.ones(2)
    with pytest.raises(Opaque, match="Tensor"):
        signature(lambda p: p * captured)


# ----------------------------------------------------------------- every method, alone == together
@dataclass
class Case:
    """A method as its tests/conf file configures it, on digits."""

    id: str
    cls: type[FederatedMethod]
    kwargs: dict[str, Any]
    num_clients: int
    data: dict[str, Any] = field(default_factory=dict)
    rounds: int = 2


def _cases() -> list[Case]:
    cases = []
    for path in sorted(CONF.glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        data = dict(config["data"]["init_args"])
        kwargs = dict(config["model"].get("init_args") or {})
        if data.pop("dataset") != "digits" or "class_path" in json.dumps(kwargs):
            continue  # other datasets and nested classes: test_cli runs them
        partition = data.pop("partition")
        data["partition"] = getattr(partitions, partition["class_path"])(
            **partition.get("init_args", {})
        )
        cls = getattr(methods, config["model"]["class_path"])
        cases.append(Case(path.stem, cls, kwargs, data.pop("num_clients"), data))
    return cases


CASES = _cases()


def _train(methods: list[FederatedMethod], rounds: int, together: bool) -> Lockstep | None:
    """``rounds`` rounds of every method as a Trainer would run them, one method after another
    or as the runs of one job."""

    def rounds_of(method: FederatedMethod) -> Callable[[], None]:
        def body() -> None:
            optimizer = method.configure_optimizers()
            for round_idx in range(rounds):
                optimizer.zero_grad()
                with torch.random.fork_rng(devices=[]):  # dropout, as training_step seeds it
                    torch.manual_seed(derive_seed(method.hp.seed, round_idx, DROPOUT_STREAM))
                    method.run_round(round_idx, method.sample_clients(round_idx))
                optimizer.step()

        return body

    if not together:
        for method in methods:
            rounds_of(method)()
        return None
    lockstep = Lockstep(len(methods), [get_rng() for _ in methods])
    for index, method in enumerate(methods):
        method.executor = LockstepExecutor(lockstep, index, method.executor)
    outcomes = lockstep.run([rounds_of(m) for m in methods])
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return lockstep


def _runs(case: Case, path: dict[str, Any], datas: list[Any]) -> list[FederatedMethod]:
    adam = VMAP_ADAM if path.get("vectorize") and issubclass(case.cls, MHPFedHN) else {}
    return [
        build(case.cls, data, **{**case.kwargs, "seed": seed, **path, **adam})
        for seed, data in enumerate(datas)
    ]


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {
            k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()
        }
    if isinstance(tree, (list, tuple)):
        return {
            k: v for i, sub in enumerate(tree) for k, v in _leaves(sub, f"{prefix}{i}.").items()
        }
    return {prefix.rstrip("."): tree}


def _checkpoint(method: FederatedMethod) -> dict[str, Any]:
    """What a checkpoint of the run holds, flattened: the module's state, the server
    optimizer's state (e.g. FedOpt's moments, pFedHN's momentum) and the method's own part
    (per-client state, the run record, a method's extras such as FedGen's optimizer)."""
    checkpoint = {
        "state_dict": method.state_dict(),
        "optimizer_states": [method.server_optimizer.state_dict()],
    }
    method.on_save_checkpoint(checkpoint)
    return _leaves(checkpoint)


ONE_BY_ONE = {"vectorize": False, "client_threads": 1}
# the batched paths: both runs' clients in one vmap, or spread over the threaded loop
BATCHED = {"vmap": {"vectorize": True}, "threads": {"vectorize": False, "client_threads": 2}}
# Every case runs on vmap, where the job batches both runs' clients together; the paths that
# run clients one at a time (one by one, the threaded loop) reach a method only through the
# executor's training and evaluation calls, so these cases cover them bit for bit: each kind
# of phase the executor serves (FedAvg's; several phases; hypernetwork-generated models;
# models the server keeps; fine-tuning at evaluation; feature statistics; a generator; a
# memory at evaluation) and FedCP's refusal of threads.
EXACT_PATHS = {
    "fedavg", "ditto", "fedrep", "fedpac", "pfedhn", "pfedhn_pc", "pfedkt", "mh_pfedhn",
    "fedtp", "fedsimsup", "fedamp", "fedbabu", "ccvr", "fedproto", "fedgen", "knn_per", "fedcp",
}  # fmt: skip
# Adam turns a near-zero gradient's rounding (vmap's batch of both runs' clients against one
# run's) into a full step of its sign: MH-pFedHN's embeddings then differ by ~hn_lr in a few
# coordinates (measured on an AMD EPYC at the configs' hn_lr 1e-2); at 1e-3 they agree.
VMAP_ADAM = {"hn_lr": 1e-3}


def _assert_same_checkpoints(
    alone: list[FederatedMethod], together: list[FederatedMethod], path: str, exact: bool
) -> None:
    for a, b in zip(alone, together, strict=True):
        sa, sb = _checkpoint(a), _checkpoint(b)
        assert sa.keys() == sb.keys()
        for name, value in sa.items():
            if not isinstance(value, torch.Tensor):
                assert sb[name] == value, f"{path}: {name}"
            elif exact:
                assert torch.equal(sb[name], value), f"{path}: {name}"
            else:
                where = f"{path}: {name}"
                torch.testing.assert_close(
                    sb[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}"
                )


def test_a_jobs_runs_compute_with_the_intra_op_threads_of_a_run_alone() -> None:
    """A thread started after the client threads (which set one intra-op thread each) would
    take their count, not the process's: a job's runs would then round differently from the
    same runs alone (CCVR's one-by-one path did, after a threaded test, with two threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            pool.submit(int).result()
        counts = Lockstep(2, [get_rng(), get_rng()]).run([torch.get_num_threads] * 2)
    finally:
        torch.set_num_threads(threads)
    assert counts == [2, 2]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_job_trains_every_method_as_its_runs_alone(case: Case) -> None:
    """Two seeds (split and training) of every method on vmap (and the ``EXACT_PATHS`` cases
    one by one and on the threaded loop), as a job and alone: the runs end where they end
    alone (everything a checkpoint holds: model, server optimizer, per-client state, record),
    bit for bit one by one and on the threaded loop, up to float rounding on vmap (both runs'
    clients in one batch). Where the method's jobs can share a computation, they did."""
    datas = [digits_data(case.num_clients, seed=seed, **case.data) for seed in (0, 1)]
    paths = [("one by one", ONE_BY_ONE), *BATCHED.items()]
    for name, path in [(n, p) for n, p in paths if n == "vmap" or case.id in EXACT_PATHS]:
        try:
            alone = _runs(case, path, datas)
        except ConfigError as refused:  # e.g. FedCP's Gumbel noise on the threaded loop
            assert name == "threads" and "client_threads" in str(refused)
            continue
        together = _runs(case, path, datas)
        _train(alone, case.rounds, together=False)
        lockstep = _train(together, case.rounds, together=True)
        assert lockstep is not None
        _assert_same_checkpoints(alone, together, name, exact=name != "vmap")
        if not lockstep.apart_reasons:  # else the job trains them one after another
            assert lockstep.groups_trained < lockstep.submissions, name


# ----------------------------------------------------------------- the CLI
def _results(path: Path) -> dict[str, Any]:
    results = json.loads(path.read_text())
    for key in ("seconds_per_round", "config"):
        results.pop(key)
    return results


def _partition(folder: Path) -> Any:
    return json.loads((folder / "partition.json").read_text())


def test_a_job_says_why_runs_with_different_loss_constants_train_apart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A grid over FedProx's mu: the proximal term's constant differs, so the runs cannot be one
    computation; the job trains them as two and names the reason in its closing line."""
    caplog.set_level("INFO")
    job = run(
        [
            "fit",
            f"--config={CONF / 'fedprox.yaml'}",
            "--model.init_args.vectorize=false",
            "--model.init_args.client_threads=1",
            "--model.init_args.log_figures=false",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            '--runs.grid={"model.init_args.mu": [0.01, 0.1]}',
        ]
    ).job
    assert job is not None and job.lockstep.groups_trained == job.lockstep.submissions
    reason = "their local losses (a constant in the loss, e.g. FedProx's mu, or its code) differ"
    assert any(reason in r for r in job.lockstep.apart_reasons)
    assert any("trained apart because" in m and reason in m for m in caplog.messages)


def test_a_job_writes_each_runs_folder_as_alone_and_a_summary(tmp_path: Path) -> None:
    common = [
        "fit",
        f"--config={FEDAVG}",
        "--model.init_args.vectorize=false",
        "--model.init_args.client_threads=1",
        "--model.init_args.log_figures=false",
        "--trainer.enable_progress_bar=false",
    ]
    job = run(
        [
            *common,
            f"--trainer.logger.init_args.save_dir={tmp_path / 'job'}",
            "--runs.seeds=[0, 1]",
            '--runs.grid={"model.init_args.local_lr": [0.01, 0.1]}',
        ]
    ).job
    # the four runs (two seeds x two learning rates) train every round as one computation
    assert job is not None and 4 * job.lockstep.groups_trained == job.lockstep.submissions
    assert not job.lockstep.apart_reasons
    folder = tmp_path / "job" / "conf" / "fedavg"
    summary = json.loads((folder / "job.json").read_text())
    assert summary["runs"] == [s.label for s in job.specs]
    assert [p["runs"] for p in summary["points"]] == [2, 2]
    assert summary["best_point"] in [p["point"] for p in summary["points"]]
    for spec in job.specs:
        seed = spec.overrides["model.init_args.seed"]
        lr = spec.overrides["model.init_args.local_lr"]
        together = folder / spec.label / "version_0"
        config = (together / "config.yaml").read_text()
        assert f"local_lr: {lr}" in config and f"seed: {seed}" in config
        if (seed, lr) not in ((0, 0.01), (1, 0.1)):
            continue  # two runs alone, one of each seed and lr (the job table: every method)
        alone = run(
            [
                *common,
                f"--trainer.logger.init_args.save_dir={tmp_path / spec.label}",
                f"--model.init_args.seed={seed}",
                f"--data.init_args.seed={seed}",
                f"--model.init_args.local_lr={lr}",
            ]
        )
        alone_dir = Path(str(alone.trainer.log_dir))
        assert _results(together / "results.json") == _results(alone_dir / "results.json")
        assert _partition(together) == _partition(alone_dir)
    seeds = [folder / f"local_lr_0.01-seed_{s}" / "version_0" for s in (0, 1)]
    assert _partition(seeds[0]) != _partition(seeds[1])


def test_each_run_of_an_lr_grid_takes_the_sgd_step_of_its_own_lr(tmp_path: Path) -> None:
    """Three runs that differ only by local_lr, one round of one client's one full-batch step,
    trained as one computation: each run's global model is w - lr * grad, with w the model
    the config builds and grad the client's mean cross-entropy gradient by autograd."""
    lrs = [0.01, 0.1, 0.5]
    common = [
        "fit",
        f"--config={FEDAVG}",
        "--model.init_args.net=mlp",
        "--model.init_args.net_args={hidden: 4}",
        "--model.init_args.clients_per_round=1",
        "--model.init_args.local_steps=1",
        "--model.init_args.batch_size=100000",  # the client's whole training set
        "--trainer.max_steps=1",
        "--trainer.val_check_interval=1",
        "--test_after_fit=false",
        "--model.init_args.log_figures=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    job = run([*common, f'--runs.grid={{"model.init_args.local_lr": {lrs}}}']).job
    assert job is not None and job.lockstep.groups_trained == 1 < job.lockstep.submissions
    start = run([*common, "--model.init_args.local_lr=0.3"], run_subcommand=False)
    assert isinstance(start.model, FederatedMethod)
    start.datamodule.setup("fit")
    (client,) = start.model.sample_clients(0).tolist()
    index = start.datamodule.index["train"]
    first, count = int(index.offsets[client]), int(index.counts[client])
    x, y = start.datamodule.fetch(index.flat[first : first + count])
    net = start.model.net
    grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(net.parameters()))
    for cli, lr in zip(job.members, lrs, strict=True):
        trained = dict(cli.model.net.named_parameters())
        for (name, w), g in zip(net.named_parameters(), grads, strict=True):
            torch.testing.assert_close(trained[name], w - lr * g, rtol=1e-5, atol=1e-7, msg=name)


JOB = [
    "fit",
    f"--config={FEDAVG}",
    "--trainer.max_steps=20",
    "--trainer.val_check_interval=5",
    "--checkpoint.every_n_rounds=3",
    "--model.init_args.local_steps=6",
    "--model.init_args.vectorize=false",
    "--model.init_args.client_threads=1",
    "--model.init_args.log_figures=false",
    "--runs.seeds=[0, 1]",
]


def _job_results(save_dir: Path) -> dict[str, Any]:
    folder = save_dir / "conf" / "fedavg"
    return {s: _results(folder / s / "version_0" / "results.json") for s in ("seed_0", "seed_1")}


@pytest.fixture(scope="module")
def uninterrupted_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    save_dir = tmp_path_factory.mktemp("straight")
    run([*JOB, f"--trainer.logger.init_args.save_dir={save_dir}"])
    return _job_results(save_dir)


# SIGINT takes the same handler as SIGTERM (RoundCheckpoint's STOP_SIGNALS); tests/test_runs.py
# sends it to a single run
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_interrupted_job_resumes_to_the_results_of_an_uninterrupted_one(
    tmp_path: Path, uninterrupted_job: dict[str, Any], signum: signal.Signals
) -> None:
    """SIGTERM stops the job at a round boundary with every run's last.ckpt saved; SIGKILL (a
    crash) leaves the periodic checkpoints of round 9. Either way ``--ckpt_path last`` ends
    the job where the uninterrupted one ends."""
    command = [sys.executable, str(ROOT / "cli.py"), *JOB]
    command.append(f"--trainer.logger.init_args.save_dir={tmp_path}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    validated = 0
    for line in process.stderr:  # both runs validated round 10, after checkpoints at 3, 6, 9
        validated += line.startswith("round 10/")
        if validated == 2:
            break
    process.send_signal(signum)
    _, err = process.communicate(timeout=300)
    if signum == signal.SIGKILL:
        assert process.returncode == -signal.SIGKILL
    else:
        assert process.returncode == 128 + signum, err[-2000:]
        assert "2 of 2 runs stopped" in err and "--ckpt_path last" in err
    assert not (tmp_path / "conf" / "fedavg" / "job.json").exists()
    run([*JOB, f"--trainer.logger.init_args.save_dir={tmp_path}", "--ckpt_path=last"])
    assert _job_results(tmp_path) == uninterrupted_job


def test_a_job_without_validation_summarizes_the_last_evaluations(tmp_path: Path) -> None:
    """val_fraction 0 (FedTP's protocol): no run has a best round, so the table shows the mean
    over the last evaluations, the paper's metric, where the best round's accuracy would be."""
    specs = expand(Runs(seeds=[0, 1]), {"model.init_args.seed": 0, "data.init_args.seed": 0})
    paths = []
    for spec, (mean, pooled) in zip(specs, [(0.8, 0.7), (0.6, 0.5)], strict=True):
        path = tmp_path / f"{spec.label}.json"
        results = {
            "select_metric": None,
            "test_at_best_val": None,
            "val_at_best": None,
            "test_last": {"acc": mean, "acc_weighted": pooled},
            "test_last_evals": {"acc_mean": mean, "acc_weighted_mean": pooled},
            "test_max_over_evals": {"acc": mean + 0.1, "acc_weighted": pooled + 0.1},
        }
        path.write_text(json.dumps(results))
        paths.append(path)
    summary = summarize(specs, paths, "acc")
    assert summary["best_point"] is None
    header, row = format_summary(summary, tmp_path / "job.json").splitlines()[1:3]
    # a run's closing entries without validation (console.closing_entries), over seeds
    assert header.split(" | ")[2:] == [
        "last-evals acc",
        "pooled",
        "best-eval acc",
        "pooled",
        "test@last acc",
        "pooled",
    ]
    assert row.split(" | ")[2:] == ["70.00 +- 10.00", "60.00 +- 10.00", "80.00 +- 10.00"] + [
        "70.00 +- 10.00",
        "70.00 +- 10.00",
        "60.00 +- 10.00",
    ]
