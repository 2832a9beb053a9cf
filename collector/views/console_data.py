"""What the live console (views/console.py) shows, read from the collector's database.

Every read goes through the same bounded, read-only query guard as the ``sql`` command (views/sqlguard.py:
one read statement, a read-only transaction, a row cap and a time limit) on a reader cursor of its own, never
on the writer. Pages read the per-minute rollups (samples_1m, job_samples_1m), the flags, findings, jobs and
actions tables, and the latest-value view; none reads every raw sample. Tables are paged (PAGE_ROWS).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from gpuagent.collector.views.dialect import DUCKDB
from gpuagent.collector.views.sqlguard import run_readonly

# Time bounds are TIMESTAMP literals (to_timestamp(s)::TIMESTAMP, folded once): a bare to_timestamp() is a
# TIMESTAMPTZ, which makes DuckDB cast the TIMESTAMP column on every row and skip no row group.
ts = DUCKDB.ts

PAGE_ROWS = 50
MAX_ROWS = 20_000          # the heatmap of a 10,000-node fleet is one row per node
QUERY_TIMEOUT_S = 10.0
SEVERITIES = ("critical", "warning", "info")
# the metrics the fleet heatmap offers (their unit in the name, docs/METRICS.md)
HEATMAP_METRICS = ("gpu_util_percent", "gpu_mem_util_percent", "gpu_power_watts", "gpu_temperature_celsius",
                   "cpu_user_percent", "cpu_steal_percent")


def lit(text: Any) -> str:
    """A SQL string literal (the guard takes no bind parameters)."""
    return "'" + str(text).replace("'", "''") + "'"


class Reader:
    """Rows as dicts through the query guard; ``queries`` counts what a page cost."""

    def __init__(self, cursor_factory: Callable[[], Any], timeout_s: float = QUERY_TIMEOUT_S):
        self._cursor = cursor_factory
        self.timeout_s = timeout_s
        self.queries = 0

    def query(self, sql: str, max_rows: int = MAX_ROWS) -> list[dict[str, Any]]:
        self.queries += 1
        res = run_readonly(self._cursor(), sql, max_rows, self.timeout_s)
        return [dict(zip(res.columns, r)) for r in res.rows]

    def one(self, sql: str) -> dict[str, Any] | None:
        rows = self.query(sql, 1)
        return rows[0] if rows else None


@dataclass(frozen=True)
class Page:
    """A page of rows and where it is in the whole."""
    rows: list[dict[str, Any]]
    page: int
    total: int

    @property
    def pages(self) -> int:
        return max(1, math.ceil(self.total / PAGE_ROWS))


def synthetic_nodes(r: Reader) -> int:
    row = r.one("SELECT count(*) FILTER (WHERE synthetic) AS n FROM nodes")
    return int(row["n"]) if row else 0


def newest(r: Reader) -> float | None:
    """The newest rollup minute (epoch s): the console's "now", so an old database still shows its last hour."""
    row = r.one("SELECT epoch(max(minute)) AS t FROM samples_1m")
    return float(row["t"]) if row and row["t"] is not None else None


# ------------------------------------------------------------------------------------------ fleet

# The pools as `compare` counts them (compare_sql.UTIL_TAIL: a GPU-minute is a minute with a utilization sample,
# its effective share the minute's average), but from the 1-minute rollups instead of every raw sample, so the
# fleet page of 10,000 nodes reads 1/60 of the rows: the same figures up to the rollup's lag (one pass).
SQL_POOLS = """
WITH node_pool AS (SELECT node_id, coalesce(pool, '(no pool)') AS pool, gpu_count, price_per_gpu_hour,
                          virtualized FROM nodes),
util AS (
    SELECT s.node_id, count(*) AS gpu_minutes, sum(s.avg) AS util_sum,
           count(*) FILTER (WHERE s.avg < 10) AS idle_minutes
    FROM samples_1m s
    WHERE s.metric = 'gpu_util_percent' AND s.gpu IS NOT NULL AND s.minute > {start}
      AND s.minute <= {end}
    GROUP BY s.node_id
), flags AS (SELECT node_id, count(*) AS open_flags FROM flags WHERE state = 'open' GROUP BY node_id)
SELECT n.pool, count(*) AS nodes, count(*) FILTER (WHERE n.virtualized) AS virtualized_nodes,
       sum(coalesce(n.gpu_count, 0)) AS gpus, median(n.price_per_gpu_hour) AS price_per_gpu_hour,
       coalesce(sum(u.gpu_minutes), 0) / 60e0 AS gpu_hours,
       coalesce(sum(u.util_sum), 0) / 100e0 / 60e0 AS effective_gpu_hours,
       sum(u.util_sum) / nullif(sum(u.gpu_minutes), 0) AS effective_util_percent,
       100e0 * sum(u.idle_minutes) / nullif(sum(u.gpu_minutes), 0) AS idle_minutes_percent,
       coalesce(sum(f.open_flags), 0) AS open_flags
FROM node_pool n LEFT JOIN util u ON u.node_id = n.node_id LEFT JOIN flags f ON f.node_id = n.node_id
GROUP BY n.pool ORDER BY n.pool
"""
# The pools' window: the newest hour by default, whose cost does not grow with retention (the rollups are
# written in minute order, so DuckDB's zone maps skip older row groups); a day on request.
FLEET_WINDOWS_S = {"1h": 3600.0, "6h": 6 * 3600.0, "24h": 86400.0}
FLEET_WINDOW_DEFAULT = "1h"
HEATMAP_S = 600          # the heatmap is each node's average over the newest 10 minutes of rollups


