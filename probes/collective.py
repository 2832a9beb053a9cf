"""collective: all-reduce bandwidth and small-message latency through torch.distributed.

One process per rank (MASTER_ADDR/MASTER_PORT rendezvous): spawned for NCCL, forked for gloo. Backends:
  * nccl over all local GPUs, one process per GPU (``backend=auto`` on a node with >= 2 GPUs);
  * gloo over ``nprocs`` local CPU processes (``backend=auto`` without CUDA, default 2), labelled
    backend=gloo: it measures the host's loopback/shared-memory path, not a GPU fabric;
  * a node with exactly one GPU (and nnodes=1) is skipped: the NCCL all-reduce needs >= 2 GPUs (ranks);
    ``backend=gloo`` measures the host path there instead.
For each message size (default 1 MiB..1 GiB on GPU, 64 KiB..16 MiB on CPU, x``factor``) every rank runs
warm-up then timed in-place SUM all-reduces of float32 (``warmup``/``iters`` up to 64 MiB; above that the
counts shrink with the size, to no fewer than 2 warm-up and 5 timed, so a 1 GiB all-reduce on a slow
fabric still fits the probe's timeout; every rank derives the same counts, as it must). Before timing, the
GPU is synchronised and all ranks meet at a barrier; after the loop each rank synchronises its GPU and
reads its wall time, and the time per iteration is the mean over ranks (nccl-tests' default,
``-a 1``): algbw = bytes / time, busbw = algbw x 2(n-1)/n (nccl-tests' all-reduce bus bandwidth,
PERFORMANCE.md; n = ranks), GB = 10^9 B. small_msg_latency_us is the time per all-reduce of
``latency_bytes``. Each rank binds its GPU (torch.cuda.set_device, and device_id to
init_process_group) before the process group is created; only local rank 0 writes the results.
Across nodes, run the same command on every node with master_addr, master_port, nnodes and node_rank
set (docs/PROBES.md, "Collective across nodes"), or let the fabric coordinator do it ([fabric] group_size).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from datetime import timedelta
from typing import Any

from gpuagent.probes import progress
from gpuagent.probes.registry import ProbeSpec
from gpuagent.probes.result import ProbeResult

SPEC = ProbeSpec(
    name="collective",
    description="all-reduce algbw/busbw sweep and small-message latency (NCCL on GPUs, gloo on CPU)",
    platform="multi-gpu",
    defaults={"backend": "auto", "nprocs": 0, "min_bytes": 0, "max_bytes": 0, "factor": 4,
              "iters": 20, "warmup": 5, "latency_bytes": 8, "latency_iters": 200,
              "master_addr": "127.0.0.1", "master_port": 0, "nnodes": 1, "node_rank": 0,
              "init_timeout_s": 120.0},
    resources=frozenset({"gpu"}),
    timeout_s=300.0,
    interval_s=3600.0,
    param_help={"backend": "auto | nccl | gloo", "nprocs": "ranks on this node (0: all GPUs, or 2 on CPU)",
                "min_bytes": "0: 1 MiB on GPU, 64 KiB on CPU", "max_bytes": "0: 1 GiB on GPU, 16 MiB on CPU"},
    limits={"nprocs": (0, 1024), "min_bytes": (0, 1 << 36), "max_bytes": (0, 1 << 36), "factor": (2, 1024),
            "iters": (1, 100000), "warmup": (0, 10000), "latency_bytes": (4, 1 << 30),
            "latency_iters": (1, 10**6), "master_port": (0, 65535), "nnodes": (1, 100000),
            "node_rank": (0, 99999), "init_timeout_s": (1, 3600)},
)

GPU_SIZES = (1 << 20, 1 << 30)
CPU_SIZES = (64 << 10, 16 << 20)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    out, s = [], max(4, min_bytes)
    while s <= max_bytes:
        out.append(s // 4 * 4)
        s *= max(2, factor)
    return out


FULL_ITERS_UP_TO = 64 << 20   # bytes: sizes up to this run the configured warm-up and iteration counts


def iteration_counts(nbytes: int, iters: int, warmup: int) -> tuple[int, int]:
    """(warmup, iters) for one message size: the configured counts up to FULL_ITERS_UP_TO bytes, then
    scaled down in proportion to the size (never below 5 timed and 2 warm-up iterations, never above the
    configured counts), so the largest sizes move about as many bytes as a 64 MiB message does."""
    if nbytes <= FULL_ITERS_UP_TO:
        return warmup, iters
    scale = FULL_ITERS_UP_TO / nbytes
    return (min(warmup, max(2, round(warmup * scale))), min(iters, max(5, round(iters * scale))))


def decide(backend: str, nprocs: int, nnodes: int, ngpu: int) -> tuple[str, int, str, str]:
    """(backend, ranks on this node, status, reason): status "" means run; else "skipped"/"failed"."""
    if backend not in ("auto", "nccl", "gloo"):
        return backend, 0, "failed", f"backend must be auto, nccl or gloo, got {backend!r}"
    if backend == "auto":
        backend = "nccl" if ngpu >= 1 else "gloo"
    if backend == "nccl":
        if ngpu < 1:
            return backend, 0, "skipped", "backend nccl needs CUDA, which is not available here"
        n = nprocs or ngpu
        if n > ngpu:
            return backend, n, "failed", f"nprocs={n} but only {ngpu} GPUs are visible"
    else:
        n = nprocs or 2
    if n * nnodes < 2:
        if backend == "nccl":
            return backend, n, "skipped", (
                f"only one GPU on this node and nnodes={nnodes}: the NCCL all-reduce needs >= 2 GPUs (ranks) "
                "(pass --param backend=gloo to measure the host-side gloo path instead)")
        return backend, n, "skipped", "an all-reduce needs at least two ranks (nprocs x nnodes >= 2)"
    return backend, n, "", ""


def bandwidth_metrics(seconds_per_iter: dict[str, float], latency_s: float, world: int) -> dict[str, float]:
    """algbw/busbw per size (GB/s, 10^9 B/s) and at the largest size, from seconds per all-reduce."""
    metrics: dict[str, float] = {}
    factor = 2.0 * (world - 1) / world
    for nbytes, per_iter in seconds_per_iter.items():
        algbw = int(nbytes) / per_iter / 1e9
        metrics[f"algbw_gbps_{nbytes}"] = algbw
        metrics[f"busbw_gbps_{nbytes}"] = algbw * factor
    largest = str(max(int(k) for k in seconds_per_iter))
    metrics["algbw_gbps"] = metrics[f"algbw_gbps_{largest}"]
    metrics["busbw_gbps"] = metrics[f"busbw_gbps_{largest}"]
    metrics["small_msg_latency_us"] = latency_s * 1e6
    return metrics


def _human(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _worker(local_rank: int, cfg: dict[str, Any], out_path: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = cfg["master_addr"]
    os.environ["MASTER_PORT"] = str(cfg["master_port"])
    torch.set_num_threads(1)
    world = cfg["nnodes"] * cfg["nprocs"]
    rank = cfg["node_rank"] * cfg["nprocs"] + local_rank
    extra: dict[str, Any] = {}
    if cfg["backend"] == "nccl":
        torch.cuda.set_device(local_rank)     # before the process group: NCCL binds this rank to its GPU
        device = torch.device("cuda", local_rank)
        extra["device_id"] = device           # so barrier() uses this GPU instead of guessing one

        def sync() -> None:
            torch.cuda.synchronize(device)
    else:
        device = torch.device("cpu")

        def sync() -> None:
            return None
    dist.init_process_group(cfg["backend"], rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg["init_timeout_s"]), **extra)

    def timed(nbytes: int, iters: int, warmup: int) -> float:
        t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(t)
        sync()
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        sync()
        el = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(el)                   # summed over ranks: the mean below (nccl-tests' default)
        del t
        return float(el.item()) / world / iters

    try:
        res: dict[str, Any] = {"sizes": {}, "counts": {}}
        parts = len(cfg["sizes"]) + 1
        for j, nbytes in enumerate(cfg["sizes"]):
            if local_rank == 0:
                progress.step(j, parts, f"all-reduce {_human(nbytes)}")
            w, k = iteration_counts(nbytes, cfg["iters"], cfg["warmup"])
            res["sizes"][str(nbytes)] = timed(nbytes, k, w)
            res["counts"][str(nbytes)] = k
        if local_rank == 0:
            progress.step(parts - 1, parts, f"small-message latency, {cfg['latency_bytes']} B")
        res["latency_s"] = timed(cfg["latency_bytes"], cfg["latency_iters"], cfg["warmup"])
        if local_rank == 0:
            with open(out_path, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def start_method(backend: str) -> str:
    """How the ranks start. NCCL ranks are spawned: this process has asked CUDA for its devices, and CUDA
    does not survive a fork. gloo ranks touch no GPU and are forked, so each inherits the torch this process
    imported instead of importing it again: a 2-rank gloo probe took 2.2 CPU-seconds forked against 6.5
    spawned (2-core test machine, 2026-12-03), and a fabric group member runs one rank per node."""
    return "spawn" if backend == "nccl" else "fork"


def rank_config(backend: str, nprocs: int, p: dict[str, Any], size_list: list[int]) -> dict[str, Any]:
    """What every rank's `_worker` is given (picklable: spawned ranks receive it pickled)."""
    return {"backend": backend, "nprocs": nprocs, "nnodes": p["nnodes"], "node_rank": p["node_rank"],
            "master_addr": p["master_addr"], "master_port": p["master_port"] or free_port(p["master_addr"]),
            "sizes": size_list, "iters": max(1, p["iters"]), "warmup": max(0, p["warmup"]),
            "latency_bytes": max(4, p["latency_bytes"]), "latency_iters": max(1, p["latency_iters"]),
            "init_timeout_s": float(p["init_timeout_s"])}


