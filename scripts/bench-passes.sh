#!/usr/bin/env bash
# The step's roofline: `keel-worker bench` pass by pass (each pass's time, the bytes it must
# move, its GB/s against this machine's copy bandwidth on the same threads; each GEMM class's
# GFLOP/s), at 1 and at 2 threads, alternated round by round in the same minutes (this
# machine's speed drifts by tens of percent within an hour: only same-round ratios mean much).
# Prints one Markdown table per config: median ms per step at 1 and 2 threads, the speed-up of
# each pass, MiB moved per step, and the 1-thread rate against the bandwidth.
#
# Usage: scripts/bench-passes.sh [OUT.jsonl]
#   CONFIGS="tiny:32 mini:32 base:8" (config:batch), PRECISION=bf16, ROUNDS=3, THREADS="1 2".
# Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-passes.jsonl}
configs=${CONFIGS:-"tiny:32 mini:32 base:8"}
precision=${PRECISION:-bf16}
rounds=${ROUNDS:-3}
threads=${THREADS:-"1 2"}
cargo build --release -p keel-worker --bin keel-worker >/dev/null
bin=target/release/keel-worker
: >"$out"
for _ in $(seq "$rounds"); do
  for cb in $configs; do
    cfg=${cb%%:*} batch=${cb##*:}
    steps=5
    [ "$cfg" = base ] && steps=3
    for th in $threads; do
      "$bin" bench --config "$cfg" --batch "$batch" --steps "$steps" --threads "$th" \
        --precision "$precision" | tee -a "$out" | cut -c1-160
    done
  done
done
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
cpu = open("/proc/cpuinfo").read()
model = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("model name")), "?")
print(f"\nCPU: {model}; precision {rows[0]['precision'] if rows else '?'}")
for cfg in dict.fromkeys(r["config"] for r in rows):
    mine = [r for r in rows if r["config"] == cfg]
    threads = sorted({r["threads"] for r in mine})
    def med(th, pass_name, field):
        v = [p[field] for r in mine if r["threads"] == th for p in r["passes"]
             if p["pass"] == pass_name and field in p]
        return statistics.median(v) if v else None
    step = {th: statistics.median(r["s_per_step"] for r in mine if r["threads"] == th) for th in threads}
    bw = {th: statistics.median(r["copy_bandwidth_gb_s"] for r in mine if r["threads"] == th) for th in threads}
    names = list(dict.fromkeys(p["pass"] for r in mine for p in r["passes"]))
    t1, tn = threads[0], threads[-1]
    print(f"\n### {cfg} batch {mine[0]['batch']}: {step[t1] * 1e3:.0f} ms per step at {t1} thread(s), "
          f"{step[tn] * 1e3:.0f} at {tn} ({step[t1] / step[tn]:.2f}x); copy bandwidth {bw[t1]:.1f} / {bw[tn]:.1f} GB/s; "
          f"saved activations {mine[0]['saved_activation_bytes_per_token']:,.0f} bytes/token")
    print(f"\n| pass | ms/step {t1}t | share | ms/step {tn}t | speed-up | MiB moved/step | GB/s ({t1}t) | of bandwidth | GFLOP/s ({t1}t) |")
    print("|---|---|---|---|---|---|---|---|---|")
    f = lambda x, d=1: "-" if x is None else f"{x:,.{d}f}"
    for n in names:
        a, b = med(t1, n, "ms_per_step"), med(tn, n, "ms_per_step")
        moved = None
        rd, wr = med(t1, n, "mib_read_per_step"), med(t1, n, "mib_written_per_step")
        if rd is not None:
            moved = rd + wr
        sp = None if a is None or not b else a / b
        print(f"| {n} | {f(a)} | {f(med(t1, n, 'share'), 2)} | {f(b)} | {f(sp, 2)} | {f(moved, 0)} | "
              f"{f(med(t1, n, 'gb_s'))} | {f(med(t1, n, 'of_bandwidth'), 2)} | {f(med(t1, n, 'gflops'))} |")
EOF
