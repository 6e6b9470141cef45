#!/usr/bin/env python3
"""How fast Keel's bf16 step could be at most on this core, against the PyTorch peer.

Reads the JSON lines of `scripts/bench-bf16.sh` (Keel's `keel-worker bench` and
`scripts/peer/pytorch_bert_bench.py`, measured in the same minutes) and the core's bf16
ceiling from `scripts/bench/bf16_peak.c` (GFLOP/s of register-only `vdpbf16ps` chains: no
GEMM on this core can run faster). For each config, on 1 thread:

  GEMM GFLOP per step  = the bench's `gflops` x `s_per_step` (its FLOP count is 2 m n k over
                         every GEMM call of the step, forward and backward)
  shortest step        = GEMM GFLOP per step / ceiling (every other op of the step taking 0 s)
  most tokens/s        = tokens per step / shortest step
  best ratio           = most tokens/s / PyTorch bf16 autocast's tokens/s (median of rounds)

A best ratio under the issue's target means the target cannot be met on this CPU by any GEMM
kernel or any cut elsewhere in the step. Prints a Markdown table and, with --json, one JSON
object. A measuring tool, not part of Keel.

Usage: scripts/bench/ceiling.py BENCH.jsonl --peak-gflops 234.6 [--json OUT]
"""
import argparse
import json
import statistics
import sys

TARGETS = {"tiny": 2.0, "mini": 2.5, "base": 2.0}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", help="JSON lines from scripts/bench-bf16.sh")
    p.add_argument("--peak-gflops", type=float, required=True, help="bf16_dp_gflops from bf16_peak.c")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args()
    rows = []
    with open(a.bench) as f:
        for n, line in enumerate(f, 1):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"ceiling: {a.bench} line {n}: not JSON ({e})")
    out = {"peak_gflops": a.peak_gflops, "configs": {}}
    print("| config | GEMM GFLOP per step | shortest step at the ceiling | Keel bf16 step now | most tokens/s | PyTorch bf16 tokens/s | best ratio possible | target |")
    print("|---|---|---|---|---|---|---|---|")
    for cfg, target in TARGETS.items():
        keel = [r for r in rows if r.get("side") == "keel" and r.get("config") == cfg
                and r.get("precision") == "bf16" and r.get("threads") == 1]
        peer = [r["tokens_per_s"] for r in rows if r.get("side") == "pytorch" and r.get("config") == cfg
                and r.get("precision") == "bf16-autocast"]
        if not keel or not peer:
            continue
        gflop = statistics.median(r["gflops"] * r["s_per_step"] for r in keel)
        step = statistics.median(r["s_per_step"] for r in keel)
        tokens = keel[0]["batch"] * keel[0]["seq"]
        shortest = gflop / a.peak_gflops
        most = tokens / shortest
        torch = statistics.median(peer)
        best = most / torch
        out["configs"][cfg] = {
            "gemm_gflop_per_step": gflop, "shortest_step_s": shortest, "keel_step_s": step,
            "most_tokens_per_s": most, "pytorch_bf16_tokens_per_s": torch,
            "best_ratio": best, "target": target, "reachable": best >= target,
        }
        print(f"| {cfg} | {gflop:.1f} | {shortest:.3f} s | {step:.3f} s | {most:,.0f} | {torch:,.0f} | "
              f"{best:.2f}x | {target:.1f}x{'' if best >= target else ' (out of reach)'} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