def run(params: dict[str, Any]) -> ProbeResult:
    import torch
    import torch.multiprocessing as mp

    started = time.time_ns()
    p = dict(params)
    cuda = torch.cuda.is_available()
    ngpu = torch.cuda.device_count() if cuda else 0
    backend, nprocs, status, why = decide(p["backend"], p["nprocs"], p["nnodes"], ngpu)
    if backend not in ("nccl", "gloo"):
        return ProbeResult("collective", "failed", why, p)
    env: dict[str, Any] = {"backend": backend, "torch": torch.__version__}
    if backend == "nccl" and ngpu < 1:
        return ProbeResult.skipped("collective", why, p, env)
    if status == "failed":
        return ProbeResult("collective", "failed", why, p, env=env)
    if backend == "nccl":
        env["devices"] = ",".join(torch.cuda.get_device_name(i) for i in range(nprocs))
        lo, hi = GPU_SIZES
    else:
        env["devices"] = f"cpu x{nprocs}"
        lo, hi = CPU_SIZES
    world = nprocs * p["nnodes"]
    env.update(world_size=world, nnodes=p["nnodes"], nprocs_per_node=nprocs)
    if status == "skipped":
        return ProbeResult.skipped("collective", why, p, env)
    if p["nnodes"] > 1 and not p["master_port"]:
        return ProbeResult("collective", "failed", "master_port must be given when nnodes > 1", p, env=env)
    if not 0 <= p["node_rank"] < p["nnodes"]:
        return ProbeResult("collective", "failed", f"node_rank must be in [0, {p['nnodes']})", p, env=env)
    size_list = sizes(p["min_bytes"] or lo, p["max_bytes"] or hi, p["factor"])
    if not size_list:
        return ProbeResult("collective", "failed", "min_bytes is larger than max_bytes", p, env=env)
    cfg = rank_config(backend, nprocs, p, size_list)
    env["master"] = f"{cfg['master_addr']}:{cfg['master_port']}"
    fd, out_path = tempfile.mkstemp(prefix="gpuagent-collective-", suffix=".json")
    os.close(fd)
    progress.step(0, len(size_list) + 1, f"starting {world if p['nnodes'] == 1 else nprocs} {backend} ranks")
    env["start_method"] = start_method(backend)
    try:
        try:
            mp.start_processes(_worker, args=(cfg, out_path), nprocs=nprocs, join=True,
                               start_method=env["start_method"])
        except Exception as exc:  # a rank died: report why, in one line
            last = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            return ProbeResult("collective", "failed", f"a rank failed: {last[-1] if last else exc}", p,
                               started_ns=started, ended_ns=time.time_ns(), env=env)
        with open(out_path) as f:
            res = json.load(f)
    finally:
        os.unlink(out_path)
    metrics = bandwidth_metrics(res["sizes"], res["latency_s"], world)
    largest = str(max(int(k) for k in res["sizes"]))
    env["largest_bytes"] = int(largest)
    env["iters_at_largest"] = res["counts"][largest]
    return ProbeResult("collective", "ok", "", p, metrics, started, time.time_ns(), env)
