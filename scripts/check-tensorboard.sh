#!/usr/bin/env bash
# Checks that the real `tensorboard` Python package reads back every scalar a Keel job writes:
# runs a short `keel local` job (1 coordinator, 2 workers, 30 steps, held-out eval every 10) on
# the King James Bible, whose pull brings the TensorBoard event files beside metrics.jsonl, then
# reads them with tensorboard's EventAccumulator and compares every value with metrics.jsonl
# (scripts/check_tensorboard.py).
#
# Usage: scripts/check-tensorboard.sh [BIN_DIR]
#   BIN_DIR  built keel, keel-coordinator, keel-worker (default: $CARGO_TARGET_DIR/release, else
#            target/release)
#
# tensorboard comes from PyPI, pinned, in a venv under /var/cache/keel-validate (as root) or
# ${XDG_CACHE_HOME:-~/.cache}/keel-validate (as a user), made once. When PyPI cannot be reached
# the check is skipped with a message and exit 0; any other failure exits 1.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
case "${1:-}" in -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
BIN_DIR="${1:-${CARGO_TARGET_DIR:-$REPO/target}/release}"
for b in keel keel-coordinator keel-worker; do
  [ -x "$BIN_DIR/$b" ] || { echo "check-tensorboard: no $BIN_DIR/$b (cargo build --release --bins)" >&2; exit 1; }
done

TENSORBOARD_VERSION=2.21.0
if [ "$(id -u)" = 0 ]; then CACHE=/var/cache/keel-validate; else CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/keel-validate"; fi
VENV=$CACHE/venv-tensorboard$TENSORBOARD_VERSION
PY=/usr/bin/python3
[ -x "$PY" ] || PY="$(command -v python3)"

if ! "$VENV/bin/python" -c 'import tensorboard' 2>/dev/null; then
  echo "check-tensorboard: installing tensorboard==$TENSORBOARD_VERSION into $VENV"
  log="$(mktemp)"
  if ! { mkdir -p "$CACHE" && "$PY" -m venv "$VENV" \
         && timeout 300 "$VENV/bin/pip" install -q --disable-pip-version-check "tensorboard==$TENSORBOARD_VERSION"; } >"$log" 2>&1; then
    rm -rf "$VENV"
    if ! "$PY" -c 'import urllib.request; urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=15)' 2>/dev/null; then
      echo "check-tensorboard: SKIPPED: PyPI is unreachable, so the tensorboard package cannot be installed"
      rm -f "$log"
      exit 0
    fi
    echo "check-tensorboard: installing tensorboard failed although PyPI is reachable:" >&2
    tail -n 10 "$log" | sed 's/^/  /' >&2
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
fi

[ -f corpora/en-kjv/kjv.txt ] || scripts/corpora.sh en-kjv
work="$(mktemp -d /tmp/keel-tensorboard.XXXXXX)"
trap 'rm -rf "$work"' EXIT
cat > "$work/job.toml" <<TOML
[data]
corpus = ["$REPO/corpora/en-kjv/kjv.txt"]
vocab_size = 2000
lowercase = true
objective = "mlm"
max_seq_length = 64
masked_lm_prob = 0.15
max_predictions_per_seq = 10
heldout_fraction = 0.01
[model]
preset = "tiny"
[train]
micro_batch_size = 8
max_steps = 30
optimizer = "adamw"
learning_rate = 1e-3
warmup_steps = 3
schedule = "linear"
seed = 7
checkpoint_every = 30
eval_every = 10
[cluster]
min_workers = 2
max_workers = 2
TOML
echo "check-tensorboard: a 30-step job on a local cluster (2 workers)"
if ! "$BIN_DIR/keel" local --quiet --workers 2 --work-dir "$work/cluster" "$work/job.toml" --out "$work/out" >"$work/local.log" 2>&1; then
  echo "check-tensorboard: keel local failed:" >&2
  tail -n 20 "$work/local.log" | sed 's/^/  /' >&2
  exit 1
fi
for f in "$work/out"/*; do echo "  pulled: ${f##*/}"; done
"$VENV/bin/python" scripts/check_tensorboard.py "$work/out" --min-steps 30 --min-evals 3
