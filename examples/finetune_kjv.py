#!/usr/bin/env python3
"""Fine-tune a Keel checkpoint with Hugging Face `transformers`: tell Old Testament verses from
New Testament ones (a two-class sequence classification), and compare with the same model from
random weights at the same budget. The pulled checkpoint is loaded as it is, with
`BertForSequenceClassification.from_pretrained` (the classification head and the pooler are new).

Usage (after scripts/demo.sh; needs torch and transformers, which Keel itself does not):
  python3 examples/finetune_kjv.py demo-out/checkpoint [corpora/en-kjv/kjv.txt]
Options through the environment: STEPS (default 300), SEED (default 0).

The verses were also the pretraining text, so this shows that the checkpoint loads and
fine-tunes, not how well it generalises; docs/performance.md has a held-out task.
"""

import os
import random
import sys

import torch
from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

ckpt = sys.argv[1] if len(sys.argv) > 1 else "demo-out/checkpoint"
corpus = sys.argv[2] if len(sys.argv) > 2 else "corpora/en-kjv/kjv.txt"
steps = int(os.environ.get("STEPS", "300"))
seed = int(os.environ.get("SEED", "0"))

lines = [l.strip() for l in open(corpus, encoding="utf-8") if l.strip()]
nt = next(i for i, l in enumerate(lines) if l.startswith("The book of the generation of Jesus Christ"))
verses = [(l, 0) for l in lines[:nt]] + [(l, 1) for l in lines[nt:]]
rng = random.Random(seed)
old = [v for v in verses if v[1] == 0]
new = [v for v in verses if v[1] == 1]
rng.shuffle(old)
rng.shuffle(new)
test = old[:250] + new[:250]
train = old[250:2250] + new[250:2250]

tok = AutoTokenizer.from_pretrained(ckpt)


def batches(data, size):
    for i in range(0, len(data), size):
        part = data[i : i + size]
        enc = tok([t for t, _ in part], padding=True, truncation=True, max_length=64, return_tensors="pt")
        yield enc, torch.tensor([y for _, y in part])


def run(model, name):
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    model.train()
    step = 0
    while step < steps:
        rng.shuffle(train)
        for enc, y in batches(train, 32):
            loss = model(**enc, labels=y).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if step == steps:
                break
    model.eval()
    right = 0
    with torch.no_grad():
        for enc, y in batches(test, 100):
            right += (model(**enc).logits.argmax(-1) == y).sum().item()
    print(f"{name}: test accuracy {right / len(test):.1%} after {steps} steps of 32 verses")


torch.manual_seed(seed)
run(BertForSequenceClassification.from_pretrained(ckpt, num_labels=2), f"from {ckpt}")
torch.manual_seed(seed)
run(BertForSequenceClassification(BertConfig.from_pretrained(ckpt, num_labels=2)), "from random weights")
