"""Client-level DP (DP-FedAvg): accounting, clipping, noise, equivalence with no DP, resume and
bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import dp_accounting as dpa
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_pfl.conditions import Conditions
from lightning_pfl.engine import TrainResult
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods import FedAvg, FedPer, FedProto, Local, PFedHN, PFedLHN
from lightning_pfl.partition import IID
from lightning_pfl.privacy import (
    CHUNK,
    EPSILON_KEY,
    ClientDP,
    PrivacyAccountant,
    clip_factors,
    private_uploads,
)
from tests.conftest import build, digits_data, fit
from tests.helpers import (
    CONF,
    assert_resume_is_exact,
    assert_same_trained_state,
    assert_vectorized_equals_sequential,
    capture_local_training,
    round_updates_beyond,
    run_dir,
)
from tests.test_bad_inputs import run_cli
from tests.test_conditions import one_round, round_with_drops

NO_DP = ClientDP(noise_multiplier=0.0, clip_norm=math.inf)


def library_epsilon(event: Any, rounds: int, delta: float, accountant: str, relation: Any) -> float:
    if accountant == "rdp":
        library = dpa.rdp.RdpAccountant(neighboring_relation=relation)
    else:
        library = dpa.pld.PLDAccountant(neighboring_relation=relation)
    library.compose(event, rounds)
    return float(library.get_epsilon(delta))


@pytest.mark.parametrize(
    ("accountant", "sampling"), [("rdp", "poisson"), ("pld", "poisson"), ("rdp", "fixed_size")]
)
def test_epsilon_is_the_librarys_own_value(accountant: str, sampling: str) -> None:
    for population, sample, sigma, rounds, delta in [
        (100, 10, 1.1, 50, 1e-5),
        (40, 8, 0.7, 7, 1e-3),
    ]:
        dp = ClientDP(sigma, 1.0, delta, accountant, sampling)  # type: ignore[arg-type]
        ours = PrivacyAccountant(dp, population, sample).epsilon(rounds)
        if sampling == "poisson":
            event = dpa.PoissonSampledDpEvent(sample / population, dpa.GaussianDpEvent(sigma))
            relation = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
        else:  # replace-one neighbours: the sum moves by up to 2S
            gaussian = dpa.GaussianDpEvent(sigma / 2)
            event = dpa.SampledWithoutReplacementDpEvent(population, sample, gaussian)
            relation = dpa.NeighboringRelation.REPLACE_ONE
        expected = library_epsilon(event, rounds, delta, accountant, relation)
        assert ours == pytest.approx(expected, rel=1e-9, abs=0), (population, sigma, rounds)
        assert 0 < ours < math.inf
    assert PrivacyAccountant(ClientDP(0.0), 100, 10).epsilon(5) == math.inf


def test_every_clipped_update_has_norm_at_most_c_and_small_ones_are_untouched() -> None:
    torch.manual_seed(0)
    sent = {"w": torch.randn(5, 3, 4), "b": torch.randn(5, 4)}
    scale = torch.tensor([0.01, 0.5, 2.0, 10.0, 0.0]).view(5, 1)
    uploaded = {
        n: s + scale.view(5, *[1] * (s.dim() - 1)) * torch.randn_like(s) for n, s in sent.items()
    }
    clip = 1.0
    private = private_uploads(sent, uploaded, ClientDP(0.0, clip), torch.Generator())
    delta = torch.cat([(private[n] - sent[n]).flatten(1) for n in sent], 1)
    before = torch.cat([(uploaded[n] - sent[n]).flatten(1) for n in sent], 1)
    norms, raw = delta.norm(dim=1), before.norm(dim=1)
    assert (norms <= clip * (1 + 1e-6)).all(), norms
    clipped = raw > clip
    assert clipped.any() and (~clipped).any()
    torch.testing.assert_close(norms[clipped], torch.full_like(norms[clipped], clip))
    for n in sent:  # unclipped rows are the uploads themselves, bit for bit
        assert torch.equal(private[n][~clipped], uploaded[n][~clipped])
    assert clip_factors({"x": torch.zeros(2, 3)}, clip).tolist() == [1.0, 1.0]


class LargestFloat64(TorchDispatchMode):
    """Records the largest float64 tensor any operation creates."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
                self.numel = max(self.numel, t.numel())
        return out


