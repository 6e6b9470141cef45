#!/usr/bin/env python3
"""Fine-tune BertForSequenceClassification (HF transformers) on the fortune-topics task from a
given init, for several seeds, and report test accuracy: a downstream check of a pretrained
checkpoint against random weights (or against another checkpoint) at the same budget.

The task is the folder scripts/bench/fortune_topics.py writes: train.jsonl / test.jsonl lines
{"text", "label", "topic"} and labels.json. A fortune's label is the name of the fortune file it
comes from (art, computers, drugs, ... work: 13 topics); see that script's docstring.

Inits:
  --init DIR     a checkpoint in HF layout (config.json, model.safetensors, vocab.txt), e.g. a Keel
                 checkpoint; loaded with BertForSequenceClassification.from_pretrained(DIR,
                 num_labels=K). The classification head (classifier.*) is always new; any other
                 weight the checkpoint lacks (e.g. the pooler of an MLM-only checkpoint) is new too
                 and is reported as a `load` JSON line on stderr and in the results.
  --init random  BertForSequenceClassification(config) with config.json from --config-from DIR,
                 so the architecture is that checkpoint's, with random weights.

Every init gets the same recipe and budget: the same seeds, AdamW (weight decay 0.01 on all
weights but biases and LayerNorm, as BERT's and the HF Trainer's recipe), a linear schedule with
linear warmup over --warmup-fraction of the steps, gradient clipping at --max-grad-norm, dropout as
in config.json, fp32, --epochs epochs over the training set shuffled with the seed, dynamic padding
per batch to the longest sequence (truncated to --max-len tokens). For seed s, torch.manual_seed(s)
is set before the model is built, so the new head (and for `random` all weights), dropout and the
shuffle order all follow s. Test accuracy and macro-F1 (over the labels that occur in the gold
labels or predictions, sklearn's default) are measured once, after the last epoch.

Output: one JSON line per seed on stdout ({"label", "seed", "accuracy", "macro_f1",
"train_seconds", ...}), then one line with the mean and std (sample std, n-1) of the accuracy.
--out FILE (a JSON object keyed by --label) is merged: the entry for --label keeps a result per
seed (with its train seconds and --threads), the mean/std over its seeds and all
hyperparameters; a run with other hyperparameters (device and library versions included)
replaces that label's entry (a note goes to stderr), other labels are left alone.

Usage:
  python3 scripts/bench/fortune_topics.py --out /tmp/fortune-topics
  python scripts/bench/finetune.py --data /tmp/fortune-topics --init CKPT_DIR \\
      --label keel-step10000 --out results.json
  python scripts/bench/finetune.py --data /tmp/fortune-topics --init random --config-from CKPT_DIR \\
      --label random --out results.json
  (--tokenizer defaults to --init, or to --config-from for `random`; --seeds 0 1 2, --epochs 4,
   --lr 1e-4, --batch 32, --max-len 128, --warmup-fraction 0.1, --threads 2; --limit-train N and
   --limit-test N take the first N examples, for smoke tests.)

Needs torch and transformers (not Keel dependencies), e.g. the venv of scripts/peer.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

EXPECTED_NEW = ("classifier.",)  # the head every init gets fresh


def die(msg):
    print(f"finetune: {msg}", file=sys.stderr)
    sys.exit(1)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--data", required=True, help="folder written by fortune_topics.py")
    ap.add_argument("--init", required=True, help="checkpoint folder (HF layout) or `random`")
    ap.add_argument("--tokenizer", help="folder with vocab.txt (default: --init, or --config-from)")
    ap.add_argument("--config-from", help="checkpoint folder whose config.json `random` uses")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--warmup-fraction", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--max-grad-norm", type=float, default=1.0, help="0 turns clipping off")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto", help="auto (cuda when there is one), cpu, cuda, ...")
    ap.add_argument("--cased", action="store_true", help="do not lower-case (default: uncased, as Keel's vocab)")
    ap.add_argument("--limit-train", type=int, help="use only the first N training examples")
    ap.add_argument("--limit-test", type=int, help="use only the first N test examples")
    ap.add_argument("--label", help="name of this run in the results (default: the init's folder name)")
    ap.add_argument("--out", help="results JSON file to merge into")
    args = ap.parse_args()
    for name in ("epochs", "batch", "max_len", "threads"):
        if getattr(args, name) < 1:
            die(f"--{name.replace('_', '-')} must be at least 1")
    if not 0.0 <= args.warmup_fraction < 1.0:
        die("--warmup-fraction must be in [0, 1)")
    if args.max_len < 3:
        die("--max-len must leave room for [CLS], [SEP] and one token")
    if len(set(args.seeds)) != len(args.seeds):
        die("--seeds has duplicates")
    return args


def check_inputs(args):
    """Every input file exists, before torch is even imported."""
    for f in ("train.jsonl", "test.jsonl", "labels.json"):
        p = os.path.join(args.data, f)
        if not os.path.isfile(p):
            die(f"{p} not found: make the task with scripts/bench/fortune_topics.py --out {args.data}")
    if args.init == "random":
        if not args.config_from:
            die("--init random needs --config-from CHECKPOINT_DIR (its config.json gives the architecture)")
        model_dir = args.config_from
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            die(f"{model_dir}/config.json not found (--config-from)")
    else:
        model_dir = args.init
        if not os.path.isdir(model_dir):
            die(f"--init {model_dir}: no such folder (give a checkpoint folder or `random`)")
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            die(f"{model_dir}/config.json not found: --init must be a checkpoint in HF layout")
        weights = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
        if not any(os.path.isfile(os.path.join(model_dir, w)) for w in weights):
            die(f"{model_dir} has no weights ({', '.join(weights)})")
    tok_dir = args.tokenizer or model_dir
    if not os.path.isfile(os.path.join(tok_dir, "vocab.txt")):
        die(f"{tok_dir}/vocab.txt not found (give --tokenizer DIR, a folder with vocab.txt)")
    return tok_dir


def read_jsonl(path, limit, num_labels):
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                text, label = r["text"], int(r["label"])
            except (ValueError, KeyError, TypeError) as e:
                die(f"{path}:{n}: not a {{\"text\", \"label\"}} line ({e})")
            if not 0 <= label < num_labels:
                die(f"{path}:{n}: label {label} is outside labels.json (0..{num_labels - 1})")
            rows.append((text, label))
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        die(f"{path} has no examples")
    return rows


def load_tokenizer(tok_dir, lower):
    from transformers import BertTokenizerFast
    tok = BertTokenizerFast.from_pretrained(tok_dir, do_lower_case=lower, local_files_only=True)
    with open(os.path.join(tok_dir, "vocab.txt"), encoding="utf-8") as f:
        n_vocab = sum(1 for _ in f)
    if len(tok) != n_vocab:  # a tokenizer that silently fell back to another vocabulary
        die(f"tokenizer from {tok_dir} has {len(tok)} tokens but vocab.txt has {n_vocab} lines")
    if tok.pad_token_id is None or tok.cls_token_id is None or tok.sep_token_id is None:
        die(f"{tok_dir}/vocab.txt lacks [PAD], [CLS] or [SEP]")
    return tok


def encode(tok, rows, max_len):
    enc = tok([t for t, _ in rows], truncation=True, max_length=max_len)
    return [(ids, label) for ids, (_, label) in zip(enc["input_ids"], rows)]


def collate(torch, examples, pad_id, device):
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (ids, _) in enumerate(examples):
        input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, :len(ids)] = 1
    labels = torch.tensor([label for _, label in examples], dtype=torch.long)
    return {
        "input_ids": input_ids.to(device),
        "attention_mask": mask.to(device),
        "token_type_ids": torch.zeros_like(input_ids).to(device),
        "labels": labels.to(device),
    }


def macro_f1(gold, pred):
    scores = []
    for c in sorted(set(gold) | set(pred)):
        tp = sum(1 for g, p in zip(gold, pred) if g == c and p == c)
        fp = sum(1 for g, p in zip(gold, pred) if g != c and p == c)
        fn = sum(1 for g, p in zip(gold, pred) if g == c and p != c)
        scores.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


def build_model(torch, args, seed, num_labels):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    if args.init == "random":
        config = BertConfig.from_pretrained(args.config_from, num_labels=num_labels, local_files_only=True)
        return BertForSequenceClassification(config).float(), {"new": "all (random init)"}
    model, info = BertForSequenceClassification.from_pretrained(
        args.init, num_labels=num_labels, output_loading_info=True, local_files_only=True)
    info = {k: sorted(map(str, v)) for k, v in info.items() if isinstance(v, (list, set, tuple))}
    missing = info.get("missing_keys", [])
    load = {
        "new_head": [k for k in missing if k.startswith(EXPECTED_NEW)],
        "new_other": [k for k in missing if not k.startswith(EXPECTED_NEW)],
        "unexpected": info.get("unexpected_keys", []),
        "mismatched": info.get("mismatched_keys", []),
    }
    print(json.dumps({"load": load, "init": args.init, "seed": seed}), file=sys.stderr)
    return model.float(), load


def run_seed(torch, args, seed, train, test, num_labels, pad_id, device):
    from transformers import get_linear_schedule_with_warmup
    model, load = build_model(torch, args, seed, num_labels)
    vocab_size = model.config.vocab_size
    if max(max(ids) for ids, _ in train + test) >= vocab_size:
        die(f"the tokenizer gives ids up to {vocab_size} or more but the model's vocab_size is {vocab_size}")
    model.to(device)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(p)
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    steps_per_epoch = math.ceil(len(train) / args.batch)
    total = steps_per_epoch * args.epochs
    warmup = round(args.warmup_fraction * total)
    sched = get_linear_schedule_with_warmup(optim, warmup, total)
    gen = torch.Generator().manual_seed(seed)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    model.train()
    losses = []
    for _ in range(args.epochs):
        order = torch.randperm(len(train), generator=gen).tolist()
        for s in range(0, len(order), args.batch):
            batch = collate(torch, [train[i] for i in order[s:s + args.batch]], pad_id, device)
            loss = model(**batch).loss
            loss.backward()
            if args.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            losses.append(loss.item())
    sync()
    train_seconds = time.perf_counter() - t0

    model.eval()
    pred = []
    with torch.no_grad():
        for s in range(0, len(test), args.batch):
            batch = collate(torch, test[s:s + args.batch], pad_id, device)
            batch.pop("labels")
            pred.extend(model(**batch).logits.argmax(-1).tolist())
    gold = [label for _, label in test]
    tail = losses[-steps_per_epoch:]
    return {
        "accuracy": sum(1 for g, p in zip(gold, pred) if g == p) / len(gold),
        "macro_f1": macro_f1(gold, pred),
        "train_seconds": round(train_seconds, 3),
        "steps": total,
        "final_epoch_loss": sum(tail) / len(tail),
        "load": load,
    }


def merge_results(path, label, hparams, runs):
    results = {}
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                results = json.load(f)
        except ValueError as e:
            die(f"{path} is not JSON ({e}); not overwriting it")
        if not isinstance(results, dict):
            die(f"{path} is not a JSON object keyed by label; not overwriting it")
    entry = results.get(label)
    if entry and entry.get("hyperparameters") != hparams:
        print(f"finetune: {path}: entry {label!r} had other hyperparameters; replacing it", file=sys.stderr)
        entry = None
    per_seed = dict(entry["per_seed"]) if entry else {}
    per_seed.update({str(s): r for s, r in runs.items()})
    per_seed = dict(sorted(per_seed.items(), key=lambda kv: int(kv[0])))
    accs = [r["accuracy"] for r in per_seed.values()]
    results[label] = {
        "hyperparameters": hparams,
        "per_seed": per_seed,
        "seeds": [int(s) for s in per_seed],
        "mean_accuracy": statistics.mean(accs),
        "std_accuracy": statistics.stdev(accs) if len(accs) > 1 else 0.0,
        "mean_macro_f1": statistics.mean(r["macro_f1"] for r in per_seed.values()),
    }
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return results[label]


def main():
    args = parse_args()
    tok_dir = check_inputs(args)
    with open(os.path.join(args.data, "labels.json"), encoding="utf-8") as f:
        topics = json.load(f)
    if not isinstance(topics, list) or len(topics) < 2:
        die(f"{args.data}/labels.json is not a list of at least two label names")
    train_rows = read_jsonl(os.path.join(args.data, "train.jsonl"), args.limit_train, len(topics))
    test_rows = read_jsonl(os.path.join(args.data, "test.jsonl"), args.limit_test, len(topics))

    try:
        import torch
        import transformers
    except ImportError as e:
        die(f"needs torch and transformers ({e}); e.g. pip install torch transformers safetensors")
    torch.set_num_threads(args.threads)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on GPUs too
    torch.backends.cudnn.allow_tf32 = False

    tok = load_tokenizer(tok_dir, lower=not args.cased)
    train = encode(tok, train_rows, args.max_len)
    test = encode(tok, test_rows, args.max_len)
    label = args.label or ("random" if args.init == "random" else os.path.basename(os.path.normpath(args.init)))
    hparams = {
        "init": args.init if args.init == "random" else os.path.abspath(args.init),
        "config_from": os.path.abspath(args.config_from) if args.config_from else None,
        "tokenizer": os.path.abspath(tok_dir), "lowercase": not args.cased,
        "data": os.path.abspath(args.data), "num_labels": len(topics),
        "train_examples": len(train), "test_examples": len(test),
        "epochs": args.epochs, "lr": args.lr, "batch": args.batch, "max_len": args.max_len,
        "warmup_fraction": args.warmup_fraction, "weight_decay": args.weight_decay,
        "weight_decay_excludes": "bias, LayerNorm", "max_grad_norm": args.max_grad_norm,
        "optimizer": "AdamW", "schedule": "linear with warmup", "dtype": "float32",
        "device": str(device),
        "torch": torch.__version__, "transformers": transformers.__version__,
    }

    runs = {}
    for seed in args.seeds:
        r = run_seed(torch, args, seed, train, test, len(topics), tok.pad_token_id, device)
        r["threads"] = args.threads  # not a hyperparameter: kept per seed, beside train_seconds
        runs[seed] = r
        print(json.dumps({"label": label, "seed": seed, "accuracy": round(r["accuracy"], 4),
                          "macro_f1": round(r["macro_f1"], 4), "train_seconds": r["train_seconds"],
                          "steps": r["steps"], "final_epoch_loss": round(r["final_epoch_loss"], 4)}),
              flush=True)
    accs = [r["accuracy"] for r in runs.values()]
    summary = {"label": label, "seeds": args.seeds, "mean_accuracy": round(statistics.mean(accs), 4),
               "std_accuracy": round(statistics.stdev(accs), 4) if len(accs) > 1 else 0.0,
               "mean_macro_f1": round(statistics.mean(r["macro_f1"] for r in runs.values()), 4)}
    if args.out:
        entry = merge_results(args.out, label, hparams, runs)
        summary["out"] = args.out
        summary["stored_seeds"] = entry["seeds"]
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
