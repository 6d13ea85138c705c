"""PeFLL (Scott, Zakerinia and Lampert, ICLR 2024): personalized FL by learning to learn."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pfl.costs import payload_bytes
from lightning_pfl.engine import Params, derive_seed
from lightning_pfl.errors import ConfigError
from lightning_pfl.methods.pfedhn import PFedHN
from lightning_pfl.models import HyperNetwork
from lightning_pfl.models.hypernetwork import BaseHyperNetwork, apply_heads, set_delta_gradients
from lightning_pfl.privacy import privatizes, set_private_delta_gradients
from lightning_pfl.streams import BATCH_STREAM
from lightning_pfl.validation import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

DESCRIPTOR_PHASE = 1
CALIBRATION_DESCRIPTORS = 64


class EmbeddingNetwork(nn.Module):
    """e(x, y; psi): an MLP on [flatten(x), onehot(y)] giving one embedding per sample.

    A client's descriptor is the (weighted) mean of its samples' embeddings, so it does not
    depend on the order of the samples and accepts any number of them, followed by a fixed
    standardization v = (mean embedding - shift) / scale (buffers, identity until
    :meth:`calibrate`).

    Why the standardization: pFedHN's hypernetwork is built for standard normal inputs (its
    ``nn.Embedding`` rows; with ``hn_feature_scale`` or ``hn_head_init: target`` its
    initialization is also calibrated on them), where clients lie about 1 apart per
    coordinate. Raw mean embeddings of an untrained e lie far closer together (digits, 10
    clients: 0.03 per coordinate), so the generated models barely depend on the client (their
    spread across clients is 0.7% of their scale, pFedHN's 22%, both measured with the feature
    scale and target-scale heads) and stay so in training: PeFLL then learns one model for all
    clients.
    The PeFLL authors' code likewise standardizes descriptors, with statistics fixed at the
    first step.
    """

    shift: Tensor
    scale: Tensor

    def __init__(self, input_shape: Sequence[int], num_classes: int, hidden: int, dim: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.mlp = nn.Sequential(
            nn.Linear(math.prod(input_shape) + num_classes, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, dim),
        )
        self.register_buffer("shift", torch.zeros(dim))
        self.register_buffer("scale", torch.ones(()))

    def embed(self, x: Tensor, y: Tensor) -> Tensor:
        """Per-sample embeddings of ``x [..., *input_shape]``, ``y [...]``: ``[..., dim]``."""
        lead = y.shape
        pairs = torch.cat(
            [x.reshape(*lead, -1).float(), F.one_hot(y, self.num_classes).float()], -1
        )
        return self.mlp(pairs)

    def standardize(self, means: Tensor) -> Tensor:
        """Descriptors v = (m - shift) / scale of mean embeddings ``m [..., dim]``."""
        return (means - self.shift) / self.scale

    @torch.no_grad()
    def calibrate(self, means: Tensor) -> None:
        """Fix shift and scale so that the mean embeddings ``means [N, dim]`` of N >= 2 clients
        become descriptors with mean 0 and a mean square deviation of 1 per coordinate (that of
        standard normal embeddings); with fewer clients there is no spread to measure and the
        standardization stays as it is."""
        if len(means) < 2:
            return
        self.shift.copy_(means.float().mean(0))
        self.scale.copy_((means.float() - self.shift).pow(2).mean().sqrt().clamp_min(1e-12))

    def forward(self, x: Tensor, y: Tensor, weight: Tensor) -> Tensor:
        """Descriptors v_c of ``[C, B]`` batches: the standardized weighted mean
        sum_b w_cb e(x_cb, y_cb) / sum_b w_cb."""
        z = self.embed(x, y)
        means = (z * weight.unsqueeze(-1)).sum(-2) / weight.sum(-1, keepdim=True).clamp_min(1)
        return self.standardize(means)


class PeFLLNetwork(BaseHyperNetwork):
    """The two learned maps: descriptor v = e(S; psi), then theta = h(v; phi).

    h is pFedHN's hypernetwork (MLP, one head per target tensor, and pFedHN's
    ``hn_feature_scale`` and ``hn_head_init``) fed with the descriptor instead of a looked-up
    embedding; its embedding table is frozen and only serves to calibrate those two options.
    """

    def __init__(
        self,
        embedder: EmbeddingNetwork,
        target_shapes: Mapping[str, tuple[int, ...]],
        dim: int,
        hidden_dim: int,
        n_hidden: int,
        spectral_norm: bool,
        target_init: Mapping[str, Tensor] | None,
        feature_scale: bool = False,
    ) -> None:
        super().__init__()
        self.embedder = embedder
        self.generator = HyperNetwork(
            CALIBRATION_DESCRIPTORS,
            target_shapes,
            dim,
            hidden_dim,
            n_hidden,
            spectral_norm,
            target_init,
            feature_scale=feature_scale,
        )
        self.generator.embeddings.weight.requires_grad_(False)

    def generate(self, descriptors: Tensor) -> dict[str, Tensor]:
        """theta = h(v; phi) for descriptors ``[C, dim]``, stacked ``[C, *shape]``."""
        g = self.generator
        return apply_heads(g.feature_scale(g.mlp(descriptors)), g.target_shapes, g.heads)

    def forward(self, x: Tensor, y: Tensor, weight: Tensor) -> dict[str, Tensor]:
        return self.generate(self.embedder(x, y, weight))

    def embedding_parameters(self) -> list[nn.Parameter]:
        """psi, the embedding network (trained with ``embed_lr``)."""
        return list(self.embedder.parameters())

    def body_parameters(self) -> list[nn.Parameter]:
        """phi, the hypernetwork (without its frozen calibration table)."""
        return [p for p in self.generator.parameters() if p.requires_grad]

    def personal_parameters(self) -> list[nn.Parameter]:
        """No parameter is personal: every client's descriptor reads psi, every model phi."""
        return []


