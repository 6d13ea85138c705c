"""The pFedHN hypernetwork: client embedding -> MLP -> one linear head per target tensor."""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm as add_spectral_norm


class HyperNetwork(nn.Module):
    """h(v_i; phi): maps client ``i``'s embedding v_i to every tensor of a target network.

    Linear(E, hidden), then ``n_hidden`` x [ReLU, Linear(hidden, hidden)], no activation before
    the heads, then one Linear(hidden, numel) head per target tensor reshaped to its shape.
    ``n_hidden=3`` is the pFedHN CIFAR hypernetwork; ``n_hidden=0`` its one-hidden-layer MNIST
    variant.

    Args:
        num_clients: number of embeddings (n).
        target_shapes: parameter name -> shape of every tensor to generate.
        embed_dim: embedding size E.
        hidden_dim: width of the MLP (100 in the paper).
        n_hidden: extra hidden layers after the first.
        spectral_norm: apply spectral normalization to every linear layer.
    """

    def __init__(
        self,
        num_clients: int,
        target_shapes: Mapping[str, tuple[int, ...]],
        embed_dim: int,
        hidden_dim: int = 100,
        n_hidden: int = 3,
        spectral_norm: bool = False,
    ) -> None:
        super().__init__()

        def linear(i: int, o: int) -> nn.Module:
            layer = nn.Linear(i, o)
            return add_spectral_norm(layer) if spectral_norm else layer

        self.target_shapes = {name: tuple(shape) for name, shape in target_shapes.items()}
        self.embeddings = nn.Embedding(num_clients, embed_dim)
        layers: list[nn.Module] = [linear(embed_dim, hidden_dim)]
        for _ in range(n_hidden):
            layers += [nn.ReLU(), linear(hidden_dim, hidden_dim)]
        self.mlp = nn.Sequential(*layers)
        self.heads = nn.ModuleList(
            linear(hidden_dim, math.prod(shape)) for shape in self.target_shapes.values()
        )

    def forward(self, clients: Tensor) -> dict[str, Tensor]:
        """Generate the target tensors of ``clients`` (shape [C]) stacked as [C, *shape].

        Outputs are float32 even under autocast: they are the clients' master weights.
        """
        features = self.mlp(self.embeddings(clients))
        return {
            name: head(features).float().view(len(clients), *shape)
            for (name, shape), head in zip(self.target_shapes.items(), self.heads, strict=True)
        }

    def embedding_parameters(self) -> list[nn.Parameter]:
        return list(self.embeddings.parameters())

    def body_parameters(self) -> list[nn.Parameter]:
        embedding_ids = {id(p) for p in self.embedding_parameters()}
        return [p for p in self.parameters() if id(p) not in embedding_ids]
