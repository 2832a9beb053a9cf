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

Slurm attribution (``jobs_slurm_steps``, agent/schedulers/slurm.py): on a REAL single-node Slurm cluster
(tests/slurm_cluster.py; root, Debian's slurmctld/slurmd/munge) one batch job runs ``--slurm-steps`` job steps
(``srun --overlap sleep``) on this node; JobDiscovery with SlurmAttribution (listpids and show job answered by
the real slurmd/slurmctld, refreshed once before the ticks) against JobDiscovery without Slurm on the same
node in the same run. A tick never calls scontrol; the background refresh is measured apart (its thread's
CPU plus the scontrol children's, per refresh, and per second at the default ``slurm_refresh_s`` of 2 s).
Without root or the Slurm binaries the case says why it did not run.

``agent_tick_8_gpus_8_ib_ports``: the agent's whole tick (every sampler into the real batcher, batches into the
spool, status.json with the hardware-health judgement) on that emulated node with 8 SYNTHETIC IB ports, with
the hardware-health sources and judgement of issue 23 and without them, in the same run (_whole_tick_case).

``jobs_tcp_sockets``: job discovery's network-neighbour reads (agent/samplers/tcp_sockets.py: a sock_diag dump of the
established TCP connections every ``[jobs] net_interval_s``, 5 s by default, and every tick) on and stubbed off,
in the same run, with ``--tcp-connections`` busy
loopback connections open (each end a socket in the dump: the dump's parse is what grows with connections; a
loopback connection never needs its owner looked up), and the worst case of the owner lookup apart: one read
of every process's /proc/<pid>/fd, which a tick does only when a socket that moved bytes has no known owner
(at most every 30 s for one that never gets one).

``hw_host_8_ib_ports``: agent/samplers/hw_host.py's HwHostSampler over a SYNTHETIC sysfs tree with 8 InfiniBand ports
(mlx5_0..7 port 1, the kernel's standard counters and hw_counters) and an empty kernel-log file, with its
default sysfs interval (10 s: one tick in ten reads sysfs) and reading sysfs every tick, against the host
sampler alone in the same run.

    python benchmarks/sampler_cost.py --json [--ticks 200 --jobs 4 --slurm-steps 100]
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
from gpuagent.agent.samplers.host import HostSampler
from gpuagent.agent.samplers.gpu import GpuSampler
from gpuagent.agent.samplers.job_discovery import JobDiscovery
from gpuagent.common.nvml import Nvml
from gpuagent.agent.samplers.sampling import ListSink
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


IB_COUNTERS = ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors", "port_rcv_remote_physical_errors",
               "port_rcv_switch_relay_errors", "port_xmit_discards", "port_xmit_constraint_errors",
               "port_rcv_constraint_errors", "local_link_integrity_errors", "excessive_buffer_overrun_errors",
               "VL15_dropped", "port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets",
               "unicast_xmit_packets", "unicast_rcv_packets", "multicast_xmit_packets", "multicast_rcv_packets",
               "port_xmit_wait")
IB_HW_COUNTERS = ("duplicate_request", "implied_nak_seq_err", "lifespan", "local_ack_timeout_err", "out_of_buffer",
                  "out_of_sequence", "packet_seq_err", "req_cqe_error", "req_remote_access_errors",
                  "req_remote_invalid_request", "resp_cqe_error", "resp_local_length_error", "rnr_nak_retry_err",
                  "rx_atomic_requests", "rx_read_requests", "rx_write_requests", "np_cnp_sent", "rp_cnp_handled")


def _ib_sysfs(root: Path, ports: int = 8) -> Path:
    """A SYNTHETIC sysfs tree: ``ports`` ConnectX InfiniBand ports (mlx5_<i> port 1), ACTIVE at 400 Gb/s."""
    for i in range(ports):
        p = root / "class" / "infiniband" / f"mlx5_{i}" / "ports" / "1"
        for sub, names in (("counters", IB_COUNTERS), ("hw_counters", IB_HW_COUNTERS)):
            (p / sub).mkdir(parents=True, exist_ok=True)
            for n in names:
                (p / sub / n).write_text(f"{1000 + i}\n")
        for name, text in (("state", "4: ACTIVE"), ("phys_state", "5: LinkUp"), ("rate", "400 Gb/sec (4X NDR)"),
                           ("link_layer", "InfiniBand")):
            (p / name).write_text(text + "\n")
    return root


