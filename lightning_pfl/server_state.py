"""Server-side tensors named like a model's tensors, kept where checkpoints carry them."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from lightning_pfl.engine import Params


def _key(name: str) -> str:
    return name.replace(".", "__")


class NamedBuffers(nn.Module):
    """One buffer per model tensor name (``conv1.weight``, ...): a server state such as
    SCAFFOLD's control variate c or FedDyn's h. Buffers are in the method's ``state_dict``, so
    a checkpoint carries them and a resumed run continues from them."""

    def __init__(self, tensors: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.names = tuple(tensors)
        for name, tensor in tensors.items():
            self.register_buffer(_key(name), tensor.detach().clone())

    @classmethod
    def zeros_like(cls, tensors: Mapping[str, Tensor]) -> NamedBuffers:
        return cls({n: torch.zeros_like(t) for n, t in tensors.items()})

    def __getitem__(self, name: str) -> Tensor:
        buffer: Tensor = getattr(self, _key(name))
        return buffer

    def tensors(self) -> Params:
        """The tensors by model name (the buffers themselves, not copies)."""
        return {n: self[n] for n in self.names}
