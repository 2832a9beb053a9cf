"""The agent's GPU readings on a real GPU, each against something that does not share its code path.

Marked gpu (needs CUDA) and/or nvml (needs the driver): skipped here, and scripts/gpu-check.sh fails the
check when they skip on a machine with a GPU. Each test records its figures (pytest's record_property,
so they land in the junit report) and the check's summary prints them beside PASS/FAIL:

- GPM (common/nvml.py's Gpm) over a 1 s interval while bf16 matmuls keep every GPU busy: SM activity must
  show the load, and every value must be in its unit's range;
- this process, holding 1 GiB on GPU 0, in the agent's process list (GpuSampler.processes()) with at
  least that much memory, and with the same figure nvidia-smi gives;
- the GPU sampler's values against `nvidia-smi --query-gpu` (an independent reader of the driver): memory
  used/total, power, temperature, SM and memory clocks, utilization.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest

from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.sampling import ListSink
from gpuagent.common.nvml import Gpm, Nvml
from gpuagent.common.timeutil import now_ns
from gpuagent.probes import gpuinfo
from tests.conftest import wait_for

MIB = 1 << 20
GIB = 1 << 30


def _smi(query: str, fields: str) -> list[dict[str, str | None]]:
    """Rows of `nvidia-smi --query-<query>=<fields>`; "[N/A]"-style answers become None."""
    out = subprocess.run(["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    names = fields.split(",")
    rows = []
    for line in out.strip().splitlines():
        vals = [c.strip() for c in line.split(",")]
        rows.append({k: (None if v.startswith("[") or v in ("", "N/A") else v) for k, v in zip(names, vals)})
    return rows


def _nvml_index(cuda_index: int) -> int:
    """NVML's index of the GPU torch calls ``cuda_index`` (they may number GPUs differently)."""
    handle = gpuinfo.nvml_handle(cuda_index)
    assert handle is not None, f"no NVML handle for CUDA device {cuda_index}: {gpuinfo.nvml_error()}"
    idx = gpuinfo.nvml().query("nvmlDeviceGetIndex", handle)
    assert idx is not None, gpuinfo.nvml().unavailable
    return int(idx)


def _matmul_load(torch, cuda_index: int, stop: threading.Event, busy: threading.Event, errors: list) -> None:
    """bf16 8192^3 products on one GPU until ``stop``; two batches stay queued so the GPU never idles."""
    try:
        dev = f"cuda:{cuda_index}"
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
        b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
        c = torch.empty_like(a)
        prev = None
        while not stop.is_set():
            for _ in range(8):
                torch.matmul(a, b, out=c)
            ev = torch.cuda.Event()
            ev.record()
            if prev is not None:
                prev.synchronize()   # the batch before this one is done: this one is still queued
                busy.set()
            prev = ev
        torch.cuda.synchronize(cuda_index)
    except Exception as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
        errors.append(f"CUDA {cuda_index}: {type(exc).__name__}: {exc}")
        busy.set()


