#!/usr/bin/env python3
"""Linear probes on frozen features: how much of the fine-tuning task a pretrained checkpoint's
representations already separate, with no weight of the encoder trained. A diagnostic beside
scripts/bench/finetune.py: when two checkpoints fine-tune differently, equal probes say their
representations are alike and the difference is in how fine-tuning moves them.

For each checkpoint (HF layout, loaded as BertModel without a pooler, eval mode, fp32) and each
example of the task folder (scripts/bench/fortune_topics.py: train.jsonl / test.jsonl with
"text" and "label"), truncated to --max-len tokens:
  - `mean`: the last layer's hidden states averaged over the real tokens;
  - `cls`:  the last layer's [CLS] hidden state;
  - `cls_per_layer`: the [CLS] state after the embeddings and after each layer.
Each feature set is standardised with the training split's mean and std, then a multinomial
logistic regression (L2 penalty 1e-3 on the weights, L-BFGS, at most 300 iterations, zero
start: deterministic) is fitted on the training split and scored on the test split. Also
printed: the mean cosine similarity of the [CLS] states of all pairs of training examples per
layer (1.0 = every input gives the same direction).

Output: one JSON line per checkpoint on stdout.

Usage:
  python scripts/bench/probe_frozen.py --data TOPICS_DIR --tokenizer DIR \\
      keel=CKPT_DIR peer=CKPT_DIR [--max-len 64] [--threads 2]

Needs torch and transformers (the venv of scripts/peer).
"""

import argparse
import json
import os
import sys


def die(msg):
    print(f"probe_frozen: {msg}", file=sys.stderr)
    sys.exit(2)


def read_split(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
                rows.append((r["text"], int(r["label"])))
            except (json.JSONDecodeError, KeyError, ValueError) as e:
                die(f"{path}:{n}: expected a JSON line with 'text' and 'label' ({e})")
    if not rows:
        die(f"{path}: no examples")
    return rows


def features(torch, model, tok, rows, max_len, batch=64):
    """`mean` [n, hidden], `cls` [n, hidden] and `layers` [n, layers + 1, hidden]."""
    means, layers = [], []
    for i in range(0, len(rows), batch):
        enc = tok([t for t, _ in rows[i : i + batch]], truncation=True, max_length=max_len,
                  padding=True, return_tensors="pt")
        with torch.no_grad():
            hs = model(**enc, output_hidden_states=True).hidden_states
        real = enc["attention_mask"].unsqueeze(-1).float()
        means.append((hs[-1] * real).sum(1) / real.sum(1))
        layers.append(torch.stack([h[:, 0] for h in hs], 1))
    layers = torch.cat(layers)
    return {"mean": torch.cat(means), "cls": layers[:, -1], "layers": layers}


def probe(torch, x_train, y_train, x_test, y_test, classes):
    mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
    x_train, x_test = (x_train - mu) / sd, (x_test - mu) / sd
    w = torch.zeros(x_train.shape[1], classes, requires_grad=True)
    b = torch.zeros(classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=300)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x_train @ w + b, y_train) + 1e-3 * (w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return round(((x_test @ w + b).argmax(1) == y_test).float().mean().item(), 4)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="task folder with train.jsonl and test.jsonl")
    ap.add_argument("--tokenizer", required=True, help="folder with vocab.txt")
    ap.add_argument("--max-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cased", action="store_true", help="do not lowercase")
    ap.add_argument("checkpoints", nargs="+", help="LABEL=DIR, a checkpoint in HF layout")
    a = ap.parse_args()
    pairs = []
    for c in a.checkpoints:
        label, sep, path = c.partition("=")
        if not sep or not label or not os.path.isfile(os.path.join(path, "config.json")):
            die(f"'{c}': expected LABEL=DIR with DIR/config.json")
        pairs.append((label, path))
    if not os.path.isfile(os.path.join(a.tokenizer, "vocab.txt")):
        die(f"{a.tokenizer}/vocab.txt not found")
    train = read_split(os.path.join(a.data, "train.jsonl"))
    test = read_split(os.path.join(a.data, "test.jsonl"))

    import torch
    from transformers import BertModel, BertTokenizerFast

    torch.set_num_threads(a.threads)
    tok = BertTokenizerFast.from_pretrained(a.tokenizer, do_lower_case=not a.cased,
                                            local_files_only=True)
    y_train = torch.tensor([y for _, y in train])
    y_test = torch.tensor([y for _, y in test])
    classes = int(max(y_train.max(), y_test.max())) + 1
    for label, path in pairs:
        model = BertModel.from_pretrained(path, add_pooling_layer=False).eval()
        f_train = features(torch, model, tok, train, a.max_len)
        f_test = features(torch, model, tok, test, a.max_len)
        per_layer, cosine = [], []
        for layer in range(f_train["layers"].shape[1]):
            per_layer.append(probe(torch, f_train["layers"][:, layer], y_train,
                                   f_test["layers"][:, layer], y_test, classes))
            unit = torch.nn.functional.normalize(f_train["layers"][:, layer], dim=1)
            cosine.append(round((unit @ unit.T).mean().item(), 3))
        print(json.dumps({
            "label": label, "checkpoint": os.path.abspath(path), "max_len": a.max_len,
            "mean": probe(torch, f_train["mean"], y_train, f_test["mean"], y_test, classes),
            "cls": per_layer[-1], "cls_per_layer": per_layer, "cls_mean_cosine_per_layer": cosine,
        }), flush=True)


if __name__ == "__main__":
    main()
