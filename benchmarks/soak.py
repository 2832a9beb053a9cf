"""Soak: real agents and a collector for N minutes at ten times the default batch rate.

Every 10 s it samples the RSS and open file descriptors of each process; after a warm-up it fits a least
squares line per process and reports the slope per 10 minutes, the maximum fds, and at the end the
exact accounting of tests/fault_helpers.py (agents stopped cleanly, so their own counters give the samples
produced).

    python benchmarks/soak.py --json                 # 30 minutes
    python benchmarks/soak.py --json --minutes 3     # a quick check that it works

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
    args = ap.parse_args()
    why = can_unshare()
    if why:
        print(f"soak cannot run here: {why}", file=sys.stderr)
        return 2
    warmup_s = min(300.0, args.minutes * 60 / 3)
    work = Path(tempfile.mkdtemp(prefix="gpuagent-soak-"))
    c = Collector(work).start()
    agents = [Agent(work, f"soak-{i}", interval=0.1, batch_interval=DEFAULT_BATCH_INTERVAL_S / 10)
              for i in range(args.agents)]
    series: dict[str, list[tuple[float, float, int]]] = {}
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
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        for name, r in report["processes"].items():
            print(f"{name:10s} rss slope {r['rss_slope_mib_per_10min']:+.3f} MiB/10min  fds max {r['fds_max']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
