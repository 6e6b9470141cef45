#!/usr/bin/env python3
"""A model of Keel's step time against world size, gradient bytes, link bandwidth and latency,
calibrated from measurements on this machine, checked against every run it was calibrated
from, and used to predict BERT-base at 8-256 workers on 10 and 25 Gbit/s.

The ring all-reduce (reduce-scatter then all-gather, pipelined by frames) takes 2 (W - 1) ring
steps; in each, every rank sends one chunk of G / W bytes to its right neighbour:

    T_ar = 2 (W - 1) * (alpha + (G_wire / W) / B_link)                    (switched network)

for one buffer. A step's gradient goes as ceil(P / bucket) buckets of `bucket` elements
(Keel: 2^20, `worker/src/buckets.rs`), all-reduced one after another, so the latency term is
paid once per bucket: T_step_ar = n_buckets * 2 (W - 1) * alpha + 2 (W - 1) * G_wire / (W B_link).

alpha is the per-hop cost (software wake-ups plus the network's one-way latency), G_wire the
gradient bytes on the wire (4 per parameter in fp32, 2 in bf16), B_link the bytes per second one
link carries. On the calibration medium here, every ring link is a flow through one shared,
shaped loopback (scripts/bench-wire.sh: tbf RATE), so B_link = eta * RATE / W and
T_ar = 2 (W - 1) * (alpha + G_wire / (eta * RATE)); on unshaped loopback the W processes
share this machine's 2 cores, the same form with an effective capacity in place of
eta * RATE. Each medium's (alpha, capacity) is fitted by least squares of the relative error
on T_ar / (2 (W - 1)) = alpha + G_wire / capacity; eta = capacity / RATE carries over to real
links (Keel's efficiency on a bandwidth-bound link).

A training step is the compute C (forward, backward, optimizer) plus the part of T_ar that the
backward pass does not hide. Keel sends a bucket as soon as backward finishes it, so at best
the all-reduce runs behind the whole backward pass (~2/3 of C) and at worst behind none of it:

    C + max(0, T_ar - 2/3 C)  <=  T_step  <=  C + T_ar

Usage:
  scripts/scale_model.py CALIBRATION.jsonl [...]       (bench-allreduce / bench-wire.sh lines)
      [--params 110e6] [--tokens-per-worker-step 4096]
      [--worker-tokens-per-second 2000,10000] [--network-latency-us 25]
Prints Markdown: the fitted constants, predicted vs measured for every calibration run, and
the BERT-base table. Lines with "rate" come from a shaped loopback of that rate; lines without
from plain loopback; lines with "train" are training runs (bench-wire.sh --train-steps).
"""

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict

RATE_UNITS = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}


def rate_bytes_per_second(rate):
    """A tc rate such as "1gbit" or "100mbit", in bytes per second."""
    for unit, scale in RATE_UNITS.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: expected a number followed by kbit, mbit or gbit")


def wire_bytes(row):
    """Bytes of the buffer as they travel: bench-allreduce's "bytes" are f32 bytes."""
    return row["bytes"] * (0.5 if row.get("dtype") == "bf16" else 1.0)


def fit_line(xs, ys):
    """y = a + b x by least squares of the relative error (weights 1 / y^2), so that the
    one-element runs (latency) count as much as the large ones (bandwidth); returns (a, b)."""
    ws = [1.0 / (y * y) for y in ys]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    b = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


class Medium:
    """alpha (seconds per ring step) and capacity (bytes per second of the shared medium)."""

    def __init__(self, name, rows):
        self.name = name
        self.rows = rows
        xs = [wire_bytes(r) for r in rows]
        ys = [r["seconds"] / (2 * (r["workers"] - 1)) for r in rows]
        alpha, inv_capacity = fit_line(xs, ys)
        self.alpha = max(alpha, 0.0)
        self.capacity = 1.0 / inv_capacity if inv_capacity > 0 else float("inf")

    def predict(self, workers, g_wire, buckets=1):
        return 2 * (workers - 1) * (buckets * self.alpha + g_wire / self.capacity)


