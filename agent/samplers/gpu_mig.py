"""MIG: the GPU instances of a MIG GPU, listed once a minute from the MIG device handles (no privileges
needed), and each instance's framebuffer and GPM values for the status and the exporter's GPU_I_ID series.

One listing serves every reader: the per-process lists (gpu_processes.py), the GPM reads per instance
(gpu_gpm.py), the kubelet's MIG devices (GpuSampler._pod_values) and ``gpu_instances``.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from gpuagent.agent.samplers.gpu_gpm import GPM_INSTANCE_FIELDS
from gpuagent.common.nvml import Nvml

_MIG_RECHECK_S = 60.0     # MIG devices (GPU instances) of a MIG GPU: re-list this often
MIG_DEV = " (MIG device)"   # suffix of the seam's key for a call on a MIG device handle


class GpuMigMixin:
    """GpuSampler's MIG GPU instances (agent/samplers/gpu.py)."""

    nvml: Nvml

    def _init_mig(self) -> None:
        self._mig_devs: dict[int, tuple[float, list[dict[str, Any]]]] = {}   # GPU -> (when, MIG devices)

    def _mig_devices(self, i: int, h: Any) -> list[dict[str, Any]]:
        """The MIG devices of GPU ``i`` (the first of each GPU instance): {handle, gpu_instance_id,
        profile}, from calls NVML answers without privileges: nvmlDeviceGetMaxMigDeviceCount,
        nvmlDeviceGetMigDeviceHandleByIndex and, on the MIG device handle, nvmlDeviceGetGpuInstanceId
        and its name ("NVIDIA H100 80GB HBM3 MIG 1g.10gb" -> profile "1g.10gb"). Re-listed every minute."""
        now = time.monotonic()
        got = self._mig_devs.get(i)
        if got is not None and now - got[0] <= _MIG_RECHECK_S:
            return got[1]
        n = self.nvml
        q = n.query
        seen: dict[int, dict[str, Any]] = {}
        count = q("nvmlDeviceGetMaxMigDeviceCount", h, gpu=i)
        for idx in range(int(count or 0)):
            mh = q("nvmlDeviceGetMigDeviceHandleByIndex", h, idx, gpu=i)   # NOT_FOUND (quiet): an empty slot
            if mh is None:
                continue
            gi = q("nvmlDeviceGetGpuInstanceId", mh, gpu=i)
            if gi is None or int(gi) in seen:
                continue
            name = q("nvmlDeviceGetName", mh, gpu=i, key="nvmlDeviceGetName" + MIG_DEV)
            name = name.decode(errors="replace") if isinstance(name, bytes) else str(name or "")
            _, sep, prof = name.rpartition(" MIG ")
            uuid = q("nvmlDeviceGetUUID", mh, gpu=i, key="nvmlDeviceGetUUID" + MIG_DEV, report=False)
            seen[int(gi)] = {"handle": mh, "gpu_instance_id": int(gi), "profile": prof.strip() if sep else "",
                             "uuid": uuid.decode(errors="replace") if isinstance(uuid, bytes) else str(uuid or "")}
        devs = [seen[k] for k in sorted(seen)]
        if devs:      # none listed (yet, or a transient error): ask again next time
            self._mig_devs[i] = (now, devs)
        return devs

    def gpu_instances(self, i: int) -> list[dict[str, Any]]:
        """The GPU instances of MIG GPU ``i``: [{gpu_instance_id, profile}] ([] when MIG is off)."""
        n = self.nvml
        if i >= n.device_count or i in n.lost or not self._static_values(i, n.handle(i))["mig"]:
            return []
        return [{"gpu_instance_id": d["gpu_instance_id"], "profile": d["profile"]}
                for d in self._mig_devices(i, n.handle(i))]

    def _mig_instances(self, i: int, h: Any, put, by_instance: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
        """The GPU instances of a MIG GPU, from the one MIG device listing (``_mig_devices``: instance id
        and profile from the MIG device handle, no privileges needed): each instance's framebuffer
        (nvmlMemory_v2 on the MIG device handle, v1 without it) and the GPM values read per instance
        this tick (GpuInstanceStatus fields)."""
        out = []
        for d in self._mig_devices(i, h):
            gi = d["gpu_instance_id"]
            row: dict[str, Any] = {"gpu_instance_id": gi, "profile": d["profile"]}
            mem = self._memory_info(i, d["handle"], MIG_DEV)
            if mem is not None:
                labels = {"gpu_instance": str(gi), "profile": d["profile"]}
                for key, v in (("memory_used_bytes", mem.used), ("memory_free_bytes", mem.free),
                               ("memory_total_bytes", mem.total),
                               ("memory_reserved_bytes", getattr(mem, "reserved", None))):   # v2 only
                    if v is not None:
                        row[key] = float(v)
                        put(f"gpu_instance_{key}", v, labels)
            for metric, field in GPM_INSTANCE_FIELDS.items():
                v = by_instance.get(str(gi), {}).get(metric)
                if v is not None:
                    row[field] = v
            out.append(row)
        if not out:
            self.nvml.mark_unsupported("MIG GPU instances", i, "MIG is on but NVML listed no GPU instance (none "
                                       "created, or nvmlDeviceGetMigDeviceHandleByIndex is not available)")
        return out
