#!/usr/bin/env python3
"""Makes the tables of docs/performance.md from the data files under docs/measured/.

(The scale model's table is what scripts/scale_model.py prints from its calibration data under
scripts/scale/.)

Usage: scripts/docs_tables.py [--check]
       scripts/docs_tables.py --builds FILE.jsonl   (the table of a scripts/bench-builds.sh run)

The tables are README.md's headline table and docs/performance.md's. Each sits in its doc between `<!-- table:NAME -->` and `<!-- /table:NAME -->`. Without
--check the script rewrites what lies between the markers; with --check it changes nothing and
exits 1 (printing a diff) when the committed tables differ from what the data gives, so a table
edited by hand, or data changed without the table, fails the test suite. Python 3, standard
library only.

Every table names the CPU, the date and the command that produced its data. The jsonl files of
the step and ring benchmarks do not record the machine, so the TABLES list below does (copied
from the runs' notes); the time-to-quality folders carry a machine.txt, which is read.
"""

import argparse
import datetime
import difflib
import json
import os
import re
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(REPO, "docs", "measured")

XEON_AMX = "2-core Intel Xeon, family 6 model 167 as the VM reports it (AVX-512, AVX512_BF16, AMX-BF16)"
ZEN4 = "2-core AMD EPYC, family 25 model 17: Zen 4 (AVX-512, AVX512_BF16, no AMX)"
ZEN5 = "2-core AMD EPYC, family 26 model 2: Zen 5 (AVX-512, AVX512_BF16, no AMX)"
ZEN3 = "2-core AMD EPYC, family 25 model 1: Zen 3 (AVX2, no AVX-512)"


def rel(path):
    return os.path.relpath(path, REPO)


def link(path):
    """A Markdown link to a data path, relative to docs/."""
    return "[`%s`](%s)" % (rel(path), os.path.relpath(path, os.path.join(REPO, "docs")))


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def fmt_int(x):
    return "{:,}".format(int(round(x)))


def median(xs):
    return statistics.median(xs) if xs else None


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def source_line(cpu, date, command, files):
    return [
        "CPU: %s. Date: %s. Command: `%s`. Data: %s." % (cpu, date, command, ", ".join(link(f) for f in files)),
        "",
    ]


# --- step speed against PyTorch -------------------------------------------------------------

def step_medians(path):
    """(config, side, precision, threads) -> median tokens/s of a bench-bf16 run."""
    cells = {}
    for r in read_jsonl(path):
        cells.setdefault((r["config"], r["side"], r["precision"], r["threads"]), []).append(r["tokens_per_s"])
    return {k: median(v) for k, v in cells.items()}


def ring_medians(files):
    """(peer, workers, MiB) -> median bus bandwidth over the rounds, GB/s."""
    cells = {}
    for path in files:
        for r in read_jsonl(path):
            if r["bytes"] < (1 << 20):
                continue
            cells.setdefault((r["peer"], r["workers"], r["bytes"] >> 20), []).append(r["busbw_gb_s"])
    return {k: median(v) for k, v in cells.items()}


def ring_cpu_medians(files):
    """(peer, workers, MiB) -> median CPU time of all ranks per byte sent, ns (every rank sends
    2 (n - 1) / n x bytes); only the runs that report their CPU."""
    cells = {}
    for path in files:
        for r in read_jsonl(path):
            if r["bytes"] < (1 << 20) or not r.get("cpu_seconds_all_ranks"):
                continue
            sent = 2 * (r["workers"] - 1) * r["bytes"]
            cells.setdefault((r["peer"], r["workers"], r["bytes"] >> 20), []).append(
                r["cpu_seconds_all_ranks"] / sent * 1e9)
    return {k: median(v) for k, v in cells.items()}