def _hw_host_case(ticks: int, sink, host_alone: dict[str, float]) -> dict[str, object]:
    import tempfile

    from gpuagent.agent.samplers.hw_host import HwHostSampler
    root = Path(tempfile.mkdtemp(prefix="sampler-cost-sysfs-"))
    sysfs = _ib_sysfs(root / "sys")
    kmsg = root / "kmsg"
    kmsg.write_text("")                # SYNTHETIC: an empty kernel log (a regular file reads to EOF)
    res: dict[str, object] = {"ib_ports": 8, "sysfs": "SYNTHETIC fixture tree"}
    for name, every in (("default_sysfs_every_10s", 10.0), ("sysfs_every_tick", 0.0)):
        hw = HwHostSampler(sys_root=str(sysfs), proc_root="/proc", kmsg_path=str(kmsg), state_dir=None,
                           sysfs_every_s=every, holdback_s=0.0)
        res[name] = _measure(lambda ts, hw=hw: hw.sample(ts, sink), ticks)
        if hw.kmsg is not None:
            hw.kmsg.close()
        res[f"ratio_{name}_to_host_sampler"] = round(res[name]["cpu_median_us"] / host_alone["cpu_median_us"], 3)
        res[f"ratio_{name}_mean_to_host_sampler_mean"] = round(res[name]["cpu_mean_us"] / host_alone["cpu_mean_us"], 3)
    res["host_sampler_alone"] = host_alone
    return res


def _whole_tick_case(ticks: int, emu) -> dict[str, object]:
    """The agent's whole tick (``Agent.tick``: every sampler into the real batcher, batch cuts into the spool,
    status.json with its health judgement) on the emulated 8-GPU node with 8 IB ports, with the hardware-health
    sources of issue 23 and without them, in the same run. Without = no hw_host sampler, the GPU sampler's
    health reads only at its first tick (``health_every`` past the run), and the health judgement replaced by an
    empty section (``daemon.health_status`` stubbed for that case only): what a tick cost before the issue."""
    import tempfile

    from gpuagent.agent import daemon
    from gpuagent.agent.config import load_config
    from gpuagent.agent.samplers.gpu import _HEALTH_EVERY, GpuSampler
    from gpuagent.agent.samplers.host import HostSampler
    from gpuagent.agent.samplers.hw_host import HwHostSampler
    from gpuagent.agent.samplers.job_discovery import JobDiscovery
    from gpuagent.agent.snapshot import HealthStatus
    from gpuagent.common.nvml import Nvml

    root = Path(tempfile.mkdtemp(prefix="sampler-cost-tick-"))
    sysfs = _ib_sysfs(root / "sys")
    kmsg = root / "kmsg"
    kmsg.write_text("")
    res: dict[str, object] = {"gpus": 8, "ib_ports": 8, "data": "SYNTHETIC (NVML emulator, sysfs fixture tree)"}
    real_health = daemon.health_status
    for name, with_health in (("without_hardware_health", False), ("with_hardware_health", True)):
        cfg = load_config(None, env={}, state_dir=str(root / f"state-{name}"), collector="127.0.0.1:9")
        gpu = GpuSampler(Nvml(), health_every=_HEALTH_EVERY if with_health else 10**9)
        samplers = [HostSampler(), gpu, JobDiscovery(scan_interval_s=5.0)]
        if with_health:
            samplers.append(HwHostSampler(sys_root=str(sysfs), proc_root="/proc", kmsg_path=str(kmsg),
                                          state_dir=None, holdback_s=0.0))
        agent = daemon.Agent(cfg, samplers=samplers, node_info=daemon.build_node_info(cfg, samplers))
        if not with_health:
            daemon.health_status = lambda *a, **k: HealthStatus(checked_ns=0, window_s=0.0, faults=[], readings=[],
                                                                events=[], checked=[], not_checked=[], error=None)
        try:
            res[name] = _measure(lambda _ts, agent=agent: (emu.advance(1.0), agent.tick()), ticks)
        finally:
            daemon.health_status = real_health
            for smp in samplers:
                close = getattr(smp, "close", None)
                if close:
                    close()
    res["added_cpu_us_per_tick"] = round(res["with_hardware_health"]["cpu_mean_us"]
                                         - res["without_hardware_health"]["cpu_mean_us"], 1)
    res["ratio_with_to_without_mean"] = round(res["with_hardware_health"]["cpu_mean_us"]
                                              / res["without_hardware_health"]["cpu_mean_us"], 3)
    return res


