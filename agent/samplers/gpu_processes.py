"""Which processes use each GPU, how much of its memory and how much of its SM time: GpuSampler.processes(),
for job discovery (agent/samplers/job_discovery.py). Under MIG each GPU instance lists its own processes.

The tick asks too, under MIG: GPM is read only for the GPU instances that run compute processes (gpu_gpm.py).
"""

from __future__ import annotations

from typing import Any

from gpuagent.agent.samplers.gpu_mig import MIG_DEV
from gpuagent.common.nvml import Nvml

_UINT_MAX = 0xFFFFFFFF
# Compute-process calls, newest first: pynvml's unversioned name calls _v3 and raises
# NVMLLibraryMismatchError on drivers without it; _v2 is in every driver since R450.
_PROC_CALLS = ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2",
               "nvmlDeviceGetComputeRunningProcesses")


class GpuProcessesMixin:
    """GpuSampler's per-process usage (agent/samplers/gpu.py)."""

    nvml: Nvml

    def _init_processes(self) -> None:
        self._proc_last_seen_us: dict[int, int] = {}   # GPU -> newest utilization sample seen (us)

    def processes(self) -> list[dict[str, Any]]:
        """Processes on each GPU: {pid, gpu, gpu_memory_bytes, gpu_util_percent, gpu_instance_id}.

        For job discovery. Utilization is the mean SM utilization of the process's samples from
        nvmlDeviceGetProcessUtilization newer than the previous call. NVML only keeps samples for
        processes that ran kernels, so a listed process without one was idle (0); -1 means unknown
        (the call is not supported, e.g. under MIG). ``gpu_memory_bytes`` is -1 when NVML has no
        figure (NVML_VALUE_NOT_AVAILABLE). Under MIG the processes come from each GPU instance's
        MIG device handle, which needs no privileges (the parent handle answers NO_PERMISSION).
        """
        n = self.nvml
        fn = "nvmlDeviceGetProcessUtilization"
        out: list[dict[str, Any]] = []
        for i in range(n.device_count):
            if i in n.lost:
                continue
            h = n.handle(i)
            procs = self._compute_processes(i, h)
            if not procs:
                continue
            last = self._proc_last_seen_us.get(i, 0)
            samples = n.query(fn, h, last, gpu=i)
            known = not n.is_unsupported(fn, i) and i not in n.lost
            util: dict[int, list[float]] = {}
            for smp in samples or ():
                ts = int(smp.timeStamp)
                if ts <= last:
                    continue
                util.setdefault(int(smp.pid), []).append(float(smp.smUtil))
                self._proc_last_seen_us[i] = max(self._proc_last_seen_us.get(i, 0), ts)
            for pid, used, gi in procs:
                vals = util.get(pid)
                out.append({"pid": pid, "gpu": i,
                            "gpu_memory_bytes": float(used) if used is not None else -1.0,
                            "gpu_util_percent": (sum(vals) / len(vals)) if vals else (0.0 if known else -1.0),
                            # MIG: the GPU instance the process runs in (-1 when MIG is off)
                            "gpu_instance_id": gi})
        return out

    def _compute_processes(self, i: int, h: Any) -> list[tuple[int, int | None, int]]:
        """(pid, used bytes or None when NVML has no figure, GPU instance id or -1) of the compute
        processes of GPU ``i``; under MIG read per GPU instance, from the parent only when the MIG
        device handles give nothing (its NO_PERMISSION is not taken as permanent)."""
        n = self.nvml
        rows: dict[tuple[int, int], int | None] = {}
        if self._static_values(i, h)["mig"]:
            answered = False
            for d in self._mig_devices(i, h):
                procs = n.query_first(tuple((c, (d["handle"],)) for c in _PROC_CALLS), gpu=i, suffix=MIG_DEV)
                if procs is None:
                    continue
                answered = True
                for p in procs:      # the instance's id when NVML does not fill it in; one row per (pid, id)
                    pgi = getattr(p, "gpuInstanceId", None)
                    gi = d["gpu_instance_id"] if pgi in (None, _UINT_MAX) else int(pgi)
                    rows.setdefault((int(p.pid), gi), _used(p))
            procs = None if answered else self._parent_processes_mig(i, h)
        else:
            procs = n.query_first(tuple((c, (h,)) for c in _PROC_CALLS), gpu=i)
        for p in procs or ():
            gi = getattr(p, "gpuInstanceId", _UINT_MAX)
            rows.setdefault((int(p.pid), -1 if gi in (None, _UINT_MAX) else int(gi)), _used(p))
        return [(pid, used, gi) for (pid, gi), used in rows.items()]

    def _parent_processes_mig(self, i: int, h: Any) -> Any:
        """The parent handle's process list on a MIG GPU (privileged agents only; NO_PERMISSION retried)."""
        n = self.nvml
        for c in _PROC_CALLS:
            if n.is_unsupported(c, i):
                continue
            v = n.query(c, h, gpu=i, report=c == _PROC_CALLS[-1], permission_final=False)
            if v is not None or not n.is_unsupported(c, i):
                return v
        return None


def _used(p: Any) -> int | None:
    """A process's usedGpuMemory; None for NVML_VALUE_NOT_AVAILABLE (pynvml already turns it into None)."""
    used = getattr(p, "usedGpuMemory", None)
    return None if used is None or int(used) == 0xFFFFFFFFFFFFFFFF else int(used)
