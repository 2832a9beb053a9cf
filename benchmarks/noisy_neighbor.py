#!/usr/bin/env python3
"""A real noisy neighbor on this real node: does noisy_neighbor_variance open under stress-ng, and not without?

Two runs of the same length, each with its own real collector (``gpuagent-collector serve`` subprocess on
127.0.0.1, its own DuckDB file) and the real agent (``gpuagent run`` subprocess) sampling this machine at 1 s
with the host probe every ``--probe-interval`` seconds (and the storage probe, gated as usual on a quiet disk):

- quiet: nothing else is started (other processes on this machine still run: the figure says so);
- noisy: ``stress-ng`` hammers CPU, memory bandwidth and I/O for the middle half of the run.

Then one analysis pass (the Analyze RPC on the live collector, window = the run) and the open
noisy_neighbor_variance flags of each run, with their CV and steal/PSI evidence, are printed. This node has no
fleet peers, so a flag needs corroborating steal or PSI (docs/FLAGS.md). All figures are measured, none
synthetic. The machine is shared: the quiet run's load average is reported next to its result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

from gpuagent.collector.views.client import analyze as remote_analyze


def _start(cmd, log: Path, **kw):
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"), start_new_session=True, **kw)


def _stop(proc, timeout=30):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_file(path: Path, proc, what: str, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start (see its log)")
        time.sleep(0.1)


def one_run(name: str, work: Path, duration_s: float, probe_interval_s: float, stress: bool,
            stress_args: list[str]) -> dict:
    d = work / name
    d.mkdir()
    db = d / "collector.duckdb"
    py = sys.executable
    col = _start([py, "-m", "gpuagent.collector", "serve", "--listen", "127.0.0.1:0", "--db", str(db),
                  "--port-file", str(d / "port"), "--no-analyze", "--log-level", "warning"], d / "collector.log")
    agent = stressor = None
    try:
        _wait_file(d / "port", col, "the collector")
        target = f"127.0.0.1:{int((d / 'port').read_text())}"
        (d / "agent.toml").write_text(f"""
