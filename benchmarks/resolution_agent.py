#!/usr/bin/env python3
"""What the agent's default resolution sends from one node: the real `gpuagent run` on this machine's host
and on a SYNTHETIC 8-GPU H100 node (the NVML emulator under the real pynvml), to a real in-process collector,
for ``--seconds`` at a 1 s interval (issue 44, docs/RESOLUTION.md).

Two runs, every sample raw (``--summary-interval 0``) and the default (60 s): the rows a node adds to
`samples` per hour (measured over the run), plus at the default the summaries (one row per summarised series
and minute). Then it asks for a raw window of the default run, which must hold each summarised series' 1 s
samples.

    python benchmarks/resolution_agent.py --json        # about 3 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def run_agent(work: Path, emu, seconds: float, summary_interval_s: float) -> dict:
    """One agent run at a resolution; what it stored, per node-hour."""
    from gpuagent.collector import service as server
    from gpuagent.collector.views import client

    work.mkdir()
    cfg = work / "agent.toml"
    cfg.write_text("[probes]\nenabled = false\n")
    col = server.start_collector(work / "c.duckdb", "127.0.0.1:0", analyze=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAGENT_")}
    env.update(emu.env_vars(), GPUAGENT_CONFIG=str(cfg), GPUAGENT_JOBS_SOCKET=str(work / "jobs.sock"))
    log = open(work / "agent.log", "ab")
    agent = subprocess.Popen([sys.executable, "-m", "gpuagent.agent.cli", "run", "--collector", col.address,
                              "--state-dir", str(work / "state"), "--interval", "1", "--batch-interval", "5",
                              "--summary-interval", f"{summary_interval_s:g}"],
                             stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    n = lambda sql: client.query(col.address, sql).rows[0][0]  # noqa: E731
    out: dict = {"summary_interval_s": summary_interval_s}
    try:
        time.sleep(seconds)
        node = n("SELECT node_id FROM nodes")
        span = n("SELECT epoch(max(ts)) - epoch(min(ts)) FROM samples")
        out["sample_rows_per_node_hour"] = round(n("SELECT count(*) FROM samples") / span * 3600)
        out["series_sent_as_samples"] = n("SELECT count(DISTINCT (metric, gpu, labels)) FROM samples")
        out["series_summarised"] = n("SELECT count(DISTINCT (metric, gpu, labels)) FROM samples_summary")
        out["summary_rows_per_node_hour"] = round(out["series_summarised"] * 3600 / summary_interval_s) \
            if summary_interval_s else 0
        out["rows_per_node_hour"] = out["sample_rows_per_node_hour"] + out["summary_rows_per_node_hour"]
        if summary_interval_s:
            rid = client.request_raw_window(col.address, node, seconds + 60, "benchmark")
            deadline = time.monotonic() + 30
            while not n(f"SELECT count(*) FROM raw_requests WHERE request_id = '{rid}' AND answered_at IS NOT NULL"):
                if time.monotonic() > deadline:
                    raise SystemExit("the agent did not answer the raw-window request within 30 s")
                time.sleep(0.5)
            out["raw_window_series"] = n(f"SELECT count(DISTINCT (metric, gpu, labels)) FROM raw_windows "
                                         f"WHERE request_id = '{rid}'")
            out["raw_window_samples_per_tick"] = round(n(f"SELECT count(*) / count(DISTINCT ts) FROM raw_windows "
                                                         f"WHERE request_id = '{rid}'"), 1)
        top = client.query(col.address, "SELECT metric, count(*) FROM samples GROUP BY 1 ORDER BY 2 DESC LIMIT 8")
        out["most_rows"] = {m: c for m, c in top.rows}
    finally:
        agent.terminate()
        agent.wait(timeout=20)
        col.stop()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=75.0, help="each run's length")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from nvml_emulator_fixture import H100_8GPU, built_or_skip  # noqa: PLC0415 - tests/ helpers

    from gpuagent.sim.nvml_emulator import Emulator

    try:
        built_or_skip()
    except BaseException as exc:  # noqa: BLE001 - pytest.skip outside pytest
        raise SystemExit(f"the NVML emulator is not built: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="gpuagent-resolution-agent-") as tmp:
        work = Path(tmp)
        emu = Emulator.start(work / "nvmlemu", json.loads(H100_8GPU.read_text()), clock="real")
        raw = run_agent(work / "raw", emu, args.seconds, 0.0)
        default = run_agent(work / "default", emu, args.seconds, 60.0)
    out = {"benchmark": "resolution_agent", "node": "this host + SYNTHETIC 8x H100 (NVML emulator)",
           "seconds_each": args.seconds, "interval_s": 1.0, "every_sample_raw": raw, "default": default,
           "ratio_rows": round(raw["rows_per_node_hour"] / default["rows_per_node_hour"], 2)}
    print(json.dumps(out, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
