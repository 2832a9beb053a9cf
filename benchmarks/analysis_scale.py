#!/usr/bin/env python3
"""Analysis at scale (issue 27): one analysis pass at a collector's memory limit, per step: its time, the peak
of DuckDB's own accounted memory (``duckdb_memory()``) and of the process's RSS while it ran, and the rows its
statements scanned (DuckDB's profiler: stored tables apart from the pass's temp tables). The profiler counts a
rowid-range scan as the whole table (DuckDB 1.5.6), so the rollup's ``samples`` figure is the table's rows once
per chunk, not what it read: timed on 4.8 M rows, a 1,000-row range took 2 ms, 500,000 rows 4 ms, all 17 ms.

Two ways to get a database:
  * ``--sizes 1000,3000,10000`` (default): a SYNTHETIC fleet per size written straight into DuckDB with SQL
    range() (node ids ``synthetic-*``, 8 GPUs, ``--interval-s`` GPU and host samples; job samples, job steps
    and probe runs from sim/synthetic_rows.py, as analysis_speed.py writes them, and two full pair-wise
    net_pair sweeps of racks of 50 nodes an hour, as flag_accuracy.py's fabric sweeps), one window
    (``--minutes``, 60) each;
  * ``--db FILE``: a copy of an existing collector database (e.g. one ``flag_accuracy.py --db`` kept), analysed
    as of its newest sample.
Each pass runs in a fresh subprocess that opens the file the way the collector does (store.db.open_database
with ``--memory-limit``, default the collector's 512MB), so one size's memory does not carry into the next.
The JSON summary fits pass time and peak memory against nodes (least squares on log-log: the exponent, and
the slope per 1,000 nodes of a straight line). A synthetic fleet's pass is its first, so its rollup takes
the whole hour at once (``rollup_s``); a collector's steady passes roll up one minute, and ``steps_s`` is
the rest of the pass. Timings and memory are real; the fleets are synthetic.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# 4 GPU series per GPU and 8 host series per node: 40 series a node, the shape of flag_accuracy.py's sim fleet
# (24.2 M sample rows for 10,000 nodes over one hour at 60 s).
GPU_METRICS = ("gpu_util_percent", "gpu_sm_active_percent", "gpu_power_watts", "gpu_temperature_celsius")
HOST_METRICS = ("cpu_user_percent", "cpu_system_percent", "cpu_iowait_percent", "cpu_steal_percent",
                "memory_used_percent", "psi_cpu_some_avg10_percent", "psi_io_some_avg10_percent", "load1")


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def build(path: Path, nodes: int, minutes: int, interval_s: int) -> dict:
    """A SYNTHETIC fleet's window of rows at interval_s sampling: GPU_METRICS per GPU, HOST_METRICS per node."""
    import duckdb

    from gpuagent.collector.store import schema
    from gpuagent.sim import synthetic_rows as S

    con = duckdb.connect(str(path))
    schema.migrate(con)
    start = dt.datetime(2026, 1, 1, 0, 0)
    S.add_synthetic_fleet(con, nodes, 8, start)
    t0 = time.perf_counter()
    secs = minutes * 60
    for first in range(0, secs, 600):
        p = {"start": start, "first": first, "last": min(secs, first + 600), "step": interval_s, "nodes": nodes}
        for m in GPU_METRICS:
            con.execute(f"""INSERT INTO samples SELECT $start::TIMESTAMP + to_seconds(s), 'synthetic-' || lpad(n::VARCHAR, 5, '0'),
                    g::SMALLINT, '{m}', '', CASE WHEN n % 10 = 0 AND g = 7 THEN 0 ELSE 75 + 20 * sin(n + g + s / 600.0) END
                FROM range($first, $last, $step) a(s), range($nodes) b(n), range(8) c(g)""", p)
        for m in HOST_METRICS:
            con.execute(f"""INSERT INTO samples SELECT $start::TIMESTAMP + to_seconds(s), 'synthetic-' || lpad(n::VARCHAR, 5, '0'),
                    NULL, '{m}', '', 5 + 10 * random() FROM range($first, $last, $step) a(s), range($nodes) b(n)""", p)
        span = p["last"] - first
        S.fill_fleet_job_rows(con, nodes=nodes, gpus=8, start=start + dt.timedelta(seconds=first), seconds=span,
                              sample_step_s=max(10, interval_s))
        S.fill_fleet_probe_rows(con, nodes=nodes, gpus=8, start=start, first_s=first, seconds=span)
        S.fill_fleet_link_rows(con, nodes=nodes, start=start, first_s=first, seconds=span)
    rows = con.execute("SELECT count(*) FROM samples").fetchone()[0]
    con.execute("CHECKPOINT")
    con.close()
    return {"sample_rows": rows, "generate_s": round(time.perf_counter() - t0, 1)}


