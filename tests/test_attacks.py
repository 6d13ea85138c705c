"""DLG / iDLG gradient inversion (lightning_pfl.attacks.GradientInversion)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_pfl.attacks import GradientInversion
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import FedAvg, FedPer, MHPFedHN, PFedHN
from lightning_pfl.partition import IID
from lightning_pfl.privacy import ClientDP
from tests.conftest import build, digits_data
from tests.helpers import CONF, cli, run_dir

# A reconstruction within 30 dB of the real 8x8 image differs from it by under 3% of the pixel
# range (RMS): the same digit to the eye.
HIGH_PSNR = 30.0


@pytest.mark.parametrize("attack", ["idlg", "dlg"])
def test_inversion_recovers_a_single_sample_and_dp_noise_stops_it(attack: str) -> None:
    dm = digits_data(6)
    attacker = GradientInversion(attack=attack, iterations=100)  # type: ignore[arg-type]
    plain = build(FedAvg, dm, net="mlp")
    record, real, fake = attacker.invert(plain)
    assert record["labels_inferred"] == record["labels"]
    assert record["psnr"] > HIGH_PSNR, record
    assert real.shape == fake.shape == (1, 1, 8, 8)
    noisy = build(FedAvg, dm, net="mlp", client_dp=ClientDP(noise_multiplier=1.0, clip_norm=1.0))
    private, _, _ = attacker.invert(noisy)
    assert private["labels"] == record["labels"]  # the same victim batch
    assert private["psnr"] < record["psnr"] - 20, (private, record)
    assert private["ssim"] < record["ssim"] - 0.5


def test_idlg_label_is_the_negative_row_of_the_last_layer_for_every_class() -> None:
    dm = digits_data(10, partition=IID())
    method = build(FedAvg, dm, net="mlp")
    found = {}
    for client in range(10):
        record, _, _ = GradientInversion(client=client, iterations=1).invert(method)
        assert record["labels_inferred"] == record["labels"]
        found[record["labels"][0]] = True
    assert len(found) > 3  # several different labels were inferred


def test_results_and_tensorboard_images_through_the_cli(tmp_path: Path) -> None:
    config = CONF / "fedavg_dlg.yaml"
    results = cli(config, tmp_path, "--test_after_fit=false")
    record = results["gradient_inversion"]
    assert record["round"] == 1 and record["attack"] == "idlg"
    assert record["labels_inferred"] == record["labels"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir(tmp_path, config)), size_guidance={"images": 0}).Reload()
    assert {"attack/real", "attack/reconstructed"} <= set(events.Tags()["images"])
    assert events.Scalars("attack/psnr")[0].value == pytest.approx(record["psnr"])


def test_bad_attack_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        GradientInversion(attack="idlg", batch_size=4)
    with pytest.raises(ConfigError, match="iterations"):
        GradientInversion(iterations=0)
    dm = digits_data(6)
    method = build(FedPer, dm, net="mlp", personal_layers=1)  # keeps the classifier: no label
    with pytest.raises(ConfigError, match="dlg"):
        GradientInversion().setup(None, method, "fit")  # type: ignore[arg-type]
    private_hn = build(PFedHN, dm, n_hidden=1, hidden_dim=8, client_dp=ClientDP())
    with pytest.raises(ConfigError, match="not on the upload"):  # its noise is on the HN
        GradientInversion().setup(None, private_hn, "fit")  # type: ignore[arg-type]


def test_a_model_zoo_victim_is_attacked_on_its_own_architecture() -> None:
    """MH-pFedHN: each client's upload is the update of its own generated network; the attack
    inverts it on that network (an MLP client's one-sample update gives the image back exactly,
    as FedAvg's does) and refuses a sparsified upload, which it cannot invert whole."""
    dm = digits_data(6)
    zoo = {
        "mlp": {"net": "mlp", "clients": [0, 2, 4]},
        "cnn": {"net": "digits_cnn", "clients": [1, 3, 5]},
    }
    method = build(MHPFedHN, dm, architectures=zoo)
    for client, kind in ((0, "mlp"), (1, "cnn")):
        attacker = GradientInversion(client=client, iterations=100)
        attacker.setup(None, method, "fit")  # type: ignore[arg-type]
        observed = attacker.observed(method, client)
        assert observed == {f"{kind}/{n}" for n in method.zoo.archs[kind].shapes}
        record, real, _ = attacker.invert(method)
        assert record["labels_inferred"] == record["labels"]
        assert real.shape == (1, 1, 8, 8)
        if kind == "mlp":
            assert record["psnr"] > HIGH_PSNR, record
    sparse = build(MHPFedHN, dm, architectures=zoo, upload_fraction=0.3)
    with pytest.raises(ConfigError, match="upload_fraction"):
        GradientInversion().setup(None, sparse, "fit")  # type: ignore[arg-type]