def step_speed(path, cpu, date, command):
    rows = read_jsonl(path)

    def tps(side, config, precision, threads=1):
        xs = [
            r["tokens_per_s"]
            for r in rows
            if r["side"] == side and r["config"] == config and r["precision"] == precision and r["threads"] == threads
        ]
        return median(xs)

    def rss(side, config, precision):
        xs = [
            r["peak_rss_mib"]
            for r in rows
            if r["side"] == side and r["config"] == config and r["precision"] == precision and r["threads"] == 1
        ]
        return median(xs)

    out = source_line(cpu, date, command, [path])
    body = []
    for config in ("tiny", "mini", "base"):
        kf, kb = tps("keel", config, "fp32"), tps("keel", config, "bf16")
        pf, pb = tps("pytorch", config, "fp32"), tps("pytorch", config, "bf16-autocast")
        k2 = tps("keel", config, "bf16", threads=2)
        body.append([
            config,
            fmt_int(kf),
            fmt_int(kb),
            fmt_int(pf),
            fmt_int(pb),
            "**%.2fx**" % (kb / pb),
            ("%.2fx" % (k2 / kb)) if k2 else "-",
            "%s / %s" % (fmt_int(rss("keel", config, "bf16")), fmt_int(rss("pytorch", config, "bf16-autocast"))),
        ])
    out += table(
        ["model", "Keel fp32", "Keel bf16", "PyTorch fp32", "PyTorch bf16", "Keel bf16 / PyTorch bf16",
         "Keel bf16, 2 threads / 1", "peak RSS, Keel bf16 / PyTorch bf16 (MiB)"],
        body,
    )
    out.append("")
    out.append("Tokens/s on 1 thread (medians of the alternated rounds); batch 32 x 128 tokens (base: 8 x 128), "
               "vocabulary 30,522; PyTorch with the MLM head on the masked positions only.")
    return out


def step_memory(path, cpu, date, command):
    """Peak RSS and the activations kept for the backward, per side (1 thread, medians)."""
    rows = read_jsonl(path)

    def med(side, config, precision, field):
        return median([r[field] for r in rows if r["side"] == side and r["config"] == config
                       and r["precision"] == precision and r["threads"] == 1 and r.get(field) is not None])

    out = source_line(cpu, date, command, [path])
    body = []
    for config in ("tiny", "mini", "base"):
        kf, kb = med("keel", config, "fp32", "peak_rss_mib"), med("keel", config, "bf16", "peak_rss_mib")
        pb = med("pytorch", config, "bf16-autocast", "peak_rss_mib")
        per = lambda side, prec: med(side, config, prec, "saved_activation_bytes_per_token")
        body.append([config, fmt_int(kf), fmt_int(kb), "**%.2fx**" % (kb / kf), fmt_int(pb),
                     fmt_int(per("keel", "fp32")), fmt_int(per("keel", "bf16")),
                     fmt_int(per("pytorch", "bf16-autocast"))])
    out += table(["model", "peak RSS, Keel fp32 (MiB)", "Keel bf16", "Keel bf16 / fp32", "PyTorch bf16",
                  "kept for the backward, Keel fp32 (bytes a token)", "Keel bf16", "PyTorch bf16"], body)
    out.append("")
    out.append("Kept for the backward: Keel's activation buffers after a step (bf16 copies included; "
               "`Bert::saved_activation_bytes`); PyTorch's, every storage autograd saved in one forward, "
               "parameters left out (autocast's bf16 copies of the weights included).")
    return out


def before_after(path, cpu, date, command):
    """tokens/s of the build before and after a change, alternated (medians)."""
    rows = read_jsonl(path)
    before, after = "keel-prof", "keel-final2"

    def med(binary, config, threads):
        return median([r["tokens_per_s"] for r in rows if r["binary"] == binary and r["config"] == config
                       and r["threads"] == threads])

    out = source_line(cpu, date, command, [path])
    body = []
    for config in ("tiny", "mini", "base"):
        for threads in (1, 2):
            b, a = med(before, config, threads), med(after, config, threads)
            if b is None or a is None:
                continue
            b1, a1 = med(before, config, 1), med(after, config, 1)
            body.append([config, str(threads), fmt_int(b), fmt_int(a), "**%.2fx**" % (a / b),
                         "%.2fx / %.2fx" % (b / b1, a / a1) if threads > 1 else "-"])
    out += table(["model", "threads", "before (tokens/s)", "after", "after / before",
                  "2 threads / 1, before / after"], body)
    return out


