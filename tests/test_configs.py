from pathlib import Path

import pytest

from lightning_pfl.cli import run

ROOT = Path(__file__).parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


@pytest.mark.parametrize(
    "config", CONFIGS, ids=[str(c.relative_to(ROOT / "configs")) for c in CONFIGS]
)
def test_every_shipped_config_parses(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(["fit", f"--config={config}", "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path" in printed and "max_steps" in printed
