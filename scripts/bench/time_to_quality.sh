#!/usr/bin/env bash
# Time to quality: Keel against the PyTorch route on this machine, on the same data, judged by
# one evaluator; then what the two checkpoints are worth when fine-tuned. A benchmark, not a test.
#
#  1. Keel: `keel local --workers 2 --threads 1` on examples/ttq-mini.toml (BERT-mini, seq 32,
#     precision auto = the job's fastest), stopped at the wall-clock budget. Checkpoints every
#     `checkpoint_every` steps; each is timed by when its last file was written.
#  2. The peer: PyTorch DDP over gloo, 2 processes x 1 thread (scripts/peer/mlm_ddp_train.py):
#     HF BertForMaskedLM, MLM head on the masked positions, the same config.json, vocabulary,
#     sequences (Keel's prepared shards, exported with `keel inspect`), global batch, AdamW
#     hyperparameters, warmup and schedule, and Keel's masking rule (BERT's count of masked
#     tokens, `--count-specials`; its own dynamic masks); its precision is its faster of fp32 and bf16
#     autocast on this CPU (measured first with scripts/peer/pytorch_bert_bench.py). Same budget;
#     checkpoints every 30 s of wall time.
#  3. One evaluator (scripts/bench/ttq_eval.py, transformers fp32) on one fixed pre-masked
#     held-out set (Keel's heldout.keel): held-out loss and accuracy of every checkpoint, the time
#     each system needs to reach the peer's final held-out loss, a JSON summary and a PNG.
#  4. Fine-tuning (scripts/bench/finetune.py): topic classification of Debian's fortunes
#     (scripts/bench/fortune_topics.py; the test split's fortunes are kept out of pretraining),
#     BertForSequenceClassification from Keel's last checkpoint, the peer's, and random weights,
#     3 seeds each, the same script and budget.
#
# Usage: scripts/bench/time_to_quality.sh [--minutes N] [--out DIR] [--job FILE] [--seed N]
#                                         [--no-finetune] [CORPUS...]
#   --minutes N    wall-clock budget of each training run (default 10)
#   --out DIR      results folder (default bench-out/ttq); summary.json, ttq.png, finetune.json
#   --job FILE     Keel job file (default examples/ttq-mini.toml); its corpus line is replaced
#   --seed N       the pretraining seed of both sides (the job's `seed`, the peer's --seed;
#                  default: the job file's). It fixes each side's initial weights, masks and
#                  dropout, so one seed is one draw: fine-tuning accuracy moved by 3 points
#                  between Keel's seeds 42 and 43 (docs/performance.md,
#                  "Time to quality and fine-tuning"); compare the two sides over several seeds.
#   CORPUS...      text files to pretrain on instead of the default (KJV + English fortunes
#                  without the fine-tuning test split)
# Environment: KEEL_PEER_VENV (default ~/.cache/keel/peer-venv): a Python venv with torch,
#   transformers and matplotlib; created with pip from PyPI when missing (about 6 GB: PyPI's
#   torch wheel carries CUDA libraries, which this CPU benchmark does not use).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)

minutes=10
out=bench-out/ttq
job_template=examples/ttq-mini.toml
finetune=1
seed=
corpus=()
while [ $# -gt 0 ]; do
  case "$1" in
    --minutes) minutes=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --job) job_template=$2; shift 2 ;;
    --seed) seed=$2; shift 2 ;;
    --no-finetune) finetune=0; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0 ;;
    -*) echo "time_to_quality: unknown option '$1'" >&2; exit 2 ;;
    *) corpus+=("$(realpath "$1")"); shift ;;
  esac
