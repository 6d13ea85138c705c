"""Which of Lightning's ``Trainer`` arguments a federated run supports: one rule per argument.

Every argument of ``lightning.Trainer.__init__`` has an entry in :data:`TRAINER_RULES`: None
when every value Lightning accepts works, or a rule that returns what is wrong with a value
(None when it works). The CLI applies them (:func:`check_trainer`) before anything is
instantiated, so a refused setting never leaves a run folder behind. A new Lightning argument
fails ``tests/test_bad_inputs.py`` until it gets its entry here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from jsonargparse import Namespace

from lightning_pfl.errors import ConfigError

Rule = Callable[[Any], "str | None"]

# Precisions that work: full float32, and bfloat16 autocast (no gradient scaler needed).
SUPPORTED_PRECISIONS = (None, 32, "32", "32-true", "bf16", "bf16-mixed")
NO_EPOCHS = "rounds never end an epoch; set the number of rounds with trainer.max_steps"


def _only(allowed: tuple[Any, ...], advice: str) -> Rule:
    """Refuse every value but ``allowed`` (compared with their types: 1 is not 1.0 here)."""

    def rule(value: Any) -> str | None:
        if any(type(value) is type(a) and value == a for a in allowed):
            return None
        return advice

    return rule


def precision_problem(value: Any) -> str | None:
    """What is wrong with ``trainer.precision = value`` (None: supported)."""
    if value in SUPPORTED_PRECISIONS:
        return None
    text = str(value)
    if text.startswith("16"):
        return (
            "needs gradient scaling, which client training does not do (on CPU Lightning would "
            "silently run bf16): use 'bf16-mixed' or '32-true'"
        )
    if text.startswith("transformer-engine"):
        return "the networks have no Transformer Engine layers: use 'bf16-mixed' or '32-true'"
    return (
        "casts the model's parameters while the client data and the engine's buffers stay "
        "float32 (the first local step fails): use 'bf16-mixed' or '32-true'"
    )


def _class_path(value: Any) -> str:
    """The class a ``class_path`` setting (a dict or Namespace), an object or a name stands for."""
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return str(value.get("class_path", ""))
    if isinstance(value, str):
        return value
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _shown(value: Any) -> Any:
    """A setting as the user wrote it: a class by its ``class_path``."""
    if isinstance(value, list):
        return [_shown(v) for v in value]
    if isinstance(value, (Namespace, Mapping)) or type(value).__module__ != "builtins":
        return _class_path(value)
    return value


def _import(path: str) -> type | None:
    module, _, name = path.rpartition(".")
    try:
        found = getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) else None


def _start_method(value: Any) -> str | None:
    if isinstance(value, Namespace):
        value = value.as_dict()
    if isinstance(value, Mapping):
        return (value.get("init_args") or {}).get("start_method")
    return getattr(value, "_start_method", None)


def _strategy(value: Any) -> str | None:
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy, StrategyRegistry

    if value == "auto":
        return None
    if isinstance(value, str) and value in StrategyRegistry:
        entry = StrategyRegistry[value]
        cls, start_method = entry["strategy"], entry["init_params"].get("start_method", "popen")
    else:
        cls, start_method = _import(_class_path(value)), _start_method(value) or "popen"
    # Exact classes: DeepSpeed and XLA strategies subclass these.
    if cls is SingleDeviceStrategy or (cls is DDPStrategy and start_method == "popen"):
        return None
    if cls is DDPStrategy:
        return (
            f"starting the ranks by {start_method} is not supported (the run record is kept by "
            "the launching process, and spawn cannot pickle the method): use 'ddp'"
        )
    return (
        "only Lightning's DDP ('ddp', started as processes) is supported: the ranks all-gather "
        "the clients' results themselves, and client training reads the whole, unwrapped "
        "parameters (FSDP and DeepSpeed shard them; XLA is untested)"
    )


def _plugins(value: Any) -> str | None:
    from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning.pytorch.plugins import LayerSync, Precision

    for plugin in value if isinstance(value, list) else [value] if value is not None else []:
        cls = _import(_class_path(plugin))
        if cls is not None and issubclass(cls, ClusterEnvironment):
            continue
        if cls is not None and issubclass(cls, Precision):
            return "precision plugins bypass the precision check: set trainer.precision"
        if cls is not None and issubclass(cls, CheckpointIO):
            return (
                "checkpoints are written to a temporary file renamed over last.ckpt (so a "
                "crash keeps the previous one); another CheckpointIO breaks that"
            )
        if cls is not None and issubclass(cls, LayerSync):
            return _SYNC_BATCHNORM
        return "only cluster environments (ClusterEnvironment subclasses) are supported"
    return None


def _val_check_interval(value: Any) -> str | None:
    if value is None or type(value) is int:
        return None
    if isinstance(value, float):
        return (
            "give the number of rounds between evaluations as an integer (a round loader has "
            "no epochs to take a fraction of)"
        )
    return (
        "give the number of rounds between evaluations as an integer: evaluations by time "
        "would fall on other rounds in a resumed run than in an uninterrupted one"
    )


_SYNC_BATCHNORM = (
    "ranks train different clients, whose batch-norm statistics are their own; synchronizing "
    "them across ranks would mix clients"
)
_GRADIENT_CLIP = (
    "Lightning does not clip manually optimized steps: clip client steps with "
    "model.init_args.local_max_grad_norm (and the hypernetwork's with hn_max_grad_norm, where "
    "the method has one)"
)

TRAINER_RULES: dict[str, Rule | None] = {
    "accelerator": None,
    "strategy": _strategy,
    "devices": None,
    "num_nodes": None,
    "precision": precision_problem,
    "logger": None,
    "callbacks": None,
    "fast_dev_run": _only(
        (False, 0),
        "it evaluates only the first chunks of clients and turns the logger off; for a quick "
        "check use --trainer.max_steps 1 (and --trainer.logger false)",
    ),
    "max_epochs": _only((None, -1), NO_EPOCHS),
    "min_epochs": _only((None, 0), NO_EPOCHS),
    "max_steps": None,  # checked with val_check_interval in trainer_problems
    "min_steps": _only(
        (None,),
        "with it set Lightning skips the validation of the final round (measured); "
        "trainer.max_steps is the number of rounds",
    ),
    "max_time": None,
    "limit_train_batches": _only((None, 1.0, 1), "set the number of rounds with trainer.max_steps"),
    "limit_val_batches": _only(
        (None, 1.0, 0, 0.0),
        "validation evaluates every client: 1.0 (all) or 0 (no validation, no best round)",
    ),
    "limit_test_batches": _only(
        (None, 1.0),
        "the test evaluates every client; to skip the test after fit use --test_after_fit false",
    ),
    "limit_predict_batches": _only((None, 1.0), "there is no predict subcommand"),
    "overfit_batches": _only((0, 0.0), "rounds of sampled clients have no batches to overfit"),
    "val_check_interval": _val_check_interval,
    "check_val_every_n_epoch": _only(
        (None,),
        "must be null: rounds never end an epoch; set trainer.val_check_interval (rounds "
        "between evaluations)",
    ),
    "num_sanity_val_steps": None,
    "log_every_n_steps": _only(
        (None, 1), "every round's metrics are logged (at step = round): it has no effect"
    ),
    "enable_checkpointing": _only(
        (None, True),
        "the round checkpoint is always on; to save only at the end set "
        "checkpoint.every_n_rounds 0 and checkpoint.every_minutes null",
    ),
    "enable_progress_bar": None,
    "enable_model_summary": None,
    "accumulate_grad_batches": _only((None, 1), "must be 1 (one step is one round)"),
    "gradient_clip_val": _only((None,), _GRADIENT_CLIP),
    "gradient_clip_algorithm": _only((None,), _GRADIENT_CLIP),
    "deterministic": None,
    "benchmark": None,
    "inference_mode": _only(
        (None, False),
        "evaluation trains some methods' models (fine-tuning, adaptation), so it runs under "
        "no_grad: under inference mode torch.func differentiates to zeros in torch 2.11 "
        "(pytorch/pytorch#177318); leave it unset",
    ),
    "use_distributed_sampler": _only(
        (True,),
        "the round loader and the client chunks are no DataLoaders (ranks split the clients "
        "themselves): it has no effect",
    ),
    "profiler": None,
    "detect_anomaly": _only(
        (False,),
        "autograd's anomaly mode fails inside the functional client training; a non-finite "
        "loss is reported with its round and clients anyway",
    ),
    "barebones": _only((False,), "it turns off the logging and metrics every run reports"),
    "plugins": _plugins,
    "sync_batchnorm": _only((False,), _SYNC_BATCHNORM),
    "reload_dataloaders_every_n_epochs": _only((0,), NO_EPOCHS),
    "default_root_dir": None,
    "enable_autolog_hparams": None,
    "model_registry": _only(
        (None,), "Lightning's model registry is not used: checkpoints are files (--ckpt_path)"
    ),
}


def trainer_problems(trainer: Mapping[str, Any] | Namespace, subcommand: str) -> list[str]:
    """What is wrong with the ``trainer`` settings for ``subcommand`` (empty: nothing)."""
    problems = []
    for name, rule in TRAINER_RULES.items():
        if rule is None or name not in trainer:
            continue
        value = trainer.get(name)
        problem = rule(value)
        if problem is not None:
            problems.append(f"trainer.{name} = {_shown(value)}: {problem}")
    if subcommand != "fit":
        return problems
    max_steps = trainer.get("max_steps")
    if max_steps is None or max_steps == 0 or (max_steps < 0 and not trainer.get("max_time")):
        problems.append(
            f"trainer.max_steps = {max_steps} is the number of rounds: give a positive number "
            "(one training step is one round)"
        )
    elif max_steps > 0:
        interval = trainer.get("val_check_interval")
        if type(interval) is int and not 1 <= interval <= max_steps:
            problems.append(
                f"trainer.val_check_interval = {interval} with trainer.max_steps = "
                f"{max_steps}: validation would never run; use 1..{max_steps}"
            )
    return problems


def check_trainer(trainer: Mapping[str, Any] | Namespace, subcommand: str) -> None:
    """Refuse trainer settings that fail or are meaningless in a federated run."""
    problems = trainer_problems(trainer, subcommand)
    if problems:
        raise ConfigError("Invalid trainer settings: " + "; ".join(problems) + ".")
