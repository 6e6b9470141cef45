"""PyTorch gloo peer for `keel-worker bench-allreduce`: all_reduce(SUM) of f32 buffers between
N local processes over TCP on 127.0.0.1, the same sizes and the same bus-bandwidth formula
(2 (n - 1) / n x bytes / seconds, the median of the timed iterations, slowest rank).

Prints one JSON line per (world size, size). Needs torch (not a Keel dependency).
Usage: python3 gloo_allreduce_bench.py [--workers 2,3,4] [--sizes-mib 1,4,16,64,256] [--iters 5]
"""
import argparse, json, os, statistics, time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def peer(rank, world, port, sizes_mib, iters, warmup, out):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for mib in sizes_mib:
        x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
        token = torch.ones(1)
        times, cpu = [], []
        for it in range(warmup + iters):
            dist.all_reduce(token)  # barrier
            c0 = time.process_time()  # this process's CPU, all threads (as Keel's bench)
            t0 = time.perf_counter()
            dist.all_reduce(x)
            dt = time.perf_counter() - t0
            dc = time.process_time() - c0
            if it >= warmup:
                times.append(dt)
                cpu.append(dc)
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        cpu_all = torch.tensor(cpu, dtype=torch.float64)
        dist.all_reduce(cpu_all, op=dist.ReduceOp.SUM)
        if rank == 0:
            s = statistics.median(slowest.tolist())
            b = mib * (1 << 20)
            out.put({"peer": "gloo", "workers": world, "bytes": b, "iters": iters,
                     "seconds": round(s, 6),
                     "busbw_gb_s": round(2 * (world - 1) / world * b / s / 1e9, 3),
                     "cpu_seconds_all_ranks": round(statistics.median(cpu_all.tolist()), 4)})
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workers", default="2,3,4")
    p.add_argument("--sizes-mib", default="1,4,16,64,256")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args()
    sizes = [int(s) for s in a.sizes_mib.split(",")]
    ctx = mp.get_context("spawn")
    for i, world in enumerate(int(w) for w in a.workers.split(",")):
        out = ctx.Queue()
        procs = [ctx.Process(target=peer, args=(r, world, 29500 + i, sizes, a.iters, a.warmup, out))
                 for r in range(world)]
        for pr in procs:
            pr.start()
        for _ in sizes:
            print(json.dumps(out.get(timeout=600)), flush=True)
        for pr in procs:
            pr.join(timeout=60)


if __name__ == "__main__":
    main()