done
[[ "$minutes" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "time_to_quality: --minutes wants a number, got '$minutes'" >&2; exit 2; }
[ -f "$job_template" ] || { echo "time_to_quality: no job file $job_template" >&2; exit 2; }
[ -z "$seed" ] || [[ "$seed" =~ ^[0-9]+$ ]] || { echo "time_to_quality: --seed wants a whole number, got '$seed'" >&2; exit 2; }
budget=$(python3 -c "print(int(round($minutes * 60)))")
say() { printf '\n==> [%s] %s\n' "$(date +%T)" "$*"; }

say "Keel: build (release)"
scripts/setup.sh
if ! command -v cargo >/dev/null; then export PATH="$HOME/.cargo/bin:$PATH"; fi
cargo build --release --bins -q
bin="${CARGO_TARGET_DIR:-$root/target}/release"

venv=${KEEL_PEER_VENV:-$HOME/.cache/keel/peer-venv}
py="$venv/bin/python"
if ! "$py" -c "import torch, transformers, matplotlib" 2>/dev/null; then
  say "The peer: a Python venv with torch, transformers and matplotlib in $venv (pip, PyPI)"
  python3 -m venv "$venv"
  "$py" -m pip install -q --disable-pip-version-check torch transformers safetensors matplotlib
fi

rm -rf "$out"
mkdir -p "$out"
out=$(realpath "$out")
{
  echo "date: $(date -u +%FT%TZ)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), family $(grep -m1 'cpu family' /proc/cpuinfo | cut -d: -f2 | xargs) model $(grep -m1 '^model\s' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
  echo "flags: $(grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|amx_bf16|amx_tile)$' | xargs)"
  echo "keel: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "torch: $("$py" -c 'import torch, transformers; print(torch.__version__, "transformers", transformers.__version__)')"
  echo "budget_seconds: $budget"
} | tee "$out/machine.txt"

say "Data: corpora and the fine-tuning task"
scripts/corpora.sh en-kjv en-fortunes
"$py" scripts/bench/fortune_topics.py --out "$out/topics"
if [ ${#corpus[@]} -eq 0 ]; then
  corpus=("$root/corpora/en-kjv/kjv.txt" "$out/topics/pretrain-fortunes.txt")
fi
job="$out/job.toml"
list=$(printf '"%s", ' "${corpus[@]}")
sed -E "s|^corpus = .*|corpus = [${list%, }]|" "$job_template" > "$job"
if [ -n "$seed" ]; then
  grep -qE '^seed = ' "$job" || { echo "time_to_quality: $job_template has no 'seed = ' line to set" >&2; exit 2; }
  sed -i -E "s|^seed = .*|seed = $seed|" "$job"
fi
value() { sed -nE "s/^$1 = \"?([^\"]*)\"?.*/\\1/p" "$job" | head -n1; }

say "Keel: ${minutes} min of 'keel local --workers 2 --threads 1' ($job)"
t0=$(date +%s.%N)
set +e
timeout --signal=INT --kill-after=60 "$budget" \
  "$bin/keel" local --workers 2 --threads 1 --quiet --work-dir "$out/keel-run" "$job" --out "$out/keel-final" \
  > "$out/keel.log" 2>&1
rc=$?
set -e
case $rc in 0|124|130) ;; *) echo "time_to_quality: keel local failed ($rc); see $out/keel.log" >&2; tail -n 20 "$out/keel.log" >&2; exit 1 ;; esac
jobdir="$out/keel-run/coordinator/jobs/job-1"
# Each checkpoint is complete when its last file is written; its time is that file's mtime.
for d in $(find "$jobdir/checkpoints" -mindepth 1 -maxdepth 1 -type d -regextype posix-extended -regex ".*/step-[0-9]+" 2>/dev/null | sort -V); do
  [ -f "$d/model.safetensors" ] || continue
  last=$(find "$d" -type f -printf '%T@\n' | sort -n | tail -n1)
  python3 -c "import json,sys; print(json.dumps({'step': int(sys.argv[1]), 'elapsed_s': round(float(sys.argv[2]) - float(sys.argv[3]), 3), 'path': sys.argv[4]}))" \
    "${d##*step-}" "$last" "$t0" "$d"
done > "$out/keel-checkpoints.jsonl"
[ -s "$out/keel-checkpoints.jsonl" ] || { echo "time_to_quality: Keel wrote no checkpoint within the budget; see $out/keel.log" >&2; exit 1; }
cp "$jobdir/metrics.jsonl" "$out/keel-metrics.jsonl"
echo "Keel checkpoints: $(wc -l < "$out/keel-checkpoints.jsonl"), last: $(tail -n1 "$out/keel-checkpoints.jsonl")"

say "Exporting Keel's prepared sequences for the peer (keel inspect)"
"$bin/keel" inspect "$jobdir/data" > "$out/sequences.jsonl"
echo "$(grep -vc '"heldout.keel"' "$out/sequences.jsonl") training and $(grep -c '"heldout.keel"' "$out/sequences.jsonl") held-out sequences"

say "The peer's precision: its faster of fp32 and bf16 autocast here (1 thread, the job's preset, masked head)"
preset=$(value preset)
fp32=$("$py" scripts/peer/pytorch_bert_bench.py --config "$preset" --variant masked --steps 6 --batch "$(value micro_batch_size)" --seq "$(value max_seq_length)" | "$py" -c "import json,sys; print(json.loads(sys.stdin.readline())['tokens_per_s'])")
bf16=$("$py" scripts/peer/pytorch_bert_bench.py --config "$preset" --variant masked --steps 6 --batch "$(value micro_batch_size)" --seq "$(value max_seq_length)" --bf16 | "$py" -c "import json,sys; print(json.loads(sys.stdin.readline())['tokens_per_s'])")
peer_precision=$("$py" -c "print('bf16' if $bf16 > $fp32 else 'fp32')")
echo "fp32 $fp32 tok/s, bf16 $bf16 tok/s: the peer runs $peer_precision" | tee -a "$out/machine.txt"

say "The peer: ${minutes} min of PyTorch DDP (gloo), 2 processes x 1 thread"
t0=$(date +%s.%N)
"$py" scripts/peer/mlm_ddp_train.py --sequences "$out/sequences.jsonl" \
  --config "$jobdir/config.json" --vocab "$jobdir/data/vocab.txt" --out "$out/peer" \
  --world-size 2 --threads 1 --precision "$peer_precision" \
  --micro-batch-size "$(value micro_batch_size)" --max-steps "$(value max_steps)" \
  --learning-rate "$(value learning_rate)" --warmup-steps "$(value warmup_steps)" \
  --weight-decay "$(value weight_decay)" --max-grad-norm "$(value max_grad_norm)" \
  --masked-lm-prob "$(value masked_lm_prob)" --max-predictions-per-seq "$(value max_predictions_per_seq)" \
  --count-specials --seed "$(value seed)" --budget-seconds "$budget" --checkpoint-every-seconds 30 --t0 "$t0" \
  > "$out/peer.log" 2>&1 || { echo "time_to_quality: the peer failed; see $out/peer.log" >&2; tail -n 20 "$out/peer.log" >&2; exit 1; }
echo "peer checkpoints: $(wc -l < "$out/peer/checkpoints.jsonl"), last: $(tail -n1 "$out/peer/checkpoints.jsonl")"

say "Evaluating every checkpoint of both on the same pre-masked held-out set"
"$py" scripts/bench/ttq_eval.py --sequences "$out/sequences.jsonl" --vocab "$jobdir/data/vocab.txt" \
  --systems "pytorch-ddp=$out/peer/checkpoints.jsonl" "keel=$out/keel-checkpoints.jsonl" \
  --max-predictions-per-seq "$(value max_predictions_per_seq)" \
  --masked "$out/heldout-masked.json" --out "$out/summary.json" --png "$out/ttq.png" \
  --title "BERT-$preset, 2 x 1 thread, ${minutes} min each ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs))" \
  | tee "$out/eval.log"

if [ "$finetune" = 1 ]; then
  say "Fine-tuning: fortunes topics from Keel's last checkpoint, the peer's, and random weights (3 seeds each)"
  keel_ckpt=$(tail -n1 "$out/keel-checkpoints.jsonl" | "$py" -c "import json,sys; print(json.load(sys.stdin)['path'])")
  peer_ckpt=$(tail -n1 "$out/peer/checkpoints.jsonl" | "$py" -c "import json,sys; print(json.load(sys.stdin)['path'])")
  for init in "keel=$keel_ckpt" "pytorch-ddp=$peer_ckpt" "random=random"; do
    "$py" scripts/bench/finetune.py --data "$out/topics" --init "${init#*=}" --label "${init%%=*}" \
      --tokenizer "$jobdir/data" --config-from "$keel_ckpt" --seeds 0 1 2 --epochs 3 --max-len 64 --out "$out/finetune.json" \
      | tee -a "$out/finetune.log"
  done
fi

say "Done: $out/summary.json, $out/ttq.png$([ "$finetune" = 1 ] && echo ", $out/finetune.json")"