def _slurm_case(ticks: int, steps: int, sink) -> dict[str, object]:
    """JobDiscovery with and without Slurm attribution, ``steps`` real job steps on a real cluster."""
    import resource
    import shutil
    import tempfile

    from gpuagent.agent.samplers.job_discovery import JobDiscovery
    from gpuagent.agent.schedulers.slurm import SlurmAttribution, parse_listpids
    missing = [t for t in ("slurmctld", "slurmd", "scontrol", "sbatch", "srun", "munged") if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        return {"skipped": f"needs root and {', '.join(missing) or 'Slurm'}" if missing else "needs root (slurmd runs jobs)"}
    os.environ.setdefault("PYTEST_XDIST_WORKER", "gw11")   # the fixture's port block: not a test worker's
    from slurm_cluster import SlurmCluster
    cluster = SlurmCluster(Path(tempfile.mkdtemp(prefix="sampler-cost-slurm-"))).start()
    old_conf = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        job = cluster.sbatch(f"for i in $(seq {steps}); do srun --overlap -n1 -c1 --mem=1 sleep 600 & done\nwait\n",
                             "-c", "1", "--mem=100", "-J", "bench-steps")
        deadline = time.monotonic() + 180
        listed: dict[int, tuple[str, str]] = {}
        while time.monotonic() < deadline:
            listed = parse_listpids(cluster.run("scontrol", "listpids", job, check=False))
            if len({s for _j, s in listed.values() if s.isdigit()}) >= steps:
                break
            time.sleep(0.5)
        step_ids = {s for _j, s in listed.values() if s.isdigit()}
        res: dict[str, object] = {"slurm": "REAL single-node cluster (slurmd 22.05, proctrack/linuxproc)",
                                  "job_steps_running": len(step_ids), "pids_listed": len(listed)}
        att = SlurmAttribution(refresh_s=2.0)
        att.refresh()
        cpu, wall, kids = [], [], []
        for _ in range(10):
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            c, w = time.thread_time_ns(), time.perf_counter_ns()
            att.refresh()
            wall.append((time.perf_counter_ns() - w) / 1e3)
            cpu.append((time.thread_time_ns() - c) / 1e3)
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            kids.append((r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) * 1e6)
        per_refresh = statistics.median(cpu) + statistics.median(kids)
        res["background_refresh"] = {
            "thread_cpu_median_us": round(statistics.median(cpu), 1),
            "scontrol_children_cpu_median_us": round(statistics.median(kids), 1),
            "wall_median_us": round(statistics.median(wall), 1),
            "cpu_percent_of_one_core_at_refresh_2s": round(per_refresh / 2e6 * 100, 4)}
        with_slurm = JobDiscovery(scan_interval_s=5.0)
        with_slurm.slurm = att           # refreshed above; no thread, so the ticks see one fixed pid map
        plain = JobDiscovery(scan_interval_s=5.0)
        for jd in (with_slurm, plain):
            for k in range(3):           # warm: first /proc scan, Slurm details
                jd.sample(time.time_ns() + k, sink)
        res["with_slurm"] = _measure(lambda ts: with_slurm.sample(ts, sink), ticks)
        res["with_slurm"]["job_processes_found"] = sum(len(j["pids"]) for j in with_slurm.active_jobs())
        res["without_slurm"] = _measure(lambda ts: plain.sample(ts, sink), ticks)
        res["without_slurm"]["job_processes_found"] = sum(len(j["pids"]) for j in plain.active_jobs())
        res["ratio_with_to_without_median"] = round(res["with_slurm"]["cpu_median_us"]
                                                    / res["without_slurm"]["cpu_median_us"], 3)
        res["ratio_with_to_without_mean"] = round(res["with_slurm"]["cpu_mean_us"]
                                                  / res["without_slurm"]["cpu_mean_us"], 3)
        res["attribution_cpu_us_per_tick_mean"] = round(res["with_slurm"]["cpu_mean_us"]
                                                        - res["without_slurm"]["cpu_mean_us"], 1)
        return res
    finally:
        if old_conf is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old_conf
        cluster.stop()


def _tcp_sockets_case(ticks: int, conns: int, sink) -> dict[str, object]:
    """JobDiscovery with the sock_diag reads on and stubbed off, ``conns`` loopback connections moving bytes."""
    import socket
    import threading

    from gpuagent.agent.samplers import job_discovery as jdmod
    from gpuagent.agent.samplers.tcp_sockets import socket_inodes, tcp_connections

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(conns)
    pairs = []
    for _ in range(conns):
        c = socket.create_connection(srv.getsockname())
        pairs.append((c, srv.accept()[0]))
    stop = threading.Event()

    def churn():      # every connection moves a few bytes between ticks
        while not stop.is_set():
            for c, a in pairs:
                c.send(b"x" * 512)
                a.recv(4096)
            time.sleep(0.05)

    th = threading.Thread(target=churn, daemon=True)
    th.start()
    try:
        real = jdmod.tcp_connections
        jdmod.tcp_connections = lambda: []      # off first, so neither side gets the other's warm caches
        try:
            off = jdmod.JobDiscovery(scan_interval_s=5.0)
            res_off = _measure(lambda ts: off.sample(ts, sink), ticks)
        finally:
            jdmod.tcp_connections = real
        on = jdmod.JobDiscovery(scan_interval_s=5.0)
        res_on = _measure(lambda ts: on.sample(ts, sink), ticks)
        every = jdmod.JobDiscovery(scan_interval_s=5.0, net_interval_s=1.0)
        res_every = _measure(lambda ts: every.sample(ts, sink), ticks)
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        scan = _measure(lambda ts: [socket_inodes("/proc", p) for p in pids], 20)
        return {"sockets_in_dump": len(tcp_connections()), "sock_diag_every_5s": res_on,
                "sock_diag_every_tick": res_every, "sock_diag_off": res_off,
                "added_cpu_us_per_tick": round(res_on["cpu_mean_us"] - res_off["cpu_mean_us"], 1),
                "added_cpu_us_per_tick_reading_every_tick": round(res_every["cpu_mean_us"] - res_off["cpu_mean_us"], 1),
                "ratio_on_to_off": round(res_on["cpu_mean_us"] / res_off["cpu_mean_us"], 3),
                "owner_lookup_every_process_cpu_median_us": scan["cpu_median_us"], "processes": len(pids)}
    finally:
        stop.set()
        th.join()
        for c, a in pairs:
            c.close()
            a.close()
        srv.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=200, help="sample() calls per case")
    ap.add_argument("--jobs", type=int, default=4, help="job processes to spawn for job discovery")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tcp-connections", type=int, default=64, help="loopback TCP connections for jobs_tcp_sockets")
    ap.add_argument("--slurm-steps", type=int, default=100, help="Slurm job steps on the node (0: skip the Slurm case)")
    args = ap.parse_args()

    import psutil

    import tempfile

    import pynvml

    from gpuagent.sim.nvml_emulator import Emulator
    from gpuagent.agent.samplers.gpu import GpuSampler
    from gpuagent.agent.samplers.host import HostSampler
    from gpuagent.agent.samplers.job_discovery import JobDiscovery
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
        out["jobs_tcp_sockets"] = _tcp_sockets_case(args.ticks, args.tcp_connections, sink)
        rss = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(args.ticks), str(ROOT / "tests")],
                             capture_output=True, text=True, timeout=300, env=rss_env)
    finally:
        for k in kids:
            k.kill()
            k.wait()
    out["hw_host_8_ib_ports"] = _hw_host_case(args.ticks, sink, out["host"])
    out["agent_tick_8_gpus_8_ib_ports"] = _whole_tick_case(args.ticks, emu)
    if args.slurm_steps > 0:
        out["jobs_slurm_steps"] = _slurm_case(args.ticks, args.slurm_steps, sink)
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