def load(paths):
    ring, train = [], []
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                if "train" in row:
                    train.append(row)
                elif row.get("workers", 1) > 1:
                    ring.append(row)
    return ring, train


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("calibration", nargs="+")
    ap.add_argument("--params", type=float, default=110e6, help="BERT-base parameters")
    ap.add_argument("--tokens-per-worker-step", type=float, default=32 * 128,
                    help="tokens each worker computes per step (micro-batch 32 x 128)")
    ap.add_argument("--worker-tokens-per-second", default="2000,10000",
                    help="compute scenarios, tokens/s of one worker machine on BERT-base")
    ap.add_argument("--network-latency-us", type=float, default=25.0,
                    help="one-way latency of a real link, added to the fitted software alpha")
    ap.add_argument("--bucket-elements", type=float, default=2**20,
                    help="gradient elements per bucket (Keel's BUCKET_ELEMS)")
    ap.add_argument("--big-bucket-elements", type=float, default=16 * 2**20,
                    help="the larger bucket the BERT-base table compares with")
    ap.add_argument("--calibration-cores", type=float, default=2.0,
                    help="cores of the machine the loopback runs shared: the ring's software "
                         "ceiling per link is the loopback capacity over this (a core per link)")
    args = ap.parse_args()

    ring, train = load(args.calibration)
    if not ring:
        sys.exit("scale_model: no all-reduce lines (bench-allreduce output) in the calibration")
    by_medium = defaultdict(list)
    for r in ring:
        by_medium[r.get("rate", "loopback")].append(r)
    media = {name: Medium(name, rows) for name, rows in by_medium.items()}

    print("## Fitted constants\n")
    print("| medium | runs | alpha (per ring step) | capacity | efficiency eta |")
    print("|---|---|---|---|---|")
    etas = []
    for name, m in sorted(media.items()):
        eta = ""
        if name != "loopback":
            e = m.capacity / rate_bytes_per_second(name)
            etas.append(e)
            eta = f"{e:.2f}"
        print(f"| {name} | {len(m.rows)} | {m.alpha * 1e3:.3f} ms | {m.capacity / 1e6:.0f} MB/s | {eta} |")
    alpha_sw = media["loopback"].alpha if "loopback" in media else min(m.alpha for m in media.values())
    eta = statistics.fmean(etas) if etas else 0.9

    print("\n## Predicted against measured: every all-reduce run\n")
    print("| medium | workers | f32 MiB | wire | measured | predicted | error |")
    print("|---|---|---|---|---|---|---|")
    errors = []
    groups = defaultdict(list)
    for r in ring:
        groups[(r.get("rate", "loopback"), r["workers"], r["bytes"], r.get("dtype", "fp32"))].append(r["seconds"])
    for (name, w, b, dtype), secs in sorted(groups.items()):
        measured = statistics.median(secs)
        g = b * (0.5 if dtype == "bf16" else 1.0)
        predicted = media[name].predict(w, g)
        err = (predicted - measured) / measured
        errors.append(abs(err))
        print(f"| {name} | {w} | {b / 2**20:g} | {dtype} | {measured * 1e3:.2f} ms | {predicted * 1e3:.2f} ms | {err:+.0%} |")
    print(f"\nmedian |error| {statistics.median(errors):.0%}, largest {max(errors):.0%} over {len(errors)} configurations")

    if train:
        print("\n## Predicted against measured: training steps\n")
        computes = defaultdict(list)
        for t in train:
            if t["workers"] == 1:
                computes[t["rate"]].append(t["step_seconds"])
        print("| medium | workers | wire | compute C (1 worker) | measured step | measured all-reduce | predicted all-reduce | predicted step range | inside |")
        print("|---|---|---|---|---|---|---|---|---|")
        for t in train:
            if t["workers"] == 1 or t["rate"] not in computes or t["rate"] not in media:
                continue
            c = statistics.median(computes[t["rate"]])
            # The job's gradient: its parameters (bench-wire.sh counts them in the checkpoint).
            g = t["params"] * (2 if t["dtype"] == "bf16" else 4)
            buckets = math.ceil(t["params"] / args.bucket_elements)
            tar = media[t["rate"]].predict(t["workers"], g, buckets)
            lo, hi = c + max(0.0, tar - 2 * c / 3), c + tar
            inside = "yes" if lo * 0.9 <= t["step_seconds"] <= hi * 1.1 else "no"
            print(f"| {t['rate']} | {t['workers']} | {t['dtype']} | {c:.3f} s | {t['step_seconds']:.3f} s | "
                  f"{t['allreduce_seconds']:.3f} s | {tar:.3f} s | {lo:.3f}-{hi:.3f} s | {inside} |")

    alpha = alpha_sw + args.network_latency_us * 1e-6
    # What one link of Keel's ring carries when the software, not the wire, is the limit: the
    # loopback capacity (all links, all of this machine's cores) per core.
    ceiling = media["loopback"].capacity / args.calibration_cores if "loopback" in media else float("inf")
    print(f"\n## BERT-base, predicted ({args.params / 1e6:.0f} M parameters, {args.tokens_per_worker_step:.0f} "
          f"tokens per worker per step, alpha = {alpha * 1e3:.3f} ms = fitted software "
          f"{alpha_sw * 1e3:.3f} ms + {args.network_latency_us:.0f} us network, eta = {eta:.2f}, "
          f"software ceiling {ceiling / 1e9:.2f} GB/s per link)\n")
    scenarios = [float(x) for x in args.worker_tokens_per_second.split(",")]
    small, big = args.bucket_elements, args.big_bucket_elements
    head = " | ".join(f"efficiency at {s:,.0f} tok/s/worker (C = {args.tokens_per_worker_step / s:.2f} s)" for s in scenarios)
    print(f"Each cell: {small * 4 / 2**20:g} MiB buckets (today) / {big * 4 / 2**20:g} MiB buckets; "
          "efficiency = C / step, worst (no overlap) - best (all-reduce behind the backward pass).\n")
    print(f"| link | workers | wire | all-reduce | bound by | {head} |")
    print("|---|---|---|---|---|" + "---|" * len(scenarios))
    for gbit in (10, 25):
        wire = min(eta, 1.0) * gbit * 1e9 / 8
        link = min(wire, ceiling)
        bound = "wire" if wire <= ceiling else "software"
        for w in (8, 32, 64, 256):
            for dtype, per in (("fp32", 4), ("bf16", 2)):
                g = args.params * per
                tars = [2 * (w - 1) * (math.ceil(args.params / e) * alpha + g / w / link)
                        for e in (small, big)]
                cells = []
                for s in scenarios:
                    c = args.tokens_per_worker_step / s
                    cells.append(" / ".join(
                        f"{c / (c + t):.0%}-{c / (c + max(0.0, t - 2 * c / 3)):.0%}" for t in tars))
                print(f"| {gbit} Gbit/s | {w} | {dtype} | {tars[0]:.2f} s / {tars[1]:.2f} s | {bound} | "
                      + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
