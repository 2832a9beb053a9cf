#!/usr/bin/env python3
"""Analysis speed: one analyzer pass over a SYNTHETIC fleet (default 1,000 nodes x 8 GPUs, the last hour of
1 s GPU samples, ~29 M sample rows), target <= 5 s per pass.

The rows are synthetic (written straight into DuckDB with SQL range(), node ids ``synthetic-*``); the timings
are real. Steps:
  1. create the hour minus ``--passes`` minutes of samples (+ job samples, job steps and probe runs);
  2. a first pass that rolls up everything at once (the reference: what a non-incremental rollup costs);
  3. ``--passes`` steady-state passes, each after appending one more minute of data (as ingest would),
     so the last pass analyses exactly the last hour. Reported: median pass time, median rollup time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import duckdb

from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.store import schema
from gpuagent.sim import synthetic_rows as S

ALL_GPU_METRICS = ("gpu_util_percent", "gpu_power_watts", "gpu_temperature_celsius", "gpu_sm_clock_mhz")


def add_minutes(con, *, nodes: int, gpus: int, start: dt.datetime, first_s: int, seconds: int,
                metrics: tuple[str, ...]) -> int:
    """Append [first_s, first_s + seconds) of data: 1 s GPU samples, 10 s job samples, 60 s job steps,
    a host + pcie probe run per node every 5 minutes."""
    t0 = start + dt.timedelta(seconds=first_s)
    S.fill_gpu_fleet_samples(con, nodes=nodes, gpus=gpus, start=t0, seconds=seconds, metrics=metrics)
    S.fill_fleet_job_rows(con, nodes=nodes, gpus=gpus, start=t0, seconds=seconds)
    S.fill_fleet_probe_rows(con, nodes=nodes, gpus=gpus, start=start, first_s=first_s, seconds=seconds)
    return seconds * nodes * gpus * len(metrics)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--minutes", type=int, default=60, help="history to analyse (the window is this long)")
    ap.add_argument("--passes", type=int, default=5, help="steady-state passes (one new minute before each)")
    ap.add_argument("--gpu-metrics", type=int, default=1, choices=range(1, len(ALL_GPU_METRICS) + 1),
                    help="GPU metrics per GPU per second (1: gpu_util_percent only, ~29 M rows for 1,000 x 8 x 1 h)")
    ap.add_argument("--db", help="database file (default: a temporary one, removed afterwards)")
    ap.add_argument("--threads", type=int, default=0, help="DuckDB threads (0: DuckDB's default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.passes >= args.minutes:
        ap.error("--passes must be smaller than --minutes")

    metrics = ALL_GPU_METRICS[:args.gpu_metrics]
    tmp = None
    if args.db:
        path = Path(args.db)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="gpuagent-speed-")
        path = Path(tmp.name) / "speed.duckdb"
    con = duckdb.connect(str(path))
    if args.threads:
        con.execute(f"SET threads = {int(args.threads)}")
    schema.migrate(con)
    start = dt.datetime(2026, 1, 1, 0, 0)
    S.add_synthetic_fleet(con, args.nodes, args.gpus, start)
    cfg = A.AnalyzerConfig(window_s=args.minutes * 60.0)
    an = A.Analyzer(cfg)

    t = time.perf_counter()
    first_min = args.minutes - args.passes
    rows = add_minutes(con, nodes=args.nodes, gpus=args.gpus, start=start, first_s=0, seconds=first_min * 60,
                       metrics=metrics)
    gen_s = time.perf_counter() - t
    con.execute("CHECKPOINT")
    now = start + dt.timedelta(minutes=first_min)
    full = an.run_pass(con, now)

    passes = []
    for i in range(args.passes):
        s0 = (first_min + i) * 60
        rows += add_minutes(con, nodes=args.nodes, gpus=args.gpus, start=start, first_s=s0, seconds=60,
                            metrics=metrics)
        now = start + dt.timedelta(seconds=s0 + 60)
        passes.append(an.run_pass(con, now))
    counts = con.execute("""SELECT (SELECT count(*) FROM samples), (SELECT count(*) FROM samples_1m),
        (SELECT count(*) FROM job_samples), (SELECT count(*) FROM probe_metrics),
        (SELECT count(*) FROM flags WHERE state = 'open')""").fetchone()
    by_kind = dict(con.execute("SELECT kind, count(*) FROM flags WHERE state = 'open' GROUP BY kind").fetchall())
    con.close()
    if tmp:
        tmp.cleanup()

    med = statistics.median(p.total_s for p in passes)
    out = {
        "benchmark": "analysis_speed",
        "data": "synthetic rows (node ids synthetic-*), real DuckDB timings",
        "nodes": args.nodes, "gpus_per_node": args.gpus, "gpu_metrics": list(metrics), "window_minutes": args.minutes,
        "gpu_sample_rows": counts[0], "samples_1m_rows": counts[1], "job_sample_rows": counts[2],
        "probe_metric_rows": counts[3], "generate_s": round(gen_s, 2),
        "first_pass_full_rollup": full.as_dict(),
        "passes": [p.as_dict() for p in passes],
        "median_pass_s": round(med, 3),
        "median_rollup_s": round(statistics.median(p.rollup_s for p in passes), 3),
        "median_flags_s": round(statistics.median(p.flags_s for p in passes), 3),
        "median_step_s": {k: round(statistics.median(p.step_s[k] for p in passes), 3) for k in passes[0].step_s},
        "full_over_incremental_ratio": round(full.total_s / med, 2) if med else None,
        "open_flags": counts[4], "open_flags_by_kind": by_kind,
        "target_s": 5.0, "meets_target": med <= 5.0,
    }
    if args.json:
        print(json.dumps(out, indent=2, default=str))
    else:
        print(f"{args.nodes} synthetic nodes x {args.gpus} GPUs, {counts[0]:,} sample rows: median pass "
              f"{med:.2f} s (rollup {out['median_rollup_s']:.2f} s, flags {out['median_flags_s']:.2f} s); "
              f"first full-rollup pass {full.total_s:.2f} s; target <= 5 s: {'met' if med <= 5 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
