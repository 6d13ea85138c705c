"""FedBN (Li et al., ICLR 2021): FedAvg with batch-norm layers kept local."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.fedavg import FedAvg
from lightning_pfl.validation import PositiveFloat, PositiveInt


class FedBN(FedAvg):
    """Federated learning on non-IID features via local batch normalization.

    Round: as FedAvg, except that every batch-norm layer's affine parameters (gamma, beta) and
    running statistics (mean, variance) stay with the client: they are neither uploaded nor
    averaged, and each client evaluates the global model with its own batch norms. Everything
    else is averaged (sample-weighted).

    Needs a network with batch norm, e.g. ``net: digits_cnn`` or ``cnn`` with
    ``net_args: {batch_norm: true}``.

    Args:
        local_lr: client SGD learning rate (paper: 1e-2).
        batch_size: local batch size (paper: 32).
        local_epochs: local epochs E per round (paper: 1; null trains ``local_steps``).
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg` (paper: plain SGD).
    """

    honours_conditions = True

    def __init__(
        self,
        local_lr: PositiveFloat = 1e-2,
        batch_size: PositiveInt = 32,
        local_epochs: PositiveInt | None = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            local_lr=local_lr, batch_size=batch_size, local_epochs=local_epochs, **kwargs
        )
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