[collector]
address = "{target}"
[agent]
interval_s = 1.0
batch_interval_s = 2.0
state_dir = "{d / 'state'}"
[labels]
pool = "local-{name}"
[probes]
enabled = true
initial_delay_s = 2.0
budget_fraction = 0.9
budget_window_s = {max(60.0, duration_s)}
jitter_fraction = 0.05
lock_path = "{d / 'probe.lock'}"
[probes.host]
interval_s = {probe_interval_s}
[probes.storage]
interval_s = {probe_interval_s * 3}
params = {{ path = "{d}", size_mib = 32, rand_seconds = 1.0, seq_seconds = 1.0 }}
[probes.pcie]
enabled = false
[probes.gpu_compute]
enabled = false
[probes.collective]
enabled = false
""")
        load0 = os.getloadavg()[0]
        t0 = time.time()
        agent = _start([py, "-m", "gpuagent.agent.cli", "run", "--config", str(d / "agent.toml")], d / "agent.log")
        stress_window = None
        if stress:
            time.sleep(duration_s / 4)
            s0 = time.time()
            stressor = _start(["stress-ng", *stress_args, "--timeout", f"{int(duration_s / 2)}s"], d / "stress.log")
            stress_window = [round(s0 - t0, 1), None]
            stressor.wait(duration_s / 2 + 60)
            stress_window[1] = round(time.time() - t0, 1)
            time.sleep(max(0.0, duration_s - (time.time() - t0)))
        else:
            time.sleep(duration_s)
        load1 = os.getloadavg()[0]
        time.sleep(4)  # the agent's last batches
        _stop(agent)
        res = remote_analyze(target, window_s=duration_s + 30)
        noisy = [f for f in res.flags if f["kind"] == "noisy_neighbor_variance"]
    finally:
        if stressor is not None:
            _stop(stressor)
        if agent is not None:
            _stop(agent)
        _stop(col)
    con = duckdb.connect(str(db), read_only=True)
    try:
        runs = con.execute("""SELECT probe, status, count(*) FROM probe_results GROUP BY ALL ORDER BY ALL""").fetchall()
        spread = con.execute("""
            SELECT m.probe, m.metric, count(*) AS n, round(stddev_samp(m.value) / avg(m.value), 3) AS cv,
                   round(quantile_cont(m.value, 0.99) / quantile_cont(m.value, 0.5), 2) AS p99_p50
            FROM probe_metrics m JOIN probe_results r USING (node_id, probe, started_at)
            WHERE r.status = 'ok' GROUP BY ALL ORDER BY ALL""").fetchall()
        pressure = con.execute("""
            SELECT metric, round(avg(value), 2), round(max(value), 2) FROM samples
            WHERE gpu IS NULL AND labels = '' AND metric IN ('cpu_steal_percent', 'psi_cpu_some_avg10_percent',
                  'psi_io_some_avg10_percent', 'psi_memory_some_avg10_percent', 'load1')
            GROUP BY metric ORDER BY metric""").fetchall()
    finally:
        con.close()
    return {
        "run": name, "stress": stress, "duration_s": duration_s, "stress_window_s": stress_window,
        "loadavg_1m_start_end": [round(load0, 2), round(load1, 2)],
        "probe_runs": [{"probe": p, "status": s, "n": n} for p, s, n in runs],
        "probe_spread": [{"probe": p, "metric": m, "n": n, "cv": cv, "p99_p50": r} for p, m, n, cv, r in spread],
        "pressure_avg_max": {m: {"avg": a, "max": x} for m, a, x in pressure},
        "noisy_flags_open": len(noisy),
        "noisy_flags": [{"component": f["component"], "severity": f["severity"], "cv": round(f["value"], 3),
                         "sentence": f["sentence"],
                         "evidence": {k: v for k, v in json.loads(f["evidence"]).items()
                                      if k in ("runs", "cv", "tail_ratio", "corroborated", "cpu_steal_percent",
                                               "psi_cpu_some_avg10_percent", "psi_io_some_avg10_percent",
                                               "psi_memory_some_avg10_percent")}}
                        for f in noisy],
        "other_open_flags": [f"{f['kind']}/{f['component']}" for f in res.flags
                             if f["kind"] != "noisy_neighbor_variance"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds per run (two runs)")
    ap.add_argument("--probe-interval", type=float, default=10.0, help="host probe interval, seconds")
    ap.add_argument("--stress", default="--cpu 2 --vm 1 --vm-bytes 256M --io 1",
                    help="stress-ng arguments for the noisy run")
    ap.add_argument("--only", choices=["quiet", "noisy"], default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not shutil.which("stress-ng"):
        raise SystemExit("stress-ng is not installed (Debian package stress-ng)")
    work = Path(tempfile.mkdtemp(prefix="gpuagent-noisy-"))
    out = {"benchmark": "noisy_neighbor", "data": "real: this node, real agent, real collector, real stress-ng",
           "cpus": os.cpu_count(), "runs": []}
    try:
        for name, stress in (("quiet", False), ("noisy", True)):
            if args.only and args.only != name:
                continue
            out["runs"].append(one_run(name, work, args.duration, args.probe_interval, stress, args.stress.split()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by = {r["run"]: r for r in out["runs"]}
    out["noisy_opened_under_stress"] = bool(by.get("noisy", {}).get("noisy_flags_open"))
    out["quiet_opened_none"] = by["quiet"]["noisy_flags_open"] == 0 if "quiet" in by else None
    if "quiet" in by:
        psi = by["quiet"]["pressure_avg_max"].get("psi_cpu_some_avg10_percent", {}).get("avg")
        load = max(by["quiet"]["loadavg_1m_start_end"])
        # The machine is shared: say whether the control run actually was quiet.
        out["quiet_run_was_quiet"] = bool(psi is not None and psi < 10.0 and load < (os.cpu_count() or 1))
        out["quiet_run_psi_cpu_avg_percent"] = psi
        out["quiet_run_max_loadavg"] = load
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for r in out["runs"]:
            print(f"{r['run']}: {r['noisy_flags_open']} noisy_neighbor_variance flags open "
                  f"(load {r['loadavg_1m_start_end']})")
            for f in r["noisy_flags"]:
                print("   ", f["sentence"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
