"""FedRoD (Chen & Chao, ICLR 2022): a generic head for the federation, a personal one per client."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_pfl.engine import Params, TrainResult, weighted_cross_entropy
from lightning_pfl.losses import balanced_softmax_cross_entropy
from lightning_pfl.methods.fedavg import FedAvg

PERSONAL = "personal_head."


class FedRoD(FedAvg):
    """Federated Robust Decoupling: a shared body with a generic and a personal head.

    Client i on a batch: z = body(x); generic logits g = G(z) and personal logits p = P_i(z).
    The body and the generic head G minimize the balanced softmax (balanced risk) of g under
    the client's training label counts n_{i,c} (cross-entropy of g + log n_{i,c}), so G
    learns the class-balanced generic task; the personal head minimizes the cross-entropy of
    g.detach() + p, with z detached, so it learns only the client's residual. Both losses are
    summed and take one SGD step. The body and G are averaged (sample-weighted), P_i stays in
    the client store (a linear layer initialized to zero: the first prediction is G's). A
    client's prediction is G(z) + P_i(z).

    The reference implementation feeds the personal head the detached representation, as here;
    the paper's hypernetwork variant (FedRoD-hyper) is not implemented.

    Args:
        **kwargs: see :class:`~lightning_pfl.methods.fedavg.FedAvg`.
    """

    honours_conditions = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.refuse_batch_norm("FedRoD reads representations")
        weight = next(n for n in self.arch.head_names if n.endswith("weight"))
        classes, dim = self.arch.shapes[weight]
        head = {"weight": torch.zeros(classes, dim), "bias": torch.zeros(classes)}
        self.store.add_field("personal_head", {PERSONAL + n: t for n, t in head.items()})
        # one object for every round: a recorded round (CUDA graph) is keyed by the loss
        self.client_loss = self.rod_loss

    def class_counts(self, clients: Tensor) -> Tensor:
        """Training samples per class of ``clients``, ``[C, num_classes]``."""
        counts = torch.as_tensor(self.data.partition_counts()["train"], dtype=torch.float32)
        return counts[clients.cpu()].to(self.device)

    def logits(self, params: Params, x: Tensor, train: bool = False) -> tuple[Tensor, Tensor]:
        """Generic logits G(z) and personal logits P(z.detach()) of one client's batch."""
        net = {n: t for n, t in params.items() if not n.startswith(PERSONAL)}
        z = self.arch.features(net, x, train=train)
        personal = F.linear(z.detach(), params[f"{PERSONAL}weight"], params[f"{PERSONAL}bias"])
        return self.arch.classify(net, z), personal

    def rod_loss(self, params: Params, context: Params, x: Tensor, y: Tensor, w: Tensor) -> Tensor:
        generic, personal = self.logits(params, x, train=True)
        balanced = balanced_softmax_cross_entropy(generic, y, context["class_counts"], w)
        return balanced + weighted_cross_entropy(generic.detach() + personal, y, w)

    def train_clients(self, round_idx: int, clients: Tensor, start: Params) -> TrainResult:
        head = self.store.gather("personal_head", clients, self.device)
        result = self.local_train(
            {**start, **head},
            clients,
            round_idx,
            loss_fn=self.client_loss,
            context={"class_counts": self.class_counts(clients)},
        )
        self.store.scatter("personal_head", clients, {n: result.params[n] for n in head})
        return result

    def personalized_params(self, clients: Tensor) -> Params:
        return super().personalized_params(clients) | self.store.gather(
            "personal_head", clients, self.device
        )

    def predict(self, params: Params, x: Tensor) -> Tensor:
        generic, personal = self.logits(params, x)
        return generic + personal
