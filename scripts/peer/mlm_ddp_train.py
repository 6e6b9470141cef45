"""The PyTorch peer of a Keel pretraining job, for the time-to-quality benchmark
(`scripts/bench/time_to_quality.sh`): Hugging Face `BertForMaskedLM` trained with
DistributedDataParallel over gloo, N processes x T threads on this machine, on the very token
sequences Keel trained on, with the same hyperparameters, for a wall-clock budget.

What it does, and how it matches Keel:
- Data: `--sequences` is the JSON-lines export of Keel's prepared folder (`keel inspect DIR`):
  every line has `ids` and `shard`; the training shards are used, `heldout.keel` is not.
  Rank r takes the sequences r, r+N, r+2N, ... of a seeded shuffle, a new shuffle per epoch
  (`--order shuffle`, the default). `--order keel` trains in Keel's order instead: every global
  batch the same sequences at the same step as in Keel, the same order in every epoch (see
  `epoch_order`).
- Model: the job's HF `config.json` as Keel wrote it (`--config`), random init (seeded).
- Masking: dynamic, a new mask per sequence each time it is drawn:
  min(max_predictions_per_seq, max(1, round(n * masked_lm_prob))) of the non-special
  positions, of which 80% become [MASK], 10% a random token, 10% stay. By default n counts the
  non-special positions; with `--count-specials` it is the sequence's whole length, [CLS] and
  [SEP] included, as BERT's create_pretraining_data.py and Keel count it (5 predictions in a
  full 32-token sequence instead of 4).
- Loss: the MLM head on the masked positions only (the hidden states are gathered first), as
  Keel computes it; the model is wrapped so that DDP sees the whole forward.
- Optimizer: torch.optim.AdamW (bias correction, as Keel's AdamW), betas (0.9, 0.999),
  eps and weight decay from the job, no decay on biases and LayerNorm weights (as Keel),
  gradients clipped to max_grad_norm, linear warmup then linear decay to 0 at max_steps.
- Precision: `--precision fp32`, or `bf16` (forward and loss under
  torch.autocast("cpu", dtype=torch.bfloat16); weights and AdamW stay fp32).
- Budget: training stops at the first step boundary after `--budget-seconds` counted from
  `--t0` (the Unix time the benchmark launched this peer, so start-up counts as it does for
  Keel), or at max_steps. Rank 0 decides and tells the others with a one-element all-reduce.
- Checkpoints: rank 0 writes `OUT/checkpoints/step-S/` (config.json + model.safetensors, the HF
  layout) every `--checkpoint-every-seconds` and at the end; `OUT/checkpoints.jsonl` lists
  `{"step", "elapsed_s", "path"}` with the wall time at which each was complete.
- Log: `OUT/steps.jsonl`, a line per step of rank 0: step, loss, lr, step_seconds, elapsed_s.

Needs torch and transformers (not Keel dependencies).
"""
import argparse
import json
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP


class MaskedPositionsMlm(torch.nn.Module):
    """BertForMaskedLM with its prediction head applied to the masked positions only.

    forward(input_ids [b, s], attention_mask [b, s], rows [m], cols [m]) -> logits [m, vocab].
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, rows, cols):
        hidden = self.model.bert(input_ids=input_ids, attention_mask=attention_mask)[0]
        return self.model.cls(hidden[rows, cols])


def load_sequences(path):
    """The training sequences of a `keel inspect` export: a list of id lists."""
    train = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not a JSON line ({e})")
            if rec.get("shard") == "heldout.keel":
                continue
            train.append(rec["ids"])
    if not train:
        raise SystemExit(f"{path}: no training sequences (expected `keel inspect` output)")
    return train


def special_ids(vocab_path):
    """Ids of [PAD], [CLS], [SEP], [MASK] and the vocabulary size, from vocab.txt."""
    with open(vocab_path) as f:
        vocab = [line.rstrip("\n") for line in f]
    index = {t: i for i, t in enumerate(vocab)}
    try:
        return {k: index[k] for k in ("[PAD]", "[CLS]", "[SEP]", "[MASK]")}, len(vocab)
    except KeyError as e:
        raise SystemExit(f"{vocab_path}: no {e} token")


def make_batch(seqs, rng, specials, vocab_size, a):
    """Pads `seqs` to their longest, masks them; returns tensors for MaskedPositionsMlm + labels."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), specials["[PAD]"], dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    rows, cols, labels = [], [], []
    skip = {specials["[PAD]"], specials["[CLS]"], specials["[SEP]"]}
    for b, s in enumerate(seqs):
        s = list(s)
        cand = [i for i, t in enumerate(s) if t not in skip]
        n = len(s) if a.count_specials else len(cand)
        k = min(a.max_predictions_per_seq, max(1, int(round(n * a.masked_lm_prob))))
        for i in sorted(rng.sample(cand, min(k, len(cand)))):
            rows.append(b)
            cols.append(i)
            labels.append(s[i])
            r = rng.random()
            if r < 0.8:
                s[i] = specials["[MASK]"]
            elif r < 0.9:
                s[i] = rng.randrange(vocab_size)
        ids[b, : len(s)] = torch.tensor(s)
        attn[b, : len(s)] = 1
    return ids, attn, torch.tensor(rows), torch.tensor(cols), torch.tensor(labels)


def lr_at(step, a):
    """Linear warmup over warmup_steps, then linear decay to 0 at max_steps (Keel's `linear`)."""
    if step < a.warmup_steps:
        return a.learning_rate * (step + 1) / a.warmup_steps
    rest = max(1, a.max_steps - a.warmup_steps)
    return a.learning_rate * max(0.0, 1.0 - (step - a.warmup_steps) / rest)


