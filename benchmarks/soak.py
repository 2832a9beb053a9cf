"""Soak: real agents and a collector for N minutes at ten times the default batch rate.

Every 10 s it samples the RSS and open file descriptors of each process; after a warm-up it fits a least
squares line per process and reports the slope per 10 minutes, the maximum fds, and at the end the
exact accounting of tests/fault_helpers.py (agents stopped cleanly, so their own counters give the samples
produced).

    python benchmarks/soak.py --json                 # 30 minutes
    python benchmarks/soak.py --json --minutes 3     # a quick check that it works

The collector's RSS holds DuckDB's memory (``duckdb_memory()``): appended rows not yet checkpointed
(IN_MEMORY_TABLE, a sawtooth that falls at each automatic checkpoint) and the blocks it has read or
written (BASE_TABLE), a cache that grows with the database until ``--memory-limit`` and is evicted beyond
it. The report gives DuckDB's figures per tag and the RSS outside them, so a leak shows apart from the
cache; ``--memory-limit`` (passed to ``serve``) lets the cache reach its bound within the warm-up.

Agents sample this host (and NVML when a driver is present; none here means host metrics only). Needs
root: each agent gets its own hostname and machine-id through unshare (see tests/fault_helpers.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fault_helpers import Agent, Collector, account, can_unshare  # noqa: E402

DEFAULT_BATCH_INTERVAL_S = 5.0


def slope_per_10min(points: list[tuple[float, float]]) -> float:
    """Least squares slope of (seconds, value) points, in value units per 10 minutes."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    return 0.0 if den == 0 else sum((t - mx) * (v - my) for t, v in points) / den * 600.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--agents", type=int, default=3)
    ap.add_argument("--every", type=float, default=10.0, help="seconds between RSS/fd samples")
    ap.add_argument("--json", action="store_true", help="print one JSON document at the end")
    ap.add_argument("--memory-limit", default=None, help="the collector's DuckDB memory_limit (serve's default if unset)")
    ap.add_argument("--warmup-minutes", type=float, default=None,
                    help="left out of the slopes (default: a third of the run, at most 10)")
    args = ap.parse_args()
    why = can_unshare()
    if why:
        print(f"soak cannot run here: {why}", file=sys.stderr)
        return 2
    warmup_s = args.warmup_minutes * 60 if args.warmup_minutes is not None else min(600.0, args.minutes * 60 / 3)
    work = Path(tempfile.mkdtemp(prefix="gpuagent-soak-"))
    c = Collector(work, extra_args=("--memory-limit", args.memory_limit) if args.memory_limit else ()).start()
    agents = [Agent(work, f"soak-{i}", interval=0.1, batch_interval=DEFAULT_BATCH_INTERVAL_S / 10)
              for i in range(args.agents)]
    series: dict[str, list[tuple[float, float, int]]] = {}
    duckdb_mib: list[tuple[float, float, float]] = []      # (t, DuckDB-accounted MiB, collector RSS minus it)
    duckdb_tags: dict[str, list[tuple[float, float]]] = {}   # tag -> (t, MiB)
    try:
        for a in agents:
            a.start(c.address)
        for a in agents:
            a.wait_running()
        procs = {"collector": psutil.Process(c.proc.pid), **{a.name: psutil.Process(a.proc.pid) for a in agents}}
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        while True:
            now = time.monotonic()
            for name, p in procs.items():
                series.setdefault(name, []).append((now - t0, p.memory_info().rss / 2**20, p.num_fds()))
            # DuckDB's own accounting (buffer pool, tables, temp): RSS minus it is what a leak would show in.
            tags = {tag: b / 2**20 for tag, b in c.sql("SELECT tag, memory_usage_bytes FROM duckdb_memory()")}
            for tag, mib in tags.items():
                duckdb_tags.setdefault(tag, []).append((now - t0, mib))
            duck = sum(tags.values())
            duckdb_mib.append((now - t0, duck, series["collector"][-1][1] - duck))
            if now >= end:
                break
            time.sleep(min(args.every, max(0.0, end - now)))
        produced = {}
        for a in agents:
            produced[a.name] = a.stop()["counters"]["samples"]
        with contextlib.redirect_stdout(sys.stderr):      # stdout carries only the report
            figs = account("soak", agents, c, produced=produced)
    finally:
        for a in agents:
            a.kill()
        c.stop()
    report = {"minutes": args.minutes, "agents": args.agents, "warmup_s": warmup_s,
              "batch_interval_s": DEFAULT_BATCH_INTERVAL_S / 10, "sample_every_s": args.every, "processes": {},
              "accounting": figs}
    for name, pts in series.items():
        post = [(t, rss, fds) for t, rss, fds in pts if t >= warmup_s]
        report["processes"][name] = {
            "rss_mib_first": round(pts[0][1], 1), "rss_mib_last": round(pts[-1][1], 1),
            "rss_slope_mib_per_10min": round(slope_per_10min([(t, r) for t, r, _ in post]), 3),
            "fds_first_after_warmup": post[0][2] if post else None, "fds_max": max(f for _, _, f in pts),
            "fds_slope_per_10min": round(slope_per_10min([(t, f) for t, _, f in post]), 3),
            "samples_after_warmup": len(post)}
    post = [x for x in duckdb_mib if x[0] >= warmup_s]
    report["processes"]["collector"].update({
        "duckdb_mib_first": round(duckdb_mib[0][1], 1), "duckdb_mib_last": round(duckdb_mib[-1][1], 1),
        "duckdb_slope_mib_per_10min": round(slope_per_10min([(t, d) for t, d, _ in post]), 3),
        "rss_outside_duckdb_slope_mib_per_10min": round(slope_per_10min([(t, o) for t, _, o in post]), 3),
        "rss_outside_duckdb_mib_first_after_warmup": round(post[0][2], 1) if post else None,
        "rss_outside_duckdb_mib_last": round(duckdb_mib[-1][2], 1),
        "memory_limit": args.memory_limit or "serve's default",
        "duckdb_by_tag": {tag: {"mib_last": round(pts[-1][1], 1), "mib_max": round(max(v for _, v in pts), 1),
                                "slope_mib_per_10min": round(slope_per_10min([p for p in pts if p[0] >= warmup_s]), 3)}
                          for tag, pts in sorted(duckdb_tags.items()) if max(v for _, v in pts) > 0}})
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        for name, r in report["processes"].items():
            print(f"{name:10s} rss slope {r['rss_slope_mib_per_10min']:+.3f} MiB/10min  fds max {r['fds_max']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
