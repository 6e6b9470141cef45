#!/usr/bin/env bash
# Optimizer-state sharding (`train.shard_optimizer`, ZeRO stage 1) against the unsharded
# optimizer, per rank, on real jobs: `keel local --workers W --threads 1` trains a preset BERT
# on corpora/en-kjv (vocabulary 8,000, micro-batch MBS x 128 tokens) for STEPS steps, unsharded
# then sharded, alternated --rounds times in the same minutes, for each optimizer. Each worker
# logs a "rank summary" when its steps end (worker/src/train/summary.rs): mean step time, mean
# optimizer time (clipping and the update; with sharding the norms' all-reduces included, the
# weights' all-gather not), mean all-gather time, the optimizer state it holds, and the
# process's peak resident memory (VmHWM). Those lines are printed as JSON, one per rank and
# run, then a Markdown table of the medians over rounds and ranks.
#
# Usage: scripts/bench-shard.sh [--preset base] [--workers 2] [--steps 8] [--mbs 4]
#                               [--optimizers adamw,lamb] [--rounds 2] [--bin-dir DIR]
#                               [--out FILE.jsonl]
# Needs the release binaries (cargo build --release) and corpora/ (scripts/corpora.sh).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PRESET=base
WORKERS=2
STEPS=8
MBS=4
OPTIMIZERS=adamw,lamb
ROUNDS=2
BIN_DIR="${CARGO_TARGET_DIR:-$REPO/target}/release"
OUT="$REPO/target/bench-shard.jsonl"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "bench-shard: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --preset) PRESET="${2:?}"; shift ;;
    --workers) WORKERS="${2:?}"; shift ;;
    --steps) STEPS="${2:?}"; shift ;;
    --mbs) MBS="${2:?}"; shift ;;
    --optimizers) OPTIMIZERS="${2:?}"; shift ;;
    --rounds) ROUNDS="${2:?}"; shift ;;
    --bin-dir) BIN_DIR="${2:?}"; shift ;;
    --out) OUT="${2:?}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done
[ -x "$BIN_DIR/keel" ] || die "no $BIN_DIR/keel: run cargo build --release first"
[ -d "$REPO/corpora/en-kjv" ] || die "no corpora/en-kjv: run scripts/corpora.sh first"
[ "$STEPS" -ge 2 ] || die "--steps must be at least 2 (the first step is left out)"

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$(dirname "$OUT")"
: > "$OUT"

cpu="$(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //')"
echo "bench-shard: $PRESET, $WORKERS workers x 1 thread, $STEPS steps, micro-batch $MBS x 128, on $cpu" >&2

run() { # round optimizer sharded
  local round="$1" optimizer="$2" sharded="$3"
  local case="$WORK/r$round-$optimizer-$sharded"
  mkdir -p "$case"
  cat > "$case/job.toml" <<EOF
[data]
corpus = ["$REPO/corpora/en-kjv"]
vocab_size = 8000
lowercase = true
objective = "mlm"
max_seq_length = 128
max_predictions_per_seq = 20
heldout_fraction = 0.01
[model]
preset = "$PRESET"
[train]
micro_batch_size = $MBS
max_steps = $STEPS
optimizer = "$optimizer"
learning_rate = 1e-4
warmup_steps = 2
checkpoint_every = 0
eval_every = 0
shard_optimizer = $sharded
[cluster]
min_workers = $WORKERS
max_workers = $WORKERS
EOF
  if ! timeout 1800 "$BIN_DIR/keel" local --workers "$WORKERS" --threads 1 --quiet \
      "$case/job.toml" --out "$case/out" --work-dir "$case/work" > "$case/keel.out" 2>&1; then
    cat "$case/keel.out" >&2
    die "the run $optimizer sharded=$sharded failed (logs: $case/work/logs)"
  fi
  # One "rank summary" line per worker log, its key=value fields as JSON.
  grep -h "rank summary" "$case"/work/logs/worker-*.log | python3 -c '
import json, re, sys
round_, optimizer, sharded, preset, workers, cpu = sys.argv[1:7]
for line in sys.stdin:
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    fields = dict(re.findall(r"(\w+)=([^\s]+)", line))
    # What the worker did, not what the job asked: a run that did not shard must not pass.
    if fields.get("sharded") != sharded:
        sys.exit(f"bench-shard: a worker logged sharded={fields.get('sharded')}, the job asked {sharded}")
    row = {"round": int(round_), "preset": preset, "workers": int(workers),
           "optimizer": optimizer, "sharded": fields["sharded"] == "true", "cpu": cpu}
    for k in ("rank", "steps"):
        row[k] = int(fields[k])
    for k in ("mean_step_ms", "mean_optimizer_ms", "mean_weight_gather_ms",
              "optimizer_state_mib", "peak_rss_mib"):
        row[k] = float(fields[k].strip("\""))
    print(json.dumps(row))
' "$round" "$optimizer" "$sharded" "$PRESET" "$WORKERS" "$cpu" | tee -a "$OUT"
}

IFS=, read -r -a opts <<< "$OPTIMIZERS"
for round in $(seq 1 "$ROUNDS"); do
  for optimizer in "${opts[@]}"; do
    for sharded in false true; do
      run "$round" "$optimizer" "$sharded"
    done
  done
done

python3 - "$OUT" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keys = sorted({(r["optimizer"], r["sharded"]) for r in rows})
print()
print(f"{rows[0]['preset']}, {rows[0]['workers']} workers x 1 thread, on {rows[0]['cpu']}; "
      "medians over rounds and ranks")
print()
print("| optimizer | sharded | optimizer state per rank, MiB | peak RSS per rank, MiB "
      "| optimizer ms/step | weight all-gather ms/step | step ms |")
print("|---|---|---|---|---|---|---|")
for opt, sharded in keys:
    sel = [r for r in rows if r["optimizer"] == opt and r["sharded"] == sharded]
    med = lambda k: statistics.median(r[k] for r in sel)
    print(f"| {opt} | {'yes' if sharded else 'no'} | {med('optimizer_state_mib'):.0f} "
          f"| {med('peak_rss_mib'):.0f} | {med('mean_optimizer_ms'):.1f} "
          f"| {med('mean_weight_gather_ms'):.1f} | {med('mean_step_ms'):.0f} |")
EOF
