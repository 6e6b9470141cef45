#!/usr/bin/env bash
# Keel's measured numbers on this machine, as JSON lines (the fp32 step and ring figures of docs/performance.md):
#  1. training-step throughput (`keel-worker bench`): tiny and mini, 1 and 2 threads, batch 32 x seq 128;
#     base, 1 thread, batch 8; each in fp32 and in bf16 (native where oneDNN's bf16 beats fp32: AMX, or
#     AVX512_BF16 when the startup race says so; emulated -- slower than fp32 -- elsewhere: the `bf16_support` field says which);
#  2. ring all-reduce bus bandwidth (`keel-worker bench-allreduce`): 2, 3, 4 workers, 1-256 MiB;
#  3. data-parallel scaling of `keel local` (examples/scaling.sh): bert-mini, 1 vs 2 workers.
# The PyTorch peers are in scripts/peer/ (they need torch and transformers).
# Run it on an otherwise idle machine. Usage: scripts/bench.sh [OUT.jsonl]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench.jsonl}
cargo build --release --bins >/dev/null
bin=target/release
: > "$out"
for prec in fp32 bf16; do
  for cfg in tiny mini; do
    for t in 1 2; do
      "$bin/keel-worker" bench --config "$cfg" --threads "$t" --steps 5 --precision "$prec" | tee -a "$out"
    done
  done
  "$bin/keel-worker" bench --config base --batch 8 --threads 1 --steps 3 --precision "$prec" | tee -a "$out"
done
"$bin/keel-worker" bench-allreduce --workers 2,3,4 --sizes-mib 1,4,16,64,256 --iters 5 | tee -a "$out"
KEEL_BIN=$bin examples/scaling.sh 100 | tee /dev/stderr | awk '/efficiency/ { print "{\"scaling_efficiency_2_workers_bert_mini\":" $NF "}" }' >> "$out"
