#!/usr/bin/env bash
# Two builds of `keel-worker bench` against each other, alternated run by run in the same
# minutes (this machine's speed drifts by tens of percent within an hour: only ratios of runs
# made side by side mean much): per round, for each config and thread count, the old build
# and then the new one. Each JSON line of `keel-worker bench` is written with a `binary` field
# naming its build (`old` or `new`). Then prints the Markdown table that
# `scripts/docs_tables.py --builds` makes of it: median ms a step of each, new over old (below
# 1: faster), 2 threads over 1 for each build, and the step thread's wait for its helper
# (`join_wait`).
#
# Usage: scripts/bench-builds.sh OLD_KEEL_WORKER NEW_KEEL_WORKER [OUT.jsonl]
#   CONFIGS="tiny:32:20 mini:32:8" (config:batch:steps), PRECISION=bf16, ROUNDS=6,
#   THREADS="1 2".
# Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
old=$1 new=$2 out=${3:-bench-builds.jsonl}
for b in "$old" "$new"; do
  [ -x "$b" ] || { echo "bench-builds: $b is not an executable keel-worker" >&2; exit 2; }
done
configs=${CONFIGS:-"tiny:32:20 mini:32:8"}
precision=${PRECISION:-bf16}
rounds=${ROUNDS:-6}
threads=${THREADS:-"1 2"}
: >"$out"
for round in $(seq "$rounds"); do
  for cbs in $configs; do
    IFS=: read -r cfg batch steps <<<"$cbs"
    for th in $threads; do
      for which in old new; do
        bin=$old
        [ "$which" = new ] && bin=$new
        "$bin" bench --config "$cfg" --batch "$batch" --steps "$steps" --threads "$th" \
          --precision "$precision" |
          python3 -c 'import json, sys
r = json.loads(sys.stdin.read()); r["binary"] = sys.argv[1]; r["round"] = int(sys.argv[2])
with open(sys.argv[3], "a") as f:
    f.write(json.dumps(r, sort_keys=True) + "\n")
j = sum(p["ms_per_step"] for p in r["passes"] if p["pass"] == "join_wait")
print("round %d %-3s %s t%d: %.1f ms a step, join_wait %.1f ms" % (r["round"], r["binary"], r["config"], r["threads"], r["s_per_step"] * 1e3, j))' "$which" "$round" "$out"
      done
    done
  done
done
echo
python3 scripts/docs_tables.py --builds "$out"