def test_clip_factors_equal_the_float64_norm_of_the_flattened_update_without_its_copy() -> None:
    """The factors of the float64 norm of every client's whole update, also as the float32 the
    rounds multiply by (float32 norms change most of those in the last bit), from float64
    squares of at most CHUNK elements at a time."""
    generator = torch.Generator().manual_seed(0)
    clip = 1.0
    for clients in (1, 3, 7):
        updates = {  # the first tensor has more elements per client than a chunk
            "w": torch.randn(clients, 700, 1500, generator=generator) * 0.02,
            "b": torch.randn(clients, 3, generator=generator),
            "c": torch.randn(clients, 5, 2, 2, generator=generator) * 30,
        }
        if clients == 7:
            for u in updates.values():
                u[6] = 0  # a zero update keeps factor 1
        flat = torch.cat([u.flatten(1).double() for u in updates.values()], 1)
        reference = (clip / flat.pow(2).sum(1).sqrt()).clamp(max=1.0)
        with LargestFloat64() as largest:
            factors = clip_factors(updates, clip)
        assert largest.numel <= CHUNK < flat[0].numel(), largest.numel
        assert factors.dtype == torch.float64
        torch.testing.assert_close(factors, reference, rtol=1e-14, atol=0)
        assert torch.equal(factors.float(), reference.float()), clients
        assert (factors[: min(clients, 6)] < 1).all()
    assert factors[6] == 1.0  # the zero update


def no_training(method: FedAvg) -> None:
    """Clients upload what they received (Delta_k = 0): the server update is the noise alone."""

    def train_with_personal(round_idx: int, clients: torch.Tensor, start: Any) -> TrainResult:
        zero = torch.zeros(len(clients))
        return TrainResult(start, {}, zero, zero, {})

    method.train_with_personal = train_with_personal  # type: ignore[method-assign]


def test_fedavg_round_applies_the_mean_of_the_clipped_updates() -> None:
    dm = digits_data(6)
    clip = 0.05
    method = build(FedAvg, dm, clients_per_round=3, client_dp=ClientDP(0.0, clip))
    deltas, norms = round_updates_beyond(method, clip)
    for n, p in method.net.named_parameters():  # grad = w - (w + mean_k clip(Delta_k))
        clipped = deltas[n] * (clip / norms).view(-1, *[1] * (deltas[n].dim() - 1))
        torch.testing.assert_close(p.grad, -clipped.mean(0), rtol=1e-4, atol=1e-7)


def test_with_drops_the_fixed_denominator_counts_the_clients_that_did_not_report() -> None:
    """DP-FedAvg with unreliable clients: the server adds the clipped updates of the clients
    that reported back and divides by the fixed qN (its sensitivity does not depend on who
    arrived); a dropped client contributes nothing."""
    clip = 0.05
    method = build(
        FedAvg,
        digits_data(6),
        clients_per_round=4,
        client_dp=ClientDP(0.0, clip),
        conditions=Conditions(drop_rate=0.5),
    )
    r = round_with_drops(method)
    clients = method.sample_clients(r)
    arrived = method.arrived(clients, r)
    trained = capture_local_training(method)
    before = {n: p.detach().clone() for n, p in method.net.named_parameters()}
    method.run_round(r, clients)
    deltas = {n: trained[0].params[n] - before[n] for n in before}
    norms = torch.cat([d.flatten(1) for d in deltas.values()], 1).norm(dim=1)
    assert torch.equal(norms == 0, ~arrived), "a dropped client's upload is what it received"
    for n, p in method.net.named_parameters():
        factor = (clip / norms.clamp_min(clip)).view(-1, *[1] * (deltas[n].dim() - 1))
        expected = (deltas[n] * factor)[arrived].sum(0) / 4
        torch.testing.assert_close(p.grad, -expected, rtol=1e-4, atol=1e-7)


