#!/usr/bin/env bash
# Issue 46's benchmark rows still missing, all at once on one device: the FashionMNIST
# Dirichlet(0.3) rows (seeds 0-2, the part-1 protocol at --rounds-scale 0.1) of every issue-46
# config without rows in benchmarks/results/fashion_mnist_dirichlet/, and pathological seeds 1-2
# of every issue-46 config whose benchmarks/results/fashion_mnist/ file lacks them; each method a
# process of its own, its seeds one job. Rows merge into those files (seed 0's kept).
# Usage, from the repository root: benchmarks/issue46_rows.sh ROOT [MAX_TIME]
# ROOT holds FashionMNIST/raw; MAX_TIME (Lightning's DD:HH:MM:SS, default 00:00:08:00) stops a
# run that has not finished by then; rerun with RESUME=1 to go on from its last.ckpt (logs in
# benchmarks/runs/issue46/). PYTHON: the interpreter (default python3).
set -uo pipefail
root=$1
max_time=${2:-00:00:08:00}
python=${PYTHON:-python3}
methods=(scaffold feddyn fedadam fedyogi fedadagrad fednova fedala fedbabu fedamp gpfl fedlc
  fedcp apple fedas fedgen fedem cfl floco ccvr qffl fedmgda_plus power_of_choice)
resume=()
[[ ${RESUME:-0} == 1 ]] && resume=(--resume)

missing() {  # missing SETTING SPLIT SEEDS: the methods whose rows of SPLIT there lack a SEED
  "$python" - "$@" "${methods[@]}" <<'EOF'
import json, sys
from pathlib import Path

setting, split, seeds, *methods = sys.argv[1:]
wanted = {int(s) for s in seeds.split(",")}


def has_rows(method: str) -> bool:
    path = Path("benchmarks/results", setting, f"{method}.json")
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    return wanted <= {r["seed"] for r in rows if r["split"] == split}


print(" ".join(m for m in methods if not has_rows(m)))
EOF
}

read -r -a dirichlet <<<"$(missing fashion_mnist_dirichlet dirichlet 0,1,2)"
# FedAMP's config (alpha = 1) is refused at 100 clients; its Dirichlet rows run at
# alpha = lambda = 0.495 (docs/results.md), so it trains in a job of its own.
fedamp_extra=()
if [[ " ${dirichlet[*]} " == *" fedamp "* ]]; then
  dirichlet=("${dirichlet[@]/fedamp/}")
  read -r -a dirichlet <<<"${dirichlet[*]}"
  fedamp_extra=(--model.init_args.alpha=0.495 --model.init_args.lam=0.495)
fi
read -r -a pathological <<<"$(missing fashion_mnist pathological 1,2)"
echo "dirichlet: ${dirichlet[*]:-none}; pathological seeds 1-2: ${pathological[*]:-none}"
status=0
if ((${#dirichlet[@]})); then
  "$python" -m benchmarks.accuracy --setting fashion_mnist_dirichlet --root "$root" \
    --methods "${dirichlet[@]}" --seeds 0 1 2 --rounds-scale 0.1 --jobs "${#dirichlet[@]}" \
    --log-dir benchmarks/runs/issue46/dirichlet "${resume[@]}" \
    --extra "--trainer.max_time=$max_time" &
fi
if ((${#fedamp_extra[@]})); then
  "$python" -m benchmarks.accuracy --setting fashion_mnist_dirichlet --root "$root" \
    --methods fedamp --seeds 0 1 2 --rounds-scale 0.1 \
    --log-dir benchmarks/runs/issue46/dirichlet "${resume[@]}" \
    --extra "--trainer.max_time=$max_time" "${fedamp_extra[@]}" &
fi
if ((${#pathological[@]})); then
  "$python" -m benchmarks.accuracy --setting fashion_mnist --root "$root" --splits pathological \
    --methods "${pathological[@]}" --seeds 1 2 --rounds-scale 0.1 --jobs "${#pathological[@]}" \
    --log-dir benchmarks/runs/issue46/pathological "${resume[@]}" \
    --extra "--trainer.max_time=$max_time" &
fi
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
