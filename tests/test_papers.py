"""Fact tables: the check of a run against its paper's settings, and the papers' metrics."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from lightning_pfl.engine import Params
from lightning_pfl.errors import ConfigError
from lightning_pfl.experiment import flatten
from lightning_pfl.methods import FedBABU
from lightning_pfl.metrics import over_evaluations
from lightning_pfl.papers import load_fact_table, overrides, same_value
from tests.helpers import CONF, cli, run_dir

FACTS = {
    "paper": "Someone et al. A paper. 2099",
    "code": "none public",
    "entries": {
        "table9_digits": {
            "what": "Table 9, digits, 4 clients",
            "metric": "test_at_best_val.acc",
            "reported": {"FedAvg": 97.5},
            "configs": ["paper/table9_digits.yaml"],
            "settings": {
                "model.class_path": {"value": "FedAvg", "source": "Table 9"},
                "model.init_args.clients_per_round": {"value": 2, "source": "section 4"},
                "model.init_args.local_lr": {"value": 5e-3, "source": "section 4 (default)"},
                "data.init_args.partition.init_args.classes": {"value": 2, "source": "sec. 4"},
                "trainer.max_steps": {"value": 4, "source": "section 4"},
                "model.init_args.local_epochs": {"value": None, "source": "K steps, section 4"},
            },
        }
    },
}


@pytest.fixture
def paper_config(tmp_path: Path) -> Path:
    """tests/conf/fedavg.yaml as a paper config listed by a fact table under a configs/ folder."""
    configs = tmp_path / "configs"
    (configs / "papers").mkdir(parents=True)
    (configs / "paper").mkdir()
    (configs / "papers" / "someone.yaml").write_text(yaml.safe_dump(FACTS))
    config = configs / "paper" / "table9_digits.yaml"
    shutil.copy(CONF / "fedavg.yaml", config)
    return config


def test_a_run_of_a_paper_config_records_that_it_holds_the_papers_settings(
    paper_config: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        result = cli(paper_config, tmp_path / "logs")
    (entry,) = result["paper"]["entries"]
    assert entry["entry"] == "table9_digits" and entry["overridden"] == []
    assert entry["metric"] == "test_at_best_val.acc" and entry["reported"] == {"FedAvg": 97.5}
    assert "every setting the paper states holds" in caplog.text


def test_an_override_of_a_paper_setting_runs_and_is_named_first(
    paper_config: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        result = cli(
            paper_config,
            tmp_path / "logs",
            "--trainer.max_steps=2",
            "--model.init_args.local_lr=0.1",
        )
    assert result["rounds"] == 2
    overridden = {o["key"]: o for o in result["paper"]["entries"][0]["overridden"]}
    assert set(overridden) == {"trainer.max_steps", "model.init_args.local_lr"}
    assert overridden["model.init_args.local_lr"] == {
        "key": "model.init_args.local_lr",
        "paper": 5e-3,
        "run": 0.1,
        "source": "section 4 (default)",
    }
    first = caplog.records[0].getMessage()
    assert first.startswith("Paper settings of") and "overrides the paper's" in first
    assert "trainer.max_steps = 2 (paper: 4, section 4)" in first


@pytest.mark.parametrize("paper_first", [True, False])
def test_a_paper_config_among_several_config_files_is_checked_against_the_run(
    paper_config: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, paper_first: bool
) -> None:
    # a user's own file: the paper config with fewer rounds (whole, so it can come first)
    changed = yaml.safe_load(paper_config.read_text())
    changed["trainer"]["max_steps"] = 2
    changes = tmp_path / "my_changes.yaml"
    changes.write_text(yaml.safe_dump(changed))
    first, second = (paper_config, changes) if paper_first else (changes, paper_config)
    with caplog.at_level(logging.INFO):
        result = cli(first, tmp_path / "logs", f"--config={second}")
    (entry,) = result["paper"]["entries"]
    message = caplog.records[0].getMessage()
    assert message.startswith(f"Paper settings of {paper_config}")
    if paper_first:  # the later file's max_steps wins and is named
        assert result["rounds"] == 2
        assert [o["key"] for o in entry["overridden"]] == ["trainer.max_steps"]
        assert "trainer.max_steps = 2 (paper: 4, section 4)" in message
    else:  # the paper config, given last, holds over the earlier file
        assert result["rounds"] == 4 and entry["overridden"] == []


def test_a_config_no_fact_table_lists_has_no_paper_record(tmp_path: Path) -> None:
    assert "paper" not in cli(CONF / "fedavg.yaml", tmp_path)


def test_values_compare_as_documented() -> None:
    assert same_value("FedAvg", "lightning_pfl.methods.fedavg.FedAvg", "model.class_path")
    assert not same_value("FedAvg", "lightning_pfl.methods.FedProx", "model.class_path")
    assert same_value(0.1, 0.1 * (1 + 1e-12), "k") and not same_value(0.1, 0.1001, "k")
    assert same_value(50, 50.0, "k") and not same_value(True, 1, "k")
    assert same_value([100, 100], [100, 100], "k") and not same_value([100], [100, 100], "k")
    zoo = {"cnn": {"net": "zoo_cnn"}, "big": {"net": "resnet18"}}
    assert same_value(zoo, {"big": {"net": "resnet18"}, "cnn": {"net": "zoo_cnn"}}, "k")
    assert not same_value(zoo, {"cnn": {"net": "zoo_cnn"}, "big": {"net": "zoo_mlp"}}, "k")
    assert not same_value(zoo, {"cnn": {"net": "zoo_cnn"}}, "k")


def test_a_mapping_setting_pins_the_whole_subtree_under_its_key(tmp_path: Path) -> None:
    zoo = {"cnn": {"net": "zoo_cnn"}, "big": {"net": "resnet18"}}
    facts = {
        "paper": "p",
        "code": "c",
        "entries": {
            "e": {
                "what": "w",
                "metric": "test_at_best_val.acc",
                "configs": ["a.yaml"],
                "settings": {"model.init_args.architectures": {"value": zoo, "source": "the zoo"}},
            }
        },
    }
    path = tmp_path / "facts.yaml"
    path.write_text(yaml.safe_dump(facts))
    (entry,) = load_fact_table(path)

    def run(architectures: object) -> list[object]:
        flat = flatten({"model": {"init_args": {"architectures": architectures, "seed": 0}}})
        return [o.run for o in overrides(entry, flat)]

    assert run(zoo) == []
    swapped = {"cnn": {"net": "zoo_cnn"}, "big": {"net": "zoo_mlp"}}
    assert run(swapped) == [swapped]
    extra = zoo | {"mlp": {"net": "zoo_mlp"}}
    assert run(extra) == [extra]
    wider = zoo | {"big": {"net": "resnet18", "net_args": {"widths": [8, 16, 32]}}}
    assert run(wider) == [wider]
    assert run(None) == [None]
    assert overrides(entry, {"model.init_args.seed": 0})[0].run == "<absent>"


def test_overrides_name_every_differing_or_missing_key(tmp_path: Path) -> None:
    path = tmp_path / "facts.yaml"
    path.write_text(yaml.safe_dump(FACTS))
    (entry,) = load_fact_table(path)
    flat = {
        "model.class_path": "lightning_pfl.methods.FedAvg",
        "model.init_args.clients_per_round": 3,
        "model.init_args.local_lr": 5e-3,
        "model.init_args.local_epochs": None,
        "trainer.max_steps": 4,
    }
    found = {o.key: (o.paper, o.run) for o in overrides(entry, flat)}
    assert found == {
        "model.init_args.clients_per_round": (2, 3),
        "data.init_args.partition.init_args.classes": (2, "<absent>"),
    }


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ({"entries": {}}, "top-level keys"),
        ({"paper": "p", "code": "c", "entries": {"e": {"what": "w"}}}, "entry e needs"),
        (
            {
                "paper": "p",
                "code": "c",
                "entries": {
                    "e": {
                        "what": "w",
                        "metric": "m",
                        "configs": ["a.yaml"],
                        "settings": {"trainer.max_steps": {"value": 1}},
                    }
                },
            },
            "needs exactly value and source",
        ),
    ],
)
def test_a_malformed_fact_table_is_refused_with_its_name(
    broken: dict[str, object], message: str, tmp_path: Path
) -> None:
    path = tmp_path / "facts.yaml"
    path.write_text(yaml.safe_dump(broken))
    with pytest.raises(ConfigError, match=message) as error:
        load_fact_table(path)
    assert str(path) in str(error.value)


def test_over_evaluations_gives_the_papers_summaries() -> None:
    history = [
        {"round": 0, "acc": 0.1, "acc_weighted": 0.2},
        {"round": 5, "acc": 0.7, "acc_weighted": 0.6},
        {"round": 10, "acc": 0.5, "acc_weighted": 0.8},
        {"round": 15, "acc": 0.6, "acc_weighted": 0.4},
    ]
    summary = over_evaluations(history, last=3)
    assert summary["test_max_over_evals"] == {
        "acc": 0.7,
        "round_acc": 5,
        "acc_weighted": 0.8,
        "round_acc_weighted": 10,
    }
    tail = summary["test_last_evals"]
    assert tail["n"] == 3 and tail["rounds"] == [5, 10, 15]
    assert tail["acc_mean"] == pytest.approx(0.6)
    assert tail["acc_std"] == pytest.approx((0.02 / 3) ** 0.5)  # population std of .7, .5, .6
    assert tail["acc_weighted_mean"] == pytest.approx(0.6)
    assert over_evaluations(history, last=10)["test_last_evals"]["n"] == 4
    assert over_evaluations([], last=3) == {}


def test_results_carry_the_test_split_of_every_evaluation(tmp_path: Path) -> None:
    result = cli(CONF / "fedavg.yaml", tmp_path, "--model.init_args.last_evals=2")
    history = result["eval_history"]
    assert [entry["round"] for entry in history] == [0, 2, 4]
    best = result["best_round"]
    (at_best,) = [entry for entry in history if entry["round"] == best]
    assert at_best["acc"] == pytest.approx(result["test_at_best_val"]["acc"])
    assert result["test_max_over_evals"]["acc"] == max(entry["acc"] for entry in history)
    assert result["test_last_evals"]["rounds"] == [2, 4]
    final = result["test_last"]
    assert history[-1]["acc_weighted"] == pytest.approx(final["acc_weighted"])


def test_an_evaluation_builds_each_clients_model_once_for_validation_and_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FedBABU fine-tunes every client's model for evaluation: once per evaluated round, both
    splits measured on it (the test after fit builds its own)."""
    built: list[int] = []
    personalize = FedBABU.personalized_params

    def counted(self: FedBABU, clients: torch.Tensor) -> Params:
        built.extend(clients.tolist())
        return personalize(self, clients)

    monkeypatch.setattr(FedBABU, "personalized_params", counted)
    result = cli(CONF / "fedbabu.yaml", tmp_path)
    evaluations = len(result["eval_history"])
    assert evaluations >= 2 and result["best_round"] is not None
    clients = range(4)  # tests/conf/fedbabu.yaml's
    assert {c: built.count(c) for c in set(built)} == dict.fromkeys(clients, evaluations + 1)


def test_a_checkpoint_without_the_evaluation_history_is_refused(tmp_path: Path) -> None:
    config = CONF / "fedavg.yaml"
    cli(config, tmp_path, "--trainer.max_steps=2")
    path = run_dir(tmp_path, config) / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    del checkpoint["pfl"]["eval_history"]
    older = tmp_path / "older.ckpt"
    torch.save(checkpoint, older)
    with pytest.raises(ConfigError, match="eval_history"):
        cli(config, tmp_path, f"--ckpt_path={older}")