def _count_rows_read(con, into: dict[str, Any]) -> None:
    """Add the last statement's scanned rows (DuckDB's profile of it) to ``into``: stored tables' rows apart
    from the temp tables' (``temp`` in the scanned table's name)."""
    try:
        tree = json.loads(con.get_profiling_information(format="json"))
    except Exception:  # noqa: BLE001 - a statement without a profile (a SET, a PRAGMA) read nothing
        return
    todo = [tree]
    while todo:
        node = todo.pop()
        todo.extend(node.get("children") or [])
        if node.get("operator_type") == "TABLE_SCAN":
            table = str((node.get("extra_info") or {}).get("Table", ""))
            rows = int(node.get("operator_rows_scanned") or 0)
            if table.startswith('"temp".') or table.startswith("temp."):
                into["temp_rows"] += rows
            else:
                into["stored_rows"] += rows
                by_table, name = into["stored_by_table"], table.rsplit(".", 1)[-1].strip('"')
                by_table[name] = by_table.get(name, 0) + rows


def one_pass(path: str, memory_limit: str, piece_nodes: int | None, rows_read_on: bool = True) -> dict:
    """Runs in the child: one pass, sampling DuckDB's memory and RSS every 20 ms, per step."""
    from gpuagent.collector.analysis import analyzer as A
    from gpuagent.collector.analysis import sql_files
    from gpuagent.collector.store import db

    con = db.open_database(path, memory_limit, profile=rows_read_on)
    now = con.execute("SELECT max(ts) FROM samples").fetchone()[0] + dt.timedelta(seconds=1)
    nodes = con.execute("SELECT count(*) FROM nodes").fetchone()[0]
    cfg = A.AnalyzerConfig() if piece_nodes is None else A.AnalyzerConfig(piece_nodes=piece_nodes)
    an = A.Analyzer(cfg)
    current = ["rollup"]
    peaks: dict[str, dict[str, int]] = {}
    probe = con.cursor()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                mem, tmp = probe.execute("SELECT sum(memory_usage_bytes), sum(temporary_storage_bytes) "
                                         "FROM duckdb_memory()").fetchone()
            except Exception:  # noqa: BLE001 - a sample lost while the connection is busy closing
                mem, tmp = 0, 0
            p = peaks.setdefault(current[0], {"duckdb_bytes": 0, "spilled_bytes": 0, "rss_bytes": 0})
            p["duckdb_bytes"] = max(p["duckdb_bytes"], int(mem or 0))
            p["spilled_bytes"] = max(p["spilled_bytes"], int(tmp or 0))
            p["rss_bytes"] = max(p["rss_bytes"], _rss_bytes())
            time.sleep(0.02)

    run_step = an._run_step
    run_stmt = sql_files.run_statement
    rows_read: dict[str, dict[str, Any]] = {}

    def tracked(c, step, params):
        current[0] = step.sql_file
        return run_step(c, step, params)

    def profiled(c, stmt, params):
        res = run_stmt(c, stmt, params)
        _count_rows_read(c, rows_read.setdefault(current[0], {"stored_rows": 0, "temp_rows": 0,
                                                              "stored_by_table": {}}))
        return res

    # The benchmark's own hooks: which step the memory samples belong to, and the rows each statement scanned
    # (DuckDB's profiler, no output: per table scan, the rows it read; stored tables apart from the pass's temp
    # tables). The rollup's statements count under "rollup".
    an._run_step = tracked
    if rows_read_on:
        sql_files.run_statement = profiled
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    error = None
    try:
        res = an.run_pass(con, now)
        result = res.as_dict()
    except Exception as exc:  # noqa: BLE001 - a pass that fails is a result here
        error, result = str(exc).splitlines()[0], {}
    wall = time.perf_counter() - t0
    sql_files.run_statement = run_stmt
    stop.set()
    th.join()
    flags = dict(con.execute("SELECT kind, count(*) FROM flags WHERE state = 'open' GROUP BY kind").fetchall())
    # The rows in the window, table by table: what a step reading that table whole would scan.
    start = now - dt.timedelta(seconds=cfg.window_s)
    rows_in_window = {t: con.execute(f"SELECT count(*) FROM {t} WHERE {c} > ? AND {c} <= ?", [start, now]).fetchone()[0]
                      for t, c in (("samples_1m", "minute"), ("job_samples_1m", "minute"), ("job_steps", "ts"))}
    pstart = now - dt.timedelta(seconds=cfg.probe_window_s)
    rows_in_window["probe_metrics (probe window)"] = con.execute(
        "SELECT count(*) FROM probe_metrics WHERE started_at > ? AND started_at <= ?", [pstart, now]).fetchone()[0]
    rows_in_window["link_results (probe window)"] = con.execute(
        "SELECT count(*) FROM link_results WHERE started_at > ? AND started_at <= ?", [pstart, now]).fetchone()[0]
    con.close()
    return {"nodes": nodes, "memory_limit": memory_limit, "pass_s": round(wall, 2), "error": error,
            "rollup_s": result.get("rollup_s"), "rollup_rows_in": result.get("rollup_rows_in"),
            "steps_s": result.get("flags_s"), "failed_steps": result.get("failed_steps", {}),
            "step_s": result.get("step_s", {}), "rows_in_window": rows_in_window, "rows_read": rows_read,
            "peak_duckdb_bytes": max((p["duckdb_bytes"] for p in peaks.values()), default=0),
            "peak_rss_bytes": max((p["rss_bytes"] for p in peaks.values()), default=0),
            "step_peaks": peaks, "open_flags_by_kind": flags}


