#!/usr/bin/env bash
# Data-parallel scaling of Keel on this machine: bert-mini, the same per-worker micro-batch and
# 1 compute thread per worker, 1 worker vs 2 workers (`keel local`). Prints
#   efficiency = throughput_2 / (2 x throughput_1)
# for each round (1 worker, then 2) and from the medians over the rounds (tokens/s averaged
# over the steps after the first 20%; 40-step runs read ~1.5% lower). This machine's speed
# drifts by several percent from minute to minute, so one round alone can mislead.
# PyTorch DDP on the same configuration: scripts/peer/ddp_scaling.py.
# Needs at least 2 free cores to mean anything.
# Usage: examples/scaling.sh [STEPS [ROUNDS]]   (defaults 100 and 3; env KEEL_BIN: folder of the
# keel binaries; KEEL_PRECISION: train.precision, auto (the default), bf16 or fp32;
# KEEL_ALLREDUCE_DTYPE: train.allreduce_dtype, fp32 (the default) or bf16)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/corpora.sh >/dev/null
steps=${1:-100}
rounds=${2:-3}
precision=${KEEL_PRECISION:-auto}
wire=${KEEL_ALLREDUCE_DTYPE:-fp32}
bin=${KEEL_BIN:-target/release}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/job.toml" <<TOML
[data]
corpus = ["$(realpath corpora/en-kjv)"]
vocab_size = 8000
max_seq_length = 128
max_predictions_per_seq = 20
[model]
preset = "mini"
[train]
micro_batch_size = 8
max_steps = $steps
learning_rate = 1e-3
warmup_steps = 4
checkpoint_every = 0
eval_every = 0
precision = "$precision"
allreduce_dtype = "$wire"
TOML
run() {
  "$bin/keel" local --workers "$1" --threads 1 --quiet "$work/job.toml" --out "$work/out-$1" --work-dir "$work/w$1" |
    sed -n 's/.*throughput \([0-9.]*\) tok\/s.*/\1/p'
}
median() { sort -n | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
ones=()
twos=()
for ((r = 1; r <= rounds; r++)); do
  t1=$(run 1)
  t2=$(run 2)
  ones+=("$t1")
  twos+=("$t2")
  awk -v r="$r" -v a="$t1" -v b="$t2" \
    'BEGIN { printf "round %d: 1 worker %s tok/s, 2 workers %s tok/s, efficiency %.3f\n", r, a, b, b / (2 * a) }'
done
m1=$(printf '%s\n' "${ones[@]}" | median)
m2=$(printf '%s\n' "${twos[@]}" | median)
echo "train.precision = $precision, train.allreduce_dtype = $wire"
echo "median over $rounds rounds: 1 worker: $m1 tok/s; 2 workers: $m2 tok/s"
awk -v a="$m1" -v b="$m2" 'BEGIN { printf "scaling efficiency throughput_2 / (2 x throughput_1) = %.3f\n", b / (2 * a) }'
