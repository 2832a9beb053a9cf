"""Jobs grouped as their scheduler groups them (``gpuagent-collector compare --by partition|account``).

Slurm names a job's partition and account (agent/schedulers/slurm.py; the ``jobs`` table's partition_name and account,
schema 15). Per group: how many jobs and nodes, the GPU-hours its jobs held, and how busy those GPUs were.
A job that spans nodes has one ``jobs`` row per node under the same job id, so it counts once.

GPU-hours held: per (node, job, GPU), the span from its first to its last job sample in the window (a job
sampled once holds 0 h). Mean GPU utilization: the job samples' per-process GPU utilization, each sample
weighted alike. Jobs no scheduler named fall in the group ``(none)``.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from gpuagent.collector.views.compare import (DUCKDB, CompareError, Window, has_table, open_source, parse_window,
                                              resolve_window)

GROUPS = {"partition": "partition_name", "account": "account"}
NONE = "(none)"
COLUMNS = ("jobs", "nodes", "gpu_hours", "mean_gpu_util_percent")


def jobs_by(src, by: str, window_s: float = 86400.0) -> list[dict[str, Any]]:
    """One row per partition (or account): group, jobs, nodes, gpu_hours, mean_gpu_util_percent."""
    if by not in GROUPS:
        raise CompareError(f"cannot group jobs by {by!r}: use one of {', '.join(GROUPS)}")
    if not has_table(src, "jobs") or not has_table(src, "job_samples"):
        return []
    w = resolve_window(src, window_s)
    # The window ends at the newest row of any kind, job samples included: a collector that only saw jobs
    # (no GPU series yet) still has them to group.
    newest_job = src.query("SELECT epoch(max(ts)) AS t FROM job_samples")[0]["t"]
    if newest_job is not None and (w is None or float(newest_job) >= w.end):
        w = Window(float(newest_job) - window_s, float(newest_job) + 1e-6, window_s, w.dialect if w else DUCKDB)
    if w is None:
        return []
    col = GROUPS[by]
    return src.query(f"""
        WITH held AS (
            SELECT node_id, job_id, gpu, epoch(max(ts) - min(ts)) AS held_s, sum(gpu_util_percent) AS util_sum,
                   count(*) AS n
            FROM job_samples
            WHERE gpu IS NOT NULL AND gpu >= 0 AND ts >= {w.start_sql} AND ts <= {w.end_sql}
            GROUP BY ALL
        )
        SELECT coalesce(j.{col}, '{NONE}') AS "group", count(DISTINCT j.job_id) AS jobs,
               count(DISTINCT j.node_id) AS nodes, coalesce(sum(h.held_s), 0) / 3600.0 AS gpu_hours,
               sum(h.util_sum) / nullif(sum(h.n), 0) AS mean_gpu_util_percent
        FROM jobs j LEFT JOIN held h USING (node_id, job_id)
        WHERE j.last_seen >= {w.start_sql} AND j.first_seen <= {w.end_sql}
        GROUP BY ALL ORDER BY gpu_hours DESC, "group"
    """)


def format_rows(rows: list[dict[str, Any]], by: str, fmt: str) -> str:
    if fmt == "json":
        return json.dumps({"by": by, "rows": rows}, indent=1, default=str)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow([by, *COLUMNS])
        for r in rows:
            w.writerow([r["group"], *(r[c] for c in COLUMNS)])
        return buf.getvalue().rstrip("\n")
    if not rows:
        return f"no jobs in the window (none has a {by} unless a scheduler named it: docs/SLURM.md)"
    table = [[by, "jobs", "nodes", "GPU-hours", "mean GPU util"]]
    for r in rows:
        util = r["mean_gpu_util_percent"]
        table.append([str(r["group"]), str(r["jobs"]), str(r["nodes"]), f"{r['gpu_hours']:.2f}",
                      "-" if util is None else f"{util:.0f} %"])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(wd) for c, wd in zip(row, widths)).rstrip() for row in table)


def run_jobs_by(db: str | None, target: str | None, by: str, window: str = "24h", fmt: str = "table",
                token: str | None = None, tls_ca: str | None = None, client_cert: str | None = None,
                client_key: str | None = None) -> str:
    """The library call behind ``compare --by partition|account``: returns the formatted text."""
    seconds = parse_window(window)
    src = open_source(db, target, token, tls_ca, client_cert, client_key)
    try:
        return format_rows(jobs_by(src, by, seconds), by, fmt)
    finally:
        src.close()
