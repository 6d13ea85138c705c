"""FedBN (Li et al., ICLR 2021): FedAvg with batch-norm layers kept local."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg


class FedBN(FedAvg):
    """Federated learning on non-IID features via local batch normalization.

    Round: as FedAvg, except that every batch-norm layer's affine parameters (gamma, beta) and
    running statistics (mean, variance) stay with the client: they are neither uploaded nor
    averaged, and each client evaluates the global model with its own batch norms. Everything
    else is averaged (sample-weighted).

    Needs a network with batch norm, e.g. ``net: digits_cnn`` or ``cnn`` with
    ``net_args: {batch_norm: true}``. The paper trains with SGD (lr 1e-2), batch 32, 1 local
    epoch (E=1) per round.

    Args:
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not self.personal_names():
            raise ConfigError(
                f"FedBN keeps batch-norm layers local, but net '{self.hp.net}' has none; set "
                "model.init_args.net_args: {batch_norm: true}."
            )

    def personal_names(self) -> tuple[str, ...]:
        """Weights, biases and running statistics of every batch-norm layer."""
        names = []
        for prefix, module in self.net.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                names += [f"{prefix}.{n}" for n, _ in module.named_parameters(recurse=False)]
                names += [f"{prefix}.{n}" for n, _ in module.named_buffers(recurse=False)]
        return tuple(names)
