#!/usr/bin/env bash
# Keel's main job on one machine: installs what it needs, builds Keel, and pretrains a tiny
# BERT on real text with a local cluster of real processes (1 coordinator + 2 workers talking
# gRPC on 127.0.0.1), then pulls the Hugging Face checkpoint and asks it to fill a [MASK].
#
# Usage: scripts/demo.sh [CORPUS_PATH...]
#   Default corpus: the King James Bible from Debian's `bible-kjv` package.
# Environment: KEEL_DEMO_STEPS (default 1200), KEEL_DEMO_OUT (default demo-out), KEEL_DEMO_WORKERS (2),
#   KEEL_DEMO_DASHBOARD (an address such as 127.0.0.1:9470: serve the live dashboard there; off).
#
# The recipe is chosen to show learning a person can see in two to three minutes on two cores:
# BERT-tiny on 32-token sequences (128 of them a step). At 128 tokens a tiny BERT spends its
# first thousands of steps guessing frequent words (`,` `the` `and`) whatever the context; with
# 32 it starts to use the neighbouring words within ~600 steps (docs/getting-started.md).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
steps=${KEEL_DEMO_STEPS:-1200}
out=${KEEL_DEMO_OUT:-demo-out}
workers=${KEEL_DEMO_WORKERS:-2}

say() { printf '\n==> %s\n' "$*"; }

say "Checking what Keel needs (OpenBLAS, a C compiler, Rust)"
scripts/setup.sh
if ! command -v cargo >/dev/null; then export PATH="$HOME/.cargo/bin:$PATH"; fi

say "Building Keel (release; the first build takes ~5 minutes on 2 cores)"
cargo build --release --bins
bin="${CARGO_TARGET_DIR:-$root/target}/release"

corpus=("$@")
if [ ${#corpus[@]} -eq 0 ]; then
  say "Writing the King James Bible (Debian's bible-kjv) to corpora/en-kjv: one verse a line, one chapter a document"
  scripts/corpora.sh en-kjv
  corpus=(corpora/en-kjv/kjv.txt)
fi

mkdir -p "$out"
job="$out/job.toml"
{
  echo "[data]"
  printf 'corpus = ['; sep=""; for c in "${corpus[@]}"; do printf '%s"%s"' "$sep" "$(realpath "$c")"; sep=", "; done; echo ']'
  cat <<TOML
vocab_size = 8000
lowercase = true
objective = "mlm"
max_seq_length = 32
masked_lm_prob = 0.15
max_predictions_per_seq = 5
heldout_fraction = 0.01
[model]
preset = "tiny"
[train]
micro_batch_size = $((128 / workers))
max_steps = $steps
optimizer = "adamw"
learning_rate = 1e-3
warmup_steps = $((steps / 10))
schedule = "linear"
seed = 42
checkpoint_every = $(( (steps + 2) / 3 ))
eval_every = $(( (steps + 2) / 3 ))
[cluster]
min_workers = $workers
max_workers = $workers
TOML
} > "$job"

say "Pretraining a tiny BERT ($steps steps) on a local cluster: 1 coordinator + $workers workers"
dashboard=()
if [ -n "${KEEL_DEMO_DASHBOARD:-}" ]; then dashboard=(--dashboard "$KEEL_DEMO_DASHBOARD"); fi
"$bin/keel" local --workers "$workers" "${dashboard[@]}" "$job" --out "$out/checkpoint"

say "Checkpoint (Hugging Face layout) in $out/checkpoint:"
ls -l "$out/checkpoint"

say "What the model learned: keel fill-mask"
if [ ${#corpus[@]} -eq 1 ] && [ "${corpus[0]}" = corpora/en-kjv/kjv.txt ]; then
  prompts=("in the beginning god created the [MASK] and the earth ."
           "and the lord [MASK] unto moses , saying ,"
           "and god said , let there be [MASK] : and there was light .")
else
  prompts=("the [MASK] of the world .")
fi
for p in "${prompts[@]}"; do
  "$bin/keel" fill-mask --checkpoint "$out/checkpoint" --top-k 5 "$p"
done
