"""Client-level differential privacy: DP-FedAvg (McMahan et al., "Learning Differentially
Private Recurrent Language Models", ICLR 2018), and its privacy accounting by ``dp-accounting``.

Each round the server clips every sampled client's update Delta_k (the whole upload, flattened)
to L2 norm S, sums the clipped updates, adds Gaussian noise N(0, z^2 S^2 I) to the sum and
divides by the expected number of clients qN: the paper's fixed-denominator estimator f~_f with
every weight w_k = 1 (so W = N and qW = qN). Every parameter the server releases is then a
post-processing of this noisy mean, and the rounds compose as the subsampled Gaussian mechanism
that :class:`PrivacyAccountant` accounts for. Guarantees are client-level: neighbouring datasets
differ in one client's whole data.

A method's round that implements this is marked :func:`privatizes` (with what it privatizes);
:meth:`ClientDP.check` refuses every other method with a ConfigError naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch
from torch import Tensor

from lightning_pfl.errors import ConfigError
from lightning_pfl.models.hypernetwork import set_delta_gradients

if TYPE_CHECKING:
    from lightning_pfl.methods.base import FederatedMethod

KEY = "model.init_args.client_dp"
EPSILON_KEY = "privacy/epsilon"  # logged every round (TensorBoard) at step = rounds completed
F = TypeVar("F", bound=Callable[..., Any])
CHUNK = 1 << 16  # elements whose float64 squares squared_norms forms at once (512 KiB)

# Why each method without a DP round has none: what each client uploads, and why DP-FedAvg
# (one clipped, noised sum per round, weights fixed in advance) does not cover it or is not
# implemented for it (docs/privacy.md has the table; tests/test_privacy_methods.py checks that
# every library method either privatizes its round or is here).
REFUSED: dict[str, tuple[str, str]] = {
    "Local": ("nothing", "every client trains alone, so there is no release to privatize"),
    "HeterogeneousLocal": (
        "nothing",
        "every client trains alone, so there is no release to privatize",
    ),
    "FedProto": (
        "its class prototypes (mean features per class) and their class counts, not a model update",
        "the server averages the prototypes per class weighted by those counts, a per-class, "
        "data-dependent weighting that DP-FedAvg's clipped sum with fixed weights does not cover",
    ),
    "FedGH": (
        "the mean representation of each of its classes with the class ids, not a model update",
        "the server takes one SGD step of its header per (representation, class) pair, a "
        "per-client use that DP-FedAvg's clipped sum does not cover",
    ),
    "FedPAC": (
        "its body update plus its classifier head, its class centroids with counts and its "
        "feature statistics",
        "the server gives each client a combination of the other clients' heads with weights "
        "solved from their statistics: per-client uses beyond the noisy mean of the bodies",
    ),
    "FedFomo": (
        "its whole local model",
        "the server sends it as it is to other clients, who weight it by their own validation "
        "loss: a per-client release that only noise on each model (local DP) could cover",
    ),
    "FedU": (
        "its whole local model",
        "its neighbours are pulled towards it as it is: a per-client release that only noise "
        "on each model (local DP) could cover",
    ),
    "FedSimSup": (
        "its personalized model",
        "the server keeps it as trained and mixes it into the other clients' models: a "
        "per-client release, not a noisy sum",
    ),
    "HypCluster": (
        "its update and, through its losses, the cluster it joins",
        "the cluster choice is a function of its data that routes its update to one of q "
        "models: it would need a private selection as well as noise per cluster",
    ),
    "PFedLA": (
        "its delta, and the server keeps its model",
        "the server mixes every client's kept model layer by layer into each client's model "
        "with learned per-client weights: client j's model reaches client i in person, not "
        "through a noisy sum",
    ),
    "APPLE": (
        "its core model",
        "every client downloads all N core models as they are and mixes them with its own "
        "weights: a per-client release that only noise on each model (local DP) could cover",
    ),
    "CCVR": (
        "its update (FedAvg's round) and, for the calibration, its per-class feature means "
        "and covariances",
        "the server fits the calibrated classifier on those statistics of every training "
        "client, not a sample, at each evaluation: a release per evaluation without "
        "subsampling, which would need its own noise and its own entry in the accountant (not "
        "implemented)",
    ),
    "CFL": (
        "its update",
        "the server splits clusters by the cosine similarities and norms of the individual "
        "updates: per-client uses of each update, not their noisy sum",
    ),
    "FedAMP": (
        "its whole personalized model",
        "the server builds each client's cloud model from its similarity to every other "
        "client's model: a per-client use that a noisy sum does not cover",
    ),
    "FedAS": (
        "its body update and its Fisher-information trace",
        "the server weights the updates by the Fisher traces, computed from each client's data: "
        "DP-FedAvg's weights are fixed in advance, and the trace is a second upload",
    ),
    "FedAvgPoC": (
        "its update, and its loss on the global model for the selection",
        "it picks the clients with the highest loss, not a uniform sample, so the accountant's "
        "subsampling bound does not hold",
    ),
    "FedGen": (
        "its update and its label counts",
        "the server trains its generator on each client's uploaded classifier head and the "
        "label counts: per-client uses that a noisy sum does not cover",
    ),
    "FedMGDAPlus": (
        "its update",
        "the server's step is the min-norm combination of the individual (normalized) updates, "
        "solved from their Gram matrix: a nonlinear function of each update, not a noisy sum",
    ),
    "FedNova": (
        "its update and its number of local steps (its a_i)",
        "the server divides the update by a_i, weights it by its sample share p_i and rescales "
        "by tau_eff = sum_i p_i a_i, all functions of the clients' data sizes: DP-FedAvg's "
        "weights are fixed in advance",
    ),
    "Floco": (
        "its update and, in round tau, the update of its simplex endpoints",
        "in round tau every client (not a sample) uploads that update and the server places it "
        "on the simplex from its own: a per-client release, without subsampling, that the "
        "noisy sum of the other rounds does not cover",
    ),
    "QFFL": (
        "its update and h_k, from its loss F_k on the global model and its update's norm",
        "the server's step is sum_k F_k^q Delta w_k / sum_k h_k: each client's weight depends "
        "on its loss and on the others', so no clip bounds one client's effect on the step",
    ),
}


@dataclass(frozen=True)
class ClientDP:
    """Client-level DP of the uploaded updates (DP-FedAvg), given as ``model.init_args.client_dp``.

    Attributes:
        noise_multiplier: z (the brief's sigma): the noise added to the sum of clipped
            updates has standard deviation z * S. 0: no noise (no privacy: epsilon = inf).
        clip_norm: S (the brief's C): each client's update is scaled to L2 norm at most S
            (flat clipping over every uploaded tensor); ``.inf``: no clipping.
        delta: the delta at which epsilon is reported.
        accountant: ``rdp`` (Renyi DP, Mironov et al.) or ``pld`` (privacy loss distributions,
            tighter, slower: about 0.2-1 s of CPU per round to compose on our 2-core machine).
        sampling: what the accountant assumes of client sampling. ``poisson`` (the paper's):
            each client joins a round independently with probability q = clients_per_round / N,
            add-or-remove-one neighbours. ``fixed_size`` (what the simulation does: exactly
            clients_per_round clients drawn without replacement): Wang et al.'s bound for
            sampling without replacement, replace-one neighbours (sensitivity 2S, so the
            effective noise multiplier is z / 2); RDP only.
    """

    noise_multiplier: float = 1.0
    clip_norm: float = 1.0
    delta: float = 1e-5
    accountant: Literal["rdp", "pld"] = "rdp"
    sampling: Literal["poisson", "fixed_size"] = "poisson"

    def __post_init__(self) -> None:
        problems = []
        if not self.noise_multiplier >= 0 or math.isinf(self.noise_multiplier):
            problems.append(f"{KEY}.noise_multiplier = {self.noise_multiplier!r} must be >= 0")
        if not self.clip_norm > 0:
            problems.append(f"{KEY}.clip_norm = {self.clip_norm!r} must be > 0 (.inf: no clip)")
        if not 0 < self.delta < 1:
            problems.append(f"{KEY}.delta = {self.delta!r} must be > 0 and < 1")
        if self.accountant == "pld" and self.sampling == "fixed_size":
            problems.append(
                f"{KEY}.sampling = 'fixed_size' has no PLD accounting in dp-accounting; "
                "use accountant: rdp or sampling: poisson"
            )
        if problems:
            raise ConfigError(
                "Invalid client-level DP setting: "
                + "; ".join(problems)
                + ". Change the value in the config file or on the command line."
            )

    def check(self, method: FederatedMethod) -> str:
        """What ``method``'s round privatizes; a ConfigError naming the method if it has no
        DP round (its uploads are not model updates, or its round is not implemented with DP)."""
        what = getattr(type(method).run_round, "privatizes", None)
        if what is None:
            name = type(method).__name__
            uploads, why = REFUSED.get(
                name,
                (
                    "what its own round defines",
                    "that round (it overrides a privatized one, or is new) is not marked as "
                    "privatizing anything",
                ),
            )
            raise ConfigError(
                f"{KEY}: {name} does not support client-level DP. Each client uploads "
                f"{uploads}; {why} (docs/privacy.md). Remove client_dp, or use a method whose "
                f"round privatizes its uploads: {', '.join(privatizing_methods())}."
            )
        return str(what)


def privatizing_methods() -> list[str]:
    """Names of the methods whose round applies :class:`ClientDP` (:func:`privatizes`)."""
    from lightning_pfl.methods import method_classes

    return sorted(
        name
        for name, cls in method_classes().items()
        if getattr(cls.run_round, "privatizes", None) is not None
    )


def privatizes(what: str) -> Callable[[F], F]:
    """Mark a ``run_round`` that applies :class:`ClientDP` when configured, saying what it
    privatizes. An override of a marked round is unmarked until it says so itself."""

    def mark(run_round: F) -> F:
        run_round.privatizes = what  # type: ignore[attr-defined]
        return run_round

    return mark


def squared_norms(updates: Mapping[str, Tensor]) -> Tensor:
    """||Delta_k||^2 of every client k (float64 ``[K]``): the squares over all of ``updates``
    (stacked ``[K, ...]``) summed in float64. No host sync.

    The float64 squares are formed ``CHUNK`` elements (of all clients together) at a time,
    never for a whole update: MH-pFedHN clips [5, 13.5 M] shared gradients, whose float64
    copies took 1 GB and most of a second. Float32 norms, though faster, would change most of
    the float32 factors in their last bit (tests/test_privacy.py), and with them every DP run."""
    total = None
    for u in updates.values():
        flat = u.flatten(1)
        for part in flat.split(max(1, CHUNK // max(1, len(flat))), dim=1):
            squares = part.double().square().sum(1)
            total = squares if total is None else total + squares
    assert total is not None, "squared_norms needs at least one tensor"
    return total


def clip_factors(
    updates: Mapping[str, Tensor], clip_norm: float, other_squares: Tensor | None = None
) -> Tensor:
    """min(1, S / ||Delta_k||) of every client k (float64 ``[K]``): the norm is over all of
    ``updates`` (stacked ``[K, ...]``) and, for a client whose upload has more parts clipped
    with the same factor, ``other_squares`` (their float64 squared norms, ``[K]``): one joint
    norm sqrt(||Delta_k||^2 + other_k). A zero update keeps factor 1. No host sync."""
    total = squared_norms(updates)
    if other_squares is not None:
        total = total + other_squares
    return (clip_norm / total.sqrt()).clamp(max=1.0)


def clip_updates(updates: Mapping[str, Tensor], clip_norm: float) -> dict[str, Tensor]:
    """Every client's update scaled to L2 norm at most ``clip_norm`` (one vectorized pass)."""
    factors = clip_factors(updates, clip_norm)
    return {n: u * factors.to(u.dtype).view(-1, *([1] * (u.dim() - 1))) for n, u in updates.items()}


def gaussian_noise(like: Mapping[str, Tensor], std: float, generator: torch.Generator) -> dict:
    """N(0, std^2) tensors shaped as ``like``'s, drawn from ``generator`` in a fixed order."""
    return {
        n: torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype) * std
        for n, t in like.items()
    }


def set_private_delta_gradients(
    shared: Sequence[torch.nn.Parameter],
    personal: Sequence[torch.nn.Parameter],
    generated: Sequence[Tensor],
    deltas: Sequence[Tensor],
    owners: Sequence[Tensor],
    count: int,
    dp: ClientDP,
    expected: int,
    generator: torch.Generator,
    max_norm: float | None,
    other_squares: Tensor | None = None,
    personal_weights: Tensor | None = None,
) -> Tensor:
    """DP-FedAvg on a hypernetwork's ``shared`` parameters: grad = (sum_i f_i c_i +
    N(0, z^2 S^2 I)) / qN with c_i = (d g_i / d shared)^T delta_i and f_i = min(1, S / ||c_i||),
    the norm over every shared tensor; grad of ``personal`` as without DP (weights
    ``personal_weights`` ``[C]``, default 1 / C). Returns the f_i (float64 ``[C]``).

    A client that uploads more than its deltas (FedTP: its shared tensors' update Delta x_i)
    passes their squared norms as ``other_squares`` (``[C]``, float64: :func:`squared_norms`):
    f_i = min(1, S / sqrt(||c_i||^2 + other_i)) then bounds the client's whole release, and the
    caller clips the other part with the returned f_i (:func:`private_uploads`' ``factors``).

    ``generated[k]`` (stacked rows with their graph) holds the rows of clients ``owners[k]``
    (indices into the round's ``count`` = C clients), ``deltas[k]`` their deltas, ``expected``
    is qN. The
    norms come from one batched backward (batch b of the output gradients holds client b's
    deltas in its rows only); the clipped sum is then the gradient of the surrogate with
    weights f_i / qN, one backward, so that with f_i = 1 (and qN = C) it is the gradient
    without DP bit for bit. The noise is on every shared tensor, also one no client of the
    round read. Each part is then clipped to ``max_norm`` on its own, so that the shared step
    does not depend on the personal part's unclipped gradients."""
    rows = torch.eye(count, device=generated[0].device)
    batched = [
        rows[:, o].view(count, len(o), *([1] * (d.dim() - 1))) * d.to(g.dtype).unsqueeze(0)
        for o, g, d in zip(owners, generated, deltas, strict=True)
    ]
    per_client = torch.autograd.grad(
        list(generated),
        list(shared),
        batched,
        retain_graph=True,
        allow_unused=True,
        is_grads_batched=True,
    )
    used = {str(i): g for i, g in enumerate(per_client) if g is not None}
    factors = clip_factors(used, dp.clip_norm, other_squares)
    weights = factors.to(generated[0].dtype) * (1.0 / expected)
    set_delta_gradients(shared, generated, deltas, [weights[o] for o in owners], None, True)
    if dp.noise_multiplier > 0:
        std = dp.noise_multiplier * dp.clip_norm
        noise = gaussian_noise({str(i): p for i, p in enumerate(shared)}, std, generator)
        for i, p in enumerate(shared):
            scaled = noise[str(i)] / expected
            p.grad = scaled if p.grad is None else p.grad + scaled
    if personal:  # PeFLL has no personal parameter
        if personal_weights is None:
            personal_weights = torch.full((count,), 1.0 / count, device=generated[0].device)
        shares = [personal_weights[o] for o in owners]
        set_delta_gradients(personal, generated, deltas, shares, None)
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(shared, max_norm)
        if personal:
            torch.nn.utils.clip_grad_norm_(personal, max_norm)
    return factors


def private_uploads(
    sent: Mapping[str, Tensor],
    uploaded: Mapping[str, Tensor],
    dp: ClientDP,
    generator: torch.Generator,
    factors: Tensor | None = None,
) -> dict[str, Tensor]:
    """Uploads whose plain mean (weights 1/K over the K rows) is the DP-FedAvg estimate
    ``sent + (sum_k clip(Delta_k) + N(0, z^2 S^2 I)) / K`` with Delta_k = uploaded_k - sent_k.
    ``factors``: the clip factors f_k ``[K]`` of a joint clip over these and other uploads
    (:func:`set_private_delta_gradients`' result), instead of min(1, S / ||Delta_k||).

    K is the fixed denominator qN (the caller passes exactly K = qN rows: the simulation
    samples clients_per_round = qN clients). Clipped rows become ``sent + clip(Delta_k)``;
    rows the clip leaves alone are returned as uploaded (bit for bit), and the noise is added to
    the first row, so that the sum gets it once: with z = 0 and S = inf the uploads are
    unchanged and any method's aggregation gives the same result as without DP.
    """
    deltas = {n: u - sent[n] for n, u in uploaded.items()}
    if factors is None:
        factors = clip_factors(deltas, dp.clip_norm)
    private = {}
    for n, u in uploaded.items():
        f = factors.to(u.dtype).view(-1, *([1] * (u.dim() - 1)))
        private[n] = torch.where(f < 1, sent[n] + f * deltas[n], u)
    if dp.noise_multiplier > 0:
        first = {n: u[0] for n, u in private.items()}
        noise = gaussian_noise(first, dp.noise_multiplier * dp.clip_norm, generator)
        for n, u in private.items():
            private[n] = torch.cat([(u[0] + noise[n]).unsqueeze(0), u[1:]])
    return private


class PrivacyAccountant:
    """epsilon at ``dp.delta`` after T rounds of the subsampled Gaussian mechanism, by
    ``dp-accounting`` (its RDP or PLD accountant, as ``dp.accountant`` says).

    The per-round privacy loss is computed once; epsilon(T) composes it T times, which is what
    the library's accountant does for ``compose(event, T)`` (tests/test_privacy.py checks the
    values are the library's), so the epsilon of a round is a function of T alone: a resumed
    run reports what an uninterrupted one does.
    """

    def __init__(self, dp: ClientDP, population: int, sample_size: int) -> None:
        import dp_accounting as dpa

        self.dp = dp
        self.sampling_rate = sample_size / population
        self.event = round_event(dp, population, sample_size)
        self._unit: Any = None
        if dp.noise_multiplier == 0:
            return
        if dp.accountant == "rdp":
            relation = (
                dpa.NeighboringRelation.REPLACE_ONE
                if dp.sampling == "fixed_size"
                else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
            )
            unit = dpa.rdp.RdpAccountant(neighboring_relation=relation)
            unit.compose(self.event)
            # The accountant keeps the RDP of the composed events per order; T rounds are T
            # times one round's (RdpAccountant.compose adds count * rdp).
            self._unit = (unit._orders, unit._rdp)
        else:
            from dp_accounting.pld import pld_privacy_accountant as pld

            self._unit = pld.PLD.from_gaussian_mechanism(
                standard_deviation=dp.noise_multiplier,
                value_discretization_interval=1e-4,
                sampling_prob=self.sampling_rate,
            )

    def epsilon(self, rounds: int) -> float:
        """epsilon at ``dp.delta`` after ``rounds`` rounds (inf without noise, 0 before any)."""
        if rounds == 0:
            return 0.0
        if self._unit is None:
            return math.inf
        if self.dp.accountant == "rdp":
            from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

            orders, rdp = self._unit
            return float(compute_epsilon(orders, rounds * rdp, self.dp.delta)[0])
        from dp_accounting.pld import pld_privacy_accountant as pld

        composed = pld.PLD.identity(value_discretization_interval=1e-4).compose(
            self._unit.self_compose(rounds)
        )
        return float(composed.get_epsilon_for_delta(self.dp.delta))

    def summary(self, rounds: int, privatized: str) -> dict[str, Any]:
        """The ``privacy`` entry of ``results.json``."""
        return {
            "epsilon": self.epsilon(rounds),
            "delta": self.dp.delta,
            "rounds": rounds,
            "noise_multiplier": self.dp.noise_multiplier,
            "clip_norm": self.dp.clip_norm,
            "sampling_rate": self.sampling_rate,
            "accountant": self.dp.accountant,
            "sampling": self.dp.sampling,
            "privatized": privatized,
        }


def round_event(dp: ClientDP, population: int, sample_size: int) -> Any:
    """One round as a ``dp_accounting`` event: the Gaussian mechanism on a client sample."""
    import dp_accounting as dpa

    if dp.sampling == "fixed_size":
        # Replacing one client's update by another moves the sum by up to 2S.
        gaussian = dpa.GaussianDpEvent(dp.noise_multiplier / 2)
        return dpa.SampledWithoutReplacementDpEvent(population, sample_size, gaussian)
    return dpa.PoissonSampledDpEvent(
        sample_size / population, dpa.GaussianDpEvent(dp.noise_multiplier)
    )
