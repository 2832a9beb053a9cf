"""CUDA probes on a real GPU (marked gpu: skipped without CUDA; scripts/gpu-check.sh runs them)."""

from __future__ import annotations

import pytest

from gpuagent.probes import gpuinfo
from gpuagent.probes.runner import run_probe

pytestmark = pytest.mark.gpu


def _ngpu() -> int:
    import torch
    return torch.cuda.device_count()


def test_pcie_probe_measures_every_gpu():
    r = run_probe("pcie", {"size_mib": 128, "iters": 5})
    assert r.status == "ok", r.reason
    assert [g["gpu"] for g in r.per_gpu] == list(range(_ngpu()))
    for rec in r.sink_records():
        m = rec["metrics"]
        assert rec["status"] == "ok", rec["reason"]
        assert m["h2d_gbps"] > 1 and m["d2h_gbps"] > 1 and m["bidir_gbps"] > 1
        assert 0 <= m["h2d_cv_percent"] < 50
        if "h2d_efficiency_percent" in m:  # NVML told us the link
            assert 5 < m["h2d_efficiency_percent"] < 110
            assert rec["env"]["link_width"] > 0
            theo = gpuinfo.pcie_theoretical_gbps(int(rec["env"]["link_gen"]), int(rec["env"]["link_width"]))
            assert float(rec["env"]["theoretical_gbps"]) == pytest.approx(theo, abs=1e-3)
        if "numa_local" in m:
            assert m["numa_local"] in (0, 1)


def test_gpu_compute_probe():
    r = run_probe("gpu_compute", {"matmul_n": 4096, "iters": 10, "sync_iters": 100})
    assert r.status == "ok", r.reason
    for rec in r.sink_records():
        m = rec["metrics"]
        assert m["bf16_tflops"] > m["fp32_tflops"] > 0.1
        assert int(rec["env"]["matmul_tf32"]) == 0      # the fp32 figure is true FP32
        assert 0 < m["launch_latency_us"] < 1000 and 0 < m["sync_latency_us"] < 10_000


def test_nccl_collective_or_single_gpu_skip():
    r = run_probe("collective", {"max_bytes": 64 << 20, "iters": 10})
    if _ngpu() < 2:
        assert r.status == "skipped" and "only one GPU" in r.reason and ">= 2 GPUs" in r.reason
        g = run_probe("collective", {"backend": "gloo", "max_bytes": 1 << 20, "iters": 5})
        assert g.status == "ok" and g.env["backend"] == "gloo"
    else:
        assert r.status == "ok", r.reason
        assert r.env["backend"] == "nccl" and r.env["world_size"] == _ngpu()
        assert r.metrics["busbw_gbps"] > 1
        assert r.env["largest_bytes"] == 64 << 20 and r.env["iters_at_largest"] == 10