def save(model, out, step, t0, log):
    path = os.path.join(out, "checkpoints", f"step-{step}")
    model.save_pretrained(path + ".tmp", safe_serialization=True)
    os.replace(path + ".tmp", path)
    log.write(json.dumps({"step": step, "elapsed_s": round(time.time() - t0, 3), "path": path}) + "\n")
    log.flush()


def epoch_order(n, rank, a, order_rng):
    """This rank's sequence indices for the next epoch, in the order it trains on them.

    `shuffle` (default): a new seeded shuffle of all sequences each epoch, rank r taking every
    N-th. `keel`: Keel's plan (`keel_proto::split`): the export's order (prepare shuffled it
    once) in every epoch, global batch p = sequences [p*B, (p+1)*B), rank r its rows
    [r*b, (r+1)*b); the last N mod B sequences unused."""
    if a.order == "shuffle":
        order = list(range(n))
        order_rng.shuffle(order)
        return order[rank :: a.world_size]
    b, big_b = a.micro_batch_size, a.micro_batch_size * a.world_size
    return [p * big_b + rank * b + i for p in range(n // big_b) for i in range(b)]


def run(rank, a):
    torch.set_num_threads(a.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank,
                            world_size=a.world_size)
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(a.seed)
    config = BertConfig.from_json_file(a.config)
    model = BertForMaskedLM(config).train()
    wrapped = DDP(MaskedPositionsMlm(model))
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or "LayerNorm" in name else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.learning_rate, betas=(0.9, 0.999), eps=a.adam_epsilon)
    specials, vocab_size = special_ids(a.vocab)
    seqs = load_sequences(a.sequences)
    rng = random.Random(a.seed * 1000 + rank)
    order_rng = random.Random(a.seed)
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if a.precision == "bf16"
                else torch.autocast("cpu", enabled=False))
    os.makedirs(os.path.join(a.out, "checkpoints"), exist_ok=True)
    ckpt_log = open(os.path.join(a.out, "checkpoints.jsonl"), "a") if rank == 0 else None
    step_log = open(os.path.join(a.out, "steps.jsonl"), "a") if rank == 0 else None
    next_ckpt = a.checkpoint_every_seconds
    order, pos, step = [], 0, 0
    while step < a.max_steps:
        if pos + a.micro_batch_size > len(order):
            order = epoch_order(len(seqs), rank, a, order_rng)
            pos = 0
        batch = [seqs[i] for i in order[pos : pos + a.micro_batch_size]]
        pos += a.micro_batch_size
        t = time.time()
        lr = lr_at(step, a)
        for g in opt.param_groups:
            g["lr"] = lr
        ids, attn, rows, cols, labels = make_batch(batch, rng, specials, vocab_size, a)
        with autocast:
            logits = wrapped(ids, attn, rows, cols)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.max_grad_norm)
        opt.step()
        step += 1
        elapsed = time.time() - a.t0
        # Rank 0's clock decides (stop, checkpoint) for all ranks.
        flags = torch.tensor([0.0, 0.0])
        if rank == 0:
            flags[0] = 1.0 if elapsed >= a.budget_seconds else 0.0
            flags[1] = 1.0 if elapsed >= next_ckpt else 0.0
        dist.all_reduce(flags)
        stop = flags[0].item() > 0 or step >= a.max_steps
        if rank == 0:
            step_log.write(json.dumps({"step": step, "loss": round(loss.item(), 5), "lr": lr,
                                       "step_seconds": round(time.time() - t, 4),
                                       "elapsed_s": round(elapsed, 3)}) + "\n")
            if flags[1].item() > 0 or stop:
                save(model, a.out, step, a.t0, ckpt_log)
                while next_ckpt <= time.time() - a.t0:
                    next_ckpt += a.checkpoint_every_seconds
        if stop:
            break
    if rank == 0:
        step_log.close()
        ckpt_log.close()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sequences", required=True, help="`keel inspect` JSON lines")
    p.add_argument("--config", required=True, help="the job's HF config.json")
    p.add_argument("--vocab", required=True, help="the job's vocab.txt")
    p.add_argument("--out", required=True)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=29517)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--learning-rate", type=float, required=True)
    p.add_argument("--warmup-steps", type=int, required=True)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--adam-epsilon", type=float, default=1e-6)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--max-predictions-per-seq", type=int, default=20)
    p.add_argument("--count-specials", action="store_true",
                   help="count [CLS] and [SEP] in the length the masked count is taken of (BERT, Keel)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--order", choices=["shuffle", "keel"], default="shuffle",
                   help="the order of sequences over epochs (see epoch_order)")
    p.add_argument("--budget-seconds", type=float, default=600)
    p.add_argument("--checkpoint-every-seconds", type=float, default=60)
    p.add_argument("--t0", type=float, default=None, help="Unix time the run counts from")
    a = p.parse_args()
    if a.t0 is None:
        a.t0 = time.time()
    for path in (a.sequences, a.config, a.vocab):
        if not os.path.isfile(path):
            raise SystemExit(f"missing input: {path}")
    if a.warmup_steps < 1 or a.max_steps < 1:
        raise SystemExit("--warmup-steps and --max-steps must be at least 1")
    mp.spawn(run, args=(a,), nprocs=a.world_size, join=True)


if __name__ == "__main__":
    main()