def memory_before_after(path, cpu, date, command):
    """Peak RSS and the activations kept, fp32 and bf16, of the build before and after a change
    (alternated; medians)."""
    rows = read_jsonl(path)

    def med(binary, config, precision, field):
        return median([r[field] for r in rows if r["binary"] == binary and r["config"] == config
                       and r["precision"] == precision])

    out = source_line(cpu, date, command, [path])
    body = []
    for config in ("tiny", "mini", "base"):
        if med("old", config, "fp32", "peak_rss_mib") is None:
            continue
        cells = [config + (" (batch 8)" if config == "base" else " (batch 32)")]
        for binary in ("old", "new"):
            f, b = (med(binary, config, p, "peak_rss_mib") for p in ("fp32", "bf16"))
            cells += [fmt_int(f), fmt_int(b), "**%.2fx**" % (b / f)]
        per = lambda binary, p: fmt_int(med(binary, config, p, "saved_activation_bytes_per_token"))
        cells += [per("old", "fp32"), per("old", "bf16"), per("new", "bf16")]
        body.append(cells)
    out += table(["model", "before: peak RSS fp32 (MiB)", "bf16", "bf16 / fp32", "after: fp32", "bf16",
                  "bf16 / fp32", "kept a token, fp32 (bytes)", "bf16 before", "bf16 after"], body)
    return out


# --- the step pass by pass --------------------------------------------------------------------

def step_roofline(path, cpu, date, command, config):
    """One config of a bench-passes run: each pass at 1 and 2 threads (medians over rounds)."""
    rows = [r for r in read_jsonl(path) if r["config"] == config]

    def med(threads, name, field):
        return median([p[field] for r in rows if r["threads"] == threads for p in r["passes"]
                       if p["pass"] == name and field in p])

    def whole(threads, field):
        return median([r[field] for r in rows if r["threads"] == threads])

    s1, s2 = whole(1, "s_per_step"), whole(2, "s_per_step")
    out = source_line(cpu, date, command, [path])
    out.append("BERT-%s, batch %d x %d, %s: %s ms a step on 1 thread, %s on 2 (**%.2fx**); copy bandwidth "
               "%.1f GB/s on 1 thread, %.1f on 2; activations kept for the backward: %s bytes a token." % (
                   config, rows[0]["batch"], rows[0]["seq"], rows[0]["precision"], fmt_int(s1 * 1e3),
                   fmt_int(s2 * 1e3), s1 / s2, whole(1, "copy_bandwidth_gb_s"), whole(2, "copy_bandwidth_gb_s"),
                   fmt_int(whole(1, "saved_activation_bytes_per_token"))))
    out.append("")
    names = list(dict.fromkeys(p["pass"] for r in rows for p in r["passes"]))
    body = []
    for name in names:
        a, b = med(1, name, "ms_per_step"), med(2, name, "ms_per_step")
        rd, wr = med(1, name, "mib_read_per_step"), med(1, name, "mib_written_per_step")
        gflops = med(1, name, "gflops")
        body.append([
            name,
            "-" if a is None else "%.1f" % a,
            "-" if a is None else "%.0f%%" % (100 * med(1, name, "share")),
            "-" if b is None else "%.1f" % b,
            "-" if not a or not b or name in ("join_wait", "untimed") else "%.2fx" % (a / b),
            "-" if rd is None else fmt_int(rd + wr),
            "-" if rd is None or not a else "%.0f%%" % (100 * med(1, name, "of_bandwidth")),
            "-" if gflops is None else fmt_int(gflops),
        ])
    out += table(["pass", "ms a step, 1 thread", "share", "ms, 2 threads", "2 threads / 1", "MiB moved a step",
                  "of copy bandwidth (1 thread)", "GFLOP/s (1 thread)"], body)
    return out