def test_noise_std_is_sigma_c_over_the_expected_clients() -> None:
    dm = digits_data(6)
    sigma, clip, per_round = 2.0, 0.1, 3
    dp = ClientDP(sigma, clip)
    method = build(FedAvg, dm, clients_per_round=per_round, client_dp=dp)
    no_training(method)
    method.run_round(0, method.sample_clients(0))
    noise = torch.cat([p.grad.flatten() for p in method.net.parameters()])
    assert len(noise) > 5000
    expected = sigma * clip / per_round
    assert noise.std().item() == pytest.approx(expected, rel=0.03)
    assert abs(noise.mean().item()) < 4 * expected / math.sqrt(len(noise))
    again = build(FedAvg, dm, clients_per_round=per_round, client_dp=dp)
    no_training(again)
    again.run_round(0, again.sample_clients(0))  # seeded by round: the same noise
    assert torch.equal(noise, torch.cat([p.grad.flatten() for p in again.net.parameters()]))


def test_pfedhn_noise_on_the_shared_hypernetwork_only() -> None:
    dm = digits_data(6)
    sigma, clip = 1.0, 0.5
    kwargs: dict[str, Any] = {"n_hidden": 1, "hidden_dim": 8, "clients_per_round": 3}
    method = build(PFedHN, dm, client_dp=ClientDP(sigma, clip), hn_max_grad_norm=None, **kwargs)
    generated = method.hnet(torch.tensor([0, 1, 2]))
    zero = {n: torch.zeros_like(t) for n, t in generated.items()}
    method.set_private_gradients(generated, zero, torch.Generator().manual_seed(0))
    body = torch.cat([p.grad.flatten() for p in method.hnet.body_parameters()])
    assert body.std().item() == pytest.approx(sigma * clip / 3, rel=0.03)
    assert torch.equal(
        method.hnet.embeddings.weight.grad, torch.zeros(6, method.hnet.embeddings.embedding_dim)
    )


def test_pfedlhn_clips_the_basis_every_clients_embedding_reads() -> None:
    """pFedLHN's v_i = c_i E: the basis E is read by every client, so it is clipped with the
    shared hypernetwork (its gradient bounded by S C / qN), and only the coefficients c_i are a
    client's own. Before, E counted among the embeddings and took every client's unclipped
    delta (gradient norm ~10 at S = 1e-6)."""
    dm = digits_data(6)
    clip = 1e-6
    method = build(PFedLHN, dm, client_dp=ClientDP(0.0, clip), clients_per_round=3)
    assert method.hp.n_embeds is not None
    generated = method.hnet(torch.tensor([0, 1, 2]))
    torch.manual_seed(0)
    delta = {n: 100 * torch.randn_like(t) for n, t in generated.items()}
    method.set_private_gradients(generated, delta, torch.Generator())
    bases = [m.basis.weight for m in method.hnet.modules() if hasattr(m, "coefficients")]
    assert bases and all(b.grad is not None for b in bases)
    personal = {id(p) for p in method.hnet.personal_parameters()}
    assert not any(id(b) in personal for b in bases)
    shared = [p.grad.flatten() for p in method.hnet.parameters() if id(p) not in personal]
    assert float(torch.cat(shared).norm()) <= clip * (1 + 1e-4)  # sum of 3 clipped / qN = 3


