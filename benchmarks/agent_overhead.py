#!/usr/bin/env python3
"""Resident cost of the agent at 1 s sampling, exporter off and on, next to prometheus-node-exporter.

Runs the real agent (``gpuagent run``, probes off: this measures the resident daemon, not the probe
subprocesses it spawns) on an emulated 8-GPU node -- the real pynvml over the NVML emulator
(gpuagent.sim.nvml_emulator, SYNTHETIC 8x H100 fixture tests/data/nvml_8gpu_h100_sxm.json, real clock,
without the fixture's recorded processes, whose pids are not processes here), so the GPU sampler does its
full work each tick -- against a real local collector for ``--duration`` seconds (default 60) after
a warm-up, and reads /proc/<pid>/stat and /proc/<pid>/status once a second:

* ``agent_rss_bytes``: peak RSS (VmHWM, includes start-up) and ``agent_rss_steady_bytes``: median VmRSS;
* ``agent_cpu_percent``: user+system CPU time over the window, as % of one core.

The window is measured three times, each with a fresh agent: the Prometheus exporter off (the
``agent_*`` figures), then ``[exporter] listen`` on and /metrics scraped every 15 s (Prometheus's
default scrape interval) and every 1 s (``exporter_scrape_15s`` / ``exporter_scrape_1s``). Where
``prometheus-node-exporter`` is installed it runs on 127.0.0.1 beside the agent in every window, is
scraped as often as the agent's /metrics (once a second in the exporter-off window), and the same
figures are reported for it (``node_exporter_*``). The load average at the start and the end is
reported too: on a shared machine the CPU figures move with it. It also checks that torch is not loaded in
the daemon (no libtorch in /proc/<pid>/maps; ``torch_loaded`` false in its status file) and that the
collector stored what the agent sent. ``--nvml system`` runs the agent on this machine's own NVML instead
(none on a machine without a GPU: host-only). Targets (docs/ARCHITECTURE.md): RSS <= 64 MiB, CPU <= 1 % of one core.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from gpuagent import local_run

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK      # utime + stime


def mem(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":", 1)
                out[k] = int(v.split()[0]) * 1024
    return out


def maps_have(pid: int, needle: str) -> bool:
    with open(f"/proc/{pid}/maps") as fh:
        return any(needle in line for line in fh)


class Watch:
    """Per-second samples of one process."""

    def __init__(self, pid: int):
        self.pid = pid
        self.rss: list[int] = []
        self.hwm = 0
        self.cpu0 = self.t0 = None
        self.cpu1 = self.t1 = None

    def start(self):
        self.cpu0, self.t0 = cpu_seconds(self.pid), time.monotonic()

    def tick(self):
        m = mem(self.pid)
        self.rss.append(m.get("VmRSS", 0))
        self.hwm = max(self.hwm, m.get("VmHWM", 0))

    def end(self):
        self.cpu1, self.t1 = cpu_seconds(self.pid), time.monotonic()

    def result(self, prefix: str) -> dict:
        return {
            f"{prefix}_rss_bytes": self.hwm,
            f"{prefix}_rss_steady_bytes": int(statistics.median(self.rss)) if self.rss else 0,
            f"{prefix}_cpu_percent": round(100.0 * (self.cpu1 - self.cpu0) / (self.t1 - self.t0), 3),
            f"{prefix}_cpu_seconds": round(self.cpu1 - self.cpu0, 3),
        }


def node_exporter(port: int, log: Path) -> subprocess.Popen | None:
    exe = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if not exe:
        return None
    return subprocess.Popen([exe, f"--web.listen-address=127.0.0.1:{port}"], stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def scraper(url: str, stop: threading.Event, stats: dict, every_s: float = 1.0) -> None:
    """Scrape every ``every_s``, as a Prometheus server with that scrape_interval would."""
    nxt = time.monotonic()
    while not stop.is_set():
        t = time.monotonic()
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                body = r.read()
            stats["scrapes"] += 1
            stats["bytes"] = len(body)
            stats["scrape_s"].append(time.monotonic() - t)
        except OSError:
            stats["errors"] += 1
        nxt += every_s
        stop.wait(max(0.0, nxt - time.monotonic()))


def emulated_node(tmp: Path) -> dict[str, str]:
    """The environment that points the agent at a fresh emulated 8 x H100 node (SYNTHETIC) under ``tmp``."""
    from gpuagent.sim.nvml_emulator import Emulator

    fixture = Path(__file__).resolve().parents[1] / "tests" / "data" / "nvml_8gpu_h100_sxm.json"
    emu = Emulator.start(tmp / "nvmlemu", fixture, clock="real")
    for pid in {p["pid"] for g in emu.model["gpus"] for p in g.get("processes", ())}:
        emu.remove_process(pid)
    return emu.env_vars()


def scraped_agent_window(address: str, tmp: Path, args, name: str, every_s: float) -> dict:
    """A fresh agent with the exporter on, and node_exporter, each scraped every ``every_s`` over one
    measurement window."""
    ne_port = local_run.free_port()
    ne = node_exporter(ne_port, tmp / f"node_exporter-{name}.log")
    try:
        if ne is not None:
            local_run.wait_port(ne_port, ne, tmp / f"node_exporter-{name}.log")
        return _scraped_agent_window(address, tmp, args, name, every_s, ne, ne_port)
    finally:
        if ne is not None:
            local_run.stop_process(ne)


def _scraped_agent_window(address: str, tmp: Path, args, name: str, every_s: float,
                          ne: subprocess.Popen | None, ne_port: int) -> dict:
    mport = local_run.free_port()
    cfg = tmp / f"agent-{name}.toml"
    cfg.write_text(("" if args.probes else "[probes]\nenabled = false\n")
                   + f'[exporter]\nlisten = "127.0.0.1:{mport}"\n')
    agent = local_run.start_agent(address, tmp / f"state-{name}", tmp / f"agent-{name}.log",
                                  interval=args.interval, batch_interval=5.0, extra_args=("--config", str(cfg)),
                                  extra_env={"GPUAGENT_JOBS_SOCKET": str(tmp / f"jobs-{name}.sock"), **args.nvml_env})
    try:
        local_run.wait_port(mport, agent, tmp / f"agent-{name}.log")
        stop = threading.Event()
        stats = {"scrapes": 0, "errors": 0, "bytes": 0, "scrape_s": []}
        ne_stats = {"scrapes": 0, "errors": 0, "bytes": 0, "scrape_s": []}
        threads = [threading.Thread(target=scraper, args=(f"http://127.0.0.1:{mport}/metrics", stop, stats, every_s),
                                    daemon=True)]
        if ne is not None:
            threads.append(threading.Thread(target=scraper, daemon=True,
                                            args=(f"http://127.0.0.1:{ne_port}/metrics", stop, ne_stats, every_s)))
        for t in threads:
            t.start()
        time.sleep(args.warmup)
        w = Watch(agent.pid)
        ne_w = Watch(ne.pid) if ne is not None else None
        for x in (w, ne_w):
            if x is not None:
                x.start()
        t_end = time.monotonic() + args.duration
        nxt = time.monotonic()
        while time.monotonic() < t_end:
            for x in (w, ne_w):
                if x is not None:
                    x.tick()
            nxt += 1.0
            time.sleep(max(0.0, nxt - time.monotonic()))
        for x in (w, ne_w):
            if x is not None:
                x.end()
        stop.set()
        for t in threads:
            t.join(timeout=10)
        status = json.loads((tmp / f"state-{name}" / "status.json").read_text())
    finally:
        local_run.stop_process(agent)
    r = w.result("agent")
    out = {"scrape_every_s": every_s, "rss_bytes": r["agent_rss_bytes"],
           "rss_steady_bytes": r["agent_rss_steady_bytes"], "cpu_percent": r["agent_cpu_percent"],
           "scrapes": stats["scrapes"], "scrape_errors": stats["errors"], "scrape_bytes": stats["bytes"],
           "late_ticks": status["counters"]["late_ticks"], "skipped_ticks": status["counters"]["skipped_ticks"]}
    if stats["scrape_s"]:
        out["scrape_median_ms"] = round(1000 * statistics.median(stats["scrape_s"]), 2)
    out["rss_within_target"] = out["rss_bytes"] <= 64 * 1024 * 1024
    out["cpu_within_target"] = out["cpu_percent"] <= 1.0
    if ne_w is not None:
        out.update(ne_w.result("node_exporter"))
        out["node_exporter_scrapes"] = ne_stats["scrapes"]
        out["node_exporter_scrape_errors"] = ne_stats["errors"]
        if ne_stats["scrape_s"]:
            out["node_exporter_scrape_median_ms"] = round(1000 * statistics.median(ne_stats["scrape_s"]), 2)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="measurement window, seconds (default 60)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds after start before measuring")
    ap.add_argument("--interval", type=float, default=1.0, help="agent sampling interval (default 1 s)")
    ap.add_argument("--probes", action="store_true",
                    help="leave the probe scheduler on (its subprocesses are not counted; default off)")
    ap.add_argument("--no-exporter", action="store_true", help="skip the two exporter-on windows")
    ap.add_argument("--nvml", choices=("emulator", "system"), default="emulator",
                    help="the agent's NVML: an emulated 8 x H100 node (default, SYNTHETIC) or this machine's")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="gpuagent-bench-"))
    args.nvml_env = emulated_node(tmp) if args.nvml == "emulator" else {}
    load_start = [round(x, 2) for x in os.getloadavg()]
    port = local_run.free_port()
    address = f"127.0.0.1:{port}"
    cfg = tmp / "agent.toml"
    cfg.write_text("" if args.probes else "[probes]\nenabled = false\n")
    procs: list[subprocess.Popen] = []
    try:
        collector = local_run.start_collector(tmp / "bench.duckdb", port, tmp / "collector.log")
        procs.append(collector)
        local_run.wait_port(port, collector, tmp / "collector.log")
        agent = local_run.start_agent(address, tmp / "state", tmp / "agent.log", interval=args.interval,
                                      batch_interval=5.0, extra_args=("--config", str(cfg)),
                                      extra_env={"GPUAGENT_JOBS_SOCKET": str(tmp / "jobs.sock"), **args.nvml_env})
        procs.append(agent)
        local_run.wait_samples(address, agent, tmp / "agent.log", timeout=60, min_ticks=1)

        ne_port = local_run.free_port()
        ne = node_exporter(ne_port, tmp / "node_exporter.log")
        if ne is not None:
            procs.append(ne)
            local_run.wait_port(ne_port, ne, tmp / "node_exporter.log")
        stop = threading.Event()
        scrape = {"scrapes": 0, "errors": 0, "bytes": 0, "scrape_s": []}
        t_scrape = None
        if ne is not None:
            t_scrape = threading.Thread(target=scraper, args=(f"http://127.0.0.1:{ne_port}/metrics", stop, scrape),
                                        daemon=True)
            t_scrape.start()
        deadline = time.monotonic() + args.warmup
        while time.monotonic() < deadline:
            time.sleep(0.2)

        watches = {"agent": Watch(agent.pid)}
        if ne is not None:
            watches["node_exporter"] = Watch(ne.pid)
        for w in watches.values():
            w.start()
        _, rows = local_run.query(address, "SELECT count(*) FROM samples")
        stored0 = int(rows[0][0])
        t_end = time.monotonic() + args.duration
        nxt = time.monotonic()
        while time.monotonic() < t_end:
            for w in watches.values():
                w.tick()
            nxt += 1.0
            time.sleep(max(0.0, nxt - time.monotonic()))
        for w in watches.values():
            w.end()
        stop.set()
        if t_scrape is not None:
            t_scrape.join(timeout=10)
        torch_mapped = maps_have(agent.pid, "libtorch")
        status = json.loads((tmp / "state" / "status.json").read_text())
        _, rows = local_run.query(address, "SELECT count(*) FROM samples")
        stored1 = int(rows[0][0])
        local_run.stop_process(agent)     # one agent at a time: the windows below must not overlap it
        if ne is not None:
            local_run.stop_process(ne)
        exporter_windows = {} if args.no_exporter else {
            f"exporter_scrape_{every:g}s": scraped_agent_window(address, tmp, args, f"scrape{every:g}", every)
            for every in (15.0, 1.0)}

        out = {
            "benchmark": "agent_overhead",
            "duration_s": args.duration,
            "interval_s": args.interval,
            "cpu_count": os.cpu_count(),
            "load_average_start": load_start,
            "probes": "on" if args.probes else "off",
            "nvml": "SYNTHETIC emulated 8 x H100 node (sim/nvmlemu)" if args.nvml == "emulator" else "system",
            "malloc_arena_max": 2,
            **watches["agent"].result("agent"),
            "agent_samples_stored_in_window": stored1 - stored0,
            "agent_ticks": status["counters"]["ticks"],
            "agent_late_ticks": status["counters"]["late_ticks"],
            "agent_skipped_ticks": status["counters"]["skipped_ticks"],
            "agent_torch_in_maps": torch_mapped,
            "agent_torch_loaded": status.get("torch_loaded"),
            "target_rss_bytes": 64 * 1024 * 1024,
            "target_cpu_percent": 1.0,
        }
        out["agent_rss_within_target"] = out["agent_rss_bytes"] <= out["target_rss_bytes"]
        out["agent_cpu_within_target"] = out["agent_cpu_percent"] <= out["target_cpu_percent"]
        out.update(exporter_windows)
        out["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        out["agent_gpus"] = len(status.get("gpus") or [])
        if ne is not None:
            out.update(watches["node_exporter"].result("node_exporter"))
            out["node_exporter_scrapes"] = scrape["scrapes"]
            out["node_exporter_scrape_errors"] = scrape["errors"]
            out["node_exporter_scrape_bytes"] = scrape["bytes"]
            if scrape["scrape_s"]:
                out["node_exporter_scrape_median_ms"] = round(1000 * statistics.median(scrape["scrape_s"]), 2)
            out["rss_ratio_agent_over_node_exporter"] = round(out["agent_rss_bytes"] / out["node_exporter_rss_bytes"], 2)
            if out["node_exporter_cpu_percent"] > 0:
                out["cpu_ratio_agent_over_node_exporter"] = round(
                    out["agent_cpu_percent"] / out["node_exporter_cpu_percent"], 2)
        else:
            out["node_exporter"] = "not installed (prometheus-node-exporter not on PATH)"
    finally:
        for p in reversed(procs):
            local_run.stop_process(p)
        shutil.rmtree(tmp, ignore_errors=True)

    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:40s} {v}")
    ok = out["agent_torch_in_maps"] is False and out["agent_torch_loaded"] is False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
