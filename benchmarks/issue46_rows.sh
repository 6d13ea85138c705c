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

has_seeds() {  # has_seeds FILE SEED...: the file holds a row of every SEED
  [[ -f $1 ]] && "$python" - "$@" <<'EOF'
import json, sys
seeds = {r["seed"] for r in json.load(open(sys.argv[1]))["rows"]}
sys.exit(0 if {int(s) for s in sys.argv[2:]} <= seeds else 1)
EOF
}

dirichlet=() pathological=()
for m in "${methods[@]}"; do
  has_seeds "benchmarks/results/fashion_mnist_dirichlet/$m.json" 0 1 2 || dirichlet+=("$m")
  has_seeds "benchmarks/results/fashion_mnist/$m.json" 1 2 || pathological+=("$m")
done
echo "dirichlet: ${dirichlet[*]:-none}; pathological seeds 1-2: ${pathological[*]:-none}"
status=0
if ((${#dirichlet[@]})); then
  "$python" -m benchmarks.accuracy --setting fashion_mnist_dirichlet --root "$root" \
    --methods "${dirichlet[@]}" --seeds 0 1 2 --rounds-scale 0.1 --jobs "${#dirichlet[@]}" \
    --log-dir benchmarks/runs/issue46/dirichlet "${resume[@]}" \
    --extra "--trainer.max_time=$max_time" &
fi
if ((${#pathological[@]})); then
  "$python" -m benchmarks.accuracy --setting fashion_mnist --root "$root" --splits pathological \
    --methods "${pathological[@]}" --seeds 1 2 --rounds-scale 0.1 --jobs "${#pathological[@]}" \
    --log-dir benchmarks/runs/issue46/pathological "${resume[@]}" \
    --extra "--trainer.max_time=$max_time" &
fi
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