def builds_alternated(path, cpu, date, command):
    """`scripts/bench-builds.sh` output: two builds' ms a step, alternated (medians), with each
    build's 2 threads / 1 and the step thread's wait for its helpers."""
    rows = read_jsonl(path)

    def med(binary, config, threads, f):
        return median([f(r) for r in rows
                       if (r["binary"], r["config"], r["threads"]) == (binary, config, threads)])

    def step(r):
        return r["s_per_step"] * 1e3

    def join(r):
        return sum(p["ms_per_step"] for p in r["passes"] if p["pass"] == "join_wait")

    body = []
    for config in dict.fromkeys(r["config"] for r in rows):
        for threads in sorted({r["threads"] for r in rows if r["config"] == config}):
            o, n = med("old", config, threads, step), med("new", config, threads, step)
            if o is None or n is None:
                continue
            o1, n1 = med("old", config, 1, step), med("new", config, 1, step)
            body.append([
                "%s b%d" % (config, next(r["batch"] for r in rows if r["config"] == config)), str(threads),
                "%.1f" % o, "%.1f" % n,
                "**%.3f**" % (n / o),
                "%.2fx / %.2fx" % (o1 / o, n1 / n) if threads > 1 and o1 and n1 else "-",
                "%.1f / %.1f" % (med("old", config, threads, join), med("new", config, threads, join))
                if threads > 1 else "-",
            ])
    return source_line(cpu, date, command, [path]) + table(
        ["model", "threads", "before (ms a step)", "after", "after / before", "2 threads / 1, before / after",
         "step thread's wait for its helper (ms a step), before / after"], body)


def thread_scaling(files, cpu, date, command):
    """Whole-step time at 1 and 2 threads per (config, precision), from bench-passes runs."""
    rows = [r for f in files for r in read_jsonl(f)]
    body = []
    for key in dict.fromkeys((r["config"], r["precision"]) for r in rows):
        mine = [r for r in rows if (r["config"], r["precision"]) == key]
        s1 = median([r["s_per_step"] for r in mine if r["threads"] == 1])
        s2 = median([r["s_per_step"] for r in mine if r["threads"] == 2])
        slow = min((p for p in dict.fromkeys(q["pass"] for r in mine for q in r["passes"])
                    if p.startswith("gemm")),
                   key=lambda p: median([q["ms_per_step"] for r in mine if r["threads"] == 1
                                         for q in r["passes"] if q["pass"] == p]) /
                   median([q["ms_per_step"] for r in mine if r["threads"] == 2
                           for q in r["passes"] if q["pass"] == p]))
        route = mine[0].get("gemm_backends", {}).get("linear", key[1])
        body.append(["%s b%d" % (key[0], mine[0]["batch"]), route, fmt_int(s1 * 1e3), fmt_int(s2 * 1e3),
                     "**%.2fx**" % (s1 / s2), slow])
    return source_line(cpu, date, command, files) + table(
        ["model", "GEMM route", "ms a step, 1 thread", "2 threads", "2 threads / 1", "GEMM class that scales least"],
        body)


def ceiling(path, shapes, cpu, date, command):
    """`scripts/bench/ceiling.py --json` output: the best ratio to PyTorch that the core's bf16
    ceiling allows, beside the ratio measured; and oneDNN's GFLOP/s at the step's shapes
    (`scripts/bench/onednn_shapes.c` output) as a share of that ceiling."""
    data = json.load(open(path))
    peak = data["peak_gflops"]
    out = source_line(cpu, date, command, [path, shapes])
    body = []
    for config, c in data["configs"].items():
        now = c["keel_step_s"]
        tokens = c["most_tokens_per_s"] * c["shortest_step_s"]
        ratio = tokens / now / c["pytorch_bf16_tokens_per_s"]
        body.append([config, "%.1f" % c["gemm_gflop_per_step"], "%.0f ms" % (1e3 * c["shortest_step_s"]),
                     "%.0f ms" % (1e3 * now), "**%.2fx**" % ratio, "%.2fx" % c["best_ratio"],
                     "%.0f%%" % (100 * ratio / c["best_ratio"])])
    out += table(["model", "GEMM GFLOP a step", "the step's GEMMs at the ceiling", "Keel bf16 step now",
                  "Keel bf16 / PyTorch bf16", "best ratio the ceiling allows",
                  "of the best (target for CPUs without AMX: 85%)"], body)
    rates = []
    with open(shapes) as f:
        for line in f:
            m = re.search(r"(\d+) GFLOP/s", line)
            if m:
                rates.append(int(m.group(1)))
    out.append("")
    out.append("Ceiling: %.1f GFLOP/s, register-only `vdpbf16ps` chains on one core (`scripts/bench/bf16_peak.c`). "
               "oneDNN's bf16 matmul alone at the step's shapes, one thread: %d-%d GFLOP/s (%.0f-%.0f%% of it). "
               "The step's times are medians of the alternated rounds." % (
                   peak, min(rates), max(rates), 100 * min(rates) / peak, 100 * max(rates) / peak))
    return out


