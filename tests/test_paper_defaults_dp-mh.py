"""Client-level DP for MH-pFedHN (issue 47): the hypernetwork's shared part (MLP, heads read by
several clients) gets DP-FedAvg on each client's contribution; embeddings and single-reader
heads are personal. Clipping, noise, equivalence with no DP, resume and the refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.mh_pfedhn import MHPFedHN
from lightning_pfl.methods.mh_pfedhng import MHPFedHNG
from lightning_pfl.methods.mh_pfedhngd import MHPFedHNGD
from lightning_pfl.privacy import ClientDP, PrivacyAccountant
from tests.conftest import build, digits_data, fit
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_same_trained_state,
    assert_vectorized_equals_sequential,
    run_dir,
)
from tests.test_bad_inputs import run_cli
from tests.test_mh_pfedhn import SMALL, TINY

NO_DP = ClientDP(noise_multiplier=0.0, clip_norm=math.inf)
# cnn for clients 0-2 (tau 2), mlp for 3-4 (tau 4), res for 5 alone (tau 3): the heads of tau 2
# and 4 are shared, the head of tau 3 is client 5's own
GROUPS = {
    k: {**v, "clients": c} for (k, v), c in zip(TINY.items(), [[0, 1, 2], [3, 4], [5]], strict=True)
}
OPTIONS: dict[str, Any] = {
    **SMALL,
    "architectures": GROUPS,
    "output_size": 700,
    "hn_update": "mean",
    "hn_lr": 1e-2,
}


def build_dp(**kwargs: Any) -> MHPFedHN:
    method = build(MHPFedHN, digits_data(6), **{**OPTIONS, **kwargs})
    assert isinstance(method, MHPFedHN)
    method.configure_optimizers()
    return method


def generated_and_deltas(method: MHPFedHN, groups: list[list[int]]) -> tuple[list[Tensor], ...]:
    """Flat vectors of ``groups`` (clients of one count each) with their graphs, and deltas of
    norms spread over two orders of magnitude."""
    torch.manual_seed(0)
    generated = [method.hnet(rows) for rows in groups]
    scales = torch.logspace(-2, 0, sum(len(rows) for rows in groups)).split(
        [len(rows) for rows in groups]
    )
    deltas = [s[:, None] * torch.randn_like(g) for s, g in zip(scales, generated, strict=True)]
    return generated, deltas


def shared_gradient(method: MHPFedHN) -> Tensor:
    grads = [p.grad for p in method.dp_shared]
    assert all(g is not None for g in grads), "every shared tensor is noised"
    return torch.cat([g.flatten() for g in grads if g is not None])


def test_the_shared_and_personal_parts() -> None:
    method = build_dp()
    assert method.hnet.tau == [2, 2, 2, 4, 4, 3]
    personal = {id(p) for p in method.dp_personal}
    named = dict(method.hnet.named_parameters())
    assert personal == {
        id(named[n]) for n in ("embeddings", "heads.tau3_weight", "heads.tau3_bias")
    }
    assert len(method.dp_shared) + len(personal) == len(named)
    every_head_own = build_dp(head_sharing="client")
    assert {id(p) for p in every_head_own.dp_shared} == {
        id(p) for p in every_head_own.hnet.mlp.parameters()
    }


def test_each_clients_shared_contribution_is_clipped_to_c_and_the_personal_part_is_not() -> None:
    method = build_dp(client_dp=ClientDP(0.0, 1.0), hn_max_grad_norm=None, clients_per_round=5)
    groups = [[0, 2], [3, 4], [5]]
    generated, deltas = generated_and_deltas(method, groups)
    shared, personal = method.dp_shared, method.dp_personal
    contributions, norms = [], []  # c_i one client at a time
    for g, d in zip(generated, deltas, strict=True):
        for r in range(len(g)):
            c = torch.autograd.grad(
                (g[r] * d[r]).sum(), shared, retain_graph=True, allow_unused=True
            )
            contributions.append(c)
            norms.append(torch.cat([x.flatten() for x in c if x is not None]).norm())
    surrogate = (
        torch.stack([(g * d).sum() for g, d in zip(generated, deltas, strict=True)]).sum() / 5
    )
    expected = torch.autograd.grad(surrogate, personal, retain_graph=True, allow_unused=True)
    clip = float(torch.stack(norms).median())
    method.client_dp = ClientDP(0.0, clip)
    method.private_server_gradients(
        generated, deltas, torch.Generator(), torch.tensor([0, 2, 3, 4, 5]), 0
    )
    factors = [min(1.0, clip / float(n)) for n in norms]
    assert min(factors) < 1 and max(factors) == 1, "some clients clipped, some not"
    for f, n in zip(factors, norms, strict=True):
        assert f * float(n) <= clip * (1 + 1e-6)
    for k, p in enumerate(shared):  # (sum_i f_i c_i) / qN
        parts = [f * c[k] for f, c in zip(factors, contributions, strict=True) if c[k] is not None]
        if not parts:
            assert p.grad is None
            continue
        torch.testing.assert_close(p.grad, sum(parts) / 5, rtol=1e-4, atol=1e-8)
    for p, e in zip(personal, expected, strict=True):  # unclipped, weights 1 / C
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-9)
    assert personal[1].grad is not None, "client 5's own head is updated"


def test_noise_std_is_sigma_c_over_the_expected_clients_on_every_shared_tensor() -> None:
    sigma, clip = 2.0, 0.5
    method = build_dp(client_dp=ClientDP(sigma, clip), hn_max_grad_norm=None, clients_per_round=3)
    generated = [method.hnet([0, 1, 2])]  # the mlp clients' head (tau 4) is read by none
    zero = [torch.zeros_like(generated[0])]
    method.private_server_gradients(
        generated, zero, torch.Generator().manual_seed(0), torch.arange(3), 0
    )
    noise = shared_gradient(method)
    assert len(noise) > 10_000
    assert noise.std().item() == pytest.approx(sigma * clip / 3, rel=0.03)
    assert abs(noise.mean().item()) < 4 * sigma * clip / 3 / math.sqrt(len(noise))
    tau4 = method.hnet.heads["tau4_weight"].grad
    assert tau4 is not None and tau4.std().item() == pytest.approx(sigma * clip / 3, rel=0.05)
    embeddings, own_head = method.dp_personal[0], method.dp_personal[1]
    assert embeddings.grad is not None and not embeddings.grad.any()  # no noise, no signal
    assert own_head.grad is None  # client 5's head: not read, personal, no noise
    again = build_dp(client_dp=ClientDP(sigma, clip), hn_max_grad_norm=None, clients_per_round=3)
    again.private_server_gradients(
        [again.hnet([0, 1, 2])], zero, torch.Generator().manual_seed(0), torch.arange(3), 0
    )
    assert torch.equal(noise, shared_gradient(again))


@pytest.mark.parametrize("head_sharing", ["tau", "client"])
def test_no_noise_and_no_clip_is_the_run_without_dp_bit_for_bit(head_sharing: str) -> None:
    def trained(**kwargs: Any) -> MHPFedHN:
        dm = digits_data(6)
        method = build(
            MHPFedHN, dm, **OPTIONS, clients_per_round=3, head_sharing=head_sharing, **kwargs
        )
        fit(method, dm, rounds=3)
        return method  # type: ignore[return-value]

    plain, private = trained(), trained(client_dp=NO_DP)
    assert private.record.extra_results["privacy"]["epsilon"] == math.inf
    assert_same_trained_state(plain, private)
    noisy = trained(client_dp=ClientDP(1e-3, 10.0))  # the check sees a changed run
    assert not torch.equal(noisy.dp_shared[0], plain.dp_shared[0])  # mlp.0.weight


def test_dp_rounds_vectorized_equal_client_by_client() -> None:
    assert_vectorized_equals_sequential(MHPFedHN, rounds=2, client_dp=ClientDP(1.0, 0.5), **OPTIONS)


def test_resume_is_exact_with_dp(tmp_path: Path) -> None:
    config = CONF / "mh_pfedhn.yaml"
    dp = "--model.init_args.client_dp={noise_multiplier: 1.0, clip_norm: 0.3, delta: 1e-4}"
    assert_resume_is_exact(config, tmp_path, dp)
    runs = [run_dir(tmp_path / name, config) for name in ("straight", "resumed")]
    straight, resumed = (json.loads((r / "results.json").read_text()) for r in runs)
    assert resumed["privacy"] == straight["privacy"]
    expected = PrivacyAccountant(ClientDP(1.0, 0.3, 1e-4), 4, 2).epsilon(6)
    assert straight["privacy"]["epsilon"] == expected and straight["privacy"]["rounds"] == 6


def test_per_client_server_steps_and_the_papers_global_step_are_refused() -> None:
    dm = digits_data(6)
    for update in ("sequential", "per_client"):
        with pytest.raises(ConfigError, match=f"hn_update = '{update}'.*hn_update: mean"):
            build(MHPFedHN, dm, **{**OPTIONS, "hn_update": update}, client_dp=ClientDP())
    for cls in (MHPFedHNG, MHPFedHNGD):  # the paper's global step before the personal round
        with pytest.raises(ConfigError, match=f"{cls.__name__}.*global_step: joint"):
            build(cls, dm, **OPTIONS, client_dp=ClientDP())
        with pytest.raises(ConfigError, match="global_step = 'joint'.*hn_update: mean"):
            build(cls, dm, **{**OPTIONS, "hn_update": "sequential"}, global_step="joint")


@pytest.mark.parametrize(
    ("config", "extra", "named"),
    [
        ("mh_pfedhn.yaml", ["--model.init_args.hn_update=sequential"], "hn_update"),
        ("mh_pfedhng.yaml", ["--model.init_args.hn_update=mean"], "global_step: joint"),
        ("mh_pfedhngd.yaml", ["--model.init_args.global_step=joint"], "hn_update: mean"),
    ],
)
def test_refusals_come_before_any_folder_exists(
    config: str, extra: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "fit",
        f"--config={CONF / config}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--model.init_args.client_dp={}",
        *extra,
    ]
    code, err = run_cli(args, capsys)
    assert code == 2, err
    assert named in err and "Traceback" not in err, err
    assert not list(tmp_path.rglob("version_*")), "a run folder was created"
