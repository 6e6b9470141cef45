#!/usr/bin/env bash
# Data-parallel scaling of Keel on this machine: bert-mini, the same per-worker micro-batch and
# 1 compute thread per worker, 1 worker vs 2 workers (`keel local`). Prints
#   efficiency = throughput_2 / (2 x throughput_1)
# (tokens/s averaged over the steps after the first 20%; 40-step runs read ~1.5% lower).
# PyTorch DDP on the same configuration: scripts/peer/ddp_scaling.py.
# Needs at least 2 free cores to mean anything.
# Usage: examples/scaling.sh [STEPS]   (env KEEL_BIN: folder of the keel binaries)
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-100}
bin=${KEEL_BIN:-target/release}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/job.toml" <<TOML
[data]
corpus = ["$(realpath ../shared/corpus/en-kjv)"]
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
TOML
run() {
  "$bin/keel" local --workers "$1" --threads 1 --quiet "$work/job.toml" --out "$work/out-$1" --work-dir "$work/w$1" |
    sed -n 's/.*throughput \([0-9.]*\) tok\/s.*/\1/p'
}
t1=$(run 1)
t2=$(run 2)
echo "1 worker: $t1 tok/s; 2 workers: $t2 tok/s"
awk -v a="$t1" -v b="$t2" 'BEGIN { printf "scaling efficiency throughput_2 / (2 x throughput_1) = %.3f\n", b / (2 * a) }'