class PeFLL(PFedHN):
    """PeFLL: an embedding network describes each client; a hypernetwork maps it to a model.

    Round (the paper's Algorithm 1): each client computes its descriptor
    v_i = ((1/|B|) sum_{(x, y) in B} e(x, y; psi) - shift) / scale on a random batch B of its
    training data (shift and scale fixed before the first round, see below); the server
    generates theta_i = h(v_i; phi); the client trains theta_i for K local SGD steps and
    uploads delta_i = theta_i - theta~_i. The server sets grad(phi) = (1/C) sum_i
    (d theta_i / d phi)^T delta_i, returns (d theta_i / d v_i)^T delta_i to the client, which
    back-propagates it through e to get its grad(psi); both networks take one optimizer step.
    This is the gradient of (1/C) sum_i <h(e(B_i; psi); phi), delta_i> in (phi, psi): the
    chain rule through the delta (computed here in one backward pass).

    The server also differentiates the regularizers of the paper's objective,
    lambda_h ||phi||^2 + lambda_v ||psi||^2 + (1/C) sum_i lambda_theta ||theta_i||^2
    (phi: the hypernetwork, psi: the embedding network, theta_i = h(v_i; phi); our reading of
    the paper's three symbols, whose text was not reachable to us): their gradients
    2 lambda_h phi, 2 lambda_v psi and (1/C) sum_i (d theta_i / d (phi, psi))^T 2 lambda_theta
    theta_i join the delta gradient before its norm is clipped. They replace the server's
    weight decay, which is off by default (``hn_weight_decay`` 0).

    Nothing is client-specific: a client's personalized model is h(e(S_i)) with its descriptor
    over all its training data S_i, so a new client gets a model with two forward passes and
    no training (:meth:`model_for`).

    Before the first round, every training client computes its mean embedding over its training
    data once (with the initial psi) and sends it; the server fixes the descriptor
    standardization from them (:meth:`calibrate_descriptors`), the analogue of the reference
    code's rescaling with statistics of the first step's descriptor.

    Unreliable clients (``conditions``): the server step is the mean over the clients that
    reported back (weights 1/|arrived|, their regularizer terms lambda_theta included; the
    other clients' descriptors and deltas get weight 0); a round in which none did sets no
    gradient, so neither network moves. No per-client state is kept.

    Client-level DP (``client_dp``, z and clip norm S; docs/privacy.md): DP-FedAvg on the
    gradient of everything shared, phi and psi together. Client i's contribution
    c_i = (d theta_i / d (phi, psi))^T (delta_i + 2 lambda_theta theta_i), which reaches psi
    through its descriptor v_i = e(B_i; psi), is clipped as one vector to S (all clients in one
    batched backward); the server's gradient is (sum_i f_i c_i + N(0, z^2 S^2 I)) / qN, then
    2 lambda_h phi and 2 lambda_v psi (functions of the released parameters alone) are added
    and the norm is clipped to ``hn_max_grad_norm``: post-processing. A dropped client's c_i is
    zero. What is released is phi and psi; the descriptor v_i and the delta reach the trusted
    server per client, as DP-FedAvg's updates do, and the generated theta_i goes back to client
    i only. The standardization is fixed from every client's data before the first round
    without noise, so ``client_dp`` needs ``standardize_descriptors: false``.

    Args:
        embed_dim: descriptor size (default floor(1 + n / 4), pFedHN's embedding size and the
            default of the PeFLL authors' code).
        embedding_hidden: width of the embedding network's two hidden layers.
        descriptor_batch: samples per descriptor during training (default ``batch_size``).
        embed_lr: learning rate of the embedding network psi (default ``hn_lr``), for the
            standardized descriptor: the optimizer uses embed_lr * s^2 with SGD and
            embed_lr * s with Adam, s the standardization's scale. Standardizing multiplies
            both psi's gradient and the descriptor's response to a step of psi by 1/s (SGD's
            step follows the gradient's scale, Adam's does not), so this way a server step
            moves the descriptor that h reads as far, for the same gradient with respect to
            it, as it would move an unstandardized one; with the plain rate SGD moves it 1/s^2
            times as far (about 1000 on digits, where training then fails: 10% validation
            accuracy after 50 rounds). The authors' code steps psi at its one ``--lr`` with Adam
            (its ``--embed-lr`` reaches only its SGD) and rescales descriptors differently (see
            ``standardize_descriptors``).
        standardize_descriptors: standardize descriptors as above (False: raw mean embeddings,
            which on digits the hypernetwork ignores, so every client gets the same model; the
            only setting with ``client_dp``).
        hn_optimizer: the server optimizer of phi and psi. Default ``adam``, the authors' code's
            default (``--optim adam``: PyTorch's Adam, betas 0.9 / 0.999, no weight decay);
            ``sgd``: SGD with momentum ``hn_momentum`` (0.9), pFedHN's optimizer and the code's
            ``--optim sgd``.
        hn_lr: the server learning rate of phi (default 2e-4, the authors' code's ``--lr``,
            used by both of its optimizers; pFedHN's SGD rate is 1e-2).
        lambda_h: lambda_h, the weight of ||phi||^2 (the hypernetwork's parameters). Default 0:
            the authors' code regularizes neither network with its default Adam; with its
            ``--optim sgd`` it decays both by 1e-3, the step of lambda_h = lambda_v = 5e-4.
        lambda_v: lambda_v, the weight of ||psi||^2 (the embedding network's parameters);
            default 0 as ``lambda_h`` (the code treats both networks alike).
        lambda_theta: lambda_theta, the weight of ||theta_i||^2 (each generated model),
            averaged over the round's clients. Default 0: the authors' code has no such server
            term; its clients' SGD weight decay (5e-5, ``local_weight_decay`` here) acts on
            theta during local training.
        hn_weight_decay: the server optimizer's weight decay, on top of the regularizers
            (default 0, as the code's Adam; its SGD: 1e-3).
        local_lr: the client SGD's step size (default 2e-3, the authors' code's
            ``--inner-lr``; pFedHN's 5e-3). The rest of the client's SGD is pFedHN's inner
            loop, as in that code: momentum 0.9, weight decay 5e-5 (``--inner-wd``), clip 50,
            K = 50 steps (``--inner-steps``), each on a fresh random batch.
        batch_size: B, the client's batch (default 32, the authors' code's ``--batch-size``,
            which also sizes its descriptor batches: ``descriptor_batch``'s default).
        clients_per_round: C, the clients sampled (uniformly, without replacement) per server
            step (default 5, the authors' code's ``--clients-per-step``, pefllauthors/PeFLL
            ``train.py`` line 511; pFedHN's default is 1). As in that code (lines 272-366) the
            server step takes the mean (1/C) sum_i of the C clients' gradients, then clips it.
        **kwargs: see :class:`~lightning_pfl.methods.pfedhn.PFedHN` (hypernetwork size,
            ``hn_momentum``, ``hn_update``, and the inner loop K).
    """

    honours_conditions = True

    def __init__(
        self,
        embedding_hidden: PositiveInt = 100,
        descriptor_batch: PositiveInt | None = None,
        standardize_descriptors: bool = True,
        hn_optimizer: Literal["sgd", "adam"] = "adam",
        hn_lr: PositiveFloat = 2e-4,
        lambda_h: NonNegativeFloat = 0.0,
        lambda_v: NonNegativeFloat = 0.0,
        lambda_theta: NonNegativeFloat = 0.0,
        n_hidden: NonNegativeInt = 3,
        hn_weight_decay: NonNegativeFloat = 0.0,
        local_lr: PositiveFloat = 2e-3,
        batch_size: PositiveInt = 32,
        clients_per_round: PositiveInt = 5,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            hn_optimizer=hn_optimizer,
            hn_lr=hn_lr,
            n_hidden=n_hidden,
            hn_weight_decay=hn_weight_decay,
            local_lr=local_lr,
            batch_size=batch_size,
            clients_per_round=clients_per_round,
            **kwargs,
        )
        if self.client_dp is not None and standardize_descriptors:
            raise ConfigError(
                "model.init_args.standardize_descriptors: under client_dp, PeFLL would fix its "
                "descriptor standardization (the released network's shift and scale, and psi's "
                "learning rate) from every training client's mean embedding before the first "
                "round, a release of every client's data that no clip or noise covers; set "
                "standardize_descriptors: false, or remove client_dp."
            )

    def build_hypernetwork(self) -> PeFLLNetwork:
        h = self.hp
        dim = h.embed_dim or int(1 + h.num_clients / 4)
        embedder = EmbeddingNetwork(h.input_shape, h.num_classes, h.embedding_hidden, dim)
        return PeFLLNetwork(
            embedder,
            self.generated_shapes(),
            dim,
            h.hidden_dim,
            h.n_hidden,
            h.spectral_norm,
            self.head_target_init(),
            h.hn_feature_scale,
        )

    @property
    def network(self) -> PeFLLNetwork:
        """The embedding network and hypernetwork (``hnet``, typed)."""
        assert isinstance(self.hnet, PeFLLNetwork)
        return self.hnet

    def descriptor_batches(self, clients: Tensor, round_idx: int) -> tuple[Tensor, Tensor, Tensor]:
        """One random batch per client for this round's descriptors: x, y and weights."""
        h = self.hp
        seed = derive_seed(h.seed, round_idx, BATCH_STREAM, DESCRIPTOR_PHASE)
        generator = torch.Generator(self.data.device).manual_seed(seed)
        batches = self.data.client_batches(
            clients, h.descriptor_batch or h.batch_size, generator, steps=1
        )
        x, y = self.data.fetch(batches.index[:, 0])
        return x.to(self.device), y.to(self.device), batches.weight[:, 0].to(self.device)

    def set_hypernetwork_gradients(
        self,
        generated: Params,
        delta: Params,
        rows: slice | None = None,
        weights: Tensor | None = None,
    ) -> None:
        """grad(phi, psi) of sum_i w_i (<theta_i, delta_i> + lambda_theta ||theta_i||^2)
        + lambda_h ||phi||^2 + lambda_v ||psi||^2 over ``delta``'s clients
        (``generated[rows]``; w_i default 1/C), then clip to ``hn_max_grad_norm``."""
        outputs = {n: t[rows] if rows is not None else t for n, t in generated.items()}
        first = next(iter(delta.values()))
        if weights is None:
            weights = torch.full((len(first),), 1.0 / len(first), device=first.device)
        set_delta_gradients(
            self.network.body_parameters() + self.network.embedding_parameters(),
            list(outputs.values()),
            self.output_gradients(outputs, delta),
            [weights] * len(outputs),
            None,
            retain_graph=rows is not None,
        )
        self.regularize_and_clip()

    def output_gradients(self, outputs: Params, delta: Params) -> list[Tensor]:
        """delta_i + 2 lambda_theta theta_i for each generated tensor ``[C, ...]``: the
        gradient, in theta_i, of client i's term <theta_i, delta_i> + lambda_theta ||theta_i||^2."""
        return [delta[n] + 2 * self.hp.lambda_theta * outputs[n].detach() for n in outputs]

    def regularize_and_clip(self) -> None:
        """Add 2 lambda_h phi and 2 lambda_v psi to the gradients set from the clients, then
        clip the norm over (phi, psi) to ``hn_max_grad_norm``."""
        h = self.hp
        phi = self.network.body_parameters()
        psi = self.network.embedding_parameters()
        for params, lam in ((phi, h.lambda_h), (psi, h.lambda_v)):
            for p in params:
                if p.grad is not None:
                    p.grad = p.grad + 2 * lam * p.detach()
                elif lam > 0:
                    p.grad = 2 * lam * p.detach()
        if h.hn_max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(phi + psi, h.hn_max_grad_norm)

    def set_private_shared_gradients(
        self, generated: Params, delta: Params, clients: Tensor, round_idx: int
    ) -> None:
        """DP-FedAvg on (phi, psi): grad = (sum_i f_i c_i + N(0, z^2 S^2 I)) / qN with
        c_i = (d theta_i / d (phi, psi))^T (delta_i + 2 lambda_theta theta_i) and
        f_i = min(1, S / ||c_i||) (:func:`~lightning_pfl.privacy.set_private_delta_gradients`),
        c_i = 0 for a client that did not report back in round ``round_idx`` (its delta is 0,
        its lambda_theta term is not); then :meth:`regularize_and_clip` (post-processing)."""
        dp = self.client_dp
        assert dp is not None, "client_dp is not set"
        outputs = list(generated.values())
        arrived = self.arrived(clients, round_idx)
        gradients = [
            torch.where(arrived.view(-1, *[1] * (g.dim() - 1)), g, 0)
            for g in self.output_gradients(generated, delta)
        ]
        every = torch.arange(len(outputs[0]), device=outputs[0].device)
        set_private_delta_gradients(
            self.network.body_parameters() + self.network.embedding_parameters(),
            [],
            outputs,
            gradients,
            [every] * len(outputs),
            len(every),
            dp,
            self.hp.clients_per_round,  # qN: the simulation samples exactly that many
            self.client_dp_generator(round_idx),
            None,
        )
        self.regularize_and_clip()

    @privatizes(
        "each client's contribution to the gradient of everything shared, the hypernetwork phi "
        "and the embedding network psi (the latter through its descriptor v_i = e(B_i; psi)), "
        "its regularizer lambda_theta ||theta_i||^2 included, clipped as one vector; the "
        "descriptor and the delta reach the trusted server per client and are not released"
    )
    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        x, y, weight = self.descriptor_batches(clients, round_idx)
        descriptors = self.network.embedder(x, y, weight)
        generated = self.network.generate(descriptors)
        start = {n: t.detach() for n, t in generated.items()}
        result = self.local_train({n: t.clone() for n, t in start.items()}, clients, round_idx)
        delta = {n: start[n] - result.params[n] for n in start}
        if self.client_dp is not None:
            self.set_private_shared_gradients(generated, delta, clients, round_idx)
        else:
            self.update_from_arrived(generated, delta, clients, round_idx)
        psi = {
            n: p.detach().expand(len(clients), *p.shape)
            for n, p in self.network.embedder.named_parameters()
        }
        self.record_communication(
            down=start | {f"psi.{n}": t for n, t in psi.items()} | {"v_grad": descriptors},
            up={"v": descriptors.detach()} | delta | {f"psi_grad.{n}": t for n, t in psi.items()},
        )
        return result.loss

    @torch.no_grad()
    def model_for(self, x: Tensor, y: Tensor, weight: Tensor | None = None) -> Params:
        """The model h(e(S)) of clients with data ``x [C, N, ...]``, ``y [C, N]`` (no training)."""
        weight = torch.ones(y.shape, device=y.device) if weight is None else weight
        return self.network(x, y, weight)

    @torch.no_grad()
    def mean_embeddings(self, clients: Tensor) -> Tensor:
        """Mean embedding of each client over all its training data, before standardization:
        ``[C, dim]``."""
        embedder = self.network.embedder
        total = torch.zeros(len(clients), embedder.shift.numel(), device=self.device)
        count = torch.zeros(len(clients), 1, device=self.device)
        by_size = self.data.by_size(clients, "train")
        for k, x, y, weight in by_size.blocks(self.hp.eval_batch_size):
            total[:k] += (embedder.embed(x, y) * weight.unsqueeze(-1)).sum(1)
            count[:k] += weight.sum(1, keepdim=True)
        return by_size.unsort(total / count.clamp_min(1))

    @torch.no_grad()
    def calibrate_descriptors(self) -> None:
        """Fix the descriptor standardization from every training client's mean embedding
        under the current psi, and set psi's learning rate for it (see ``embed_lr``).

        Called once before the first round (:meth:`on_train_start`); its statistics are
        buffers, so a resumed run keeps them (and its optimizer the learning rate).
        """
        h = self.hp
        if not h.standardize_descriptors:
            return
        clients = torch.arange(self.num_training_clients, device=self.device)
        means = torch.cat(
            [self.mean_embeddings(c) for c in clients.split(self.data.eval_clients_per_batch)]
        )
        embedder = self.network.embedder
        embedder.calibrate(means)
        psi = self.network.embedding_parameters()
        self.record.comm_bytes_total += torch.tensor(
            [
                len(clients) * payload_bytes(dict(embedder.named_parameters())),
                payload_bytes({"v": means}),
            ],
            dtype=torch.float64,
        )
        optimizer = self.server_optimizer
        if optimizer is None:
            return
        power = 1 if h.hn_optimizer == "adam" else 2
        lr = (h.embed_lr or h.hn_lr) * float(embedder.scale) ** power  # once: a host sync is fine
        ids = {id(p) for p in psi}
        for group in optimizer.param_groups:
            if any(id(p) in ids for p in group["params"]):
                group["lr"] = lr

    def on_train_start(self) -> None:
        if self.global_step == 0:
            self.calibrate_descriptors()
        super().on_train_start()

    @torch.no_grad()
    def personalized_params(self, clients: Tensor) -> Params:
        embedder = self.network.embedder
        return self.network.generate(embedder.standardize(self.mean_embeddings(clients)))
