"""Helpers shared by the collector tests: build real protobuf batches and talk to a real server."""

from __future__ import annotations

import time

from gpuagent.proto import pb

NOW_NS = time.time_ns()


def node_info(hostname="gpu-01", machine_id="m-0001", labels=None, gpus=2) -> pb.NodeInfo:
    info = pb.NodeInfo(hostname=hostname, machine_id=machine_id, agent_version="0.1.0",
                       labels=labels or {"pool": "a", "provider": "onprem", "price_per_gpu_hour": "2.5"},
                       cpu_model="Test CPU", cpu_cores_logical=16, memory_total_bytes=64 << 30, kernel="6.1")
    for i in range(gpus):
        info.gpus.add(index=i, uuid=f"GPU-{machine_id}-{i}", name="NVIDIA H100 80GB HBM3", pcie_gen_max=5,
                      pcie_width_max=16, pcie_gen_current=5, pcie_width_current=16, numa_node=0)
    info.fingerprint.virtualized = True
    info.fingerprint.virt_type = "kvm"
    info.fingerprint.cpuid_hypervisor_vendor = "KVMKVMKVM"
    return info


def sample_batch(node_id: str, seq: int, n: int = 6, ts0: int | None = None) -> pb.Batch:
    """``n`` samples over three series: a GPU 0 series with labels, a host series, a GPU 1 series."""
    b = pb.Batch(node_id=node_id, seq=seq, created_ns=NOW_NS)
    s = b.samples.series.add(id=10, metric="gpu_throttle_active", gpu=0)
    s.labels["reason"] = "sw_power_cap"
    s.labels["a"] = "1"
    b.samples.series.add(id=3, metric="cpu_steal_percent", gpu=-1)
    b.samples.series.add(id=7, metric="gpu_util_percent", gpu=1)
    ts0 = NOW_NS - 60 * 10**9 if ts0 is None else ts0
    ids = [10, 3, 7]
    b.samples.ts_ns.extend(ts0 + seq * 10**9 + i * 1000 for i in range(n))  # distinct at µs precision
    b.samples.series_id.extend(ids[i % 3] for i in range(n))
    b.samples.value.extend(float(seq * 1000 + i) for i in range(n))
    return b