def test_pfedhn_clips_each_clients_contribution_and_not_the_embeddings() -> None:
    dm = digits_data(6)
    kwargs: dict[str, Any] = {"n_hidden": 1, "hidden_dim": 8, "clients_per_round": 3}
    method = build(PFedHN, dm, client_dp=ClientDP(0.0, 1.0), hn_max_grad_norm=None, **kwargs)
    generated = method.hnet(torch.tensor([0, 1, 2]))
    torch.manual_seed(0)
    scale = torch.logspace(-2, 0, 3)
    delta = {
        n: scale.view(-1, *[1] * (t.dim() - 1)) * torch.randn_like(t) for n, t in generated.items()
    }
    body = list(method.hnet.body_parameters())
    embeddings = list(method.hnet.embedding_parameters())
    contributions, norms = [], []  # J_i^T delta_i one client at a time
    for i in range(3):
        surrogate = sum((generated[n][i] * delta[n][i]).sum() for n in generated)
        c = torch.autograd.grad(surrogate, body, retain_graph=True)
        contributions.append(c)
        norms.append(float(torch.cat([x.flatten() for x in c]).norm()))
    mean = sum((generated[n] * delta[n]).sum() for n in generated) / 3
    expected = torch.autograd.grad(mean, embeddings, retain_graph=True)
    clip = sorted(norms)[1]
    method.client_dp = ClientDP(0.0, clip)
    method.set_private_gradients(generated, delta, torch.Generator())
    factors = [min(1.0, clip / n) for n in norms]
    assert min(factors) < 1 and max(factors) == 1, "some clients clipped, some not"
    for k, p in enumerate(body):  # (sum_i f_i J_i^T delta_i) / qN
        parts = [f * c[k] / 3 for f, c in zip(factors, contributions, strict=True)]
        scale = max(float(x.abs().max()) for x in parts)  # float32 rounding of the backward
        torch.testing.assert_close(p.grad, sum(parts), rtol=1e-5, atol=1e-5 * scale)
    for p, e in zip(embeddings, expected, strict=True):  # unclipped, weights 1 / C
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(("cls", "max_grad_norm"), [(PFedHN, None), (PFedHN, 1e6), (PFedLHN, None)])
def test_hypernetwork_without_noise_and_clip_is_the_run_without_dp_bit_for_bit(
    cls: type[PFedHN], max_grad_norm: float | None
) -> None:
    """The clipped sum is the gradient of the surrogate with weights f_i / qN (one backward),
    so with f_i = 1 it is pFedHN's own; an inactive hn_max_grad_norm (its two parts clipped
    apart under DP) changes nothing."""

    def trained(**kwargs: Any) -> PFedHN:
        dm = digits_data(6)
        method = build(
            cls,
            dm,
            n_hidden=1,
            hidden_dim=8,
            clients_per_round=3,
            hn_max_grad_norm=max_grad_norm,
            **kwargs,
        )
        fit(method, dm, rounds=3)
        return method  # type: ignore[return-value]

    plain, private = trained(), trained(client_dp=NO_DP)
    assert private.record.extra_results["privacy"]["epsilon"] == math.inf
    assert_same_trained_state(plain, private, store=False)
    noisy = trained(client_dp=ClientDP(1e-3, 10.0))  # the check sees a changed run
    assert not torch.equal(noisy.state_dict()["hnet.mlp.0.weight"], plain.hnet.mlp[0].weight)


