"""MH-pFedHN, MH-pFedHNG and MH-pFedHNGD (Zhang et al., "Hypernetworks for Model-Heterogeneous
Personalized Federated Learning"): one server hypernetwork for clients of any architecture.

The code is split the way the protocol is. The *client side* (:meth:`MHPFedHN.client_update`)
knows each client's architecture, maps a flat vector onto it (:class:`FlatCodec`, a fixed
parameter order), trains it and returns the flat delta. The *server side* (``self.hnet``, a
:class:`MultiHeadHyperNetwork` built from the clients' parameter counts, and
:meth:`MHPFedHN.server_gradients`) only ever sees counts, flat vectors and flat deltas.

The client parts that the paper's tables switch on one at a time (Table 13's local layers,
Table 14's constrained clients) and the batch norm of evaluation are in
:mod:`lightning_pfl.methods.mh_parts`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import torch
from torch import Tensor

from lightning_pfl.assignment import GroupShare, NetworkGroups
from lightning_pfl.engine import (
    Architecture,
    ClientBatches,
    LossFn,
    Params,
    cross_entropy_loss,
    derive_seed,
    weighted_cross_entropy,
)
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.base import FederatedMethod
from lightning_pfl.methods.mh_parts import (
    FixedLayers,
    client_subset,
    hold_fixed,
    last_layers,
    precise_batch_norm,
    shared_and_personal,
)
from lightning_pfl.models.hypernetwork import set_delta_gradients, steps_in_turn
from lightning_pfl.models.multihead_hypernetwork import (
    FlatCodec,
    HeadSharing,
    MultiHeadHyperNetwork,
)
from lightning_pfl.novel_adaptation import NovelAdaptation
from lightning_pfl.privacy import privatizes, set_private_delta_gradients
from lightning_pfl.streams import CONSTRAINED_STREAM, ORDER_STREAM
from lightning_pfl.validation import (
    Momentum,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
    UnitInterval,
)

Fraction = Annotated[float, Range(gt=0, le=1)]
# Key of a per-client context tensor handed to the local loss next to a model's own tensors:
HOLDS = "holds_global"  # [C] bool: the client holds the global model (distils from it)


# the round's uploads, group by group: (kind, positions among the round's clients, generated
# [C_j, K_j] with its graph, deltas)
Sent = list[tuple[str, list[int], Tensor, Tensor]]


class MHPFedHN(FederatedMethod):
    """MH-pFedHN: a multi-head hypernetwork generates every client's (heterogeneous) model.

    Round: the server generates a client's flat vector g_i = h(v_i; phi); the client maps g_i
    onto its model, trains it locally and uploads delta_i = g_i - g~_i (in the flat
    coordinates, top-``upload_fraction`` entries by magnitude only); the server's gradient from
    delta_i is (d g_i / d(phi, v))^T delta_i, the gradient of the surrogate
    <g_i(phi, v), delta_i>, clipped to ``hn_max_grad_norm`` before each Adam step. By
    ``hn_update``:

    - ``sequential`` (the authors' code; default): the round's clients take turns in a seeded
      random order; each one's model is generated from phi as the previous client's step left
      it, trained, and its delta gives one Adam step: C steps per round, clients one at a time.
    - ``per_client``: every client's model is generated from the round's phi and trained
      (one vmapped group per architecture); the server then takes one step per client, in the
      seeded random order, with that client's gradient at the round's phi (pFedHN's
      ``per_client``, there in client order).
    - ``mean``: as ``per_client``, then one step with grad(phi, v) = (1/C) sum_i
      (d g_i / d(phi, v))^T delta_i (ours before issue 43).

    The order is a permutation drawn from (seed, round) alone, so resumed runs and DDP ranks
    step alike.

    With unreliable clients (``conditions``, docs/conditions.md) the server steps only from
    the clients that reported back: ``sequential`` and ``per_client`` skip a dropped client's
    step (the others keep their drawn order), ``mean`` averages the arrived clients' gradients
    with equal weights, and a round where none arrived sets no gradient. A dropped client took
    no local step, so its batch-norm statistics and local layers come back from local training
    as they were.

    With ``client_dp`` (``hn_update: mean`` only; docs/privacy.md) the server privatizes the
    update of the hypernetwork's shared part phi_s (the MLP and every head more than one client
    reads): each client's contribution c_i = (d g_i / d phi_s)^T delta_i is clipped to norm S
    as one vector, and grad(phi_s) = (sum_i clip(c_i) + N(0, z^2 S^2 I)) / qN. The slot
    embeddings and a head only one client reads are that client's personal parameters and get
    the gradient of the round without DP (:meth:`private_server_gradients`).

    Every behaviour that differs from the paper is an option whose default is the paper's (see
    the "Deviations from the paper" table of docs/methods.md).

    Architectures are assigned to clients by ``architectures`` (see
    :class:`~lightning_pfl.assignment.NetworkGroups`): ``{name: {net, net_args, share|clients}}``;
    accuracy per architecture is logged as ``{val,test}/arch_<name>/acc``. Batch-norm running
    statistics stay on the client (per-client state, never generated nor uploaded); see
    ``recalibrate_batch_norm`` for the statistics a client evaluates its generated model with.

    Args:
        architectures: the clients' architectures (default: every client uses ``net``).
        output_size: N, outputs of one head layer; client i has tau_i = ceil(K_i / N) slots.
        embed_dim: embedding size (paper: 64).
        hidden_dim: MLP width (paper: 128).
        n_layers: MLP layers, each with a ReLU (paper: 3, 64 -> 128 -> 128 -> 128).
        embed_std: standard deviation of the embeddings' initialization (paper: 0.002).
        head_sharing: ``tau`` (paper: equal tau share a head), ``client`` (a head per client)
            or ``none`` (one output layer for every slot): the paper's Table 3 study.
        parametrization: ``raw`` (the paper, default): theta = g, PyTorch's default head init;
            ``standardized`` (ours): heads start with unit-variance outputs and a client maps
            flat value g of tensor t to mu_t + sigma_t g, with mu_t, sigma_t its own
            initialization's mean and std (known only to the client), so every layer starts at
            its usual scale. The server's gradient in g is then sigma_t times the gradient in
            theta, so its step on tensor t is rescaled by sigma_t^2 relative to ``raw`` (for
            the LeNet-style CNN on CIFAR-100, sigma^2 of conv1's weight is ~72x fc1's).
        upload_fraction: share of each delta's entries uploaded (largest magnitudes; the rest
            count as 0); the paper's Table 12 uses 0.3. Uploads then count values + int32 indices.
        local_layers: the paper's Table 13: every client keeps its model's last
            ``local_layers`` layers to itself. The hypernetwork generates only the other
            tensors (K_i counts only those); the kept ones start from the architecture's seeded
            initialization, train at each of the client's visits and persist across rounds,
            and are never sent. 0 (default): the whole model is generated. A layer is a module
            owning parameters, in the network's parameter order (a batch-norm layer counts as
            one); every architecture must keep at least one generated layer.
        frozen_clients: resource-constrained clients (the paper's Table 14), which train only
            part of their model: a share of all clients (drawn once, seeded) or a list of client
            ids. Their last ``frozen_layers`` generated layers keep the generated values
            throughout local training (their delta is exactly 0); the rest trains as usual and
            the server update is unchanged. Within an architecture's vmapped group the choice
            is a per-client mask (no per-client loop); the fixed tensors' gradients are still
            computed (as zeros), so the saving is simulated, not realized.
        frozen_layers: how many of the last (generated) layers a constrained client holds fixed
            (Table 14 freezes the last layers); layers counted as for ``local_layers``; every
            architecture must keep at least one layer trainable.
        recalibrate_batch_norm: before evaluating, each client re-estimates its batch-norm
            statistics for the model it is evaluated with (the current generated one) on one
            pass over its own training data: the mean of the per-batch statistics, in training
            mode, without gradients; nothing is stored, trained or sent. ``False``: it evaluates
            with the running statistics of its last local training, which belong to the weights
            it trained, not to the ones generated since (the paper does not say which; on our
            FashionMNIST setting the stale statistics cost the generated ResNet-10 ~30 points).
        hn_lr: Adam learning rate of phi and the embeddings (paper: 2e-4).
        hn_weight_decay: Adam weight decay.
        hn_max_grad_norm: clip of the server gradient norm (paper: 50; None: off), of each
            step's gradient.
        hn_update: the server update per round (see above): ``sequential`` (the authors' code,
            ``MH-pFedHN.py`` and ``MH-pFedHNGD.py``: ``for client_id in random.sample(...)``:
            generate, train, one clipped Adam step; the paper's text was not available to us),
            ``per_client`` or ``mean``. MH-pFedHNG's global-model step is unaffected: one step
            on the holders' weighted mean, as in the authors' code.
        local_lr, local_momentum, local_weight_decay, local_epochs, batch_size: client SGD
            (paper: 1e-3, 0.9, 1e-4, 2 epochs, 64).
        net: the default architecture (and the base class's target; default ``zoo_cnn``).
        **kwargs: see :class:`~lightning_pfl.methods.base.FederatedMethod`.
    """

    honours_conditions = True

    def __init__(
        self,
        architectures: dict[str, dict[str, Any]] | None = None,
        output_size: PositiveInt = 3072,
        embed_dim: PositiveInt = 64,
        hidden_dim: PositiveInt = 128,
        n_layers: PositiveInt = 3,
        embed_std: PositiveFloat = 0.002,
        head_sharing: HeadSharing = "tau",
        parametrization: Literal["raw", "standardized"] = "raw",
        upload_fraction: Fraction = 1.0,
        local_layers: NonNegativeInt = 0,
        frozen_clients: UnitInterval | list[NonNegativeInt] = 0.0,
        frozen_layers: PositiveInt = 1,
        recalibrate_batch_norm: bool = True,
        hn_lr: PositiveFloat = 2e-4,
        hn_weight_decay: NonNegativeFloat = 0.0,
        hn_max_grad_norm: PositiveFloat | None = 50.0,
        hn_update: Literal["sequential", "per_client", "mean"] = "sequential",
        net: str = "zoo_cnn",
        local_lr: PositiveFloat = 1e-3,
        local_momentum: Momentum = 0.9,
        local_weight_decay: NonNegativeFloat = 1e-4,
        local_epochs: PositiveInt | None = 2,
        batch_size: PositiveInt = 64,
        local_max_grad_norm: PositiveFloat | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            net=net,
            local_lr=local_lr,
            local_momentum=local_momentum,
            local_weight_decay=local_weight_decay,
            local_epochs=local_epochs,
            batch_size=batch_size,
            local_max_grad_norm=local_max_grad_norm,
            **kwargs,
        )
        h = self.hp
        # ------------------------------------------------------------- client side
        with self.seeded_init():
            self.zoo = NetworkGroups(
                architectures or {net: {"net": net, "net_args": h.net_args or {}}},
                h.num_clients,
                tuple(h.input_shape),
                h.num_classes,
                h.seed,
                "model.init_args.architectures",
            )
        standardized = parametrization == "standardized"
        self.local_names: dict[str, tuple[str, ...]] = {}
        self.codecs: dict[str, FlatCodec] = {}
        for kind, arch in self.zoo.archs.items():
            initial = arch.initial_params()
            kept = last_layers(list(initial), local_layers, kind, "local_layers")
            self.local_names[kind] = kept
            generated = {n: t for n, t in initial.items() if n not in kept}
            self.codecs[kind] = FlatCodec(generated, standardized)
            if kept:
                rows = len(self.zoo.members(kind))
                self.store.add_field(f"local.{kind}", {n: initial[n] for n in kept}, rows)
        self.constrained = client_subset(
            frozen_clients,
            h.num_clients,
            h.seed,
            CONSTRAINED_STREAM,
            "model.init_args.frozen_clients",
        )
        self.any_constrained = bool(self.constrained.any())
        self.fixed_names = {  # the generated tensors a constrained client holds fixed
            kind: last_layers(codec.names, frozen_layers, kind, "frozen_layers")
            for kind, codec in self.codecs.items()
        }
        self.losses = {
            kind: self.with_fixed_layers(kind, cross_entropy_loss(arch))
            for kind, arch in self.zoo.archs.items()
        }
        for kind, arch in self.zoo.archs.items():
            if arch.stateful:
                rows = len(self.zoo.members(kind))
                self.store.add_field(f"buffers.{kind}", arch.initial_buffers(), rows)
        kinds = [self.zoo.names[g] for g in self.zoo.group_of.tolist()]
        counts = [self.codecs[kind].count for kind in kinds]  # what clients tell the server
        # ------------------------------------------------------------- server side
        with self.seeded_init():
            self.hnet = MultiHeadHyperNetwork(
                counts + self.extra_counts(),
                output_size,
                embed_dim,
                hidden_dim,
                n_layers,
                embed_std,
                head_sharing,
                standardized,
                self.separate_rows(),
            )
        if self.client_dp is not None and hn_update != "mean":
            raise ConfigError(
                f"model.init_args.client_dp: {type(self).__name__} privatizes the mean update "
                f"of the hypernetwork; hn_update = '{hn_update}' takes one server step per "
                "client, which is not a noisy mean; use hn_update: mean."
            )
        self.dp_shared, self.dp_personal = shared_and_personal(self.hnet)

    def extra_counts(self) -> list[int]:
        """Counts of hypernetwork rows after the clients' (MH-pFedHNG: the global model)."""
        return []

    def separate_rows(self) -> list[int]:
        """Hypernetwork rows with a head of their own (MH-pFedHNG: Table 10's global head)."""
        return []

    def configure_server_optimizer(self) -> torch.optim.Optimizer:
        h = self.hp
        return torch.optim.Adam(self.hnet.parameters(), lr=h.hn_lr, weight_decay=h.hn_weight_decay)

    # ----------------------------------------------------------------- client side
    def client_update(
        self,
        codec: FlatCodec,
        arch: Architecture,
        clients: Tensor,
        flat: Tensor,
        round_idx: int,
        batches: ClientBatches,
        loss_fn: LossFn,
        context: Params | None = None,
        buffers: tuple[str, Tensor] | None = None,
        fixed: FixedLayers | None = None,
        local: tuple[str, Tensor] | None = None,
    ) -> tuple[Tensor, Params, Tensor]:
        """``clients`` (all of architecture ``arch``) train the model decoded from ``flat``.

        Returns the flat delta g - g~ (sparsified to ``upload_fraction``), the trained
        parameters and buffers (kept by the clients) and the mean training loss per client.
        Batch-norm buffers are read from and written back to the store's ``buffers`` =
        (field, rows). ``context``: per-client tensors the loss reads (MH-pFedHNGD's teachers).
        ``fixed``: the constrained clients of the group and the tensors they hold at their
        generated values (Table 14; ``loss_fn`` must come from :meth:`with_fixed_layers`);
        those come back unchanged and their delta entries are exactly 0.
        ``local`` = (field, rows) of the tensors the clients keep to themselves (Table 13):
        trained with the rest and written back, never part of the delta.
        """
        params = codec.to_params(flat)
        if local is not None:
            params |= self.store.gather(*local, self.device)
        read = dict(context or {})
        if fixed is not None:
            read |= fixed.context(params)
        if arch.stateful and buffers is not None:
            params |= self.store.gather(*buffers, self.device)
        result = self.local_train(
            params,
            clients,
            round_idx,
            loss_fn=loss_fn,
            context=read or None,
            batches=batches,
            arch=arch,
        )
        if arch.stateful and buffers is not None:
            self.store.scatter(*buffers, {n: result.params[n] for n in arch.buffer_shapes})
        if local is not None:
            kept = self.store.fields[local[0]]
            self.store.scatter(*local, {n: result.params[n] for n in kept})
        trained = result.params
        delta = flat - codec.to_flat(trained)
        if fixed is not None:
            trained = fixed.restore(trained, params)
            delta = fixed.zero_delta(delta, codec)
        return self.sparsify(delta), trained, result.loss

    def with_fixed_layers(self, kind: str, loss_fn: LossFn) -> LossFn:
        """``loss_fn`` for clients of ``kind``, some of which may hold their last layers fixed
        (:func:`~lightning_pfl.methods.mh_parts.hold_fixed`); without constrained clients in
        the configuration ``loss_fn`` itself."""
        if not self.any_constrained:
            return loss_fn
        return hold_fixed(loss_fn, self.fixed_names[kind])

    def sparsify(self, delta: Tensor) -> Tensor:
        """Keep each row's top ``upload_fraction`` entries by magnitude (others 0)."""
        fraction = self.hp.upload_fraction
        if fraction >= 1.0:
            return delta
        k = max(1, math.ceil(fraction * delta.shape[1]))
        index = delta.abs().topk(k, dim=1).indices
        return torch.zeros_like(delta).scatter(1, index, delta.gather(1, index))

    def uploaded(self, delta: Tensor) -> dict[str, Tensor]:
        """What a delta costs on the wire: dense values, or values and int32 indices."""
        if self.hp.upload_fraction >= 1.0:
            return {"delta": delta}
        k = max(1, math.ceil(self.hp.upload_fraction * delta.shape[1]))
        values = delta.new_empty(len(delta), k)
        return {"values": values, "index": values.new_empty(values.shape, dtype=torch.int32)}

    # ----------------------------------------------------------------- server side
    def server_gradients(
        self, generated: list[Tensor], deltas: list[Tensor], weights: Tensor
    ) -> None:
        """grad(phi, v) = sum_i w_i (d g_i / d(phi, v))^T delta_i over flat vectors ``generated``
        (a list of ``[C_j, K_j]`` with their graphs) and flat ``deltas``, then clipped: the
        gradient of the surrogate sum_i w_i <g_i(phi, v), delta_i>. Parameters no generated
        vector depends on (heads of absent sizes) get no gradient (Adam skips them)."""
        set_delta_gradients(
            list(self.hnet.parameters()),
            generated,
            deltas,
            list(weights.split([len(g) for g in generated])),
            self.hp.hn_max_grad_norm,
        )

    def group_order(self, sent: Sent) -> Tensor:
        """The positions among the round's clients of ``sent``'s rows, group after group."""
        return torch.tensor([p for _, positions, *_ in sent for p in positions], device=self.device)

    def private_server_gradients(
        self,
        generated: list[Tensor],
        deltas: list[Tensor],
        generator: torch.Generator,
        members: Tensor,
        round_idx: int,
        other_squares: Tensor | None = None,
    ) -> Tensor:
        """DP-FedAvg on the shared part phi_s (``client_dp``: its MLP and every head more
        than one client reads; zero contribution where client i reads none), the personal part
        (embeddings, single-reader heads) as without DP (equal weights over the clients that
        reported back): :func:`~lightning_pfl.privacy.set_private_delta_gradients`, group j's
        generated tensor holding the rows of its clients. A client that did not report back
        in round ``round_idx`` adds nothing (its delta counts as 0); the sum still divides by
        qN.

        ``members`` are the client ids of the rows of ``generated`` and ``deltas``, group after
        group; ``other_squares`` (float64, in that order) the squared norms of what else each
        client uploads, clipped with the same factor. Returns the clip factors f_i, in that
        order."""
        dp = self.client_dp
        assert dp is not None, "client_dp is not set"
        sizes = [len(g) for g in generated]
        owners = torch.arange(sum(sizes), device=self.device).split(sizes)  # group j's rows
        personal_weights = None  # 1 / C each
        if self.unreliable is not None:
            arrived = self.arrived(members, round_idx).split(sizes)
            deltas = [torch.where(a[:, None], d, 0.0) for a, d in zip(arrived, deltas, strict=True)]
            personal_weights = self.client_weights(members, round_idx, uniform=True)
        return set_private_delta_gradients(
            self.dp_shared,
            self.dp_personal,
            generated,
            deltas,
            list(owners),
            sum(sizes),
            dp,
            self.hp.clients_per_round,  # qN: the simulation samples exactly that many
            generator,
            self.hp.hn_max_grad_norm,
            other_squares,
            personal_weights,
        )

    # ----------------------------------------------------------------- the round
    @privatizes(
        "each client's contribution (d g_i / d phi_s)^T delta_i to the gradient of the "
        "hypernetwork's shared part phi_s (its MLP and every head more than one client reads), "
        "clipped as one vector (hn_update: mean); client i's slot embeddings and a head only "
        "client i reads are its personal parameters and are updated from its unclipped delta"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        losses, down, up = self.personal_round(round_idx, clients)
        self.record_communication(down=down, up=up)
        return losses

    def personal_round(
        self, round_idx: int, clients: Tensor, teachers: Params | None = None
    ) -> tuple[Tensor, Params, Params]:
        """Generate, train, upload deltas and update the hypernetwork by ``hn_update``.

        ``teachers`` are per-client context tensors handed to the personal loss (MH-pFedHNGD;
        None: plain cross-entropy). Returns the losses and what was sent down and up. The server
        steps it takes itself are all but the last; the base class takes the last one.
        """
        batches = self.draw_batches(clients, round_idx)
        ids = clients.cpu()
        sent: Sent = []  # kind, rows, generated, delta

        def train(group: GroupShare) -> Tensor:
            kind, rows, positions = group.name, group.rows, group.rows.cpu()
            on_cpu = ids[positions]
            flat = self.hnet(on_cpu.tolist())  # server: the members' flat vectors
            mask = self.constrained[on_cpu].to(self.device) if self.any_constrained else None
            delta, _, loss = self.client_update(
                self.codecs[kind],
                group.arch,
                group.members,
                flat.detach(),
                round_idx,
                batches.select(rows),
                self.losses[kind] if teachers is None else self.personal_loss(kind),
                None if teachers is None else {n: t[rows] for n, t in teachers.items()},
                (f"buffers.{kind}", self.zoo.row_of[on_cpu]),
                None if mask is None else FixedLayers(mask, self.fixed_names[kind]),
                self.local_field(kind, on_cpu),
            )
            sent.append((kind, positions.tolist(), flat, delta))
            return loss

        reported = self.arrived(ids, round_idx).tolist()  # who reported back, on the host
        if self.hp.hn_update == "sequential":
            losses = torch.zeros(len(clients), device=clients.device)
            pending = False  # a gradient is set: the last arrived client's step
            for position in self.update_order(round_idx, len(clients)):
                if pending:  # that step, before this client's model is generated
                    self.step_server()
                row = torch.tensor([position], device=clients.device)
                kind = self.zoo.names[int(self.zoo.group_of[ids[position]])]
                losses[row] = train(GroupShare(kind, row, clients[row], self.zoo.archs[kind]))
                pending = reported[position]  # a dropped client's turn sets no gradient
                if pending:
                    self.server_gradients([sent[-1][2]], [sent[-1][3]], losses.new_ones(1))
        else:
            losses = self.zoo.train_groups(clients, train)
            if self.hp.hn_update == "mean":
                self.mean_update(sent, clients, round_idx, any(reported))
            else:
                self.per_client_steps(sent, round_idx, reported)
        kinds = list(dict.fromkeys(kind for kind, *_ in sent))
        down = {k: torch.cat([g.detach() for j, _, g, _ in sent if j == k]) for k in kinds}
        up: Params = {}
        for k in kinds:
            delta = torch.cat([d for j, *_, d in sent if j == k])
            up |= {f"{k}.{n}": t for n, t in self.uploaded(delta).items()}
        return losses, down, up

    def mean_update(self, sent: Sent, clients: Tensor, round_idx: int, any_arrived: bool) -> None:
        """``hn_update: mean``: set grad(phi, v) from the round's ``sent`` groups (kind,
        positions among ``clients``, generated ``[C_j, K_j]`` with its graph, deltas) with equal
        weights over the clients that reported back (none, ``any_arrived`` False: no
        gradient), or with ``client_dp`` by :meth:`private_server_gradients`."""
        generated, deltas = [g for *_, g, _ in sent], [d for *_, d in sent]
        order = self.group_order(sent)
        if self.client_dp is not None:
            generator = self.client_dp_generator(round_idx)
            self.private_server_gradients(generated, deltas, generator, clients[order], round_idx)
        elif any_arrived:
            weights = self.client_weights(clients, round_idx, uniform=True)
            self.server_gradients(generated, deltas, weights[order])

    def update_order(self, round_idx: int, count: int) -> list[int]:
        """The order (positions among the round's ``count`` clients) of the server's per-client
        steps: a seeded permutation, a function of (seed, round) alone, so that a resumed run
        and every DDP rank step alike."""
        generator = torch.Generator().manual_seed(
            derive_seed(self.hp.seed, round_idx, ORDER_STREAM)
        )
        return torch.randperm(count, generator=generator).tolist()

    def per_client_steps(self, sent: Sent, round_idx: int, reported: list[bool]) -> None:
        """``hn_update: per_client``: one step per client that reported back (``reported``,
        per position), in the seeded :meth:`update_order`, each with that client's
        (d g_i / d(phi, v))^T delta_i, clipped, all at the round's starting phi (the clients
        trained from it). ``sent``: (kind, positions among the round's clients, generated
        ``[C_j, K_j]`` with its graph, deltas) per group. The base class takes the last step;
        none arrived: no gradient is set."""
        params = list(self.hnet.parameters())
        one = torch.ones(1, device=self.device)
        grads: dict[int, list[Tensor | None]] = {}
        for _, positions, generated, delta in sent:
            for r, position in enumerate(positions):
                if not reported[position]:
                    continue
                g, d = generated[r : r + 1], delta[r : r + 1]
                set_delta_gradients(params, [g], [d], [one], self.hp.hn_max_grad_norm, True)
                grads[position] = [p.grad for p in params]
        assert self.server_optimizer is not None, "configure_optimizers() sets it"
        order = [p for p in self.update_order(round_idx, len(reported)) if p in grads]
        steps_in_turn(self.server_optimizer, params, [grads[position] for position in order])

    def step_server(self) -> None:
        """One step of the server optimizer with the gradients set, then clear them."""
        assert self.server_optimizer is not None, "configure_optimizers() sets it"
        self.server_optimizer.step()
        self.server_optimizer.zero_grad()

    def local_field(self, kind: str, clients: Tensor) -> tuple[str, Tensor] | None:
        """(store field, rows) of the layers ``clients`` of ``kind`` keep (None: none kept)."""
        if not self.local_names[kind]:
            return None
        return f"local.{kind}", self.zoo.row_of[clients.cpu()]

    def personal_loss(self, kind: str) -> LossFn:
        """The personal models' local loss (MH-pFedHN: cross-entropy)."""
        return self.losses[kind]

    # ----------------------------------------------------------------- evaluation
    def personalized_params(self, clients: Tensor) -> Params:
        kind = self.zoo.group_of_clients(clients)
        arch = self.zoo.archs[kind]
        with torch.no_grad():
            params = self.codecs[kind].to_params(self.hnet(clients.cpu().tolist()))
            local = self.local_field(kind, clients)
            if local is not None:
                params |= self.store.gather(*local, self.device)
            if arch.stateful and self.hp.recalibrate_batch_norm:
                params |= self.batch_norm_statistics(arch, params, clients)
            elif arch.stateful:
                rows = self.zoo.row_of[clients.cpu()]
                params |= self.store.gather(f"buffers.{kind}", rows, self.device)
        return self.zoo.tagged(kind, params)

    def batch_norm_statistics(self, arch: Architecture, params: Params, clients: Tensor) -> Params:
        """Batch-norm statistics of ``params`` (stacked over ``clients``) from one seeded pass
        over each client's own training data
        (:func:`~lightning_pfl.methods.mh_parts.precise_batch_norm`)."""
        h = self.hp
        return precise_batch_norm(
            arch, params, clients, self.data, h.batch_size, h.seed, self.device
        )

    def network_groups(self) -> NetworkGroups:
        return self.zoo

    def results(self) -> dict[str, Any]:
        return super().results() | {
            "client_parameters": {k: c.count for k, c in self.codecs.items()},
            "slots": {k: math.ceil(c.count / self.hp.output_size) for k, c in self.codecs.items()},
            "architecture_clients": {k: len(ids) for k, ids in self.client_groups().items()},
            "hypernetwork_parameters": sum(p.numel() for p in self.hnet.parameters()),
            "frozen_clients": self.constrained.nonzero()[:, 0].tolist(),
        }

    def novel_adaptation(self, clients: Tensor) -> NovelAdaptation:
        """Novel clients adapt their slot embeddings (all tau_i rows of each) and the heads no
        other row uses (a size only novel clients have, or ``head_sharing: client``), which
        never trained; heads shared with trained rows stay as they are. The loss is each client's
        training-mode cross-entropy (also for MH-pFedHNGD, a novel client has no teacher),
        whose forwards update the novel clients' batch-norm statistics in the store."""
        ids = clients.cpu()
        stateful = [kind for kind, arch in self.zoo.archs.items() if arch.stateful]
        buffers = [t for kind in stateful for t in self.store.fields[f"buffers.{kind}"].values()]

        def loss(index: Tensor, weight: Tensor) -> Tensor:
            total = torch.zeros((), device=self.device)
            for kind, rows in self.zoo.split(clients):
                members, arch = ids[rows.cpu()], self.zoo.archs[kind]
                params = self.codecs[kind].to_params(self.hnet(members.tolist()))
                local = self.local_field(kind, members)
                if local is not None:
                    params |= self.store.gather(*local, self.device)
                field, store_rows = f"buffers.{kind}", self.zoo.row_of[members]
                if arch.stateful:
                    params |= self.store.gather(field, store_rows, self.device)
                x, y = self.data.fetch(index[rows.to(index.device)])
                logits, state = torch.func.vmap(arch.forward_train)(params, x)
                if arch.stateful:
                    self.store.scatter(field, store_rows, state)
                w = weight[rows.to(weight.device)]
                total = total + torch.func.vmap(weighted_cross_entropy)(logits, y, w).sum()
            return total

        heads = self.hnet.heads_only_of(ids.tolist())
        return NovelAdaptation([self.hnet.embeddings, *heads], loss, buffers)
