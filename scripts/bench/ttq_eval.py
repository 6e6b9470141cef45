"""One evaluator for the time-to-quality benchmark (`scripts/bench/time_to_quality.sh`): the
held-out masked-LM loss and accuracy of every checkpoint of Keel and of the PyTorch peer,
computed the same way (transformers' BertForMaskedLM in fp32, eval mode) on one fixed,
pre-masked held-out set, then a JSON summary and a PNG of held-out loss against wall time.

The held-out set: the sequences of Keel's `heldout.keel` (from the `keel inspect` export, never
trained on by either system), masked once with a fixed seed by BERT's rule
(min(max_predictions, max(1, round(0.15 n))) of the n non-special positions; 80% [MASK],
10% a random token, 10% unchanged) and written to `--masked` so every checkpoint sees the same
input. Loss: mean cross-entropy over all masked positions; accuracy: share of them whose
argmax is the original token.

Each checkpoint list is JSON lines `{"step", "elapsed_s", "path"}`: elapsed_s is the wall time,
from the launch of that system's run, at which the checkpoint was complete.

Time to the peer's final loss: the peer's last checkpoint's held-out loss is the bar; for each
system, the first time its curve is at or below it (linear between checkpoints).

Needs torch, transformers and matplotlib (not Keel dependencies).
"""
import argparse
import json
import os
import random

import torch


def masked_heldout(sequences, vocab, seed, max_predictions, prob):
    with open(vocab) as f:
        tokens = [line.rstrip("\n") for line in f]
    ids = {t: i for i, t in enumerate(tokens)}
    special = {ids["[PAD]"], ids["[CLS]"], ids["[SEP]"]}
    rng = random.Random(seed)
    out = []
    with open(sequences) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("shard") != "heldout.keel":
                continue
            s = list(rec["ids"])
            cand = [i for i, t in enumerate(s) if t not in special]
            if not cand:
                continue
            k = min(max_predictions, max(1, int(round(len(cand) * prob))))
            pos = sorted(rng.sample(cand, min(k, len(cand))))
            labels = [s[i] for i in pos]
            for i in pos:
                r = rng.random()
                if r < 0.8:
                    s[i] = ids["[MASK]"]
                elif r < 0.9:
                    s[i] = rng.randrange(len(tokens))
            out.append({"input_ids": s, "positions": pos, "labels": labels})
    if not out:
        raise SystemExit(f"{sequences}: no heldout.keel sequences")
    return out


@torch.no_grad()
def evaluate(path, data, batch=32):
    from transformers import BertForMaskedLM

    model = BertForMaskedLM.from_pretrained(path).eval()
    total, correct, n = 0.0, 0, 0
    for b in range(0, len(data), batch):
        chunk = data[b : b + batch]
        width = max(len(r["input_ids"]) for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        rows, cols, labels = [], [], []
        for j, r in enumerate(chunk):
            ids[j, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            attn[j, : len(r["input_ids"])] = 1
            rows += [j] * len(r["positions"])
            cols += r["positions"]
            labels += r["labels"]
        logits = model(input_ids=ids, attention_mask=attn).logits[rows, cols].float()
        labels = torch.tensor(labels)
        total += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
        n += len(labels)
    return {"heldout_loss": total / n, "heldout_accuracy": correct / n, "masked_tokens": n}


def time_to(curve, bar):
    """First wall time at which `curve` ([(t, loss)], by t) is at or below `bar` (linear)."""
    prev = None
    for t, loss in curve:
        if loss <= bar:
            if prev is None or prev[1] == loss:
                return t
            t0, l0 = prev
            return t0 + (t - t0) * (l0 - bar) / (l0 - loss)
        prev = (t, loss)
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sequences", required=True, help="`keel inspect` export of the prepared folder")
    p.add_argument("--vocab", required=True)
    p.add_argument("--systems", nargs="+", required=True,
                   help="NAME=CHECKPOINTS.jsonl pairs, the peer first")
    p.add_argument("--masked", required=True, help="where to write the pre-masked held-out set")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--max-predictions-per-seq", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True, help="summary JSON")
    p.add_argument("--png", required=True)
    p.add_argument("--title", default="held-out MLM loss against wall-clock time")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    data = masked_heldout(a.sequences, a.vocab, a.seed, a.max_predictions_per_seq, 0.15)
    with open(a.masked, "w") as f:
        json.dump({"seed": a.seed, "sequences": data}, f)
    systems = {}
    for pair in a.systems:
        name, _, listing = pair.partition("=")
        if not os.path.isfile(listing):
            raise SystemExit(f"{name}: missing checkpoint list {listing}")
        points = []
        with open(listing) as f:
            for line in f:
                c = json.loads(line)
                points.append({**c, **evaluate(c["path"], data)})
                print(json.dumps({"system": name, **points[-1]}), flush=True)
        if not points:
            raise SystemExit(f"{name}: no checkpoints in {listing}")
        systems[name] = sorted(points, key=lambda c: c["elapsed_s"])
    names = list(systems)
    peer = names[0]
    bar = systems[peer][-1]["heldout_loss"]
    summary = {"heldout_sequences": len(data),
               "masked_tokens": systems[peer][-1]["masked_tokens"],
               "bar": {"system": peer, "heldout_loss": bar,
                       "what": "the peer's final held-out loss"},
               "systems": {}}
    for name, pts in systems.items():
        t = time_to([(c["elapsed_s"], c["heldout_loss"]) for c in pts], bar)
        summary["systems"][name] = {
            "checkpoints": pts,
            "final": pts[-1],
            "best_heldout_loss": min(c["heldout_loss"] for c in pts),
            "seconds_to_bar": t,
        }
    tp = summary["systems"][peer]["seconds_to_bar"]
    for name in names[1:]:
        tk = summary["systems"][name]["seconds_to_bar"]
        summary["systems"][name]["time_ratio_to_peer"] = (tk / tp) if (tk and tp) else None
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=2)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for name, pts in systems.items():
        ax.plot([c["elapsed_s"] for c in pts], [c["heldout_loss"] for c in pts], marker="o",
                label=f"{name} (final {pts[-1]['heldout_loss']:.3f})")
    ax.axhline(bar, color="grey", linestyle="--", linewidth=1, label=f"{peer}'s final loss")
    ax.set_xlabel("wall-clock seconds since launch")
    ax.set_ylabel("held-out MLM loss (fixed masks, fp32)")
    ax.set_title(a.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(json.dumps({"bar": bar, **{n: summary["systems"][n]["seconds_to_bar"] for n in names}}))


if __name__ == "__main__":
    main()