def test_pfedhn_embeddings_take_the_arrived_clients_weights_under_dp_as_without() -> None:
    """With drops, an arrived client's embedding v_i (personal, not clipped) gets the gradient
    it gets without DP, 1/|arrived| of its J_i^T delta_i, not 1/C; the shared part, where DP's
    denominator is the fixed qN, differs."""

    def round_gradients(**kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        method = build(
            PFedHN, digits_data(6), clients_per_round=4, conditions={"drop_rate": 0.5}, **kwargs
        )
        r = round_with_drops(method)
        one_round(method, r)
        return method.hnet.embeddings.weight.grad, method.hnet.mlp[0].weight.grad

    embeddings, shared = round_gradients()
    private_embeddings, private_shared = round_gradients(client_dp=NO_DP)
    assert embeddings.abs().sum() > 0
    torch.testing.assert_close(private_embeddings, embeddings, rtol=1e-6, atol=0)
    assert not torch.allclose(private_shared, shared)


@pytest.mark.parametrize("cls", [FedAvg, FedPer])
def test_no_noise_and_no_clip_is_the_run_without_dp_bit_for_bit(cls: type[FedAvg]) -> None:
    def trained(**kwargs: Any) -> FedAvg:
        # equal client sizes: FedAvg's sample weights are then DP-FedAvg's 1 / (qN)
        dm = digits_data(6, partition=IID(), val_fraction=0.15)
        assert len(set(dm.num_samples("train").tolist())) == 1
        method = build(cls, dm, clients_per_round=3, vectorize=True, **kwargs)
        fit(method, dm, rounds=3)
        return method  # type: ignore[return-value]

    plain, private = trained(), trained(client_dp=NO_DP)
    assert private.record.extra_results["privacy"]["epsilon"] == math.inf
    assert_same_trained_state(plain, private)
    noisy = trained(client_dp=ClientDP(1e-3, 10.0))  # the check sees a changed run
    assert not torch.equal(noisy.net.conv1.weight, plain.net.conv1.weight)  # shared by both


def test_resume_is_exact_with_dp_and_epsilon_is_logged_every_round(tmp_path: Path) -> None:
    config = CONF / "fedavg.yaml"
    dp = "--model.init_args.client_dp={noise_multiplier: 1.0, clip_norm: 0.3, delta: 1e-4}"
    assert_resume_is_exact(config, tmp_path, dp)
    runs = [run_dir(tmp_path / name, config) for name in ("straight", "resumed")]
    straight, resumed = (json.loads((r / "results.json").read_text()) for r in runs)
    assert resumed["privacy"] == straight["privacy"]
    q = 2 / 4  # clients_per_round / num_clients of the config
    expected = PrivacyAccountant(ClientDP(1.0, 0.3, 1e-4), 4, 2).epsilon(6)
    assert straight["privacy"]["epsilon"] == expected and straight["privacy"]["rounds"] == 6
    assert straight["privacy"]["sampling_rate"] == q
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs[0])).Reload()
    logged = {e.step: e.value for e in events.Scalars(EPSILON_KEY)}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    assert logged[6] == pytest.approx(expected)
    assert logged[1] < logged[3] < logged[6]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--model.init_args.client_dp.noise_multiplier=-0.5"], "client_dp.noise_multiplier"),
        (["--model.init_args.client_dp.clip_norm=0"], "client_dp.clip_norm"),
        (["--model.init_args.client_dp.clip_norm=-1"], "client_dp.clip_norm"),
        (["--model.init_args.client_dp.delta=0"], "client_dp.delta"),
        (["--model.init_args.client_dp.delta=1"], "client_dp.delta"),
        (["--model=FedProto", "--model.init_args.client_dp={}"], "FedProto"),
        (["--model=Local", "--model.init_args.client_dp={}"], "Local"),
    ],
    ids=lambda v: str(v),
)
def test_bad_dp_input_is_refused_before_any_folder_exists(
    extra: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [
        "fit",
        f"--config={CONF / 'fedavg.yaml'}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
    ]
    code, err = run_cli([*args, *extra], capsys)
    assert code == 2, err
    assert named in err, err
    assert "Traceback" not in err
    assert not list(tmp_path.rglob("version_*")), "a run folder was created"


def test_methods_without_a_dp_round_and_unprivatizable_settings_are_refused() -> None:
    dm = digits_data(6)
    for cls in (FedProto, Local):
        with pytest.raises(ConfigError, match=cls.__name__):
            build(cls, dm, client_dp=ClientDP())
    with pytest.raises(ConfigError, match="hn_update"):
        build(PFedHN, dm, client_dp=ClientDP(), hn_update="per_client", n_hidden=1)
    with pytest.raises(ConfigError, match="batch-norm"):
        build(FedAvg, dm, net_args={"batch_norm": True}, client_dp=ClientDP())
    with pytest.raises(ConfigError, match="sampling"):
        ClientDP(accountant="pld", sampling="fixed_size")


def test_dp_rounds_vectorized_equal_client_by_client() -> None:
    assert_vectorized_equals_sequential(FedPer, client_dp=ClientDP(1.0, 0.5))
