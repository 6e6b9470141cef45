#!/usr/bin/env python3
"""Build a topic-classification task from Debian's `fortunes` package, plus a pretraining corpus
that leaves the task's test texts out.

What it writes (into --out DIR):
  train.jsonl, test.jsonl   one example a line: {"text": ..., "label": int, "topic": str}
  labels.json               the topic names; label i is labels[i]
  summary.json              counts per split and label, the seed, the source files, what was dropped
  pretrain-fortunes.txt     the English fortunes pretraining corpus minus every test text

How labels are made: the label of a fortune is the name of the fortune file it comes from (the
file its text really lives in), for these topical files of /usr/share/games/fortunes:
art, computers, drugs, education, food, law, literature, love, medicine, politics, science,
sports, work. Label ids are the positions in that (alphabetical) list.

Text cleaning follows `fortunes_to_documents` in scripts/corpora.sh, byte for byte: ANSI colour
codes (ESC [ digits/; m) are removed, trailing blanks (space, tab, CR) are removed, a line that is
just `%` ends a fortune, blank lines inside a fortune are dropped and empty fortunes are skipped.
Nothing else is changed (backspace overstriking in a few fortunes is kept, as corpora.sh keeps
it). For classification a fortune's lines are joined with one space.

Duplicates: an exact duplicate text (after joining) is kept once, at its first occurrence; a text
that occurs under two or more labels is dropped entirely, because its label is ambiguous.

Split: stratified per label with a fixed seed: each label's examples (in file order) are shuffled
with random.Random(f"{seed}:{topic}") and the first round(n * test_fraction) go to test, the rest
to train. The same seed and the same fortune files give the same split.

Pretraining corpus: every fortune of the files scripts/corpora.sh uses for en-fortunes (the files
`dpkg -L fortunes fortunes-min` lists that match ^/usr/share/games/fortunes/[a-z0-9-]+$, read from
--fortunes-dir), one fortune a document, in corpora.sh's layout: one line per line of the
fortune, one blank line between documents. A fortune whose joined text equals a test text is left
out (every copy of it, from any file), so the pretraining data never contains a test example.
As in corpora.sh, each file's end ends its last fortune, even where the file has no closing `%`
line (computers, law, people, pratchett, wisdom in fortunes 1:1.99.1), so every document is
exactly one fortune (and a test fortune cannot hide inside another document).

Prints a one-line JSON summary on stdout.

Usage:
  python3 scripts/bench/fortune_topics.py --out /tmp/fortune-topics
  python3 scripts/bench/fortune_topics.py --out DIR [--fortunes-dir /usr/share/games/fortunes]
      [--seed 1234] [--test-fraction 0.2]

Needs the Debian packages fortunes and fortunes-min (scripts/setup.sh fortunes fortunes-min).
Standard library only.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys

TOPICS = [
    "art", "computers", "drugs", "education", "food", "law", "literature", "love", "medicine",
    "politics", "science", "sports", "work",
]
DEFAULT_DIR = "/usr/share/games/fortunes"
# corpora.sh: (dpkg -L fortunes fortunes-min) | grep -E "^$fdir/[a-z0-9-]+$"
PRETRAIN_PACKAGES = ["fortunes", "fortunes-min"]
PRETRAIN_NAME = re.compile(r"^" + re.escape(DEFAULT_DIR) + r"/([a-z0-9-]+)$")
ANSI = re.compile(rb"\x1b\[[0-9;]*m")


def die(msg):
    print(f"fortune_topics: {msg}", file=sys.stderr)
    sys.exit(1)


def read_fortunes(path):
    """The fortunes of one %-separated file, each a list of lines (bytes), cleaned as
    scripts/corpora.sh's fortunes_to_documents does (LC_ALL=C, so byte-wise)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        die(f"cannot read fortune file {path}: {e.strerror}")
    fortunes, buf = [], []
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last line starts no new line
    for line in lines:
        line = ANSI.sub(b"", line).rstrip(b" \t\r")
        if line == b"%":
            if buf:
                fortunes.append(buf)
            buf = []
        elif line:
            buf.append(line)
    if buf:  # the file's last fortune, even without a closing `%` (see the module docstring)
        fortunes.append(buf)
    return fortunes


def joined(lines):
    """The classification text of a fortune: its lines joined with one space."""
    return b" ".join(lines).decode("utf-8", errors="replace")