# --- time to quality and fine-tuning --------------------------------------------------------

def machine(folder):
    info = {}
    with open(os.path.join(folder, "machine.txt")) as f:
        for line in f:
            if ":" in line:
                k, v = line.split(":", 1)
                info.setdefault(k.strip(), v.strip())
    return info


def cpu_name(info):
    cpu = info.get("cpu", "?")
    flags = info.get("flags", "").split()
    amx = "AMX" if "amx_bf16" in flags else ("AVX512_BF16, no AMX" if "avx512_bf16" in flags else "no bf16")
    cpu = re.sub(r"Intel\(R\) Xeon\(R\) Processor", "Intel Xeon", cpu)
    return "%s (%s)" % (cpu, amx)


def time_to_quality(folders):
    body = []
    for name in folders:
        folder = os.path.join(MEASURED, name)
        info = machine(folder)
        summary = json.load(open(os.path.join(folder, "summary.json")))
        ft = json.load(open(os.path.join(folder, "finetune.json")))
        keel, peer = summary["systems"]["keel"], summary["systems"]["pytorch-ddp"]

        def acc(k):
            return "%.1f%% (%.1f)" % (100 * ft[k]["mean_accuracy"], 100 * ft[k]["std_accuracy"])

        body.append([
            "[%s](%s)" % (name.replace("ttq-mini-", ""), os.path.relpath(folder, os.path.join(REPO, "docs"))),
            info.get("date", "?")[:10],
            cpu_name(info),
            "%.3f / %.3f" % (keel["final"]["heldout_loss"], peer["final"]["heldout_loss"]),
            "%.0f s / %.0f s" % (keel["seconds_to_bar"], peer["seconds_to_bar"]),
            "**%.2fx**" % keel["time_ratio_to_peer"],
            acc("keel"),
            acc("pytorch-ddp"),
            acc("random"),
        ])
    out = [
        "Command: `scripts/bench/time_to_quality.sh --minutes 10` (Keel: `keel local --workers 2 --threads 1` "
        "on `examples/ttq-mini.toml`; the peer: PyTorch DDP over gloo, 2 processes x 1 thread, on the same "
        "sequences). CPU and date: each run's `machine.txt`. Data: each run's folder (`summary.json`, "
        "`finetune.json`).",
        "",
    ]
    out += table(
        ["run", "date", "CPU", "final held-out loss, Keel / peer", "time to the peer's final loss, Keel / peer",
         "Keel / peer", "fine-tuned from Keel (spread)", "from the peer", "from random weights"],
        body,
    )
    out.append("")
    out.append("Fine-tuning: topic classification of 13 topics of Debian's fortunes, mean test accuracy over "
               "3 seeds (sample std in parentheses).")
    return out


# --- the ring against gloo and the bare TCP ring --------------------------------------------

def ring_paired(files, peer, against):
    """(workers, MiB) -> median over rounds of peer / against, each pair from one round's run of
    that cell (the runs bench-ring.sh puts seconds apart)."""
    runs = {}
    for path in files:
        for r in read_jsonl(path):
            if r["bytes"] >= (1 << 20):
                runs[(r["peer"], r["workers"], r["bytes"] >> 20, r.get("round"))] = r["busbw_gb_s"]
    cells = {}
    for (p, w, m, rnd), v in runs.items():
        other = runs.get((against, w, m, rnd))
        if p == peer and other:
            cells.setdefault((w, m), []).append(v / other)
    return {k: median(v) for k, v in cells.items()}