def _fit(xs: list[float], ys: list[float]) -> dict:
    if len(xs) < 2 or min(ys) <= 0:
        return {}
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    exp = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
    mxx, myy = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((a - mxx) * (b - myy) for a, b in zip(xs, ys)) / sum((a - mxx) ** 2 for a in xs)
    return {"exponent": round(exp, 3), "per_1000_nodes": round(slope * 1000, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,3000,10000", help="SYNTHETIC fleet sizes (nodes), comma-separated")
    ap.add_argument("--interval-s", type=int, default=60, help="sample interval of the synthetic fleet")
    ap.add_argument("--minutes", type=int, default=60)
    ap.add_argument("--db", help="analyse a copy of this collector database instead of synthetic fleets")
    ap.add_argument("--memory-limit", default="512MB", help="DuckDB memory limit, as the collector's --memory-limit")
    ap.add_argument("--piece-nodes", type=int, help="[analyzer] piece_nodes (default: the analyzer's)")
    ap.add_argument("--work", help="folder for the databases (default: a temporary one, removed afterwards)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-rows-read", action="store_true",
                    help="leave DuckDB's profiler off (to measure what counting the rows read costs)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_pass(args.child, args.memory_limit, args.piece_nodes, not args.no_rows_read)))
        return 0

    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="gpuagent-scale-")
    work = Path(args.work or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    targets: list[tuple[Path, dict]] = []
    if args.db:
        copy = work / "copy.duckdb"
        shutil.copy(args.db, copy)
        if os.path.exists(args.db + ".wal"):
            shutil.copy(args.db + ".wal", str(copy) + ".wal")
        targets.append((copy, {"source": args.db}))
    else:
        for n in (int(s) for s in args.sizes.split(",")):
            path = work / f"synthetic-{n}.duckdb"
            info = build(path, n, args.minutes, args.interval_s)
            targets.append((path, {"source": "SYNTHETIC", "interval_s": args.interval_s, **info}))
    for path, info in targets:
        cmd = [sys.executable, __file__, "--child", str(path), "--memory-limit", args.memory_limit]
        if args.piece_nodes:
            cmd += ["--piece-nodes", str(args.piece_nodes)]
        if args.no_rows_read:
            cmd += ["--no-rows-read"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            runs.append({**info, "error": (out.stderr.strip().splitlines() or ["no output"])[-1]})
        else:
            runs.append({**info, **json.loads(out.stdout.strip().splitlines()[-1])})
        if not args.db and not args.work:
            path.unlink()
        if not args.json:
            r = runs[-1]
            print(f"{r.get('nodes', '?')} nodes: pass {r.get('pass_s')} s (rollup {r.get('rollup_s')} s, steps "
                  f"{r.get('steps_s')} s), peak DuckDB "
                  f"{r.get('peak_duckdb_bytes', 0) / 2**20:.0f} MiB, peak RSS {r.get('peak_rss_bytes', 0) / 2**20:.0f} MiB, "
                  f"failed steps {list(r.get('failed_steps') or {}) or 'none'}{', error: ' + r['error'] if r.get('error') else ''}")
            for step, n in sorted((r.get("rows_read") or {}).items()):
                tables = ", ".join(f"{t} {v:,}" for t, v in sorted(n["stored_by_table"].items(), key=lambda kv: -kv[1]))
                print(f"  {step}: {(r.get('step_s') or {}).get(step, '-')} s, read {n['stored_rows']:,} stored rows "
                      f"({tables or 'none'}) and {n['temp_rows']:,} temp-table rows")
    ok = [r for r in runs if not r.get("error") and "nodes" in r]
    summary = {"benchmark": "analysis_scale", "memory_limit": args.memory_limit,
               "data": "SYNTHETIC fleets (or a copy of the database given); real DuckDB passes, real timings and memory",
               "runs": runs,
               "fit_pass_s": _fit([r["nodes"] for r in ok], [r["pass_s"] for r in ok]),
               "fit_steps_s": _fit([r["nodes"] for r in ok], [r["steps_s"] for r in ok]),
               "fit_peak_duckdb_bytes": _fit([r["nodes"] for r in ok], [r["peak_duckdb_bytes"] for r in ok]),
               "fit_peak_rss_bytes": _fit([r["nodes"] for r in ok], [r["peak_rss_bytes"] for r in ok]),
               "fit_stored_rows_read": _fit([r["nodes"] for r in ok],
                                            [sum(v["stored_rows"] for v in r["rows_read"].values()) for r in ok])
                                       if all(r.get("rows_read") for r in ok) else None,
               "all_passes_complete": all(not r.get("error") and not r.get("failed_steps") for r in runs)}
    if tmp:
        tmp.cleanup()
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    return 0 if summary["all_passes_complete"] else 1


if __name__ == "__main__":
    sys.exit(main())
