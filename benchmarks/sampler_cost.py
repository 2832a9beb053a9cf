"""Per-tick cost of the data sources: host sampler, GPU sampler (emulated 8-GPU NVML), job discovery.

Method: each case calls ``sample()`` ``--ticks`` times back to back with timestamps 1 s apart (so rates
and the job scan interval behave as at 1 s sampling) and records the thread CPU time and wall time of
every call; we report the median and p95 per call in microseconds. ``cpu_percent_of_one_core_at_1s``
is the mean CPU time per tick / 1 s. The reference, measured in the same run, is what a plain psutil
sampler would call every tick for the same host data (cpu_times(percpu) + cpu_stats + virtual_memory
+ swap_memory + disk_io_counters(perdisk) + net_io_counters(pernic) + getloadavg).

The GPU case runs on the real pynvml over the NVML EMULATOR (sim/nvmlemu, SYNTHETIC 8x H100 fixture,
frozen clock advanced 1 s per tick): it measures our Python work plus pynvml's ctypes calls into a C
library that answers from memory, not the driver's time, which real NVML adds (typically tens of µs per
call). It runs twice, with GPM sampling on (the default; 7 of the 8 GPUs offer GPM, the MIG one has no
busy instance) and off (``GpuSampler(gpm=False)``); the difference is GPM's per-tick cost in our code,
pynvml and the emulator (one nvmlGpmSampleGet + one nvmlGpmMetricsGet per GPU), not what the driver
spends computing the metrics on a real Hopper GPU.
Job discovery runs on this GPU-less node in rule mode (a /proc scan every 5 s), with ``--jobs`` real
subprocesses carrying RANK/LOCAL_RANK so that there is something to sample.

The RSS figure comes from a fresh subprocess that imports only the agent's samplers and runs the ticks
(no torch): its peak RSS (VmHWM) after the run.

    python benchmarks/sampler_cost.py --json [--ticks 200 --jobs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

_RSS_CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
from gpuagent.agent.host_sampler import HostSampler
from gpuagent.agent.gpu_sampler import GpuSampler
from gpuagent.agent.job_discovery import JobDiscovery
from gpuagent.common.nvml import Nvml
from gpuagent.agent.sampling import ListSink
g = GpuSampler(Nvml()); h = HostSampler(); j = JobDiscovery()   # NVML: the emulator node in the env
t = time.time_ns()
for k in range(int(sys.argv[1])):
    sink = ListSink()   # a fresh sink per tick, as the batcher drains each tick
    for s in (h, g, j):
        s.sample(t + k * 1_000_000_000, sink)
hwm = 0
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        hwm = int(line.split()[1]) * 1024
print(hwm, "torch" in sys.modules)
"""


class _NullSink:
    """Takes everything and keeps nothing, so the sink's own cost is not measured."""

    def add(self, *a, **k):
        pass

    def event(self, *a, **k):
        pass

    def job_sample(self, **k):
        pass


