#!/usr/bin/env python3
"""Reference values for Keel's numerics tests, computed with PyTorch + HF transformers.

Run from the repository's root, in a venv with torch, transformers and safetensors
(see fixtures/README.md for the versions):  python scripts/peer/make_fixtures.py fixtures
Writes, per case folder: config.json, model.safetensors (HF save_pretrained layout),
batch.json, expected.json, forward.safetensors, grads.safetensors, and optimizer steps.
Everything is computed in float64 from the float32 weights (the model is loaded, cast to
double, run in eval mode so dropout is off). Rust tests compare their f64 kernels tightly
and their f32 kernels loosely against these.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import BertConfig, BertForMaskedLM, BertForPreTraining
from transformers.utils import logging as hf_logging

hf_logging.set_verbosity_error()

MASK, CLS, SEP, PAD = 4, 2, 3, 0  # a small made-up vocab: [PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4


def config(vocab=512, hidden=64, layers=2, heads=4, inter=128, max_pos=64):
    return BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=inter, max_position_embeddings=max_pos,
                      type_vocab_size=2, pad_token_id=PAD, layer_norm_eps=1e-12, hidden_act="gelu")


def make_batch(vocab, seed):
    """3 rows x 16 positions: [CLS] a [SEP] b [SEP] [PAD]...; rows of length 16, 12 and 9."""
    g = torch.Generator().manual_seed(seed)
    seq, lengths = 16, [16, 12, 9]
    ids = torch.zeros(3, seq, dtype=torch.long)
    tt = torch.zeros_like(ids)
    attn = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for r, n in enumerate(lengths):
        body = torch.randint(5, vocab, (n,), generator=g)
        a_end = n // 2
        body[0], body[a_end], body[n - 1] = CLS, SEP, SEP
        ids[r, :n] = body
        tt[r, a_end + 1:n] = 1
        attn[r, :n] = 1
        cand = [i for i in range(n) if i not in (0, a_end, n - 1)]
        pick = [cand[i] for i in torch.randperm(len(cand), generator=g)[:3].tolist()]
        for j, p in enumerate(pick):
            labels[r, p] = ids[r, p]
            if j == 0:
                ids[r, p] = MASK            # 80% case
            elif j == 1:
                ids[r, p] = int(torch.randint(5, vocab, (1,), generator=g))  # 10% random
            # j == 2: 10% unchanged
    return {"input_ids": ids, "token_type_ids": tt, "attention_mask": attn, "labels": labels}


def perturb(model, seed):
    """HF init sets biases to 0 and LayerNorm to 1/0: jitter 1-D params so they are tested too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn(p.shape, generator=g))


def no_decay(name):
    return name.endswith(".bias") or "LayerNorm" in name


