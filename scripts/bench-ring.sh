#!/usr/bin/env bash
# The ring all-reduce against the bare TCP ring, in the same minutes:
# per round, `keel-worker bench-allreduce --threads T` for each T of --io-threads (the worker's
# `--io-threads`: 1 is its default, every ring task on one thread) and then
# `tcp_ring_ceiling` (the same pipelined ring over plain blocking sockets, no HTTP/2 and no
# async runtime: an upper bound for a ring over TCP here), all on 127.0.0.1, alternated cell
# by cell: each (workers, size) is run by every peer back to back, then the next cell. Also the
# 1-element all-reduce (the ring's latency, 2 (n - 1) hops of nothing).
# With --gloo PYTHON, each cell also runs PyTorch's gloo all_reduce with that interpreter
# (`scripts/peer/gloo_allreduce_bench.py`; needs torch, not a Keel dependency), and a third
# table gives each Keel run over the gloo run of its cell and round.
#
# Prints one JSON line per (round, peer, workers, size) and then two Markdown tables: bus
# bandwidth in GB/s (2 (n - 1) / n x bytes / seconds, median over rounds of each run's median
# of the slowest rank) and Keel / bare TCP ring; and the CPU time all ranks spent per byte
# sent (user + system, ns; on a machine with fewer cores than ranks this is what bounds the
# bandwidth) and Keel / bare TCP ring.
#
# Usage: scripts/bench-ring.sh [--workers 2,3,4] [--sizes-mib 1,4,16,64] [--rounds 3]
#                              [--iters 40] [--io-threads 1,2] [--gloo PYTHON] [--bin-dir DIR]
#                              [--out FILE.jsonl]
#        scripts/bench-ring.sh --summary FILE.jsonl      (the tables of an earlier run)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORKERS=2,3,4
SIZES=1,4,16,64
ROUNDS=3
ITERS=40
IO_THREADS=1,2
SUMMARY=""
GLOO_PYTHON=""
BIN_DIR="${CARGO_TARGET_DIR:-$REPO/target}/release"
OUT="$REPO/target/bench-ring.jsonl"

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "bench-ring: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --workers) WORKERS="${2:?--workers needs a list}"; shift ;;
    --sizes-mib) SIZES="${2:?--sizes-mib needs a list}"; shift ;;
    --rounds) ROUNDS="${2:?--rounds needs a number}"; shift ;;
    --iters) ITERS="${2:?--iters needs a number}"; shift ;;
    --io-threads) IO_THREADS="${2:?--io-threads needs a list}"; shift ;;
    --bin-dir) BIN_DIR="${2:?--bin-dir needs a directory}"; shift ;;
    --out) OUT="${2:?--out needs a file}"; shift ;;
    --gloo) GLOO_PYTHON="${2:?--gloo needs a python interpreter with torch}"; shift ;;
    --summary) SUMMARY="${2:?--summary needs a file}"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done

summary() {
  python3 - "$1" <<'PY'
import json, statistics, sys
from collections import defaultdict
rows = []
for n, line in enumerate(open(sys.argv[1]), 1):
    if line.strip():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            sys.exit(f"bench-ring: {sys.argv[1]} line {n} is not JSON ({e.msg})")
rows = [r for r in rows if r.get("workers", 0) >= 2 and "peer" in r]
if not any(r["peer"] == "tcp" for r in rows) or not any(r["peer"] != "tcp" for r in rows):
    sys.exit(f"bench-ring: {sys.argv[1]} holds no pair of bare-ring and Keel runs to compare")
bus, lat = defaultdict(list), defaultdict(list)
for r in rows:
    if r["bytes"] < 1024:
        lat[(r["peer"], r["workers"])].append(r["seconds"])
    else:
        bus[(r["peer"], r["workers"], r["bytes"])].append(r["busbw_gb_s"])
peers = sorted({p for p, *_ in bus if p != "tcp"})
print("\n1-element all-reduce, ms (median over rounds; per hop = / 2 (n - 1)):")
for (p, w), v in sorted(lat.items()):
    s = statistics.median(v)
    print(f"- {p}, {w} workers: {s * 1e3:.3f} ms, {s * 1e6 / (2 * (w - 1)):.0f} us per hop")


def table(values, unit, digits):
    """Rows (workers, MiB): the bare ring's median of `values`, then each Keel (or gloo) peer's
    median and its ratio to the bare ring."""
    cols = " | ".join(f"{p} {unit} | {p} / tcp" for p in peers)
    print(f"| workers | MiB | tcp {unit} | {cols} |")
    print("|---|---|---|" + "---|---|" * len(peers))
    for (w, b) in sorted({(k[1], k[2]) for k in values}):
        tcp = values.get(("tcp", w, b))
        if not tcp:
            continue
        t = statistics.median(tcp)
        cells = []
        for p in peers:
            v = values.get((p, w, b))
            cells.append(f"{statistics.median(v):.{digits}f} | {statistics.median(v) / t:.2f}" if v else "- | -")
        print(f"| {w} | {b >> 20} | {t:.{digits}f} | " + " | ".join(cells) + " |")


print()
table(bus, "GB/s", 2)
# CPU per byte sent: every rank sends 2 (n - 1) / n x bytes.
cpu = defaultdict(list)
for r in rows:
    if r["bytes"] >= 1024 and r.get("cpu_seconds_all_ranks"):
        sent = 2 * (r["workers"] - 1) * r["bytes"]
        cpu[(r["peer"], r["workers"], r["bytes"])].append(r["cpu_seconds_all_ranks"] / sent * 1e9)
print("\nCPU time of all ranks per byte sent, ns (median over rounds):\n")
table(cpu, "ns/B", 3)
# Each Keel run against the gloo run of the same cell and round (seconds apart), median over rounds.
paired = defaultdict(list)
by_round = {(r["peer"], r["workers"], r["bytes"], r.get("round")): r["busbw_gb_s"]
            for r in rows if r["bytes"] >= 1024}
for (p, w, b, rnd), v in by_round.items():
    g = by_round.get(("gloo", w, b, rnd))
    if p not in ("gloo", "tcp") and g:
        paired[(p, w, b)].append(v / g)
if paired:
    print("\nKeel / gloo, each round's pair (seconds apart), median over rounds [min-max]:\n")
    print("| workers | MiB | " + " | ".join(sorted({p for p, _, _ in paired})) + " |")
    print("|---|---|" + "---|" * len({p for p, _, _ in paired}))
    for w, b in sorted({(w, b) for _, w, b in paired}):
        cells = []
        for p in sorted({p for p, _, _ in paired}):
            v = paired.get((p, w, b), [])
            cells.append(f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]" if v else "-")
        print(f"| {w} | {b >> 20} | " + " | ".join(cells) + " |")
PY
}

