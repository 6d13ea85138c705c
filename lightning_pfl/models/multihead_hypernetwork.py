"""MH-pFedHN's multi-head hypernetwork: flat parameter vectors of any length from counts only.

The server knows each client only by its parameter count K_i. Client i owns
tau_i = ceil(K_i / N) embedding vectors ("slots"); a shared MLP maps every slot's embedding to
features, and a *head* (tau Linear(hidden, N) layers, one per slot) maps the features of slot t
to N outputs. Client i's flat parameter vector is concat(outputs of its tau slots)[:K_i]. How
that vector becomes a model is the client's business (:class:`FlatCodec`); nothing here sees an
architecture.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_pfl.engine import Params

HeadSharing = Literal["tau", "client", "none"]
CONSTANT_SCALE = 0.1  # sigma of a tensor initialized to a constant (a norm layer's weight)


def slots_needed(count: int, output_size: int) -> int:
    """tau = ceil(K / N): the embedding slots (and head layers) a K-parameter model needs."""
    return -(-count // output_size)


class MultiHeadHyperNetwork(nn.Module):
    """h(v; phi) for clients that differ only in their parameter counts.

    Args:
        counts: K_i of every row (clients, then any extra rows such as a global model).
        output_size: N, the outputs of one head layer (3072 in the paper).
        embed_dim: embedding size (64).
        hidden_dim: MLP width (128).
        n_layers: Linear layers of the MLP, each followed by a ReLU (3: 64 -> 128 -> 128 -> 128).
        embed_std: standard deviation of the embeddings' normal initialization (0.002).
        sharing: ``tau`` (paper): rows with equal tau share one head; ``client``: a head per
            row (the paper's Table 3 "one head per client"); ``none``: one Linear(hidden, N)
            used for every slot of every row (Table 3 "no head").
        standardize: rescale every head at initialization so that its outputs over the initial
            embeddings have mean 0 and standard deviation 1 (clients then map them to their own
            initialization scale, see :class:`FlatCodec`); False (the paper): PyTorch's default
            init.
        separate: rows with a head of their own whatever ``sharing`` says (the paper's Table 10:
            MH-pFedHNG's global model on a head separate from the clients of its tau).
    """

    def __init__(
        self,
        counts: Sequence[int],
        output_size: int = 3072,
        embed_dim: int = 64,
        hidden_dim: int = 128,
        n_layers: int = 3,
        embed_std: float = 0.002,
        sharing: HeadSharing = "tau",
        standardize: bool = False,
        separate: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.counts = [int(k) for k in counts]
        self.output_size = output_size
        self.sharing = sharing
        self.separate = {int(r) for r in separate}
        self.tau = [slots_needed(k, output_size) for k in self.counts]
        starts = [0]
        for t in self.tau:
            starts.append(starts[-1] + t)
        self.slot_start = starts[:-1]
        self.embeddings = nn.Parameter(torch.randn(starts[-1], embed_dim) * embed_std)
        layers: list[nn.Module] = []
        for i in range(n_layers):
            layers += [nn.Linear(embed_dim if i == 0 else hidden_dim, hidden_dim), nn.ReLU()]
        self.mlp = nn.Sequential(*layers)
        self.head_of = [self._head_key(row) for row in range(len(self.counts))]
        self.heads = nn.ParameterDict()
        for row, key in enumerate(self.head_of):
            if key + "_weight" not in self.heads:
                slots = 1 if key == "shared" else self.tau[row]
                weight, bias = _default_linear(slots, hidden_dim, output_size)
                self.heads[key + "_weight"] = nn.Parameter(weight)
                self.heads[key + "_bias"] = nn.Parameter(bias)
        if standardize:
            self._standardize_heads()

    def _head_key(self, row: int) -> str:
        if row in self.separate or self.sharing == "client":
            return f"row{row}"
        if self.sharing == "tau":
            return f"tau{self.tau[row]}"
        return "shared"

    def head_keys(self) -> list[str]:
        """Names of the heads (``tau<t>``, ``row<i>`` or ``shared``)."""
        return sorted({k.rsplit("_", 1)[0] for k in self.heads})

    @torch.no_grad()
    def _standardize_heads(self) -> None:
        for key in self.head_keys():
            rows = [r for r, k in enumerate(self.head_of) if k == key]
            outputs = torch.cat([self.forward([r]) for r in rows], 1)
            mean, std = outputs.mean(), outputs.std().clamp_min(1e-12)
            self.heads[key + "_weight"].div_(std)
            self.heads[key + "_bias"].sub_(mean).div_(std)

    def forward(self, rows: Sequence[int]) -> Tensor:
        """Flat parameter vectors ``[len(rows), K]`` of rows that all have the same count K."""
        rows = [int(r) for r in rows]
        count, tau = self.counts[rows[0]], self.tau[rows[0]]
        if any(self.counts[r] != count for r in rows):
            raise ValueError("generate rows of one parameter count at a time")
        slots = torch.stack([torch.arange(tau) + self.slot_start[r] for r in rows])
        features = self.mlp(self.embeddings[slots.to(self.embeddings.device)])  # [C, tau, H]
        keys = [self.head_of[r] for r in rows]
        if len(set(keys)) == 1:  # one head for all (always, unless one head per client)
            out = self._apply_head(keys[0], features)
        else:
            out = torch.cat(
                [self._apply_head(k, f[None]) for k, f in zip(keys, features, strict=True)]
            )
        return out.flatten(1)[:, :count].float()

    def _apply_head(self, key: str, features: Tensor) -> Tensor:
        """Head ``key`` on slot features ``[C, tau, H]``: ``[C, tau, N]``."""
        weight, bias = self.heads[key + "_weight"], self.heads[key + "_bias"]
        if key == "shared":
            return features @ weight[0].T + bias[0]
        return torch.einsum("cth,tnh->ctn", features, weight) + bias

    def heads_only_of(self, rows: Sequence[int]) -> list[nn.Parameter]:
        """Weights and biases of the heads that no row outside ``rows`` uses: heads that never
        trained while ``rows`` were held out of training (e.g. the tau of a size only they
        have, or their own heads with ``sharing="client"``)."""
        held_out = {int(r) for r in rows}
        used = {key for row, key in enumerate(self.head_of) if row not in held_out}
        return [p for name, p in self.heads.items() if name.rsplit("_", 1)[0] not in used]

    def embedding_parameters(self) -> list[nn.Parameter]:
        return [self.embeddings]

    def body_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p is not self.embeddings]


def _default_linear(slots: int, fan_in: int, fan_out: int) -> tuple[Tensor, Tensor]:
    """``slots`` stacked Linear(fan_in, fan_out) weights and biases, PyTorch's default init."""
    bound = 1 / math.sqrt(fan_in)
    weight = torch.empty(slots, fan_out, fan_in).uniform_(-bound, bound)
    bias = torch.empty(slots, fan_out).uniform_(-bound, bound)
    return weight, bias


class FlatCodec:
    """The client side's map between a flat vector and its model's parameters.

    Parameters are laid out in a fixed order (the network's ``named_parameters`` order), each
    flattened. With ``standardized`` the flat values g are in units of each tensor's own
    initialization: theta_t = mu_t + sigma_t g_t, where mu_t and sigma_t are the mean and
    standard deviation of tensor t in the network's initialization (sigma_t = 0.1 for a constant
    tensor such as a norm layer's weight); otherwise theta = g.
    """

    def __init__(self, initial: Mapping[str, Tensor], standardized: bool = False) -> None:
        self.names = list(initial)
        self.shapes = {n: tuple(t.shape) for n, t in initial.items()}
        self.sizes = [t.numel() for t in initial.values()]
        self.count = sum(self.sizes)
        mean, scale = [], []
        for t in initial.values():
            values = t.detach().float().flatten()
            std = float(values.std()) if values.numel() > 1 else 0.0
            m, s = (float(values.mean()), std or CONSTANT_SCALE) if standardized else (0.0, 1.0)
            mean.append(torch.full((t.numel(),), m))
            scale.append(torch.full((t.numel(),), s))
        self.mean = torch.cat(mean)
        self.scale = torch.cat(scale)

    def to_params(self, flat: Tensor) -> Params:
        """Parameters ``[C, *shape]`` from flat values ``[C, K]``."""
        theta = self.mean.to(flat) + self.scale.to(flat) * flat
        chunks = theta.split(self.sizes, dim=1)
        return {
            n: c.reshape(len(flat), *self.shapes[n])
            for n, c in zip(self.names, chunks, strict=True)
        }

    def to_flat(self, params: Mapping[str, Tensor]) -> Tensor:
        """Flat values ``[C, K]`` of parameters ``[C, *shape]`` (inverse of :meth:`to_params`)."""
        theta = torch.cat([params[n].flatten(1) for n in self.names], 1)
        return (theta - self.mean.to(theta)) / self.scale.to(theta)
