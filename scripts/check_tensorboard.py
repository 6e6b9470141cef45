"""Reads a folder's TensorBoard event files with the real `tensorboard` package's
EventAccumulator and checks that they hold exactly the scalars of its metrics.jsonl.

Usage: check_tensorboard.py FOLDER [--min-steps N] [--min-evals N]

The tags and fields are keel_proto::tensorboard's table. After a `resume` line at step s the
values of steps after s are dropped (the coordinator writes a restart event at s + 1, on which
TensorBoard drops them too), and a later line for the same step replaces an earlier one.
A value matches when it is the metrics value rounded to a 32-bit float (TensorBoard's
simple_value); NaN matches NaN (`null` in metrics.jsonl). Exits 1 naming the first mismatch.
"""

import argparse
import json
import math
import struct
import sys
from pathlib import Path

from tensorboard.backend.event_processing import event_accumulator

STEP_TAGS = {
    "train/loss": "loss",
    "train/mlm_loss": "mlm_loss",
    "train/nsp_loss": "nsp_loss",
    "train/mlm_accuracy": "mlm_accuracy",
    "train/learning_rate": "lr",
    "train/grad_norm": "grad_norm",
    "train/tokens_per_second": "tokens_per_s",
    "train/step_seconds": "step_seconds",
    "train/allreduce_seconds": "allreduce_seconds",
}
EVAL_TAGS = {
    "eval/loss": "eval_loss",
    "eval/accuracy": "eval_accuracy",
    "eval/perplexity": "eval_perplexity",
}


def f32(x):
    """x as TensorBoard stores it (NaN for null)."""
    if x is None:
        return math.nan
    return struct.unpack("<f", struct.pack("<f", float(x)))[0]


def expected_scalars(metrics_path):
    """tag -> {step: value} from metrics.jsonl, later lines winning, resumes applied."""
    want = {}
    steps = evals = 0
    for n, text in enumerate(metrics_path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        line = json.loads(text)
        if "event" in line:
            if line["event"] == "resume":
                for values in want.values():
                    for step in [s for s in values if s > line["step"]]:
                        del values[step]
            continue
        if "eval_loss" in line:
            tags, evals = EVAL_TAGS, evals + 1
        elif "loss" in line:
            tags, steps = STEP_TAGS, steps + 1
        else:
            continue
        for tag, field in tags.items():
            if field not in line:
                sys.exit(f"{metrics_path}:{n}: no {field!r} field")
            want.setdefault(tag, {})[line["step"]] = f32(line[field])
    return want, steps, evals


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--min-steps", type=int, default=1)
    parser.add_argument("--min-evals", type=int, default=1)
    args = parser.parse_args()

    event_files = sorted(args.folder.glob("events.out.tfevents.*"))
    if not event_files:
        sys.exit(f"{args.folder}: no events.out.tfevents.* file")
    want, steps, evals = expected_scalars(args.folder / "metrics.jsonl")
    if steps < args.min_steps or evals < args.min_evals:
        sys.exit(f"metrics.jsonl has {steps} step and {evals} eval lines; "
                 f"want at least {args.min_steps} and {args.min_evals}")

    # 0: keep every value (the default samples 10,000 scalars per tag).
    acc = event_accumulator.EventAccumulator(
        str(args.folder), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    got_tags = set(acc.Tags()["scalars"])
    if got_tags != set(want):
        sys.exit(f"tags differ: TensorBoard has {sorted(got_tags)}, metrics.jsonl gives {sorted(want)}")
    checked = 0
    for tag in sorted(want):
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        expect = sorted(want[tag].items())
        if [s for s, _ in got] != [s for s, _ in expect]:
            sys.exit(f"{tag}: TensorBoard has steps {[s for s, _ in got]}, "
                     f"metrics.jsonl {[s for s, _ in expect]}")
        for (step, value), (_, wanted) in zip(got, expect):
            if not same(value, wanted):
                sys.exit(f"{tag} at step {step}: TensorBoard reads {value!r}, metrics.jsonl has {wanted!r}")
            checked += 1
    print(f"TensorBoard reads back all {checked} scalars ({len(want)} tags, {steps} step lines, "
          f"{evals} eval lines) from {len(event_files)} event file(s) in {args.folder}")


if __name__ == "__main__":
    main()