@pytest.mark.gpu
@pytest.mark.nvml
def test_gpm_sm_activity_under_load(record_property):
    torch = pytest.importorskip("torch")
    nv = gpuinfo.nvml()
    assert nv is not None, gpuinfo.nvml_error()
    gpus = {_nvml_index(c): c for c in range(torch.cuda.device_count())}   # NVML index -> CUDA index
    gpm = Gpm(nv)
    for i in gpus:
        mig = nv.query("nvmlDeviceGetMigMode", nv.handle(i), gpu=i)
        if mig is not None and int(mig[0]) == 1:
            pytest.skip(f"GPU {i} has MIG on: GPM is then per GPU instance, not per device")
        assert gpm.supported(i), f"GPU {i}: {nv.unavailable}"
    stop, errors = threading.Event(), []
    busy = {c: threading.Event() for c in gpus.values()}
    threads = [threading.Thread(target=_matmul_load, args=(torch, c, stop, busy[c], errors), daemon=True)
               for c in gpus.values()]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: all(e.is_set() for e in busy.values()), timeout=60, what="matmul load on every GPU")
        assert not errors, errors
        assert all(gpm.read(i) is None for i in gpus), "the first GPM sample has no interval to report"
        t0 = time.monotonic()
        time.sleep(1.0)   # the measurement interval itself (GPM reports over the time between two samples)
        vals = {i: gpm.read(i) for i in gpus}
        interval = time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        gpm.close()
        torch.cuda.empty_cache()   # later tests compare memory figures: give back what the load held
    assert not errors, errors
    record_property("interval_s", f"{interval:.2f}")
    for i, v in vals.items():
        assert v, f"GPU {i}: no GPM metrics from the second sample ({nv.unavailable})"
        for name, value in sorted(v.items()):
            record_property(f"gpu{i}_{name}", f"{value:.1f}")
        # Back-to-back bf16 products keep every SM busy (~100 %); 10 % is far below that and still catches
        # a wrong metric id, a fraction reported as if it were a percentage, or a read of an idle GPU.
        assert 10.0 <= v["gpu_sm_active_percent"] <= 100.0, (i, v)
        assert 0.0 < v["gpu_tensor_active_percent"] <= 100.0, (i, v)   # bf16 matmuls run on tensor cores
        for name in ("gpu_sm_occupancy_percent", "gpu_dram_active_percent"):
            assert name in v, (i, name, v)
        for name in [n for n in v if n.endswith("_percent")]:
            assert 0.0 <= v[name] <= 100.0, (i, name, v)
        for name in [n for n in v if n.endswith("_bytes_per_s")]:
            assert 0.0 <= v[name] < 2e12, (i, name, v)   # below 2 TB/s: NVLink 4 is 900 GB/s both ways


def _nspid() -> str:
    try:
        with open("/proc/self/status") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("NSpid:")), "?")
    except OSError:
        return "?"


@pytest.mark.gpu
@pytest.mark.nvml
def test_own_cuda_process_in_agent_process_list(record_property):
    torch = pytest.importorskip("torch")
    gpu = _nvml_index(0)
    x = torch.ones(GIB, dtype=torch.uint8, device="cuda:0")   # 1 GiB held (and touched) on CUDA device 0
    torch.cuda.synchronize()
    sampler = GpuSampler(Nvml())
    pid = os.getpid()
    try:
        def mine():
            return [p for p in sampler.processes()
                    if p["pid"] == pid and p["gpu"] == gpu and p["gpu_memory_bytes"] >= GIB]
        try:
            (entry,) = wait_for(mine, timeout=15, what=f"this process with >= 1 GiB on GPU {gpu} in the list")
        except AssertionError:
            listed = [(p["pid"], p["gpu"], round(p["gpu_memory_bytes"] / MIB)) for p in sampler.processes()]
            raise AssertionError(
                f"this process (pid {pid}; NSpid {_nspid()}) holds 1 GiB on NVML GPU {gpu} but the agent's "
                f"process list (pid, gpu, MiB) is {listed}: NVML reports host pids, so a pid namespace "
                "(a container) hides it") from None
        record_property("pid", str(pid))
        record_property("gpu", str(entry["gpu"]))
        record_property("gpu_memory_mib", f"{entry['gpu_memory_bytes'] / MIB:.0f}")
        if shutil.which("nvidia-smi"):
            apps = {r["pid"]: r["used_memory"] for r in _smi("compute-apps", "pid,used_memory")}
            smi = apps.get(str(pid))
            record_property("nvidia_smi_used_memory_mib", smi or "not listed")
            if smi is not None:
                assert abs(entry["gpu_memory_bytes"] / MIB - float(smi)) <= 2, (entry, smi)
    finally:
        sampler.close()
        del x
        torch.cuda.empty_cache()


