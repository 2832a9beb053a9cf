"""The loop shared by the per-GPU probes (pcie, gpu_compute): pick the GPUs, measure each, and fold the
per-GPU outcomes into one result. One GPU's trouble is that GPU's result, not the whole run's."""

from __future__ import annotations

import time
from typing import Any, Callable

from gpuagent.probes import progress
from gpuagent.probes.result import ProbeResult


def gpu_list(torch, spec: str) -> list[int]:
    """``spec`` is "all" (or empty) or a comma list of CUDA device indexes."""
    n = torch.cuda.device_count()
    if spec in ("", "all"):
        return list(range(n))
    out = [int(x) for x in spec.split(",") if x.strip()]
    bad = [i for i in out if not 0 <= i < n]
    if bad:
        raise ValueError(f"GPU index {bad[0]} is out of range (this node has {n} GPUs)")
    return out


def run_per_gpu(probe: str, params: dict[str, Any],
                measure: Callable[[Any, int, dict[str, Any]], dict[str, Any]]) -> ProbeResult:
    """Run ``measure(torch, gpu_index, params)`` on each selected GPU (``params["gpus"]``)."""
    import torch

    started = time.time_ns()
    p = dict(params)
    if not torch.cuda.is_available():
        return ProbeResult.skipped(probe, "CUDA is not available (no GPU or driver, or a CPU-only torch build)",
                                   p, {"backend": "cuda", "torch": torch.__version__})
    try:
        gpus = gpu_list(torch, p["gpus"])
    except ValueError as exc:
        return ProbeResult(probe, "failed", str(exc), p)
    per_gpu = []
    for k, i in enumerate(gpus):
        progress.step(k, len(gpus), f"GPU {i}")
        try:
            per_gpu.append(measure(torch, i, p))
        except Exception as exc:  # noqa: BLE001 - one GPU's trouble is that GPU's result
            per_gpu.append({"gpu": i, "status": "failed", "reason": f"{type(exc).__name__}: {exc}", "metrics": {}})
    ok = [g for g in per_gpu if g["status"] == "ok"]
    env = {"backend": "cuda", "torch": torch.__version__, "cuda": torch.version.cuda,
           "devices": ",".join(str(g["gpu"]) for g in per_gpu)}
    reason = "" if ok else "; ".join(f"gpu{g['gpu']}: {g['reason']}" for g in per_gpu)
    return ProbeResult(probe, "ok" if ok else "failed", reason, p, {}, started, time.time_ns(), env,
                       per_gpu=per_gpu)