def ring(files, cpu, date, command):
    cells = ring_medians(files)
    ns = ring_cpu_medians(files)
    paired = ring_paired(files, "keel-io1", "gloo")
    out = source_line(cpu, date, command, files)
    body = []
    sizes = sorted({(w, m) for (_, w, m) in cells})

    def cpu_cell(peer, w, m):
        return "%.2f" % ns[(peer, w, m)] if (peer, w, m) in ns else "-"

    for w, m in sizes:
        keel = cells.get(("keel-io1", w, m))
        gloo = cells.get(("gloo", w, m))
        tcp = cells.get(("tcp", w, m))
        if keel is None or gloo is None or tcp is None:
            continue
        body.append([str(w), str(m), "%.2f" % keel, "%.2f" % gloo, "%.2f" % tcp,
                     "**%.2f**" % paired.get((w, m), keel / gloo), "%.2f" % (keel / tcp),
                     cpu_cell("keel-io1", w, m), cpu_cell("gloo", w, m), cpu_cell("tcp", w, m)])
    out += table(["workers", "MiB", "Keel", "gloo", "bare TCP ring", "Keel / gloo", "Keel / bare ring",
                  "Keel ns/B", "gloo ns/B", "bare ring ns/B"], body)
    out.append("")
    out.append("Bus bandwidth in GB/s (2 (n - 1) / n x bytes / time, the slowest rank), median over the "
               "alternated rounds; every process on 127.0.0.1; Keel with one network thread, 4 streams per "
               "link, 512 KiB frames; gloo is PyTorch 2.15's `all_reduce`, one thread per process. "
               "Keel / gloo: each round's Keel run over the gloo run of the same cell, seconds apart, median "
               "over the rounds (the GB/s columns are medians of their own). "
               "ns/B: CPU time (user + system) of all ranks per byte each rank sends, median over the rounds.")
    return out


# --- the scale model's predictions ---------------------------------------------------------

def scale_model(pattern_files, cpu, date):
    import subprocess
    files = [os.path.join(REPO, "scripts", "scale", f) for f in pattern_files]
    cmd = [sys.executable, os.path.join(REPO, "scripts", "scale_model.py")] + files
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("## BERT-base, predicted"))
    part = lines[start:]
    part[0] = part[0][3:] + "."
    command = "scripts/scale_model.py " + " ".join("scripts/scale/" + f for f in pattern_files)
    return source_line(cpu, date, command, files) + part


# --- the README's headline table ------------------------------------------------------------

AMX_STEP = os.path.join(MEASURED, "bf16-amx-2026-12-05", "bench-bf16.jsonl")
AMX_PASSES = os.path.join(MEASURED, "bf16-amx-2026-12-05", "passes.jsonl")
AMX_BEFORE_AFTER = os.path.join(MEASURED, "bf16-amx-2026-12-05", "before-after.jsonl")
AMX_MEMORY = os.path.join(MEASURED, "bf16-memory-2026-12-05", "memory.jsonl")
ZEN4_STEP = os.path.join(MEASURED, "bf16-zen4-2026-12-04", "bench-bf16.jsonl")
ZEN5_DIR = os.path.join(MEASURED, "bf16-zen5-2026-12-06")
ZEN5_STEP = os.path.join(ZEN5_DIR, "bench-bf16.jsonl")
ZEN5_PASSES = os.path.join(ZEN5_DIR, "passes.jsonl")
RING_FILES = [os.path.join(MEASURED, "ring-2026-12-07", "bench-ring-gloo-2-3-4.jsonl")]