def unique_params(model):
    seen, out = set(), []
    for n, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def adamw_steps(model, batch, steps, lr, wd, eps, betas=(0.9, 0.999), clip=1.0):
    """torch.optim.AdamW with HF/BERT param groups (no decay on bias and LayerNorm) and global-norm
    clipping at `clip`, constant lr; returns per-step losses (before each update) and final params."""
    params = unique_params(model)
    groups = [{"params": [p for n, p in params if not no_decay(n)], "weight_decay": wd},
              {"params": [p for n, p in params if no_decay(n)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        losses.append(float(loss))
        opt.step()
    return losses, norms


def lamb_step(params, grads, lr, wd, eps, betas=(0.9, 0.999)):
    """One LAMB step, You et al. 2019 (arXiv:1904.00962) Algorithm 2, step t=1, float64:
    m = (1-b1) g, v = (1-b2) g^2, m_hat = m/(1-b1), v_hat = v/(1-b2), r = m_hat/(sqrt(v_hat)+eps),
    u = r + wd*w (wd only for decayed params), ratio = ||w||/||u|| if both > 0 else 1
    (ratio = 1 for bias and LayerNorm params: excluded from layer adaptation), w <- w - lr*ratio*u."""
    b1, b2 = betas
    out, ratios = {}, {}
    for n, w in params.items():
        g = grads[n]
        m, v = (1 - b1) * g, (1 - b2) * g * g
        r = (m / (1 - b1)) / (np.sqrt(v / (1 - b2)) + eps)
        u = r + (0.0 if no_decay(n) else wd) * w
        wn, un = np.linalg.norm(w), np.linalg.norm(u)
        ratio = 1.0 if no_decay(n) or wn == 0 or un == 0 else wn / un
        out[n], ratios[n] = w - lr * ratio * u, ratio
    return out, ratios


def t(x):
    return x.detach().contiguous().clone()


def case(out, cls, seed, nsp):
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = config()
    model = cls(cfg)
    perturb(model, seed + 7)
    model.save_pretrained(out)
    batch = make_batch(cfg.vocab_size, seed + 1)
    if nsp:
        batch["next_sentence_label"] = torch.tensor([0, 1, 0])
    (out / "batch.json").write_text(json.dumps({k: v.tolist() for k, v in batch.items()}))

    m = cls.from_pretrained(out).double().eval()
    o = m(**batch, output_hidden_states=True)
    o.loss.backward()
    names = dict(m.named_parameters(remove_duplicate=False))
    grads = {n: t(p.grad) for n, p in names.items()}
    logits = o.prediction_logits if nsp else o.logits
    fwd = {f"hidden_states.{i}": t(h) for i, h in enumerate(o.hidden_states)}
    fwd["logits"] = t(logits)
    if nsp:
        fwd["seq_relationship_logits"] = t(o.seq_relationship_logits)
    mlm_loss = torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab_size), batch["labels"].view(-1),
                                                 ignore_index=-100, reduction="sum")
    save_file(fwd, out / "forward.safetensors")
    save_file(grads, out / "grads.safetensors")
    uniq = unique_params(m)
    gnorm = float(torch.sqrt(sum((p.grad ** 2).sum() for _, p in uniq)))
    expected = {
        "loss": float(o.loss), "mlm_loss_sum": float(mlm_loss),
        "n_masked": int((batch["labels"] != -100).sum()), "grad_global_norm": gnorm,
        "dtype": "float64 (weights stored float32, cast to float64 before the run)",
        "dropout": "off (eval mode)",
        "loss_definition": "mean cross-entropy over positions with label != -100"
                           + (" plus mean NSP cross-entropy over the batch" if nsp else ""),
        "tied": "cls.predictions.decoder.weight is bert.embeddings.word_embeddings.weight; "
                "cls.predictions.decoder.bias is cls.predictions.bias; grads.safetensors holds the summed "
                "gradient under both names",
    }

    # optimizer references, from the same starting weights
    lr, wd, eps = 1e-3, 0.01, 1e-6
    p0 = {n: p.detach().double().numpy().copy() for n, p in uniq}
    g0 = {n: p.grad.detach().numpy().copy() for n, p in uniq}
    lamb, ratios = lamb_step(p0, g0, lr, wd, eps)
    save_file({n: torch.from_numpy(v) for n, v in lamb.items()}, out / "lamb_step1.safetensors")
    m2 = cls.from_pretrained(out).double().eval()
    losses, norms = adamw_steps(m2, batch, 5, lr, wd, eps)
    save_file({n: t(p) for n, p in unique_params(m2)}, out / "adamw_step5.safetensors")
    expected["optimizer"] = {
        "adamw": {"lr": lr, "betas": [0.9, 0.999], "eps": eps, "weight_decay": wd, "bias_correction": True,
                  "no_decay": "names ending in .bias or containing LayerNorm", "clip_global_norm": 1.0,
                  "steps": 5, "same_batch_every_step": True, "losses_before_each_step": losses,
                  "grad_norms_before_clipping": norms, "params_after": "adamw_step5.safetensors",
                  "reference": "torch.optim.AdamW " + torch.__version__},
        "lamb": {"lr": lr, "betas": [0.9, 0.999], "eps": eps, "weight_decay": wd, "steps": 1,
                 "no_clipping": True, "params_after": "lamb_step1.safetensors",
                 "trust_ratio_excluded": "bias and LayerNorm (ratio 1)",
                 "trust_ratios": {n: r for n, r in ratios.items() if r != 1.0},
                 "reference": "You et al. 2019 Algorithm 2, float64, see scripts/peer/make_fixtures.py"},
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1))
    print(out, json.dumps({k: expected[k] for k in ("loss", "n_masked", "grad_global_norm")}))


if __name__ == "__main__":
    root = Path(sys.argv[1])
    case(root / "bert-micro-mlm", BertForMaskedLM, 11, nsp=False)
    case(root / "bert-micro-pretraining", BertForPreTraining, 23, nsp=True)
