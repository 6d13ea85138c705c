"""Every random stream of a run, in one table.

A random draw is keyed by what it draws, never by the order in which code asks:
``derive_seed(seed, [round,] STREAM, ...)`` seeds a generator for that draw alone, so a resumed
run and every DDP rank draw what an uninterrupted single-process run draws. Two draws of one
run must not share a key. The ids below keep the values every committed result was run with.

- Run-wide streams (any method, the base class, conditions, DP, callbacks) are distinct from
  each other and from every method's streams.
- A method's own streams are distinct among themselves; two different methods may reuse an id,
  since one run trains one method (FedFomo and FedGen both use 7, MH-pFedHN and CCVR 14,
  Power-of-Choice and pFedGP 16).
- Kept overlaps (values every committed result was run with), each safe for the reason given:
  Per-FedAvg's evaluation adaptation and the novel-client callback both use 101, with keys of
  different lengths (``(seed, round, 101)`` and ``(seed, 101)``), so their seeds differ; the
  architecture assignment (7) seeds only methods with several architectures, and FedFomo and
  FedGen (also 7) have one. :data:`KEPT_OVERLAPS` lists them.

``tests/test_streams.py`` checks these rules against the table.
"""

from __future__ import annotations

# Run-wide
INIT_STREAM = 0  # the method's initialization (FederatedMethod.seeded_init)
CLIENT_STREAM = 1  # which clients a round samples
BATCH_STREAM = 2  # local-training batches (phases of a round add a key)
SERVER_INIT_STREAM = 3  # server-side modules a method builds (seeded_init's default)
DROPOUT_STREAM = 4  # dropout during a round's local training
CONDITIONS_STREAM = 5  # drops, stragglers and availability (lightning_pfl.conditions)
ARCHITECTURE_STREAM = 7  # which client gets which architecture (lightning_pfl.assignment)
NOVEL_ADAPTATION_STREAM = 101  # the novel-client callback's adaptation batches
NOISE_STREAM = 1001  # client-level DP noise (lightning_pfl.privacy)
ATTACK_STREAM = 1002  # the gradient-inversion attack's victim batch and dummy start

RUN_WIDE = {
    "INIT_STREAM": INIT_STREAM,
    "CLIENT_STREAM": CLIENT_STREAM,
    "BATCH_STREAM": BATCH_STREAM,
    "SERVER_INIT_STREAM": SERVER_INIT_STREAM,
    "DROPOUT_STREAM": DROPOUT_STREAM,
    "CONDITIONS_STREAM": CONDITIONS_STREAM,
    "ARCHITECTURE_STREAM": ARCHITECTURE_STREAM,
    "NOVEL_ADAPTATION_STREAM": NOVEL_ADAPTATION_STREAM,
    "NOISE_STREAM": NOISE_STREAM,
    "ATTACK_STREAM": ATTACK_STREAM,
}

# Per method
FOMO_STREAM = 7  # FedFomo: the epsilon-greedy model choice
GENERATOR_STREAM = 7  # FedGen: generated samples and the generator's training
FLOCO_STREAM = 8  # Floco: the sampled simplex points
CONSTRAINED_STREAM = 11  # MH-pFedHN: the constrained clients
GLOBAL_STREAM = 12  # MH-pFedHN-G/GD: which clients hold the global model
RECALIBRATION_STREAM = 13  # MH-pFedHN: batches that re-estimate batch-norm statistics
ORDER_STREAM = 14  # MH-pFedHN: the order of the server's per-client steps
CALIBRATION_STREAM = 14  # CCVR: the virtual representations and their batch order
ADAPT_STREAM = 101  # Per-FedAvg: the evaluation's adaptation batch, keyed by round
LOAD_STREAM = 15  # PartialFed: the relaxed-Bernoulli noise of the per-layer load choice
LOSS_SAMPLE_STREAM = 16  # Power-of-Choice (cpow-d): the b samples of each candidate's loss
SPLIT_STREAM = 16  # pFedGP: which batch points condition the GP and which it scores

PER_METHOD = {
    "FedFomo": {"FOMO_STREAM": FOMO_STREAM},
    "FedGen": {"GENERATOR_STREAM": GENERATOR_STREAM},
    "Floco": {"FLOCO_STREAM": FLOCO_STREAM},
    "MHPFedHN": {
        "CONSTRAINED_STREAM": CONSTRAINED_STREAM,
        "GLOBAL_STREAM": GLOBAL_STREAM,
        "RECALIBRATION_STREAM": RECALIBRATION_STREAM,
        "ORDER_STREAM": ORDER_STREAM,
    },
    "CCVR": {"CALIBRATION_STREAM": CALIBRATION_STREAM},
    "PerFedAvg": {"ADAPT_STREAM": ADAPT_STREAM},
    "PartialFed": {"LOAD_STREAM": LOAD_STREAM},
    "FedAvgPoC": {"LOSS_SAMPLE_STREAM": LOSS_SAMPLE_STREAM},
    "PFedGP": {"SPLIT_STREAM": SPLIT_STREAM},
}
KEPT_OVERLAPS = {
    frozenset({"NOVEL_ADAPTATION_STREAM", "ADAPT_STREAM"}),
    frozenset({"ARCHITECTURE_STREAM", "FOMO_STREAM"}),
    frozenset({"ARCHITECTURE_STREAM", "GENERATOR_STREAM"}),
}