def fleet(r: Reader, metric: str, window_s: float = FLEET_WINDOWS_S[FLEET_WINDOW_DEFAULT]) -> dict[str, Any]:
    end = newest(r)
    pools: list[dict[str, Any]] = []
    cells: list[dict[str, Any]] = []
    if end is not None:
        pools = r.query(SQL_POOLS.format(start=ts(end - window_s), end=ts(end)))
        cells = r.query(f"""
            WITH v AS (SELECT node_id, avg(avg) AS value FROM samples_1m
                       WHERE metric = {lit(metric)} AND minute > {ts(end - HEATMAP_S)} AND avg IS NOT NULL
                       GROUP BY node_id)
            SELECT n.node_id, n.hostname, coalesce(n.pool, '(no pool)') AS pool, v.value
            FROM v JOIN nodes n ON n.node_id = v.node_id ORDER BY pool, n.hostname""")
    for p in pools:
        p["lost_gpu_hours"] = p["gpu_hours"] - p["effective_gpu_hours"]
    severities = {row["severity"]: int(row["n"]) for row in r.query(
        "SELECT severity, count(*) AS n FROM v_open_findings GROUP BY severity")}
    kinds = r.query("SELECT kind, severity, count(*) AS n FROM v_open_findings GROUP BY ALL ORDER BY n DESC, kind")
    return {"pools": pools, "severities": severities, "kinds": kinds, "cells": cells, "metric": metric,
            "nodes": sum(int(p["nodes"]) for p in pools), "end": end, "window_s": window_s}


# ------------------------------------------------------------------------------------------ findings

def findings(r: Reader, kind: str = "", severity: str = "", pool: str = "", page: int = 1,
             state: str = "open") -> Page:
    where = [f"f.state = {lit(state)}"]
    if kind:
        where.append(f"f.kind = {lit(kind)}")
    if severity:
        where.append(f"f.severity = {lit(severity)}")
    if pool:
        where.append(f"coalesce(f.pool, n.pool) = {lit(pool)}")
    cond = " AND ".join(where)
    total = r.one(f"SELECT count(*) AS n FROM findings f LEFT JOIN nodes n ON n.node_id = f.node_id WHERE {cond}")
    rows = r.query(f"""
        SELECT f.finding_id, f.kind, f.severity, f.scope, f.node_id, n.hostname, coalesce(f.pool, n.pool) AS pool,
               epoch(f.first_seen) AS first_seen, epoch(f.last_seen) AS last_seen, f.flags, f.gpus, f.sentence,
               (SELECT list(DISTINCT j.job_id ORDER BY j.job_id) FROM jobs j
                WHERE j.node_id = f.node_id AND j.first_seen <= f.last_seen
                  AND coalesce(j.ended_at, j.last_seen) >= f.first_seen) AS jobs
        FROM findings f LEFT JOIN nodes n ON n.node_id = f.node_id
        WHERE {cond}
        ORDER BY CASE f.severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END, f.last_seen DESC,
                 f.finding_id
        LIMIT {PAGE_ROWS} OFFSET {(max(1, page) - 1) * PAGE_ROWS}""", PAGE_ROWS)
    for row in rows:
        row["jobs"] = [j for j in (row["jobs"] or [])][:5]
    return Page(rows, max(1, page), int(total["n"]) if total else 0)