def pretrain_files(fortunes_dir):
    """The fortune files corpora.sh uses for en-fortunes, looked up in fortunes_dir."""
    try:
        proc = subprocess.run(["dpkg", "-L", *PRETRAIN_PACKAGES], capture_output=True, text=True)
    except FileNotFoundError:
        die("dpkg not found: the pretraining file list comes from `dpkg -L fortunes fortunes-min`")
    names = sorted({m.group(1) for m in map(PRETRAIN_NAME.match, proc.stdout.splitlines()) if m})
    if proc.returncode != 0 or not names:
        die("`dpkg -L fortunes fortunes-min` lists no fortune files "
            f"({proc.stderr.strip() or 'no match'}); install them: scripts/setup.sh fortunes fortunes-min")
    paths = [os.path.join(fortunes_dir, n) for n in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        die(f"fortune files listed by dpkg are missing from {fortunes_dir}: {', '.join(missing)}")
    return paths


def write_atomic(path, write):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def write_jsonl(path, rows):
    def w(f):
        for r in rows:
            f.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
    write_atomic(path, w)


def write_json(path, obj):
    write_atomic(path, lambda f: f.write((json.dumps(obj, ensure_ascii=False, indent=2) + "\n").encode("utf-8")))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fortunes-dir", default=DEFAULT_DIR)
    ap.add_argument("--out", required=True, help="folder to write the task and corpus into")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--test-fraction", type=float, default=0.2)
    args = ap.parse_args()
    if not 0.0 < args.test_fraction < 1.0:
        die(f"--test-fraction must be between 0 and 1, got {args.test_fraction}")
    if not os.path.isdir(args.fortunes_dir):
        die(f"fortunes folder {args.fortunes_dir} not found; install the packages: "
            "scripts/setup.sh fortunes fortunes-min")
    topic_paths = [os.path.join(args.fortunes_dir, t) for t in TOPICS]
    missing = [p for p in topic_paths if not os.path.isfile(p)]
    if missing:
        die(f"missing fortune files: {', '.join(missing)} (scripts/setup.sh fortunes fortunes-min)")
    pretrain_paths = pretrain_files(args.fortunes_dir)  # checked before anything is written

    # Texts per label, in file order; then duplicates out.
    raw = []  # (text, label)
    for label, path in enumerate(topic_paths):
        raw.extend((joined(f), label) for f in read_fortunes(path))
    labels_of = {}
    for text, label in raw:
        labels_of.setdefault(text, set()).add(label)
    seen, examples = set(), {label: [] for label in range(len(TOPICS))}
    dup_same, dup_cross = 0, 0
    for text, label in raw:
        if len(labels_of[text]) > 1:
            dup_cross += 1
            continue
        if text in seen:
            dup_same += 1
            continue
        seen.add(text)
        examples[label].append(text)
    cross_texts = sum(1 for ls in labels_of.values() if len(ls) > 1)

    # Stratified split.
    train, test = [], []
    counts = {"train": {}, "test": {}, "total": {}}
    for label, topic in enumerate(TOPICS):
        texts = list(examples[label])
        random.Random(f"{args.seed}:{topic}").shuffle(texts)
        n_test = round(len(texts) * args.test_fraction)
        if len(texts) >= 2:
            n_test = min(max(n_test, 1), len(texts) - 1)  # both splits see every label
        test.extend({"text": t, "label": label, "topic": topic} for t in texts[:n_test])
        train.extend({"text": t, "label": label, "topic": topic} for t in texts[n_test:])
        counts["test"][topic] = n_test
        counts["train"][topic] = len(texts) - n_test
        counts["total"][topic] = len(texts)
    # Shuffle each split's order once (fixed seed), so the files are not sorted by label.
    random.Random(f"{args.seed}:train").shuffle(train)
    random.Random(f"{args.seed}:test").shuffle(test)

    # Pretraining corpus without the test texts.
    test_texts = {r["text"] for r in test}
    docs, excluded = [], 0
    for path in pretrain_paths:
        for f in read_fortunes(path):
            if joined(f) in test_texts:
                excluded += 1
            else:
                docs.append(f)
    if not docs:
        die("the pretraining corpus would be empty")

    os.makedirs(args.out, exist_ok=True)
    write_jsonl(os.path.join(args.out, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "test.jsonl"), test)
    write_json(os.path.join(args.out, "labels.json"), TOPICS)
    pretrain_out = os.path.join(args.out, "pretrain-fortunes.txt")
    write_atomic(pretrain_out, lambda out: out.write(b"\n\n".join(b"\n".join(d) for d in docs) + b"\n"))
    summary = {
        "seed": args.seed,
        "test_fraction": args.test_fraction,
        "labels": TOPICS,
        "counts": {"train": len(train), "test": len(test), "total": len(train) + len(test)},
        "per_label": counts,
        "dropped": {
            "duplicates_same_label": dup_same,
            "cross_label_fortunes": dup_cross,
            "cross_label_distinct_texts": cross_texts,
        },
        "sources": {"topic_files": topic_paths, "pretrain_files": pretrain_paths},
        "pretrain": {
            "path": pretrain_out,
            "documents": len(docs),
            "excluded_test_fortunes": excluded,
        },
    }
    write_json(os.path.join(args.out, "summary.json"), summary)
    print(json.dumps({
        "out": args.out, "seed": args.seed, "labels": len(TOPICS), "train": len(train),
        "test": len(test), "dropped_duplicates": dup_same, "dropped_cross_label": dup_cross,
        "pretrain_documents": len(docs), "pretrain_excluded": excluded,
    }))


if __name__ == "__main__":
    main()
