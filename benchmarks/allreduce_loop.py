#!/usr/bin/env python3
"""The reference for the collective probe across nodes: a plain torch.distributed all-reduce loop.

One rank per process (run one per node): init_process_group(gloo) from MASTER_ADDR/MASTER_PORT, ``warmup``
unrecorded in-place SUM all-reduces of ``nbytes`` of float32, a barrier, ``iters`` timed ones; the time per
all-reduce is the mean over ranks (summed by one more all-reduce). busbw = nbytes / t x 2(n-1)/n (nccl-tests'
all-reduce bus bandwidth), GB = 10^9 B. Rank 0 prints {"busbw_gbps", "algbw_gbps", "seconds_per_iter"}.
"""

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--nbytes", type=int, required=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world, timeout=timedelta(seconds=120))
    t = torch.zeros(a.nbytes // 4, dtype=torch.float32)
    for _ in range(a.warmup):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        dist.all_reduce(t)
    el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(el)
    per_iter = float(el.item()) / a.world / a.iters
    algbw = a.nbytes / per_iter / 1e9
    if a.rank == 0:
        print(json.dumps({"seconds_per_iter": per_iter, "algbw_gbps": algbw,
                          "busbw_gbps": algbw * 2 * (a.world - 1) / a.world}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