def _measure(fn, ticks: int) -> dict[str, float]:
    cpu, wall = [], []
    t0 = time.time_ns()
    for k in range(ticks):
        c = time.thread_time_ns()
        w = time.perf_counter_ns()
        fn(t0 + k * 1_000_000_000)
        wall.append((time.perf_counter_ns() - w) / 1000.0)
        cpu.append((time.thread_time_ns() - c) / 1000.0)
    cpu.sort()
    return {"cpu_median_us": round(statistics.median(cpu), 1),
            "cpu_p95_us": round(cpu[int(0.95 * (len(cpu) - 1))], 1),
            "wall_median_us": round(statistics.median(wall), 1),
            "cpu_mean_us": round(statistics.fmean(cpu), 1),
            "cpu_percent_of_one_core_at_1s": round(statistics.fmean(cpu) / 1e6 * 100, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=200, help="sample() calls per case")
    ap.add_argument("--jobs", type=int, default=4, help="job processes to spawn for job discovery")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    import psutil

    import tempfile

    import pynvml

    from gpuagent.sim.nvml_emulator import Emulator
    from gpuagent.agent.gpu_sampler import GpuSampler
    from gpuagent.agent.host_sampler import HostSampler
    from gpuagent.agent.job_discovery import JobDiscovery
    from gpuagent.common.nvml import Nvml

    sink = _NullSink()
    out: dict[str, object] = {"ticks": args.ticks, "cpus": os.cpu_count(), "python": sys.version.split()[0],
                              "load1_at_start": os.getloadavg()[0]}

    def psutil_reference(_ts):
        psutil.cpu_times(percpu=True)
        psutil.cpu_times()
        psutil.cpu_stats()
        psutil.virtual_memory()
        psutil.swap_memory()
        psutil.disk_io_counters(perdisk=True)
        psutil.net_io_counters(pernic=True)
        os.getloadavg()

    host = HostSampler()
    out["host"] = _measure(lambda ts: host.sample(ts, sink), args.ticks)
    out["reference_psutil_calls"] = _measure(psutil_reference, args.ticks)
    out["ratio_host_to_psutil_reference"] = round(
        out["host"]["cpu_median_us"] / out["reference_psutil_calls"]["cpu_median_us"], 3)

    node_dir = tempfile.mkdtemp(prefix="sampler-cost-nvmlemu-")
    fixture = ROOT / "tests" / "data" / "nvml_8gpu_h100_sxm.json"
    emu = Emulator.start(Path(node_dir) / "on", fixture, clock="frozen").activate()
    fake_gpm_ns = [0]

    def timed(fn):
        def call(*a):
            c = time.thread_time_ns()
            try:
                return fn(*a)
            finally:
                fake_gpm_ns[0] += time.thread_time_ns() - c
        return call

    # pynvml's GPM calls (binding + emulator) are timed apart, so the agent's share can be told from theirs
    real_gpm = {fn: getattr(pynvml, fn) for fn in ("nvmlGpmSampleGet", "nvmlGpmMetricsGet")}
    for fn, f in real_gpm.items():
        setattr(pynvml, fn, timed(f))
    gpu = GpuSampler(Nvml())
    out["gpu_emulated_8x_h100"] = _measure(lambda ts: (emu.advance(1.0), gpu.sample(ts, sink)), args.ticks)
    out["gpu_emulated_8x_h100"]["gpm_metrics_get_calls"] = emu.calls(pid=os.getpid()).get("nvmlGpmMetricsGet", 0)
    out["gpu_emulated_8x_h100"]["gpm_calls_cpu_us_per_tick"] = round(fake_gpm_ns[0] / 1000 / args.ticks, 1)
    for fn, f in real_gpm.items():
        setattr(pynvml, fn, f)
    gpu_off = GpuSampler(Nvml(), gpm=False)
    out["gpu_emulated_8x_h100_gpm_off"] = _measure(lambda ts: (emu.advance(1.0), gpu_off.sample(ts, sink)),
                                                   args.ticks)
    out["gpm_cpu_us_per_tick_8_gpus"] = round(out["gpu_emulated_8x_h100"]["cpu_mean_us"]
                                              - out["gpu_emulated_8x_h100_gpm_off"]["cpu_mean_us"], 1)
    out["gpm_cpu_us_per_tick_8_gpus_agent_side"] = round(
        out["gpm_cpu_us_per_tick_8_gpus"] - out["gpu_emulated_8x_h100"]["gpm_calls_cpu_us_per_tick"], 1)
    out["gpu_emulated_8x_h100_plus_processes"] = _measure(lambda ts: gpu.processes(), args.ticks)

    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(args.jobs))
    rss_env = emu.env(base=env)        # the RSS child reads the same emulated node
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
            for _ in range(args.jobs)]
    try:
        jd = JobDiscovery(scan_interval_s=5.0)
        time.sleep(0.2)
        out["jobs_rule_mode"] = _measure(lambda ts: jd.sample(ts, sink), args.ticks)
        out["jobs_rule_mode"]["processes_in_proc"] = len([p for p in os.listdir("/proc") if p.isdigit()])
        out["jobs_rule_mode"]["job_processes_found"] = sum(len(j["pids"]) for j in jd.active_jobs())
        rss = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(args.ticks), str(ROOT / "tests")],
                             capture_output=True, text=True, timeout=300, env=rss_env)
    finally:
        for k in kids:
            k.kill()
            k.wait()
    hwm, torch_loaded = rss.stdout.split()
    total_cpu = sum(out[c]["cpu_mean_us"] for c in ("host", "gpu_emulated_8x_h100", "jobs_rule_mode"))
    out.update({
        "samplers_peak_rss_bytes": int(hwm),
        "torch_imported_by_samplers": torch_loaded == "True",
        "all_three_cpu_percent_of_one_core_at_1s": round(total_cpu / 1e6 * 100, 4),
        "target_cpu_percent_whole_daemon": 1.0, "target_rss_bytes_whole_daemon": 64 << 20,
    })
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:42s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
