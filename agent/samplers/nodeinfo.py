"""Builds the proto NodeInfo the agent sends with Register: who this node is and what it has."""

from __future__ import annotations

import os
import platform
import socket
from typing import Any, Mapping

import psutil

from gpuagent import __version__
from gpuagent.agent.samplers.fingerprint import Evidence, fingerprint
from gpuagent.agent.samplers.host import numa_layout


def machine_id(root: str = "/") -> str:
    """/etc/machine-id (or the dbus copy); falls back to the hostname so the id is never empty."""
    r = root.rstrip("/")
    for p in (f"{r}/etc/machine-id", f"{r}/var/lib/dbus/machine-id"):
        try:
            with open(p) as f:
                v = f.read().strip()
        except OSError:
            continue
        if v:
            return v
    return "host-" + socket.gethostname()


def cpu_model(proc_root: str = "/proc") -> str:
    try:
        with open(f"{proc_root}/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def os_name(root: str = "/") -> str:
    try:
        with open(os.path.join(root, "etc/os-release")) as f:
            kv = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        return kv.get("PRETTY_NAME", "").strip('"') or platform.system()
    except OSError:
        return platform.system()


def build_node_info(labels: Mapping[str, str] | None = None, gpu_sampler: Any = None,
                    fp: Evidence | None = None, root: str = "/"):
    """NodeInfo for Register. ``gpu_sampler`` (a GpuSampler) supplies GPUs and driver versions;
    without it, or without NVML, the node registers with no GPUs."""
    from gpuagent.proto import pb  # noqa: PLC0415

    gpus: list[dict[str, Any]] = []
    driver = cuda = ""
    nvml_mode = ""
    if gpu_sampler is not None and gpu_sampler.nvml.available:
        gpus = gpu_sampler.gpu_inventory()
        driver = gpu_sampler.nvml.driver_version()
        cuda = gpu_sampler.nvml.cuda_version()
        if gpus:
            nvml_mode = gpus[0]["virtualization_mode"]
    if fp is None:
        fp = fingerprint(root, nvml_virtualization_mode=nvml_mode)
    elif nvml_mode and not fp.nvml_virtualization_mode:
        fp.nvml_virtualization_mode = nvml_mode
        fp.virtualized = fp.virtualized or nvml_mode in ("passthrough", "vgpu")
    numa = numa_layout(os.path.join(root, "sys"))
    return pb.NodeInfo(
        hostname=socket.gethostname(),
        machine_id=machine_id(root),
        agent_version=__version__,
        labels={str(k): str(v) for k, v in (labels or {}).items()},
        cpu_model=cpu_model(os.path.join(root, "proc")),
        cpu_cores_logical=psutil.cpu_count(logical=True) or 0,
        cpu_cores_physical=psutil.cpu_count(logical=False) or 0,
        memory_total_bytes=psutil.virtual_memory().total,
        kernel=platform.release(),
        os=os_name(root),
        driver_version=driver,
        cuda_version=cuda,
        gpus=[pb.GpuInfo(**g) for g in gpus],
        fingerprint=fp.to_proto(),
        numa_nodes=len(numa) or 1,
        boot_time_ns=int(psutil.boot_time() * 1e9),
    )
