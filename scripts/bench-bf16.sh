#!/usr/bin/env bash
# bf16 against fp32 and against PyTorch, measured in the same minutes: for each config (tiny and
# mini at batch 32, base at batch 8; seq 128, vocab 30,522, MLM head on the masked positions),
# ROUNDS rounds of Keel fp32, Keel bf16, PyTorch fp32 and PyTorch bf16 autocast, one after the
# other (this machine's speed drifts by tens of percent within an hour, so only ratios from the
# same round mean anything), on 1 thread; then Keel bf16 on 2 threads against 1.
# Writes JSON lines to OUT (default bench-bf16.jsonl) and prints tables of medians: speed, then
# memory (peak RSS, and the activations each side keeps for the backward per token).
#
# Usage: scripts/bench-bf16.sh [OUT.jsonl]; ROUNDS=3 by default. The PyTorch side runs when
# $PEER_PYTHON (default python3) imports torch and transformers (scripts/peer/); else it is
# left out and said so. Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-bf16.jsonl}
rounds=${ROUNDS:-3}
py=${PEER_PYTHON:-python3}
cargo build --release -p keel-worker --bin keel-worker >/dev/null
bin=target/release/keel-worker
peer=1
if ! "$py" -c 'import torch, transformers' 2>/dev/null; then
  echo "bench-bf16: $py has no torch/transformers: PyTorch left out" >&2
  peer=0
fi
: >"$out"
tag() { python3 -c 'import json,sys; d=json.loads(sys.argv[2]); d["side"]=sys.argv[1]; print(json.dumps(d))' "$1" "$2"; }
for cfg in tiny mini base; do
  batch=32 steps=5
  if [ "$cfg" = base ]; then batch=8 steps=3; fi
  for _ in $(seq "$rounds"); do
    for prec in fp32 bf16; do
      tag keel "$("$bin" bench --config "$cfg" --batch "$batch" --steps "$steps" --threads 1 --precision "$prec")" | tee -a "$out"
    done
    if [ "$peer" = 1 ]; then
      for flag in "" --bf16; do
        while IFS= read -r line; do tag pytorch "$line" | tee -a "$out"; done < <(
          "$py" scripts/peer/pytorch_bert_bench.py --config "$cfg" --batch "$batch" --steps "$steps" \
            --threads 1 --variant masked $flag)
      done
    fi
    if [ "$cfg" != base ]; then
      tag keel "$("$bin" bench --config "$cfg" --batch "$batch" --steps "$steps" --threads 2 --precision bf16)" | tee -a "$out"
    fi
  done
done
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(side, cfg, prec, threads=1, field="tokens_per_s"):
    v = [r[field] for r in rows if r["side"] == side and r["config"] == cfg
         and r["precision"] == prec and r["threads"] == threads and r.get(field) is not None]
    return statistics.median(v) if v else None
f = lambda x: "-" if x is None else f"{x:,.0f}"
r = lambda a, b: "-" if a is None or b is None else f"{a / b:.2f}x"
print("\n| config | Keel fp32 | Keel bf16 | PyTorch fp32 | PyTorch bf16 | Keel bf16 / PyTorch bf16 | Keel bf16 2 threads / 1 |")
print("|---|---|---|---|---|---|---|")
for cfg in ["tiny", "mini", "base"]:
    kf, kb, pf, pb = med("keel", cfg, "fp32"), med("keel", cfg, "bf16"), med("pytorch", cfg, "fp32"), med("pytorch", cfg, "bf16-autocast")
    k2 = med("keel", cfg, "bf16", 2)
    print(f"| {cfg} | {f(kf)} | {f(kb)} | {f(pf)} | {f(pb)} | {r(kb, pb)} | {r(k2, kb)} |")
print("\nMemory, 1 thread: peak RSS (MiB) and the activations kept for the backward (bytes per token)")
print("\n| config | RSS Keel fp32 | RSS Keel bf16 | RSS PyTorch bf16 | Keel bf16 / fp32 | saved/token Keel fp32 | Keel bf16 | PyTorch bf16 |")
print("|---|---|---|---|---|---|---|---|")
for cfg in ["tiny", "mini", "base"]:
    rss = lambda side, prec: med(side, cfg, prec, field="peak_rss_mib")
    per = lambda side, prec: med(side, cfg, prec, field="saved_activation_bytes_per_token")
    kf, kb, pb = rss("keel", "fp32"), rss("keel", "bf16"), rss("pytorch", "bf16-autocast")
    print(f"| {cfg} | {f(kf)} | {f(kb)} | {f(pb)} | {r(kb, kf)} | {f(per('keel', 'fp32'))} | {f(per('keel', 'bf16'))} | {f(per('pytorch', 'bf16-autocast'))} |")
EOF
