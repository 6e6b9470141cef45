#!/usr/bin/env bash
# The ring all-reduce on a slow link, gradients as f32 vs bf16 on the wire
# (`train.allreduce_dtype`): `keel-worker bench-allreduce --dtype fp32|bf16`, alternated round by
# round in the same minutes, with every peer inside one network namespace whose loopback is
# shaped by `tc qdisc ... tbf rate RATE`. All ring links share that one shaped loopback (like
# hosts on one shared medium): each of the n links gets about RATE / n, which is what a
# bandwidth-bound ring sees; the ratio fp32 / bf16 is the point, not the absolute figure.
#
# Prints one JSON line per (round, dtype, workers, size) as bench-allreduce does, with "rate"
# and "round" added, and then a Markdown table: median seconds over rounds, fp32 vs bf16.
#
# With --train-steps N it then trains: `keel local --threads 1` in the same namespace,
# bert-mini on corpora/en-kjv (vocabulary 8,000, micro-batch 8 x 128 tokens, as
# examples/scaling.sh), N steps on 1 worker (dtype "none": no ring, the compute alone), then 2
# workers with train.allreduce_dtype = fp32, then bf16, --rounds times, and prints per run the
# mean step seconds and all-reduce seconds (metrics.jsonl, steps after the first 20%) and the
# final training loss.
#
# Usage (as root; needs ip and tc, Debian: iproute2):
#   scripts/bench-wire.sh [--rate 1gbit] [--workers 2,4] [--sizes-mib 4,16,64] [--rounds 2]
#                         [--iters 3] [--train-steps N] [--bin-dir DIR] [--out FILE.jsonl]
# The namespace is removed on exit, whatever the exit; every run is bounded by --timeout-secs.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RATE=1gbit
WORKERS=2,4
SIZES=4,16,64
ROUNDS=2
ITERS=3
TRAIN_STEPS=0
BIN_DIR="${CARGO_TARGET_DIR:-$REPO/target}/release"
OUT="$REPO/target/bench-wire.jsonl"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "bench-wire: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --rate) RATE="${2:?--rate needs a tc rate such as 1gbit}"; shift ;;
    --workers) WORKERS="${2:?--workers needs a list}"; shift ;;
    --sizes-mib) SIZES="${2:?--sizes-mib needs a list}"; shift ;;
    --rounds) ROUNDS="${2:?--rounds needs a number}"; shift ;;
    --iters) ITERS="${2:?--iters needs a number}"; shift ;;
    --train-steps) TRAIN_STEPS="${2:?--train-steps needs a number}"; shift ;;
    --bin-dir) BIN_DIR="${2:?--bin-dir needs a directory}"; shift ;;
    --out) OUT="${2:?--out needs a file}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done

[ "$(id -u)" = 0 ] || die "needs root (network namespaces and tc)"
{ command -v ip && command -v tc; } >/dev/null || die "'ip' and 'tc' not found (Debian: apt-get install iproute2)"
[ -x "$BIN_DIR/keel-worker" ] || die "$BIN_DIR/keel-worker not found (cargo build --release)"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive number, got $ROUNDS"

[[ "$TRAIN_STEPS" =~ ^[0-9]+$ ]] || die "--train-steps must be a number, got $TRAIN_STEPS"

