"""PyTorch peer for `keel-worker bench`: full training steps (forward, backward, AdamW) of a
Hugging Face BERT on random tokens, batch x seq tokens per step, 15% of positions masked.

Two variants, as in the first fp32 measurements:
  full   -- BertForMaskedLM as users run it: the MLM head on every position.
  masked -- the same model, the MLM head only on the masked positions (gathered first).

With --bf16, forward and loss run under torch.autocast("cpu", dtype=torch.bfloat16): matmuls
take bf16 inputs and accumulate in fp32 (oneDNN underneath), weights and AdamW stay fp32 --
the peer of `keel-worker bench --precision bf16`.

Prints one JSON line per variant: config, threads, batch, seq, precision, s_per_step,
tokens_per_s, peak_rss_mib, and saved_activation_mib / saved_activation_bytes_per_token: the
bytes autograd keeps from one forward for the backward (each storage counted once, through
torch.autograd.graph.saved_tensors_hooks; parameters left out), the peer of Keel's
`saved_activation_*` fields.
Needs torch and transformers (not a Keel dependency); see README "Measured" for the numbers.
"""
import argparse, contextlib, json, resource, time

import torch
from transformers import BertConfig, BertForMaskedLM

PRESETS = {  # (layers, hidden, heads), intermediate = 4 x hidden
    "tiny": (2, 128, 2), "mini": (4, 256, 4), "small": (4, 512, 8),
    "medium": (8, 512, 8), "base": (12, 768, 12),
}

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="mini", choices=sorted(PRESETS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--variant", default="both", choices=["full", "masked", "both"])
    p.add_argument("--bf16", action="store_true",
                   help='forward and loss under torch.autocast("cpu", dtype=torch.bfloat16)')
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    layers, hidden, heads = PRESETS[a.config]
    cfg = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=4 * hidden,
                     max_position_embeddings=512)
    variants = ["full", "masked"] if a.variant == "both" else [a.variant]
    for variant in variants:
        model = BertForMaskedLM(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        ids = torch.randint(1000, 30522, (a.batch, a.seq))
        mask = torch.rand(a.batch, a.seq) < 0.15
        labels = torch.where(mask, ids, torch.full_like(ids, -100))

        def autocast():
            if a.bf16:
                return torch.autocast("cpu", dtype=torch.bfloat16)
            return contextlib.nullcontext()

        def step():
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = forward()
            loss.backward()
            opt.step()

        def forward():
            if variant == "full":
                return model(input_ids=ids, labels=labels).loss
            hidden_states = model.bert(input_ids=ids).last_hidden_state
            logits = model.cls(hidden_states[mask])
            return torch.nn.functional.cross_entropy(logits.float(), ids[mask], reduction="sum")

        step()  # warm-up
        saved = saved_activation_bytes(model, autocast, forward)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        s = (time.perf_counter() - t0) / a.steps
        print(json.dumps({"peer": "pytorch", "variant": variant, "config": a.config,
                          "threads": a.threads, "batch": a.batch, "seq": a.seq,
                          "precision": "bf16-autocast" if a.bf16 else "fp32",
                          "s_per_step": round(s, 4),
                          "tokens_per_s": round(a.batch * a.seq / s, 1),
                          "peak_rss_mib": round(
                              resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                          "saved_activation_mib": round(saved / 2**20, 1),
                          "saved_activation_bytes_per_token": round(saved / (a.batch * a.seq), 1),
                          "torch": torch.__version__}), flush=True)

def saved_activation_bytes(model, autocast, forward):
    """Bytes of the distinct storages autograd saves in one forward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with autocast():
            loss = forward()
    del loss
    return sum(seen.values())


if __name__ == "__main__":
    main()
