#!/usr/bin/env python3
"""Samples stored per node-hour and bytes per node-day at the agent's resolutions, and the same for a
Prometheus TSDB fed dcgm-exporter's default counter set at 30 s (issue 44, docs/RESOLUTION.md). SYNTHETIC data.

1. For each resolution (``--summary-interval-s 0``: every sample raw, as before; 60: the agent's default), a
   fresh in-process collector (real gRPC on loopback, a fresh DuckDB file) takes the same ``gpuagent-sim``
   fleet (fixed seed): ``--nodes`` x ``--hours``. Then one analysis pass runs (the rollups: the summaries move
   into samples_1m), and a CHECKPOINT. It reports the rows of samples, samples_summary and samples_1m, and the
   bytes the database uses (file minus free blocks, plus WAL: collector/store/disk_usage.py), per node-hour
   and per node-day.
2. Prometheus: dcgm-exporter's 25 default counters (agent/surface/dcgm_names.py, from its
   etc/default-counters.csv) for 8 GPUs a node, with dcgm-exporter's labels (gpu, UUID, pci_bus_id, device,
   modelName, Hostname), a SYNTHETIC value every 30 s (the scrape interval) for the same span, written as
   OpenMetrics and turned into TSDB blocks by ``promtool tsdb create-blocks-from openmetrics``; the bytes of
   the block directory per node-day.

    python benchmarks/resolution_storage.py --json                     # 20 nodes x 2 h
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HOUR_NS = 3600 * 10**9
END_NS = 1_790_000_000 * 10**9 // (24 * HOUR_NS) * (24 * HOUR_NS)   # a fixed midnight: the same data every run


def gpuagent_store(work: Path, nodes: int, hours: float, summary_interval_s: float, seed: int) -> dict:
    from gpuagent.collector import service as server
    from gpuagent.collector.analysis import analyzer as an
    from gpuagent.collector.store import disk_usage as du
    from gpuagent.sim.run import SimConfig, run_sim

    db = work / f"resolution-{summary_interval_s:g}.duckdb"
    h = server.start_collector(db, "127.0.0.1:0", analyze=False)
    try:
        t0 = time.perf_counter()
        s = run_sim(SimConfig(collector=h.address, nodes=nodes, sim_hours=hours, seed=seed, end_ns=END_NS,
                              summary_interval_s=summary_interval_s, scenario="mixed"))
        ingest_s = time.perf_counter() - t0
        if s.nodes_ok != nodes:
            raise SystemExit(f"the simulated fleet was not fully acknowledged: {s.errors[:3]}")
        analyzer = an.Analyzer(an.AnalyzerConfig())
        t1 = time.perf_counter()
        rolled = h.writer.call(analyzer.run_pass).result()
        pass_s = time.perf_counter() - t1

        def measure(c):
            c.execute("CHECKPOINT")
            n = lambda sql: c.execute(sql).fetchone()[0]  # noqa: E731
            return {"used_bytes": du.measure(c, str(db)).used_bytes,
                    "samples_bytes": du.table_bytes(c, "samples"),
                    "samples_1m_bytes": du.table_bytes(c, "samples_1m"),
                    "raw_rows": n("SELECT count(*) FROM samples"),
                    "summary_rows_left": n("SELECT count(*) FROM samples_summary"),
                    "rollup_rows": n("SELECT count(*) FROM samples_1m"),
                    "series_raw_per_node": n("SELECT count(DISTINCT (node_id, metric, gpu, labels)) FROM samples") / nodes,
                    "series_per_node": n("SELECT count(DISTINCT (node_id, metric, gpu, labels)) FROM samples_1m") / nodes}

        m = h.writer.call(measure).result()
    finally:
        h.stop()
    node_hours = nodes * hours
    return {**m, "summary_interval_s": summary_interval_s, "ingest_s": round(ingest_s, 2),
            "first_pass_s": round(pass_s, 2), "first_pass_rollup_rows_in": rolled.rollup_rows_in,
            "samples_per_node_hour": round(m["raw_rows"] / node_hours, 1),
            "rows_per_node_hour": round((m["raw_rows"] + m["rollup_rows"]) / node_hours, 1),
            "bytes_per_node_day": round(m["used_bytes"] / node_hours * 24),
            "samples_table_bytes_per_node_day": round(m["samples_bytes"] / node_hours * 24)}


def dcgm_openmetrics(path: Path, nodes: int, hours: float, seed: int, interval_s: float = 30.0) -> int:
    """dcgm-exporter's default counters for ``nodes`` x 8 GPUs as OpenMetrics text (SYNTHETIC values); the
    number of samples written."""
    from gpuagent.agent.surface.dcgm_names import DCGM_METRICS

    metrics = [m for m in DCGM_METRICS if m.default]
    rng = np.random.default_rng(seed)
    steps = int(hours * 3600 / interval_s)
    t_s = (END_NS / 1e9 - hours * 3600) + np.arange(steps) * interval_s
    n = 0
    with open(path, "w") as fh:
        for m in metrics:
            name, counter = m.old, m.kind == "counter"
            fh.write(f"# TYPE {name} gauge\n")     # the TSDB stores both kinds alike
            for node in range(nodes):
                for g in range(8):
                    labels = (f'gpu="{g}",UUID="GPU-{node:04d}-{g}",pci_bus_id="00000000:{g + 0x18:02X}:00.0",'
                              f'device="nvidia{g}",modelName="NVIDIA H100 80GB HBM3",Hostname="sim-{node:05d}"')
                    if counter:   # whole numbers that rise (energy in mJ, violation us, error counts)
                        vals = np.cumsum(rng.integers(0, 400_000 if "ENERGY" in name else 3, steps))
                    elif "CLOCK" in name:
                        vals = np.full(steps, 1980.0)
                    elif "TEMP" in name:
                        vals = np.round(55 + rng.normal(0, 1.5, steps))
                    elif "POWER" in name:
                        vals = np.round(600 + rng.normal(0, 40, steps), 3)
                    else:
                        vals = np.round(np.clip(rng.normal(85, 8, steps), 0, 100))
                    fh.writelines(f"{name}{{{labels}}} {v:g} {t:.3f}\n" for v, t in zip(vals, t_s))
                    n += steps
        fh.write("# EOF\n")
    return n


def prometheus(work: Path, nodes: int, hours: float, seed: int, promtool: str) -> dict:
    om = work / "dcgm.om"
    samples = dcgm_openmetrics(om, nodes, hours, seed)
    blocks = work / "prom"
    t0 = time.perf_counter()
    r = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(blocks)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"promtool failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    size = sum(p.stat().st_size for p in blocks.rglob("*") if p.is_file())
    node_hours = nodes * hours
    return {"samples": samples, "bytes": size, "promtool_s": round(time.perf_counter() - t0, 2),
            "series_per_node": samples / (nodes * hours * 3600 / 30.0),
            "samples_per_node_hour": round(samples / node_hours, 1), "bytes_per_node_day": round(size / node_hours * 24)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=20)
    p.add_argument("--hours", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--promtool", default=shutil.which("promtool") or "/usr/bin/promtool")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.nodes < 1 or not args.hours > 0 or not math.isfinite(args.hours):
        raise SystemExit("--nodes must be at least 1 and --hours positive")
    with tempfile.TemporaryDirectory(prefix="gpuagent-resolution-") as tmp:
        work = Path(tmp)
        out = {"benchmark": "resolution_storage", "data": "SYNTHETIC (gpuagent-sim, scenario mixed)",
               "nodes": args.nodes, "hours": args.hours, "seed": args.seed,
               "raw_every_sample": gpuagent_store(work, args.nodes, args.hours, 0.0, args.seed),
               "default_summaries_60s": gpuagent_store(work, args.nodes, args.hours, 60.0, args.seed)}
        if Path(args.promtool).exists():
            out["prometheus_dcgm_default_30s"] = prometheus(work, args.nodes, args.hours, args.seed, args.promtool)
        else:
            out["prometheus_dcgm_default_30s"] = f"not measured: no promtool at {args.promtool}"
    raw, new = out["raw_every_sample"], out["default_summaries_60s"]
    out["ratio_bytes_raw_over_default"] = round(raw["bytes_per_node_day"] / new["bytes_per_node_day"], 2)
    out["ratio_samples_raw_over_default"] = round(raw["samples_per_node_hour"] / new["samples_per_node_hour"], 2)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")


if __name__ == "__main__":
    sys.exit(main())