# (nvidia-smi field, GPU sampler metric, NVML value -> nvidia-smi's unit, tolerance(value) in that unit).
# Every value but memory.total moves, so the nvidia-smi reading is taken between two sampler ticks and must
# fall inside [min - tol, max + tol] of them. memory.used is handled apart (see below).
_FIELDS = (
    ("memory.total", "gpu_memory_total_bytes", 1 / MIB, lambda v: 1.0),
    ("power.draw", "gpu_power_watts", 1.0, lambda v: max(25.0, 0.15 * v)),
    ("temperature.gpu", "gpu_temperature_celsius", 1.0, lambda v: 2.0),
    ("clocks.sm", "gpu_sm_clock_mhz", 1.0, lambda v: max(50.0, 0.10 * v)),
    ("clocks.mem", "gpu_mem_clock_mhz", 1.0, lambda v: max(50.0, 0.05 * v)),
    ("utilization.gpu", "gpu_util_percent", 1.0, lambda v: 15.0),
)


@pytest.mark.nvml
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi not installed")
def test_nvml_values_against_nvidia_smi(record_property):
    sampler = GpuSampler(Nvml())

    def tick() -> dict[tuple[str, int], float]:
        sink = ListSink()
        sampler.sample(now_ns(), sink)
        return {(s.metric, s.gpu): s.value for s in sink.samples if not s.labels}

    fields = "index,memory.used," + ",".join(f for f, _, _, _ in _FIELDS)
    try:
        before = tick()
        smi = _smi("gpu", fields)
        after = tick()
        try:   # memory.reserved: driver-reserved memory, which NVML's v1 "used" (total - free) includes
            reserved = {r["index"]: r["memory.reserved"] for r in _smi("gpu", "index,memory.reserved")}
        except subprocess.CalledProcessError:   # an older nvidia-smi without the field
            reserved = {}
    finally:
        sampler.close()
    assert smi, "nvidia-smi listed no GPU"
    bad = []
    for row in smi:
        i = int(row["index"])
        for field, metric, scale, tol in _FIELDS:
            a, b = before.get((metric, i)), after.get((metric, i))
            s = row[field]
            if a is None or b is None:
                if s is not None:
                    bad.append(f"GPU {i}: nvidia-smi gives {field} = {s} but the sampler has no {metric}")
                record_property(f"gpu{i}_{field}", f"nvml n/a / smi {s}")
                continue
            lo, hi = sorted((a * scale, b * scale))
            record_property(f"gpu{i}_{field}", f"nvml {lo:.0f}..{hi:.0f} / smi {s}")
            if s is not None and not lo - tol(hi) <= float(s) <= hi + tol(hi):
                bad.append(f"GPU {i}: {field} nvidia-smi {s} vs sampler {lo:.1f}..{hi:.1f} (± {tol(hi):.1f})")
        # memory.used: nvidia-smi reports it without the driver's reserved memory; the sampler's
        # gpu_memory_used_bytes (nvmlDeviceGetMemoryInfo, v1) is total - free, which includes it.
        a, b = before.get(("gpu_memory_used_bytes", i)), after.get(("gpu_memory_used_bytes", i))
        s, r = row["memory.used"], reserved.get(row["index"])
        assert a is not None and b is not None and s is not None, (i, a, b, s)
        lo, hi = sorted((a / MIB, b / MIB))
        smi_used = float(s)
        fits = [label for label, v in (("used", smi_used), ("used + reserved", smi_used + float(r or 0)))
                if lo - 64 <= v <= hi + 64]
        record_property(f"gpu{i}_memory.used", f"nvml {lo:.0f}..{hi:.0f} / smi {s} (+ reserved {r}) MiB; "
                        f"matches smi {' or '.join(fits) or 'neither'}")
        if not fits:
            bad.append(f"GPU {i}: memory used {lo:.0f}..{hi:.0f} MiB vs nvidia-smi {s} (reserved {r}) MiB")
    assert not bad, "; ".join(bad)
