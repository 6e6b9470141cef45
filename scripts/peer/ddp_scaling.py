"""PyTorch DDP (gloo) peer for `examples/scaling.sh`: bert-mini (L4 H256 A4), vocab 8,000,
micro-batch 8 x seq 128 per process, 15% masked, MLM head on the masked positions only, AdamW,
1 thread per process. Runs 1 process, then 2, and prints tokens/s of each and the efficiency
throughput_2 / (2 x throughput_1), averaged over the steps after the first 20%.

Needs torch and transformers (not Keel dependencies).
Usage: python3 ddp_scaling.py [--steps 40]
"""
import argparse, json, os, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import BertConfig, BertForMaskedLM


class MaskedMlm(torch.nn.Module):
    """BertForMaskedLM with its head on the masked positions only, as Keel computes it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        h = self.model.bert(input_ids=ids).last_hidden_state
        logits = self.model.cls(h[mask])
        return torch.nn.functional.cross_entropy(logits, ids[mask])


def peer(rank, world, port, steps, out):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=8000, hidden_size=256, num_hidden_layers=4,
                     num_attention_heads=4, intermediate_size=1024)
    model = BertForMaskedLM(cfg).train()
    ddp = torch.nn.parallel.DistributedDataParallel(MaskedMlm(model))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(rank)
    times = []
    for step in range(steps):
        ids = torch.randint(1000, 8000, (8, 128), generator=g)
        mask = torch.rand(8, 128, generator=g) < 0.15
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        # Through the DDP wrapper: its hooks all-reduce the gradients during backward.
        loss = ddp(ids, mask)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        rest = times[steps // 5:]
        out.put(world * 8 * 128 * len(rest) / sum(rest))
    dist.destroy_process_group()


def run(world, steps, port):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=peer, args=(r, world, port, steps, out)) for r in range(world)]
    for p in procs:
        p.start()
    tps = out.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return tps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    t1 = run(1, a.steps, 29610)
    t2 = run(2, a.steps, 29611)
    print(json.dumps({"peer": "pytorch-ddp-gloo", "config": "mini", "vocab": 8000,
                      "micro_batch": 8, "seq": 128, "tokens_per_s_1": round(t1, 1),
                      "tokens_per_s_2": round(t2, 1), "efficiency": round(t2 / (2 * t1), 3)}))


if __name__ == "__main__":
    main()
