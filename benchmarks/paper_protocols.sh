#!/usr/bin/env bash
# The papers' full protocols on FashionMNIST (issue "Paper-faithful by default", deliverables 8
# and 9): every run of the three settings at once, each a process of its own on one device.
# Usage, from the repository root: benchmarks/paper_protocols.sh ROOT [MAX_TIME [SETTING...]]
# ROOT holds FashionMNIST/raw; MAX_TIME (Lightning's DD:HH:MM:SS, default 00:00:08:00) stops a run
# that has not finished by then, which its row records (`stopped_by`, `rounds`). Rows go to
# benchmarks/results/<setting>/, run logs to benchmarks/runs/<setting>/. PYTHON: the interpreter
# (default python3).
set -uo pipefail
root=$1
max_time=${2:-00:00:08:00}
shift $(($# < 2 ? $# : 2))
settings=("${@:-fashion_mnist_pfedhn_table1 fashion_mnist_pfedkt_table1 fashion_mnist_mlp_5000rounds}")
status=0
for setting in ${settings[*]}; do
  jobs=$(find "configs/$setting" -name '*.yaml' | wc -l)
  "${PYTHON:-python3}" -m benchmarks.accuracy --setting "$setting" --root "$root" --jobs "$jobs" \
    --log-dir "benchmarks/runs/$setting" --extra "--trainer.max_time=$max_time" &
done
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
