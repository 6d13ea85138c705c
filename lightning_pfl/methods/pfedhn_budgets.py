"""pFedHN's computational-budget setting (Shamsian et al., ICML 2021, section 5, Table 2): one
hypernetwork generates personalized target networks of several sizes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pfl.assignment import GroupShare, NetworkGroups
from lightning_pfl.costs import payload_bytes
from lightning_pfl.engine import Params, cross_entropy_loss
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.pfedhn import PFedHN
from lightning_pfl.models import HyperNetwork
from lightning_pfl.models.hypernetwork import BaseHyperNetwork, apply_heads, set_delta_gradients
from lightning_pfl.privacy import privatizes, set_private_delta_gradients

PAPER_SIZES: dict[str, dict[str, Any]] = {
    name: {"net": "cnn", "net_args": {"n_kernels": k}}
    for name, k in (("S", 8), ("M", 16), ("L", 32))
}


class BudgetHyperNetwork(BaseHyperNetwork):
    """h(v_i; phi) for clients of several target sizes: the embedding table v and MLP body of a
    :class:`~lightning_pfl.models.HyperNetwork` (built without heads) are shared by every size;
    each size has its own output heads, one per tensor of that size's network, at PyTorch's
    default initialization, or, given ``target_init`` (``hn_head_init: target``), started at
    that network's own initialization scale.
    """

    def __init__(
        self,
        body: HyperNetwork,
        target_shapes: Mapping[str, Mapping[str, tuple[int, ...]]],
        target_init: Mapping[str, Mapping[str, Tensor]] | None = None,
    ) -> None:
        super().__init__()
        self.body = body
        self.target_shapes = {size: dict(shapes) for size, shapes in target_shapes.items()}
        self.heads = nn.ModuleDict(
            {
                size: body.new_heads(shapes, target_init[size] if target_init else None)
                for size, shapes in target_shapes.items()
            }
        )

    def generate(self, features: Tensor, size: str) -> dict[str, Tensor]:
        """The tensors of a ``size`` network from the body's features ``[C, width]`` of C clients
        (all of that size), stacked ``[C, *shape]``."""
        heads = self.heads[size]
        assert isinstance(heads, nn.ModuleList)
        return apply_heads(features, self.target_shapes[size], heads)

    def forward(self, clients: Tensor, size: str) -> dict[str, Tensor]:
        return self.generate(self.body.features(clients), size)

    def embedding_parameters(self) -> list[nn.Parameter]:
        return self.body.embedding_parameters()


class PFedHNBudgets(PFedHN):
    """pFedHN for clients with different computational budgets: S/M/L targets from one HN.

    The paper's setting (section 5, Table 2): the clients are split into three equal groups
    whose target is the CIFAR CNN with 8 (S), 16 (M) or 32 (L) filters in the first
    convolution (twice that in the second), 75 clients in all (25 per size) on CIFAR-10 and
    CIFAR-100 (pFedHN split). One hypernetwork serves them all: the client embeddings v_i and
    the MLP body are shared, each size has its own set of output heads. The paper gives
    neither the clients per round nor the rounds of this study; we keep its main setting (one
    client per round, 5000 rounds, the same HN and inner loop).

    Round: the body computes the features of all sampled clients in one forward; each size
    group's heads generate theta_i = h_s(v_i; phi) for its clients, which train together (one
    ``local_train``, vmapped) for K steps to theta~_i and upload delta_i = theta_i - theta~_i.
    The server sets grad(phi, v) = (1/C) sum_i J_i^T delta_i over the round's C clients (each
    through its own size's heads; one backward pass), the gradient of
    (1/C) sum_i 0.5 ||h_{s(i)}(v_i; phi) - theta~_i||^2, clips it and steps. Heads of sizes
    with no client in the round get no gradient (our choice; the paper is silent): the
    optimizer leaves them as they are (no weight decay, no momentum step).

    Unreliable clients (``conditions``): the mean is over the clients S that reported back
    (weights 1/|S|, zero for the others); the heads of a size none of whose clients did get no
    gradient, as those of a size not sampled, and a round where none did sets no gradient.

    Client-level DP (``client_dp``): pFedHN's, with each client's contribution to every shared
    tensor (the body's MLP and every size's heads, zero on the other sizes' heads) clipped as
    one vector, the sum over qN, the noise on every shared tensor (also the heads of a size
    absent from the round); the embeddings v_i are personal.

    Sizes are client groups of :class:`~lightning_pfl.assignment.NetworkGroups`
    (``architectures: {name: {net, net_args, share|clients}}``); test and validation accuracy
    per size are logged as ``{val,test}/arch_<name>/acc`` and ``results.json`` also holds
    each size's clients, parameter count and bytes sent and received. A client's personalized
    model is h_{s(i)}(v_i; phi). Novel clients are not supported (``NovelClients`` refuses the
    method: its hypernetwork has no per-client embedding table ``hnet.embeddings`` at the top).

    Args:
        architectures: the size groups (default: the paper's S/M/L, ``cnn`` with
            ``n_kernels`` 8/16/32 in equal shares). Networks with batch norm are refused.
        **kwargs: see :class:`~lightning_pfl.methods.pfedhn.PFedHN` (embedding size E,
            HN width and depth, server optimizer of phi and v, inner loop K, eta). ``net`` and
            ``net_args`` only build the base class's reference target, which is not trained:
            give one the inputs fit (e.g. one of the sizes' networks). ``hn_update`` must be
            ``mean``.
    """

    honours_conditions = True

    def __init__(
        self, architectures: dict[str, dict[str, Any]] | None = None, **kwargs: Any
    ) -> None:
        if kwargs.get("hn_update", "mean") != "mean":
            raise ConfigError(
                "model.init_args.hn_update: PFedHNBudgets takes one server step per round "
                "('mean'); 'per_client' is not supported."
            )
        super().__init__(**kwargs)
        self.comm_bytes_by_size = {size: [0.0, 0.0] for size in self.sizes.names}

    def build_hypernetwork(self) -> BudgetHyperNetwork:
        # The sizes are assigned here: PFedHN.__init__ builds the HN before this __init__ runs.
        h = self.hp
        self.sizes = NetworkGroups(
            h.architectures or PAPER_SIZES,
            h.num_clients,
            tuple(h.input_shape),
            h.num_classes,
            h.seed,
            "model.init_args.architectures",
        )
        archs = self.sizes.archs
        for size, arch in archs.items():
            reason = f"PFedHNBudgets generates whole models (architectures.{size})"
            self.refuse_batch_norm(reason, arch)
        self.losses = {size: cross_entropy_loss(arch) for size, arch in archs.items()}
        n = h.num_clients
        body = HyperNetwork(
            n,
            {},
            h.embed_dim or int(1 + n / 4),
            h.hidden_dim,
            h.n_hidden,
            h.spectral_norm,
            feature_scale=h.hn_feature_scale,
        )
        init = {size: self.head_target_init(arch) for size, arch in archs.items()}
        return BudgetHyperNetwork(
            body,
            {size: arch.shapes for size, arch in archs.items()},
            {size: t for size, t in init.items() if t is not None} or None,
        )

    @property
    def network(self) -> BudgetHyperNetwork:
        """The hypernetwork (``hnet``, typed)."""
        assert isinstance(self.hnet, BudgetHyperNetwork)
        return self.hnet

    @privatizes(
        "each client's contribution J_i^T delta_i to the gradient of the shared hypernetwork "
        "(the body every size reads and every size's heads, zero on the heads of the other "
        "sizes), clipped as one vector; the embedding v_i is client i's personal parameter "
        "and is updated from its unclipped delta"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        batches = self.draw_batches(clients, round_idx)
        features = self.network.body.features(clients)
        generated: list[Tensor] = []
        deltas: list[Tensor] = []
        owners: list[Tensor] = []  # the rows (among the round's clients) of each generated tensor
        of_size: list[str] = []  # the size of each generated tensor
        down: Params = {}
        up: Params = {}

        def train(group: GroupShare) -> Tensor:
            size, rows = group.name, group.rows
            theta = self.network.generate(features[rows], size)
            start = {n: t.detach() for n, t in theta.items()}
            result = self.local_train(
                {n: t.clone() for n, t in start.items()},
                group.members,
                round_idx,
                loss_fn=self.losses[size],
                batches=batches.select(rows),
                arch=group.arch,
            )
            delta = {n: start[n] - result.params[n] for n in start}
            generated.extend(theta.values())
            deltas.extend(delta.values())
            owners.extend([rows] * len(theta))
            of_size.extend([size] * len(theta))
            down.update(self.sizes.tagged(size, start))
            up.update(self.sizes.tagged(size, delta))
            totals = self.comm_bytes_by_size[size]
            totals[0] += payload_bytes(start)
            totals[1] += payload_bytes(delta)
            return result.loss

        losses = self.sizes.train_groups(clients, train)
        if self.client_dp is not None:
            self.set_private_budget_gradients(generated, deltas, owners, len(clients), round_idx)
        else:
            # a size none of whose clients reported back gets no gradient, as one not sampled
            live = self.arrived_sizes(clients, round_idx)
            kept = [k for k, size in enumerate(of_size) if size in live]
            if kept:
                # 1/C each, or 1/|S| over the clients S that reported back (zero for the others)
                weights = self.client_weights(clients, round_idx, uniform=True).to(generated[0])
                set_delta_gradients(
                    [p for p in self.hnet.parameters() if p.requires_grad],
                    [generated[k] for k in kept],
                    [deltas[k] for k in kept],
                    [weights[owners[k]] for k in kept],
                    self.hp.hn_max_grad_norm,
                )
        self.record_communication(down=down, up=up)
        return losses

    def arrived_sizes(self, clients: Tensor, round_idx: int) -> set[str]:
        """The sizes with a client among ``clients`` that reported back in round ``round_idx``
        (every size of the round without ``conditions``; with them, server side: reads the
        mask on the host)."""
        if self.unreliable is None:
            return set(self.sizes.names)
        reported = self.arrived(clients, round_idx).cpu()
        groups = self.sizes.group_of[clients.cpu()][reported]
        return {self.sizes.names[g] for g in groups.tolist()}

    def set_private_budget_gradients(
        self,
        generated: list[Tensor],
        deltas: list[Tensor],
        owners: list[Tensor],
        count: int,
        round_idx: int,
    ) -> None:
        """DP-FedAvg on the shared hypernetwork (every parameter but the embeddings: the body
        and every size's heads), the embeddings as without DP:
        :func:`~lightning_pfl.privacy.set_private_delta_gradients`, the tensors of size s
        holding the rows of its clients among the round's ``count``."""
        dp = self.client_dp
        assert dp is not None, "client_dp is not set"
        embeddings = [p for p in self.hnet.personal_parameters() if p.requires_grad]
        personal = {id(p) for p in embeddings}
        shared = [p for p in self.hnet.parameters() if p.requires_grad and id(p) not in personal]
        set_private_delta_gradients(
            shared,
            embeddings,
            generated,
            deltas,
            owners,
            count,
            dp,
            self.hp.clients_per_round,  # qN: the simulation samples exactly that many
            self.client_dp_generator(round_idx),
            self.hp.hn_max_grad_norm,
        )

    # ----------------------------------------------------------------- evaluation
    def personalized_params(self, clients: Tensor) -> Params:
        size = self.sizes.group_of_clients(clients)
        with torch.no_grad():
            return self.sizes.tagged(size, self.network(clients, size))

    def network_groups(self) -> NetworkGroups:
        return self.sizes

    # ----------------------------------------------------------------- state and results
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["pfl"]["comm_bytes_by_size"] = self.comm_bytes_by_size

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.comm_bytes_by_size = checkpoint["pfl"]["comm_bytes_by_size"]

    def results(self) -> dict[str, Any]:
        sizes = self.sizes
        return super().results() | {
            "size_clients": {s: len(sizes.members(s)) for s in sizes.names},
            "size_parameters": {
                s: sum(math.prod(shape) for shape in arch.shapes.values())
                for s, arch in sizes.archs.items()
            },
            "comm_bytes_by_size": {
                s: {"down": down, "up": up} for s, (down, up) in self.comm_bytes_by_size.items()
            },
        }
