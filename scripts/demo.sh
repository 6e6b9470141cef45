#!/usr/bin/env bash
# Keel's main job on one machine: installs what it needs, builds Keel, and pretrains a tiny
# BERT on real text with a local cluster of real processes (1 coordinator + 2 workers talking
# gRPC on 127.0.0.1), then pulls the Hugging Face checkpoint and asks it to fill a [MASK].
#
# Usage: scripts/demo.sh [CORPUS_PATH...]
#   Default corpus: the King James Bible from Debian's `bible-kjv` package.
# Environment: KEEL_DEMO_STEPS (default 300), KEEL_DEMO_OUT (default demo-out), KEEL_DEMO_WORKERS (2).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
steps=${KEEL_DEMO_STEPS:-300}
out=${KEEL_DEMO_OUT:-demo-out}
workers=${KEEL_DEMO_WORKERS:-2}

say() { printf '\n==> %s\n' "$*"; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    echo "need root (or sudo) to run: $*" >&2; exit 1; fi
}

need_pkgs=()
[ -e /usr/include/x86_64-linux-gnu/cblas.h ] || [ -e /usr/include/cblas.h ] || \
  dpkg -s libopenblas-dev >/dev/null 2>&1 || need_pkgs+=(libopenblas-dev)
command -v cc >/dev/null || need_pkgs+=(build-essential)
command -v curl >/dev/null || need_pkgs+=(curl ca-certificates)
if [ $# -eq 0 ] && ! command -v bible >/dev/null; then need_pkgs+=(bible-kjv); fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
  say "Installing Debian packages: ${need_pkgs[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null && [ -x "$HOME/.cargo/bin/cargo" ]; then export PATH="$HOME/.cargo/bin:$PATH"; fi
if ! command -v cargo >/dev/null; then
  say "Installing the Rust toolchain with rustup (into ~/.cargo)"
  curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  export PATH="$HOME/.cargo/bin:$PATH"
fi

say "Building Keel (release; the first build takes ~5 minutes on 2 cores)"
cargo build --release --bins
bin="$root/target/release"

corpus=("$@")
if [ ${#corpus[@]} -eq 0 ]; then
  mkdir -p "$out"
  kjv="$out/kjv.txt"
  if [ ! -s "$kjv" ]; then
    say "Writing the King James Bible (Debian's bible-kjv) to $kjv: one verse a line, one chapter a document"
    bible -f "Ge1:1-Re22:21" | awk '{
        ref = $1; chapter = ref; sub(/:.*/, "", chapter);
        if (NR > 1 && chapter != last) print "";
        last = chapter; $1 = ""; sub(/^ /, ""); print }' > "$kjv.tmp"
    mv "$kjv.tmp" "$kjv"
  fi
  corpus=("$kjv")
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
max_seq_length = 128
masked_lm_prob = 0.15
max_predictions_per_seq = 20
heldout_fraction = 0.01
[model]
preset = "tiny"
[train]
micro_batch_size = 16
max_steps = $steps
optimizer = "adamw"
learning_rate = 1e-3
warmup_steps = $((steps / 10))
schedule = "linear"
seed = 42
checkpoint_every = 100
eval_every = 100
[cluster]
min_workers = $workers
max_workers = $workers
TOML
} > "$job"

say "Pretraining a tiny BERT ($steps steps) on a local cluster: 1 coordinator + $workers workers"
"$bin/keel" local --workers "$workers" "$job" --out "$out/checkpoint"

say "Checkpoint (Hugging Face layout) in $out/checkpoint:"
ls -l "$out/checkpoint"

say "What the model learned: keel fill-mask"
"$bin/keel" fill-mask --checkpoint "$out/checkpoint" --top-k 5 "and god said , let there be [MASK] : and there was light ."