NS="keelwire$$"
WORK="$(mktemp -d)"
cleanup() { ip netns del "$NS" 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
ip netns add "$NS"
ip netns exec "$NS" ip link set lo up
ip netns exec "$NS" tc qdisc replace dev lo root tbf rate "$RATE" burst 256kb latency 50ms \
  || die "tc tbf on the namespace's loopback failed"
SHAPING="$(ip netns exec "$NS" tc qdisc show dev lo | head -n 1)"
echo "bench-wire: $SHAPING (namespace $NS); $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) cores" >&2

mkdir -p "$(dirname "$OUT")"
: > "$OUT"
for round in $(seq 1 "$ROUNDS"); do
  for dtype in fp32 bf16; do
    ip netns exec "$NS" timeout 1800 "$BIN_DIR/keel-worker" bench-allreduce \
        --workers "$WORKERS" --sizes-mib "$SIZES" --iters "$ITERS" --dtype "$dtype" --timeout-secs 300 \
      | python3 -c '
import json, sys
for line in sys.stdin:
    row = json.loads(line)
    row.update(rate=sys.argv[1], round=int(sys.argv[2]))
    print(json.dumps(row), flush=True)
' "$RATE" "$round" | tee -a "$OUT"
  done
done

python3 - "$OUT" "$RATE" <<'PY'
import json, statistics, sys
from collections import defaultdict
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = defaultdict(list)
for r in rows:
    by[(r["workers"], r["bytes"], r["dtype"])].append(r["seconds"])
print(f"\n| workers | gradient MiB | fp32 wire, ms | bf16 wire, ms | fp32 / bf16 |  ({sys.argv[2]} shared loopback, median of rounds)")
print("|---|---|---|---|---|")
for (w, b) in sorted({(k[0], k[1]) for k in by}):
    f, h = by.get((w, b, "fp32")), by.get((w, b, "bf16"))
    if not f or not h:
        continue
    f, h = statistics.median(f), statistics.median(h)
    print(f"| {w} | {b / 2**20:g} | {f * 1e3:.1f} | {h * 1e3:.1f} | {f / h:.2f} |")
PY

[ "$TRAIN_STEPS" -gt 0 ] || exit 0
[ -x "$BIN_DIR/keel" ] || die "$BIN_DIR/keel not found (cargo build --release)"
"$REPO/scripts/corpora.sh" >/dev/null
for round in $(seq 1 "$ROUNDS"); do
  # "none": one worker, no ring: the step's compute alone (the scale model's calibration).
  for dtype in none fp32 bf16; do
    workers=2
    [ "$dtype" = none ] && workers=1
    run="$WORK/$dtype-$round"
    mkdir -p "$run"
    cat > "$run/job.toml" <<TOML
[data]
corpus = ["$REPO/corpora/en-kjv"]
vocab_size = 8000
max_seq_length = 128
max_predictions_per_seq = 20
[model]
preset = "mini"
[train]
micro_batch_size = 8
max_steps = $TRAIN_STEPS
learning_rate = 1e-3
warmup_steps = 4
checkpoint_every = 0
eval_every = 0
precision = "fp32"
allreduce_dtype = "${dtype/none/fp32}"
TOML
    ip netns exec "$NS" timeout 3600 "$BIN_DIR/keel" local --workers "$workers" --threads 1 --quiet \
        "$run/job.toml" --out "$run/out" --work-dir "$run/work" >"$run/log" 2>&1 \
      || { tail -n 20 "$run/log" >&2; die "keel local ($dtype wire) failed; its log is above"; }
    python3 - "$run/out/metrics.jsonl" "$dtype" "$round" "$RATE" "$workers" <<'PY'
import json, os, struct, sys
steps = [r for r in map(json.loads, open(sys.argv[1])) if "loss" in r]
# Parameters (the gradient's elements), from the checkpoint's safetensors header; the MLM
# decoder's weight is the word embeddings' (tied), counted once.
with open(os.path.join(os.path.dirname(sys.argv[1]), "model.safetensors"), "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
params = 0
for name, t in header.items():
    if name != "__metadata__" and name != "cls.predictions.decoder.weight":
        n = 1
        for d in t["shape"]:
            n *= d
        params += n
tail = steps[len(steps) // 5:]
mean = lambda k: sum(r[k] for r in tail) / len(tail)
print(json.dumps({"train": "bert-mini", "workers": int(sys.argv[5]), "rate": sys.argv[4],
                  "round": int(sys.argv[3]), "dtype": sys.argv[2], "steps": len(steps), "params": params,
                  "step_seconds": round(mean("step_seconds"), 4),
                  "allreduce_seconds": round(mean("allreduce_seconds"), 4),
                  "final_loss": round(steps[-1]["loss"], 4)}))
PY
  done
done | tee -a "$OUT"