def finding_kinds(r: Reader) -> list[str]:
    return [row["kind"] for row in r.query("SELECT DISTINCT kind FROM findings ORDER BY kind")]


def pools(r: Reader) -> list[str]:
    return [row["pool"] for row in r.query("SELECT DISTINCT coalesce(pool, '(no pool)') AS pool FROM nodes ORDER BY 1")]


# ------------------------------------------------------------------------------------------ pool

def pool(r: Reader, name: str, page: int = 1) -> dict[str, Any]:
    cond = "pool IS NULL" if name == "(no pool)" else f"pool = {lit(name)}"
    total = r.one(f"SELECT count(*) AS n FROM nodes WHERE {cond}")
    end = newest(r) or 0.0
    rows = r.query(f"""
        WITH page AS (SELECT node_id, hostname, gpu_count, gpu_model, virtualized, provider, region,
                             epoch(last_seen) AS last_seen
                      FROM nodes WHERE {cond} ORDER BY hostname LIMIT {PAGE_ROWS}
                      OFFSET {(max(1, page) - 1) * PAGE_ROWS})
        SELECT p.*, (SELECT count(*) FROM flags f WHERE f.node_id = p.node_id AND f.state = 'open') AS open_flags,
               (SELECT avg(s.avg) FROM samples_1m s WHERE s.node_id = p.node_id AND s.metric = 'gpu_util_percent'
                  AND s.minute > {ts(end - 3600)}) AS gpu_util_percent
        FROM page p ORDER BY p.hostname""", PAGE_ROWS)
    return {"name": name, "nodes": Page(rows, max(1, page), int(total["n"]) if total else 0)}


# ------------------------------------------------------------------------------------------ node

def node(r: Reader, node_id: str, start: float | None, end: float | None) -> dict[str, Any] | None:
    info = r.one(f"SELECT * EXCLUDE (labels, fingerprint), epoch(last_seen) AS last_seen_s FROM nodes "
                 f"WHERE node_id = {lit(node_id)}")
    if info is None:
        return None
    end = end if end is not None else (newest(r) or 0.0)
    start = start if start is not None else end - 6 * 3600
    span = f"minute > {ts(start)} AND minute <= {ts(end)}"
    gpus = r.query(f"""
        SELECT g.gpu, g.name, g.uuid, g.pci_bus_id, g.memory_total_bytes, g.pcie_gen_current, g.pcie_gen_max,
               g.pcie_width_current, g.pcie_width_max,
               (SELECT avg(avg) FROM samples_1m s WHERE s.node_id = g.node_id AND s.gpu = g.gpu
                  AND s.metric = 'gpu_util_percent' AND s.{span}) AS gpu_util_percent
        FROM gpus g WHERE g.node_id = {lit(node_id)} ORDER BY g.gpu""")
    series: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for row in r.query(f"""
            SELECT metric, coalesce('GPU ' || gpu::VARCHAR, 'host') AS who, epoch(minute) AS t, avg
            FROM samples_1m WHERE node_id = {lit(node_id)} AND {span}
              AND metric IN ('gpu_util_percent', 'cpu_user_percent', 'cpu_steal_percent', 'gpu_power_watts',
                             'psi_cpu_some_avg10_percent')
              AND labels = '' ORDER BY metric, who, t"""):
        series.setdefault(row["metric"], {}).setdefault(row["who"], []).append((row["t"], row["avg"]))
    flags = r.query(f"""
        SELECT flag_id, kind, component, gpu, severity, state, epoch(first_seen) AS first_seen,
               epoch(last_seen) AS last_seen, value, unit, baseline, sentence, evidence
        FROM flags WHERE node_id = {lit(node_id)}
          AND (state = 'open' OR last_seen > {ts(start)})
        ORDER BY state DESC, CASE severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END,
                 last_seen DESC LIMIT 200""", 200)
    for f in flags:
        try:
            f["evidence"] = json.dumps(json.loads(f["evidence"] or "null"), indent=1, sort_keys=True)
        except ValueError:
            pass
    actions = r.query(f"""
        SELECT epoch(ts) AS ts, action, mode, kind, severity, outcome, reason, detail FROM actions
        WHERE node_id = {lit(node_id)} ORDER BY ts DESC LIMIT 50""", 50)
    # link_matrix_latest's rule (the newest result per pair, probe and params) on this node's rows only: the
    # view's window runs over every link result before a filter, 20 times the rows at 10,000 nodes
    links = r.query(f"""
        SELECT CASE WHEN node_a = {lit(node_id)} THEN node_b ELSE node_a END AS peer, probe,
               send_gbits_per_s, recv_gbits_per_s, rtt_p50_us, status, epoch(ended_at) AS ended_at
        FROM (SELECT *, row_number() OVER (PARTITION BY least(node_a, node_b), greatest(node_a, node_b), probe,
                                                        params_key
                                           ORDER BY started_at DESC, (reported_by = node_a) DESC,
                                                    (reported_by = 'collector')) AS rn
              FROM link_results WHERE node_a = {lit(node_id)} OR node_b = {lit(node_id)})
        WHERE rn = 1 ORDER BY send_gbits_per_s NULLS LAST LIMIT 100""", 100)
    probes = r.query(f"""
        SELECT probe, metric, median(value) AS value, count(*) AS runs, epoch(max(started_at)) AS last
        FROM probe_metrics WHERE node_id = {lit(node_id)} AND started_at > {ts(start - 86400)}
        GROUP BY ALL ORDER BY probe, metric LIMIT 100""", 100)
    jobs = r.query(f"""
        SELECT job_id, job_name, epoch(first_seen) AS first_seen, epoch(coalesce(ended_at, last_seen)) AS last_seen,
               avg_gpu_util_percent FROM jobs WHERE node_id = {lit(node_id)}
          AND coalesce(ended_at, last_seen) > {ts(start)} ORDER BY first_seen DESC LIMIT 50""", 50)
    return {"info": info, "gpus": gpus, "series": series, "flags": flags, "actions": actions, "links": links,
            "probes": probes, "jobs": jobs, "start": start, "end": end}


