"""The parts of an MH-pFedHN client that the paper's studies switch on one at a time.

Which clients are chosen (:func:`client_subset`: Table 14's resource-constrained clients,
MH-pFedHNG's holders of the global model), which layers (:func:`last_layers`: Table 13's local
layers, Table 14's fixed ones), how a constrained client holds its fixed layers at their
generated values (:class:`FixedLayers`, :func:`hold_fixed`), the batch-norm statistics a
client evaluates a generated model with (:func:`precise_batch_norm`), and which hypernetwork
parameters client-level DP treats as shared (:func:`shared_and_personal`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import vmap

from lightning_pfl.datamodule import FederatedDataModule
from lightning_pfl.engine import Architecture, LossFn, Params, derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.models.multihead_hypernetwork import FlatCodec, MultiHeadHyperNetwork
from lightning_pfl.streams import RECALIBRATION_STREAM

# Keys of the per-client context tensors handed to the local loss next to a model's own tensors:
CONSTRAINED = "constrained"  # [C] bool: a resource-constrained client (holds its fixed layers)
GENERATED = "generated."  # + tensor name: the generated value of a fixed tensor


def client_subset(
    chosen: float | Sequence[int], num_clients: int, seed: int, stream: int, key: str
) -> Tensor:
    """``[num_clients]`` bool mask of ``chosen``: a list of client ids, or a share of all
    clients (round(share * num_clients) of them, drawn once with a seeded permutation).

    Raises:
        ConfigError: naming ``key`` for an id outside 0..num_clients-1 or listed twice.
    """
    mask = torch.zeros(num_clients, dtype=torch.bool)
    if isinstance(chosen, (int, float)):
        count = round(chosen * num_clients)
        rng = np.random.default_rng([seed, 0, stream])
        mask[torch.from_numpy(rng.permutation(num_clients)[:count])] = True
        return mask
    ids = [int(i) for i in chosen]
    if any(not 0 <= i < num_clients for i in ids) or len(set(ids)) != len(ids):
        raise ConfigError(
            f"{key} = {list(chosen)!r}: give distinct client ids in 0..{num_clients - 1}."
        )
    mask[ids] = True
    return mask


def last_layers(names: Sequence[str], count: int, kind: str, key: str) -> tuple[str, ...]:
    """The tensor names of the last ``count`` layers (modules owning parameters, in parameter
    order) among ``names``; () for ``count`` 0.

    Raises:
        ConfigError: naming ``key`` when architecture ``kind`` would have no layer left.
    """
    layers = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in names))
    if count >= len(layers):
        raise ConfigError(
            f"model.init_args.{key} = {count} leaves no layer of architecture {kind!r} "
            f"(of {len(layers)}) to the hypernetwork's training; use 0..{len(layers) - 1}."
        )
    chosen = set(layers[len(layers) - count :])
    return tuple(n for n in names if n.rsplit(".", 1)[0] in chosen)


@dataclass(frozen=True)
class FixedLayers:
    """Table 14 within one architecture's group of clients: those of ``mask`` (``[C]`` bool)
    hold the generated tensors ``names`` at their generated values through local training."""

    mask: Tensor
    names: tuple[str, ...]

    def context(self, generated: Params) -> Params:
        """The per-client context a loss wrapped by :func:`hold_fixed` reads: the mask and
        the generated values of the fixed tensors."""
        return {CONSTRAINED: self.mask} | {GENERATED + n: generated[n] for n in self.names}

    def restore(self, trained: Params, generated: Params) -> Params:
        """``trained`` with the constrained clients' fixed tensors back at their generated
        values (SGD's weight decay still moved their unused trainable copies)."""
        return trained | {
            n: torch.where(
                self.mask.view(-1, *[1] * (generated[n].dim() - 1)), generated[n], trained[n]
            )
            for n in self.names
        }

    def zero_delta(self, delta: Tensor, codec: FlatCodec) -> Tensor:
        """The flat ``delta`` ``[C, K]`` with the constrained clients' fixed entries exactly 0."""
        entries = torch.cat(
            [
                torch.full((size,), n in self.names, dtype=torch.bool, device=delta.device)
                for n, size in zip(codec.names, codec.sizes, strict=True)
            ]
        )
        return delta.masked_fill(self.mask[:, None] & entries, 0.0)


def hold_fixed(loss_fn: LossFn, names: Sequence[str]) -> LossFn:
    """``loss_fn`` reading every tensor t of ``names`` as where(constrained, generated t,
    trainable t), the ``constrained`` mask and the generated values coming per client in the
    context (:meth:`FixedLayers.context`): a constrained client's gradient of t is exactly 0
    and its forward pass uses the generated values at every step. Without that context (no
    fixed layers in the group) ``loss_fn`` is called as it is."""
    fixed = set(names)

    def loss(
        params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor
    ) -> Tensor | tuple[Tensor, Params]:
        if CONSTRAINED not in context:
            return loss_fn(params, context, x, y, w)
        mask = context[CONSTRAINED]
        own = {
            n: torch.where(mask, context[GENERATED + n], p) if n in fixed else p
            for n, p in params.items()
        }
        rest = {
            n: t for n, t in context.items() if n != CONSTRAINED and not n.startswith(GENERATED)
        }
        return loss_fn(own, rest, x, y, w)

    return loss


def precise_batch_norm(
    arch: Architecture,
    params: Params,
    clients: Tensor,
    data: FederatedDataModule,
    batch_size: int,
    seed: int,
    device: torch.device,
) -> Params:
    """Batch-norm statistics of ``params`` (stacked over ``clients``), each client's mean
    over the batches of one seeded pass over its own training data (precise batch norm).

    As in local training, a client's last batch is filled up to the batch size with repeats
    of its own samples, so the statistics are exact only where a client's data fills its
    batches.
    """
    generator = torch.Generator(data.device)
    generator.manual_seed(derive_seed(seed, RECALIBRATION_STREAM))
    batches = data.client_batches(clients, batch_size, generator, epochs=1)
    statistics = vmap(arch.batch_statistics, randomness="different")
    sums = {
        n: torch.zeros(len(clients), *shape, device=device)
        for n, shape in arch.buffer_shapes.items()
    }
    active = batches.active.float()
    for step in range(active.shape[1]):
        x, _ = data.fetch(batches.index[:, step])
        for n, value in statistics(params | sums, x).items():
            sums[n] += active[:, step].view(-1, *[1] * (value.dim() - 1)) * value
    count = active.sum(1).clamp_min(1)
    return {n: t / count.view(-1, *[1] * (t.dim() - 1)) for n, t in sums.items()}


def shared_and_personal(
    hnet: MultiHeadHyperNetwork,
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The (shared, personal) parameters of ``hnet`` for client-level DP, each in ``hnet``'s
    parameter order. Personal: the slot embeddings (row i's slots feed only row i's vector) and
    every head that a single row reads (``head_sharing: client``, or a tau no other row has);
    what they are is released to that row's client alone. Shared: the MLP and every head that
    several rows read (the rows of all clients, novel ones included), whose values reach more
    than one client."""
    readers = Counter(hnet.head_of)
    own = {
        f"heads.{key}_{part}" for key, n in readers.items() if n == 1 for part in ("weight", "bias")
    }
    shared: list[nn.Parameter] = []
    personal: list[nn.Parameter] = []
    for name, p in hnet.named_parameters():
        (personal if name == "embeddings" or name in own else shared).append(p)
    return shared, personal
