"""GPM (Hopper and newer, through :class:`gpuagent.common.nvml.Gpm`): SM activity, SM occupancy,
tensor-pipe activity, DRAM bandwidth utilization and PCIe/NVLink throughput over each tick.

Where GPM is missing, the only activity figure is ``gpu_util_percent`` (time any kernel ran), and the status
says so (``activity_source``). Under MIG the GPM values are per GPU instance (label ``gpu_instance``) for the
instances that run compute processes.
"""

from __future__ import annotations

from typing import Any

from gpuagent.common.nvml import Gpm, Nvml

# GPM metric (common/nvml.py GPM_METRICS, labelled gpu_instance under MIG) -> GpuInstanceStatus field
GPM_INSTANCE_FIELDS = {"gpu_gr_engine_active_percent": "gr_engine_active_percent",
                       "gpu_sm_active_percent": "sm_active_percent",
                       "gpu_sm_occupancy_percent": "sm_occupancy_percent",
                       "gpu_tensor_active_percent": "tensor_active_percent",
                       "gpu_dram_active_percent": "dram_active_percent"}


class GpuGpmMixin:
    """GpuSampler's GPM reads (agent/samplers/gpu.py)."""

    nvml: Nvml

    def _init_gpm(self, gpm: bool) -> None:
        self.gpm = Gpm(self.nvml) if gpm and self.nvml.available else None

    def _gpm_values(self, i: int, h: Any, put, cur: dict[str, Any], ts: int) -> None:
        """GPM metrics of the GPU (of each busy GPU instance under MIG, read through the instance's MIG
        device handle); ``cur['activity_source']``: 'gpm', 'gpm per GPU instance' (only while an
        instance's read gives values), or 'utilization counter' when only gpu_util_percent exists."""
        gpm = self.gpm
        cur["activity_source"] = "utilization counter"
        if gpm is None or not gpm.supported(i):
            return
        now = ts / 1e9
        if self._static_values(i, h)["mig"]:
            busy = {gi for _, _, gi in self._compute_processes(i, h) if gi >= 0}
            for d in self._mig_devices(i, h):
                gi = d["gpu_instance_id"]
                if gi not in busy:
                    continue
                for name, v in (gpm.read(i, gi, d["handle"], now_s=now) or {}).items():
                    put(name, v, {"gpu_instance": str(gi)})
            if any(gpm.working.get((i, gi)) for gi in busy):
                cur["activity_source"] = "gpm per GPU instance"
            return
        for name, v in (gpm.read(i, now_s=now) or {}).items():
            put(name, v)
        if gpm.working.get((i, None)):
            cur["activity_source"] = "gpm"
