"""pcie: host<->device copy bandwidth per GPU, against the link's current theoretical rate.

Per GPU: pinned host buffers and device buffers of ``size_mib``; ``warmup`` copies, then ``iters`` timed
copies per direction, each timed with CUDA events on a dedicated stream; the median is reported and the
spread as the coefficient of variation. bidir_gbps runs an H2D and a D2H copy on two streams at once and
counts both directions' bytes. The link's current generation and width are read from NVML while copies
are in flight (links downshift when idle); efficiency = measured / raw link rate per direction (see
gpuinfo.PCIE_*; the raw rate ignores TLP/DLLP overhead, so ~80-90 % is a healthy Gen4/Gen5 x16).
numa_local says whether the CPU that allocated the pinned buffers and issued the copies sat on the GPU's
NUMA node: the CPU is read (sched_getcpu) at allocation and after every timed copy, since an unpinned
process can migrate; 1 only if every reading was on the GPU's node (1 when the machine has a single node),
left out when a node is unknown. Skipped without CUDA.
"""

from __future__ import annotations

import statistics
from typing import Any

from gpuagent.probes import gpuinfo
from gpuagent.probes.per_gpu import run_per_gpu
from gpuagent.probes.registry import ProbeSpec
from gpuagent.probes.result import ProbeResult

SPEC = ProbeSpec(
    name="pcie",
    description="per GPU pinned H2D/D2H/bidirectional GB/s (CUDA events), efficiency vs PCIe link, NUMA locality",
    platform="cuda",
    defaults={"gpus": "all", "size_mib": 256, "iters": 10, "warmup": 3},
    resources=frozenset({"gpu"}),
    timeout_s=120.0,
    interval_s=3600.0,
    param_help={"gpus": "'all' or a comma list of CUDA indices"},
    limits={"size_mib": (1, 65536), "iters": (1, 10000), "warmup": (0, 1000)},
)


def _cv(vals: list[float]) -> float:
    return 100.0 * statistics.pstdev(vals) / statistics.mean(vals) if len(vals) > 1 else 0.0


def _measure(torch, i: int, p: dict[str, Any]) -> dict[str, Any]:
    torch.cuda.set_device(i)
    n = int(p["size_mib"]) << 20
    iters = max(1, int(p["iters"]))
    cpus = {gpuinfo.current_cpu()}   # pinned pages land on the allocating CPU's node (first touch)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    cpus.add(gpuinfo.current_cpu())
    dev = torch.empty(n, dtype=torch.uint8, device=f"cuda:{i}")
    dev2 = torch.empty(n, dtype=torch.uint8, device=f"cuda:{i}")
    s1, s2 = torch.cuda.Stream(i), torch.cuda.Stream(i)
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

    def one(dst, src) -> float:
        a, b = ev(), ev()
        with torch.cuda.stream(s1):
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
        b.synchronize()
        cpus.add(gpuinfo.current_cpu())
        return n / (a.elapsed_time(b) / 1e3) / 1e9

    def bidir() -> float:
        a, b1, b2, end = ev(), ev(), ev(), ev()
        with torch.cuda.stream(s1):
            a.record()
            dev.copy_(host, non_blocking=True)
            b1.record()
        s2.wait_event(a)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)
            b2.record()
        s1.wait_event(b2)
        with torch.cuda.stream(s1):
            end.record()
        end.synchronize()
        return 2 * n / (a.elapsed_time(end) / 1e3) / 1e9

    for _ in range(max(1, int(p["warmup"]))):
        one(dev, host)
        one(host, dev)
        bidir()
    handle = gpuinfo.nvml_handle(i)
    # Read the link while copies run: idle links drop to a lower generation to save power.
    with torch.cuda.stream(s1):
        for _ in range(4):
            dev.copy_(host, non_blocking=True)
    link = gpuinfo.link(handle, i)
    torch.cuda.synchronize(i)
    h2d = [one(dev, host) for _ in range(iters)]
    d2h = [one(host, dev) for _ in range(iters)]
    bi = [bidir() for _ in range(iters)]
    bus = gpuinfo.pci_bus_id(i)
    gnode = gpuinfo.gpu_numa_node(bus) if bus else -1
    nodes = gpuinfo.numa_nodes()
    cnodes = {gpuinfo.cpu_numa_node(c) for c in cpus}   # a -1 CPU (sched_getcpu missing) gives node -1
    m: dict[str, Any] = {"h2d_gbps": statistics.median(h2d), "d2h_gbps": statistics.median(d2h),
                         "bidir_gbps": statistics.median(bi), "h2d_cv_percent": _cv(h2d),
                         "d2h_cv_percent": _cv(d2h)}
    env: dict[str, Any] = {"device": torch.cuda.get_device_name(i), "pci_bus_id": bus, "numa_node": gnode,
                           "cpus": ",".join(map(str, sorted(cpus))),
                           "cpu_numa_nodes": ",".join(map(str, sorted(cnodes))), **link,
                           "h2d_gbps_min": round(min(h2d), 3), "h2d_gbps_max": round(max(h2d), 3),
                           "d2h_gbps_min": round(min(d2h), 3), "d2h_gbps_max": round(max(d2h), 3)}
    local = gpuinfo.numa_local(gnode, cnodes, len(nodes))
    if local is not None:   # None: no NUMA information (no /sys/devices/system/node, GPU node unknown)
        m["numa_local"] = local
    reason = ""
    theo = gpuinfo.pcie_theoretical_gbps(link.get("link_gen", 0), link.get("link_width", 0))
    if theo:
        env["theoretical_gbps"] = round(theo, 3)
        m["h2d_efficiency_percent"] = 100.0 * m["h2d_gbps"] / theo
        m["d2h_efficiency_percent"] = 100.0 * m["d2h_gbps"] / theo
    else:
        reason = "PCIe link generation/width unknown, no efficiency" + (
            f" ({gpuinfo.nvml_error()})" if gpuinfo.nvml_error() else "")
    del host, host2, dev, dev2
    torch.cuda.empty_cache()
    return {"gpu": i, "status": "ok", "reason": reason, "metrics": m, "env": env}


def run(params: dict[str, Any]) -> ProbeResult:
    return run_per_gpu("pcie", params, _measure)