if [ -n "$SUMMARY" ]; then
  [ -f "$SUMMARY" ] || die "$SUMMARY not found"
  summary "$SUMMARY"
  exit 0
fi

[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "--rounds must be a positive number, got $ROUNDS"
[[ "$WORKERS" =~ ^([2-9]|[1-9][0-9]+)(,([2-9]|[1-9][0-9]+))*$ ]] || die "--workers must be world sizes of 2 or more, comma-separated, got $WORKERS"
[[ "$IO_THREADS" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "--io-threads must be positive thread counts, comma-separated, got $IO_THREADS"
if [ -n "$GLOO_PYTHON" ]; then
  "$GLOO_PYTHON" -c 'import torch.distributed' 2>/dev/null \
    || die "--gloo $GLOO_PYTHON: not a python that can import torch.distributed"
fi
[[ "$ITERS" =~ ^[1-9][0-9]*$ ]] || die "--iters must be a positive number, got $ITERS"
[[ "$SIZES" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--sizes-mib must be whole MiB (the bare ring takes no fractions), got $SIZES"
[ -x "$BIN_DIR/keel-worker" ] || die "$BIN_DIR/keel-worker not found (cargo build --release)"
CEILING="$BIN_DIR/examples/tcp_ring_ceiling"
[ -x "$CEILING" ] || die "$CEILING not found (cargo build --release -p keel-worker --example tcp_ring_ceiling)"
command -v python3 >/dev/null || die "python3 not found (it writes the table)"

echo "bench-ring: $(grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'), $(nproc) cores, $(date -u +%FT%TZ)" >&2
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
tag() { python3 -c '
import json, sys
for line in sys.stdin:
    row = json.loads(line)
    row.update(peer=sys.argv[1], round=int(sys.argv[2]))
    print(json.dumps(row), flush=True)
' "$1" "$2"; }
# Alternated cell by cell: each (workers, size) is run by every peer back to back, so that the
# peers of one cell are seconds apart (speeds on a shared VM drift by up to 2x within minutes;
# a whole sweep per peer put minutes between the runs that are compared).
for round in $(seq 1 "$ROUNDS"); do
  for w in ${WORKERS//,/ }; do
    first=1
    for m in ${SIZES//,/ }; do
      # The 1-element all-reduce (the ring's latency) once per world size.
      keel_sizes="$m"; [ "$first" = 1 ] && keel_sizes="0.000004,$m"; first=0
      for t in ${IO_THREADS//,/ }; do
        timeout 900 "$BIN_DIR/keel-worker" bench-allreduce --workers "$w" \
            --sizes-mib "$keel_sizes" --iters "$ITERS" --warmup 3 --threads "$t" \
          | tag "keel-io$t" "$round" | tee -a "$OUT"
      done
      timeout 900 "$CEILING" --workers "$w" --sizes-mib "$m" --iters "$ITERS" --warmup 3 \
        | tag tcp "$round" | tee -a "$OUT"
      if [ -n "$GLOO_PYTHON" ]; then
        timeout 900 "$GLOO_PYTHON" "$REPO/scripts/peer/gloo_allreduce_bench.py" --workers "$w" \
            --sizes-mib "$m" --iters "$ITERS" --warmup 3 \
          | tag gloo "$round" | tee -a "$OUT"
      fi
    done
  done
done

summary "$OUT"
