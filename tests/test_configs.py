from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_pfl.cli import run
from lightning_pfl.experiment import flatten
from lightning_pfl.papers import PaperEntry, load_fact_tables, overrides

ROOT = Path(__file__).parents[1]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if p.parent.name != "papers")
FACTS = load_fact_tables(ROOT / "configs")
# Folders named after a paper: every config there reproduces one of its tables (and is listed
# by a fact entry) or says in its name that it is reduced.
PAPER_FOLDERS = ("pfedhn", "pfedhn_pc", "pfedkt", "fedsimsup", "mh_pfedhn", "fedtp", "baselines")
# Folders that run a paper's own protocol on FashionMNIST (the data we have): every config there
# is listed by a fact entry, reduced or not.
PROTOCOL_FOLDERS = (
    "fashion_mnist_pfedhn_table1",
    "fashion_mnist_pfedkt_table1",
    "fashion_mnist_mlp_5000rounds",
)


def entries_listing(config: Path) -> list[PaperEntry]:
    relative = config.relative_to(ROOT / "configs").as_posix()
    return [entry for entry in FACTS if relative in entry.configs]


@pytest.fixture(scope="module")
def fit_parser() -> Any:
    """The CLI's ``fit`` parser, built once: what ``fit --config X --print_config`` parses with."""
    cli = run(
        ["fit", f"--config={ROOT / 'configs' / 'digits' / 'fedavg.yaml'}"], run_subcommand=False
    )
    return cli.parser


def test_print_config_prints_the_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(
            [
                "fit",
                f"--config={ROOT / 'configs' / 'pfedhn' / 'table1_cifar10_50clients.yaml'}",
                "--print_config",
            ]
        )
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"].endswith("PFedHN") and printed["trainer"]["max_steps"]


@pytest.mark.parametrize(
    "config", CONFIGS, ids=[str(c.relative_to(ROOT / "configs")) for c in CONFIGS]
)
def test_every_shipped_config_parses_and_holds_its_papers_settings(
    config: Path, fit_parser: Any
) -> None:
    """Parsed and resolved as ``--print_config`` does (one parser for every config)."""
    parsed = fit_parser.parse_args(["fit", f"--config={config}"])
    printed = yaml.safe_load(fit_parser.dump(parsed, skip_none=False, skip_validation=True))["fit"]
    assert "class_path" in printed["model"] and "max_steps" in printed["trainer"]
    flat = flatten(printed)
    for entry in entries_listing(config):
        found = [o.describe() for o in overrides(entry, flat)]
        assert not found, f"{entry.facts.name} {entry.name}: {found}"


def test_every_fact_entry_lists_existing_configs_and_cites_a_metric() -> None:
    assert FACTS, "no fact tables under configs/papers"
    for entry in FACTS:
        for config in entry.configs:
            assert (ROOT / "configs" / config).is_file(), f"{entry.name}: no configs/{config}"
        head = entry.metric.split(".")[0]
        assert head in {
            "test_at_best_val",
            "test_max_over_evals",
            "test_last_evals",
            "novel_clients",
        }, entry


@pytest.mark.parametrize("folder", PAPER_FOLDERS)
def test_paper_folders_hold_paper_configs_or_say_they_are_reduced(folder: str) -> None:
    for config in sorted((ROOT / "configs" / folder).rglob("*.yaml")):
        if "reduced" in config.stem:
            lines = config.read_text().splitlines()
            header = " ".join(line for line in lines if line.startswith("#")).lower()
            assert "reduced" in header, f"{config}: the header must say what is reduced"
        else:
            assert entries_listing(config), f"{config}: no fact entry lists it"


@pytest.mark.parametrize("folder", PROTOCOL_FOLDERS)
def test_paper_protocol_folders_hold_only_configs_a_fact_entry_lists(folder: str) -> None:
    configs = sorted((ROOT / "configs" / folder).rglob("*.yaml"))
    assert configs, f"configs/{folder} holds no config"
    unlisted = [config.name for config in configs if not entries_listing(config)]
    assert not unlisted, f"configs/{folder}: no fact entry lists {unlisted}"