def headline():
    """One row per headline figure, links relative to the repository's root."""
    def rlink(path, text=None):
        return "[%s](%s)" % (text or os.path.basename(path), rel(path))

    rows = []
    for path, cpu, what, date in ((AMX_STEP, "Intel Xeon with AMX (family 6 model 167)", "training step of BERT-mini, bf16, 1 core", "2026-12-05"),
                                  (ZEN5_STEP, "AMD EPYC Zen 5 (family 26 model 2)", "the same on a Zen 5", "2026-12-06"),
                                  (ZEN4_STEP, "AMD EPYC Zen 4 (family 25 model 17)", "the same on a Zen 4", "2026-12-04")):
        m = step_medians(path)
        ratio = {c: m[(c, "keel", "bf16", 1)] / m[(c, "pytorch", "bf16-autocast", 1)] for c in ("tiny", "mini", "base")}
        rows.append([what, "%s tokens/s" % fmt_int(m[("mini", "keel", "bf16", 1)]),
                     "PyTorch bf16: %s (**%.2fx**); tiny %.2fx, base %.2fx" % (
                         fmt_int(m[("mini", "pytorch", "bf16-autocast", 1)]), ratio["mini"], ratio["tiny"], ratio["base"]),
                     cpu, date, rlink(path)])
    for name, cpu, what in (("ttq-mini-2026-12-04-unpad", "Intel Xeon with AMX",
                             "time to PyTorch DDP's final held-out loss, BERT-mini, 2 workers"),
                            ("ttq-mini-2026-12-04-zen4", "AMD EPYC Zen 4", "the same on a Zen 4")):
        folder = os.path.join(MEASURED, name)
        summary = json.load(open(os.path.join(folder, "summary.json")))
        keel, peer = summary["systems"]["keel"], summary["systems"]["pytorch-ddp"]
        rows.append([what, "%.0f s" % keel["seconds_to_bar"],
                     "DDP: %.0f s (**%.2fx**)" % (peer["seconds_to_bar"], keel["time_ratio_to_peer"]),
                     cpu, machine(folder).get("date", "?")[:10], rlink(folder, name)])
    cells = ring_medians(RING_FILES)
    paired = ring_paired(RING_FILES, "keel-io1", "gloo")
    k4, k64 = cells[("keel-io1", 2, 4)], cells[("keel-io1", 2, 64)]
    g4, g64 = cells[("gloo", 2, 4)], cells[("gloo", 2, 64)]
    folder = os.path.dirname(RING_FILES[0])
    rows.append(["ring all-reduce, 2 workers, 4 / 64 MiB", "%.2f / %.2f GB/s" % (k4, k64),
                 "gloo: %.2f / %.2f (**%.2fx / %.2fx**)" % (g4, g64, paired[(2, 4)], paired[(2, 64)]),
                 "AMD EPYC Zen 3", "2026-12-07", rlink(folder, "ring-2026-12-07")])
    k, g = cells[("keel-io1", 4, 64)], cells[("gloo", 4, 64)]
    rows.append(["ring all-reduce, 4 workers, 64 MiB", "%.2f GB/s" % k, "gloo: %.2f (**%.2fx**)" % (g, paired[(4, 64)]),
                 "AMD EPYC Zen 3", "2026-12-07", rlink(folder, "ring-2026-12-07")])
    return table(["what", "Keel", "against", "CPU", "date", "data"], rows)


TABLES = {
    "headline": headline,
    "step-speed-amx": lambda: step_speed(
        AMX_STEP,
        XEON_AMX, "2026-12-05", "ROUNDS=2 scripts/bench-bf16.sh"),
    "step-memory-amx": lambda: step_memory(
        AMX_STEP,
        XEON_AMX, "2026-12-05", "ROUNDS=2 scripts/bench-bf16.sh"),
    "bf16-memory-before-after": lambda: memory_before_after(
        AMX_MEMORY, XEON_AMX, "2026-12-05",
        "keel-worker bench --steps 2 --threads 1, two builds alternated (notes.md)"),
    "step-roofline-tiny": lambda: step_roofline(
        AMX_PASSES, XEON_AMX, "2026-12-05", "ROUNDS=2 scripts/bench-passes.sh", "tiny"),
    "step-roofline-mini": lambda: step_roofline(
        AMX_PASSES, XEON_AMX, "2026-12-05", "ROUNDS=2 scripts/bench-passes.sh", "mini"),
    "threads-before-after": lambda: before_after(
        AMX_BEFORE_AFTER, XEON_AMX, "2026-12-05",
        "keel-worker bench --precision bf16, two builds alternated (notes.md)"),
    "threads-zen3": lambda: thread_scaling(
        [os.path.join(MEASURED, "threads-zen3-2026-12-07", f)
         for f in ("passes-fp32.jsonl", "passes-bf16-emulated.jsonl")],
        ZEN3, "2026-12-07", "ROUNDS=3 CONFIGS='tiny:32 mini:32' PRECISION=fp32|bf16 scripts/bench-passes.sh"),
    "threads-join-zen5": lambda: builds_alternated(
        os.path.join(MEASURED, "threads-zen5-2026-12-08", "builds.jsonl"), ZEN5, "2026-12-08",
        "scripts/bench-builds.sh OLD NEW (ROUNDS=6, tiny batch 32 20 steps, mini batch 32 8 steps, bf16)"),
    "step-speed-zen4": lambda: step_speed(
        ZEN4_STEP,
        ZEN4, "2026-12-04", "ROUNDS=2 scripts/bench-bf16.sh"),
    "step-speed-zen5": lambda: step_speed(
        ZEN5_STEP,
        ZEN5, "2026-12-06", "ROUNDS=2 scripts/bench-bf16.sh"),
    "ceiling-zen5": lambda: ceiling(
        os.path.join(ZEN5_DIR, "ceiling.json"), os.path.join(ZEN5_DIR, "onednn-shapes.txt"),
        ZEN5, "2026-12-06", "scripts/bench/ceiling.py bench-bf16.jsonl --peak-gflops 472.9"),
    "step-roofline-mini-zen5": lambda: step_roofline(
        ZEN5_PASSES, ZEN5, "2026-12-06", "ROUNDS=2 CONFIGS='tiny:32 mini:32' scripts/bench-passes.sh", "mini"),
    "step-roofline-tiny-zen5": lambda: step_roofline(
        ZEN5_PASSES, ZEN5, "2026-12-06", "ROUNDS=2 CONFIGS='tiny:32 mini:32' scripts/bench-passes.sh", "tiny"),
    "time-to-quality": lambda: time_to_quality([
        "ttq-mini-2026-12-04-unpad",
        "ttq-mini-2026-12-04-zen4",
        "ttq-mini-2026-12-04-amx3",
        "ttq-mini-2026-12-04-amx2",
        "ttq-mini-2026-12-04-amx",
        "ttq-mini-2026-12-02",
    ]),
    "ring": lambda: ring(
        RING_FILES,
        ZEN3, "2026-12-07", "scripts/bench-ring.sh --rounds 3 --io-threads 1 --gloo PYTHON"),
    "scale-model": lambda: scale_model(
        ["calibration-loopback-2026-12-04-xeon-amx.jsonl", "calibration-1gbit-2026-12-04-xeon-amx.jsonl"],
        XEON_AMX, "2026-12-04 (calibration runs)"),
}


