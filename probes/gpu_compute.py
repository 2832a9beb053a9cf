"""gpu_compute: matmul throughput and the CPU-GPU coordination cost, per GPU.

  * bf16_tflops / fp32_tflops: ``matmul_n``-square matmuls on random data (2n^3 flops each): at least
    ``warmup`` products and at least ``warmup_s`` seconds of them (clocks ramp up from idle), then ``iters``
    back-to-back products timed with CUDA events. fp32 runs with TF32 disabled
    (``torch.backends.cuda.matmul.allow_tf32 = False``, also PyTorch's default), so it is true FP32;
    env matmul_tf32 is the flag read back while the fp32 products ran (1 also when
    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 forces TF32 inside cuBLAS). At the default n=8192 one bf16 product
    is ~1.1 TFLOP (~1.4 ms on an H100/H200), far above the ~10 us launch cost, so the figure is not
    launch-bound.
  * launch_latency_us: host time to enqueue one tiny kernel (``x.add_(1)`` on a 1-element CUDA tensor,
    queue kept far from full), i.e. PyTorch dispatch + cudaLaunchKernel. torch_cpu_op_us is the same op on
    a CPU tensor (dispatch without a launch) measured alongside, so the launch part is the difference.
  * sync_latency_us: median of one tiny kernel + torch.cuda.synchronize() round trips: the host<->GPU
    coordination that virtualization (interrupt/doorbell paths) inflates.
Skipped without CUDA.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from gpuagent.probes.per_gpu import run_per_gpu
from gpuagent.probes.registry import ProbeSpec
from gpuagent.probes.result import ProbeResult

SPEC = ProbeSpec(
    name="gpu_compute",
    description="per GPU bf16/fp32 matmul TFLOP/s, kernel-launch and launch+sync latency",
    platform="cuda",
    defaults={"gpus": "all", "matmul_n": 8192, "iters": 20, "warmup": 3, "warmup_s": 0.3,
              "launch_iters": 1000, "sync_iters": 500},
    resources=frozenset({"gpu"}),
    timeout_s=180.0,
    interval_s=3600.0,
    limits={"matmul_n": (64, 65536), "iters": (1, 10000), "warmup": (0, 1000), "warmup_s": (0, 60),
            "launch_iters": (1, 10**6), "sync_iters": (1, 10**6)},
)


def matmul_tflops(n: int, count: int, elapsed_ms: float) -> float:
    """TFLOP/s of ``count`` n x n x n matrix products in ``elapsed_ms``: 2n^3 flops each (n^3 multiply-adds)."""
    return 2.0 * n ** 3 * count / (elapsed_ms / 1e3) / 1e12


def _measure(torch, i: int, p: dict[str, Any]) -> dict[str, Any]:
    torch.cuda.set_device(i)
    dev = f"cuda:{i}"
    n = int(p["matmul_n"])
    iters = max(1, int(p["iters"]))
    m: dict[str, float] = {}
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    tf32 = 0
    try:
        for dtype, key in ((torch.bfloat16, "bf16_tflops"), (torch.float32, "fp32_tflops")):
            a = torch.randn(n, n, dtype=dtype, device=dev)
            b = torch.randn(n, n, dtype=dtype, device=dev)
            c = torch.empty(n, n, dtype=dtype, device=dev)
            deadline = time.perf_counter() + float(p["warmup_s"])
            while True:   # warm-up: at least `warmup` products and `warmup_s` seconds of them
                for _ in range(max(1, int(p["warmup"]))):
                    torch.matmul(a, b, out=c)
                torch.cuda.synchronize(i)
                if time.perf_counter() >= deadline:
                    break
            if dtype == torch.float32:
                tf32 = int(bool(torch.backends.cuda.matmul.allow_tf32)
                           or os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1")
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(iters):
                torch.matmul(a, b, out=c)
            e.record()
            e.synchronize()
            m[key] = matmul_tflops(n, iters, s.elapsed_time(e))
            del a, b, c
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    x = torch.zeros(1, device=dev)
    xc = torch.zeros(1)
    for t in (x, xc):
        for _ in range(100):
            t.add_(1)
    torch.cuda.synchronize(i)
    k = int(p["launch_iters"])
    t0 = time.perf_counter_ns()
    for _ in range(k):
        x.add_(1)
    t1 = time.perf_counter_ns()
    torch.cuda.synchronize(i)
    t2 = time.perf_counter_ns()
    for _ in range(k):
        xc.add_(1)
    t3 = time.perf_counter_ns()
    m["launch_latency_us"] = (t1 - t0) / k / 1e3
    m["torch_cpu_op_us"] = (t3 - t2) / k / 1e3
    sync = []
    for _ in range(int(p["sync_iters"])):
        a = time.perf_counter_ns()
        x.add_(1)
        torch.cuda.synchronize(i)
        sync.append(time.perf_counter_ns() - a)
    m["sync_latency_us"] = statistics.median(sync) / 1e3
    props = torch.cuda.get_device_properties(i)
    env = {"device": props.name, "sm_count": props.multi_processor_count, "matmul_tf32": tf32}
    torch.cuda.empty_cache()
    return {"gpu": i, "status": "ok", "reason": "", "metrics": m, "env": env}


def run(params: dict[str, Any]) -> ProbeResult:
    return run_per_gpu("gpu_compute", params, _measure)
