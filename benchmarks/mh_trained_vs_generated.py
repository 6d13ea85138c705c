"""Does MH-pFedHN's hypernetwork keep up with its clients? Trained vs generated accuracy.

For every client of every round, three validation accuracies (mean over the client's own
validation split), written to a JSON per round and client with its architecture:

- ``generated_before``: the model generated for it at the start of the round (before it trains;
  with ``hn_update: sequential`` it trains from the model generated after the steps of the
  clients before it in the round);
- ``trained``: the model it has after this round's local training, with the batch-norm
  statistics re-estimated for it as evaluation does (``recalibrate_batch_norm``);
- ``generated_after``: the model generated for it after the round's server step(s).

``trained`` - ``generated_before`` is what one visit of local training adds; ``generated_after`` -
``generated_before`` is how much of it the server step carries into the hypernetwork. A generated
architecture that trails the same architecture trained alone because the hypernetwork lags its
clients shows a large first gap and a small second one. Measuring changes nothing in training
(evaluation runs without gradients and draws nothing from the training streams).

Run it through the CLI with this class in place of ``MHPFedHN``:

    lightning-pfl fit --config configs/fashion_mnist_mh/mh_pfedhn.yaml \\
        --model.class_path benchmarks.mh_trained_vs_generated.TrackedMHPFedHN \\
        --model.init_args.diagnosis_out benchmarks/results/fashion_mnist_mh_diagnosis/x.json \\
        --data.init_args.root <datasets>
    python -m benchmarks.mh_trained_vs_generated summarize <json>...
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.accuracy import environment
from lightning_pfl.engine import Architecture, ClientBatches, LossFn, Params
from lightning_pfl.methods import MHPFedHN
from lightning_pfl.models.multihead_hypernetwork import FlatCodec


class TrackedMHPFedHN(MHPFedHN):
    """:class:`MHPFedHN` that records trained vs generated validation accuracy every round.

    Args:
        diagnosis_out: the JSON file the per-round, per-client accuracies go to.
        **kwargs: see :class:`MHPFedHN`.
    """

    def __init__(self, diagnosis_out: str = "mh_trained_vs_generated.json", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.diagnosis_out = Path(diagnosis_out)
        self.diagnosis_rows: list[dict[str, Any]] = []
        self._trained: dict[str, tuple[Tensor, Params]] = {}
        self._evaluate_trained = False
        self._round_clients: Tensor | None = None
        self._before: Tensor | None = None

    def client_update(
        self,
        codec: FlatCodec,
        arch: Architecture,
        clients: Tensor,
        flat: Tensor,
        round_idx: int,
        batches: ClientBatches,
        loss_fn: LossFn,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[Tensor, Params, Tensor]:
        delta, trained, loss = super().client_update(
            codec, arch, clients, flat, round_idx, batches, loss_fn, *args, **kwargs
        )
        kind = self.zoo.group_of_clients(clients)
        weights = {n: t.detach() for n, t in trained.items() if n not in arch.buffer_shapes}
        if kind in self._trained:  # hn_update sequential: the kind's clients train one by one
            members, earlier = self._trained[kind]
            clients = torch.cat([members, clients])
            weights = {n: torch.cat([earlier[n], t]) for n, t in weights.items()}
        self._trained[kind] = (clients.clone(), weights)
        return delta, trained, loss

    def personalized_params(self, clients: Tensor) -> Params:
        if not self._evaluate_trained:
            return super().personalized_params(clients)
        kind = self.zoo.group_of_clients(clients)
        members, params = self._trained[kind]
        if sorted(members.tolist()) != sorted(clients.tolist()):
            raise RuntimeError("trained models are evaluated for the clients that trained them")
        rows = torch.tensor([members.tolist().index(c) for c in clients.tolist()])
        params = {n: t[rows.to(t.device)] for n, t in params.items()}
        arch = self.zoo.archs[kind]
        if arch.stateful:
            with torch.no_grad():
                params = params | self.batch_norm_statistics(arch, params, clients)
        return self.zoo.tagged(kind, params)

    def accuracy(self, clients: Tensor) -> Tensor:
        correct, total, _ = self.evaluate(clients, "val")
        return correct / total.clamp_min(1)

    def run_round(self, round_idx: int, clients: Tensor) -> Tensor:
        self._round_clients = clients
        self._trained = {}
        self._before = self.accuracy(clients)
        return super().run_round(round_idx, clients)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        clients = self._round_clients
        assert clients is not None and self._before is not None
        self._evaluate_trained = True
        try:
            trained = self.accuracy(clients)
        finally:
            self._evaluate_trained = False
        after = self.accuracy(clients)  # the server step has been taken
        for i, client in enumerate(clients.tolist()):
            self.diagnosis_rows.append(
                {
                    "round": self.global_step - 1,
                    "client": client,
                    "arch": self.zoo.names[int(self.zoo.group_of[client])],
                    "generated_before": float(self._before[i]),
                    "trained": float(trained[i]),
                    "generated_after": float(after[i]),
                }
            )
        super().on_train_batch_end(outputs, batch, batch_idx)

    def on_train_end(self) -> None:
        self.diagnosis_out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "mh_trained_vs_generated",
            "environment": environment(),
            "command": sys.argv,
            "rows": self.diagnosis_rows,
            "summary": summarize(self.diagnosis_rows),
        }
        self.diagnosis_out.write_text(json.dumps(result, indent=1))


def summarize(rows: list[dict[str, Any]], windows: int = 4) -> dict[str, Any]:
    """Mean accuracies per architecture over ``windows`` equal spans of rounds, and
    ``between_visits``: the mean of generated_before at a client's visit minus generated_after
    at its previous visit (what the other clients' server steps did to its generated model)."""
    last = max(r["round"] for r in rows) + 1
    span = -(-last // windows)
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    drifts: dict[tuple[str, int], list[float]] = defaultdict(list)
    previous: dict[int, dict[str, Any]] = {}
    for r in rows:
        key = (r["arch"], r["round"] // span)
        groups[key].append(r)
        if r["client"] in previous:
            drifts[key].append(r["generated_before"] - previous[r["client"]]["generated_after"])
        previous[r["client"]] = r
    out: dict[str, Any] = {}
    for (arch, w), members in sorted(groups.items()):
        keys = ("generated_before", "trained", "generated_after")
        drift = drifts[(arch, w)]
        out.setdefault(arch, {})[f"rounds {w * span}-{min(last, (w + 1) * span) - 1}"] = {
            "visits": len(members),
            **{k: sum(m[k] for m in members) / len(members) for k in keys},
            "between_visits": sum(drift) / len(drift) if drift else None,
        }
    return out


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "summarize":
        raise SystemExit("usage: python -m benchmarks.mh_trained_vs_generated summarize JSON...")
    for path in argv[1:]:
        summary = summarize(json.loads(Path(path).read_text())["rows"])
        print(f"\n{path}")
        print(
            "| arch | rounds | visits | generated before (%) | trained (%) | "
            "generated after (%) | between visits (points) |"
        )
        print("|---|---|---|---|---|---|---|")
        for arch, spans in summary.items():
            for span, s in spans.items():
                print(
                    f"| {arch} | {span} | {s['visits']} | {100 * s['generated_before']:.1f} | "
                    f"{100 * s['trained']:.1f} | {100 * s['generated_after']:.1f} | "
                    + ("-" if s["between_visits"] is None else f"{100 * s['between_visits']:+.1f}")
                    + " |"
                )


if __name__ == "__main__":
    main(sys.argv[1:])