def render(text):
    """The doc with every marked table replaced by what the data gives."""
    def replace(m):
        name = m.group(1)
        if name not in TABLES:
            raise SystemExit("docs_tables: unknown table %r in the doc" % name)
        lines = TABLES[name]()
        return "<!-- table:%s -->\n%s\n<!-- /table:%s -->" % (name, "\n".join(lines), name)

    pattern = re.compile(r"<!-- table:([\w-]+) -->\n.*?<!-- /table:\1 -->", re.S)
    return pattern.sub(replace, text)


DOCS = [os.path.join(REPO, "README.md"), os.path.join(REPO, "docs", "performance.md")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="fail (exit 1) when the doc's tables differ from the data")
    ap.add_argument("--builds", metavar="FILE.jsonl",
                    help="print the table of a scripts/bench-builds.sh run made on this machine, and stop")
    args = ap.parse_args()
    if args.builds:
        with open("/proc/cpuinfo") as f:
            info = dict((k.strip(), v.strip()) for k, v in (l.split(":", 1) for l in f if ":" in l))
        cpu = "%s, family %s model %s" % (cpu_name({"cpu": info.get("model name", "?"), "flags": info.get("flags", "")}),
                                          info.get("cpu family", "?"), info.get("model", "?"))
        print("\n".join(builds_alternated(os.path.abspath(args.builds), cpu, datetime.date.today().isoformat(),
                                          "scripts/bench-builds.sh")))
        return 0
    status = 0
    found = set()
    pattern = re.compile(r"<!-- table:([\w-]+) -->")
    for doc in DOCS:
        with open(doc) as f:
            old = f.read()
        found |= set(pattern.findall(old))
        new = render(old)
        if args.check:
            if new != old:
                sys.stdout.writelines(difflib.unified_diff(
                    old.splitlines(True), new.splitlines(True), rel(doc), "what the data gives"))
                print("docs_tables: %s's tables differ from docs/measured/; run scripts/docs_tables.py" % rel(doc),
                      file=sys.stderr)
                status = 1
            else:
                print("docs_tables: %s's tables match the data" % rel(doc))
        elif new != old:
            with open(doc, "w") as f:
                f.write(new)
            print("docs_tables: rewrote the tables of %s" % rel(doc))
    missing = set(TABLES) - found
    if missing:
        print("docs_tables: no doc has markers for %s" % ", ".join(sorted(missing)), file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
