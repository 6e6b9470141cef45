#!/usr/bin/env bash
# Checks that two builds of Keel train to the same bytes: runs one set of short jobs with the
# binaries in OLD_BIN and again with those in NEW_BIN (each a folder holding keel,
# keel-coordinator and keel-worker) and compares the final `model.safetensors` and
# `optimizer.safetensors` of each job by sha256. For refactors that must change nothing a user
# sees: plain data parallelism, ZeRO-1, a two-phase job, DiLoCo and LAMB, in fp32 and bf16.
#
# Usage: scripts/same-bytes.sh OLD_BIN NEW_BIN [WORK_DIR]
#   e.g. build the old revision in a worktree with its own CARGO_TARGET_DIR, then
#   scripts/same-bytes.sh /tmp/old-target/release target/release
# Environment: KEEL_SAME_BYTES_CASES (space-separated case names; default all), KEEL_THREADS
#   (compute threads per worker, default 1, the same for both builds).
# Exit status 0 when every case matches; 1 when any differs or fails to run.
#
# Both builds run on this machine with the same vocabulary file (fixtures/wordpiece/vocab.txt)
# and corpus, so the prepared data is the same; bf16 results depend on the CPU's bf16 route, so
# compare builds only on one machine.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
if [ $# -lt 2 ]; then
  sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
old=$(realpath "$1")
new=$(realpath "$2")
work=${3:-$(mktemp -d)}
mkdir -p "$work"
work=$(realpath "$work")
export KEEL_THREADS=${KEEL_THREADS:-1}
for b in "$old" "$new"; do
  for exe in keel keel-coordinator keel-worker; do
    [ -x "$b/$exe" ] || { echo "same-bytes: $b/$exe is missing (build with cargo build --release --bins)" >&2; exit 2; }
  done
done

if [ ! -f corpora/en-kjv/kjv.txt ]; then scripts/corpora.sh en-kjv >/dev/null; fi
corpus="$work/kjv-part.txt"
head -n 3000 corpora/en-kjv/kjv.txt > "$corpus"
vocab="$root/fixtures/wordpiece/vocab.txt"

# job CASE: prints the job file of one case.
job() {
  local precision=fp32 extra="" tail="" optimizer=adamw lr=1e-3
  case "$1" in
    plain-fp32) ;;
    plain-bf16) precision=bf16 ;;
    zero1-fp32) extra="shard_optimizer = true" ;;
    zero1-bf16) precision=bf16; extra="shard_optimizer = true" ;;
    lamb-bf16) precision=bf16; optimizer=lamb; lr=4e-3 ;;
    accum-fp32) extra="" ;;
    two-phase-bf16)
      precision=bf16
      tail=$'[[phase]]\nstart_step = 8\nmax_seq_length = 128\nmax_predictions_per_seq = 20\nmicro_batch_size = 4'
      ;;
    diloco-fp32) tail=$'[diloco]\ninner_steps = 3\nouter_learning_rate = 0.7\nouter_momentum = 0.5' ;;
    diloco-bf16)
      precision=bf16
      tail=$'[diloco]\ninner_steps = 3\nouter_learning_rate = 0.7\nouter_momentum = 0.5'
      ;;
    *) echo "same-bytes: no case named $1" >&2; return 1 ;;
  esac
  local accum=1 mbs=8
  if [ "$1" = accum-fp32 ]; then accum=2; mbs=4; fi
  cat <<JOB
[data]
corpus = ["$corpus"]
vocab = "$vocab"
lowercase = true
objective = "mlm"
max_seq_length = 64
masked_lm_prob = 0.15
max_predictions_per_seq = 10
heldout_fraction = 0.01

[model]
preset = "tiny"

[train]
micro_batch_size = $mbs
gradient_accumulation_steps = $accum
max_steps = 12
optimizer = "$optimizer"
learning_rate = $lr
warmup_steps = 2
schedule = "linear"
weight_decay = 0.01
max_grad_norm = 1.0
seed = 42
checkpoint_every = 6
eval_every = 6
precision = "$precision"
$extra

[cluster]
min_workers = 2
max_workers = 2

$tail
JOB
}

cases=${KEEL_SAME_BYTES_CASES:-"plain-fp32 plain-bf16 accum-fp32 zero1-fp32 zero1-bf16 lamb-bf16 two-phase-bf16 diloco-fp32 diloco-bf16"}
failed=0
printf "%-16s %-22s %s\n" case file result
for c in $cases; do
  for side in old new; do
    bin=$old; [ "$side" = new ] && bin=$new
    dir="$work/$c/$side"
    rm -rf "$dir"; mkdir -p "$dir"
    job "$c" > "$dir/job.toml"
    if ! "$bin/keel" local --quiet --workers 2 --work-dir "$dir/work" "$dir/job.toml" --out "$dir/checkpoint" > "$dir/run.log" 2>&1; then
      echo "same-bytes: $c failed with the $side build; its log: $dir/run.log" >&2
      tail -n 20 "$dir/run.log" >&2
      failed=1
      continue 2
    fi
  done
  for f in model.safetensors optimizer.safetensors; do
    a=$(sha256sum < "$work/$c/old/checkpoint/$f" | cut -c1-16)
    b=$(sha256sum < "$work/$c/new/checkpoint/$f" | cut -c1-16)
    if [ "$a" = "$b" ]; then
      printf '%-16s %-22s same (%s)\n' "$c" "$f" "$a"
    else
      printf '%-16s %-22s DIFFERENT (old %s, new %s)\n' "$c" "$f" "$a" "$b"
      failed=1
    fi
  done
done
exit "$failed"