# ------------------------------------------------------------------------------------------ job

def job(r: Reader, job_id: str) -> dict[str, Any] | None:
    nodes = r.query(f"""
        SELECT j.node_id, n.hostname, coalesce(n.pool, '(no pool)') AS pool, j.job_name, j.source, j.user_name,
               j.partition_name, j.account, j.pod_namespace, j.pod_name, epoch(j.first_seen) AS first_seen,
               epoch(coalesce(j.ended_at, j.last_seen)) AS last_seen, j.avg_gpu_util_percent, j.world_size
        FROM jobs j LEFT JOIN nodes n ON n.node_id = j.node_id
        WHERE j.job_id = {lit(job_id)} ORDER BY n.hostname""", 1000)
    if not nodes:
        return None
    start = min(n["first_seen"] for n in nodes)
    end = max(n["last_seen"] for n in nodes)
    span = f"{ts(start - 60)} AND {ts(end + 60)}"
    gpus = r.query(f"""
        SELECT node_id, gpu, avg(gpu_util_avg) AS gpu_util_percent, sum(n) AS samples
        FROM job_samples_1m WHERE job_id = {lit(job_id)} AND gpu IS NOT NULL AND gpu >= 0
        GROUP BY ALL ORDER BY node_id, gpu""", 5000)
    steps = r.query(f"""
        SELECT epoch(ts) AS t, median(step_time_p50_s) AS step_time_s, sum(samples_per_s) AS samples_per_s,
               sum(tokens_per_s) AS tokens_per_s
        FROM job_steps WHERE job_id = {lit(job_id)} AND ts BETWEEN {span}
        GROUP BY ALL ORDER BY t""", 5000)
    flags = r.query(f"""
        SELECT f.flag_id, f.node_id, n.hostname, f.gpu, f.kind, f.component, f.severity, f.state,
               epoch(f.first_seen) AS first_seen, f.sentence
        FROM flags f JOIN (SELECT DISTINCT node_id FROM jobs WHERE job_id = {lit(job_id)}) j ON j.node_id = f.node_id
        LEFT JOIN nodes n ON n.node_id = f.node_id
        WHERE f.first_seen <= {ts(end)} AND coalesce(f.closed_at, f.last_seen) >= {ts(start)}
          AND (f.gpu IS NULL OR EXISTS (SELECT 1 FROM job_samples_1m s WHERE s.job_id = {lit(job_id)}
                                        AND s.node_id = f.node_id AND s.gpu = f.gpu)
               OR json_extract_string(f.evidence, '$.job') = {lit(job_id)})
        ORDER BY f.first_seen LIMIT 200""", 200)
    return {"job_id": job_id, "nodes": nodes, "gpus": gpus, "steps": steps, "flags": flags, "start": start,
            "end": end}
