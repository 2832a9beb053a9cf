"""What the fleet report reads: its queries over a source (a DuckDB file, a live collector or the lake).

Each function asks ``src`` for one part of the report (findings, flags, hardware health, actions, per-node
distributions, noisy series, the utilization and link heatmaps) and returns plain rows; report.py turns
them into HTML and plots. Every query bounds its rows in SQL, so a live collector's row cap is never hit.
"""

from __future__ import annotations

import math
from typing import Any

from gpuagent.collector.views.compare import Window, _lit, has_table
from gpuagent.collector.views.compare_sql import HEADLINE, NO_POOL, NOT_FABRIC_GROUP
from gpuagent.common import hardware_faults

MAX_FLAGS = 500
MAX_HEATMAP_ROWS = 60
MAX_LINK_NODES = 48
MAX_NOISY_SERIES = 6

# noisy_neighbor_variance component -> (probe, metric) per docs/FLAGS.md; "step_time" reads job_steps.
NOISY_SOURCES = {
    "collective_busbw": ("collective", "busbw_gbps"), "h2d": ("pcie", "h2d_gbps"), "d2h": ("pcie", "d2h_gbps"),
    "gpu_compute": ("gpu_compute", "bf16_tflops"), "storage_seq_read": ("storage", "seq_read_gbps"),
    "storage_rand_read": ("storage", "rand_read_iops"),
    "storage_rand_read_p99": ("storage", "rand_read_p99_latency_us"),
    "host_syscall": ("host", "syscall_ns"), "host_pipe": ("host", "pipe_roundtrip_us"),
    "host_memcpy": ("host", "memcpy_gbps"), "step_time": ("job_steps", "step_time_p50_s"),
}

SEVERITY_ORDER = "CASE f.severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END"


def _findings(src) -> list[dict[str, Any]]:
    """Open findings, worst first (one per cause: what the report leads with)."""
    if not has_table(src, "findings"):
        return []
    return src.query("SELECT finding_id, scope, kind, coalesce(node_id, '') AS node_id, coalesce(pool, '') AS pool, "
                     "severity, flags, nodes, pool_nodes, sentence FROM v_open_findings LIMIT 500")


def _flags(src) -> tuple[list[dict[str, Any]], int]:
    if not has_table(src, "flags"):
        return [], 0
    total = src.query("SELECT count(*) AS n FROM flags WHERE state = 'open'")[0]["n"]
    rows = src.query(f"""
        SELECT f.flag_id, f.node_id, n.hostname, coalesce(n.pool, {_lit(NO_POOL)}) AS pool, f.gpu, f.kind,
               f.component, f.severity, epoch(f.first_seen) AS first_seen, epoch(f.last_seen) AS last_seen,
               f.value, f.unit, f.baseline, f.baseline_source, f.sentence
        FROM flags f LEFT JOIN nodes n USING (node_id)
        WHERE f.state = 'open'
        ORDER BY {SEVERITY_ORDER}, f.kind, f.node_id, f.gpu NULLS FIRST, f.component
        LIMIT {MAX_FLAGS}""")
    return rows, int(total)


def _health(src, w: Window | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Open hardware_fault flags (one per node fault, worst first) and the application XIDs of the window,
    which the rules attribute to the job on the GPU rather than to the hardware (common/hardware_faults.toml)."""
    if not has_table(src, "flags"):
        return [], []
    faults = src.query(f"""
        SELECT f.node_id, coalesce(n.hostname, f.node_id) AS hostname, coalesce(n.pool, {_lit(NO_POOL)}) AS pool,
               f.gpu, f.component, f.severity, epoch(f.first_seen) AS first_seen, f.baseline_source AS source,
               f.sentence
        FROM flags f LEFT JOIN nodes n USING (node_id)
        WHERE f.state = 'open' AND f.kind = 'hardware_fault'
        ORDER BY {SEVERITY_ORDER}, f.node_id, f.gpu NULLS FIRST, f.component
        LIMIT {MAX_FLAGS}""")
    app = sorted(r["xid"] for r in hardware_faults.xid_rows() if r["kind"] == "xid" and r["application"])
    apps: list[dict[str, Any]] = []
    if w is not None and app and has_table(src, "events"):
        apps = src.query(f"""
            SELECT coalesce(n.hostname, e.node_id) AS hostname, e.gpu, CAST(e.value AS INTEGER) AS xid, count(*) AS n,
                   epoch(max(e.ts)) AS last_seen
            FROM events e LEFT JOIN nodes n USING (node_id)
            WHERE e.kind = 'xid' AND CAST(e.value AS INTEGER) IN ({", ".join(str(int(x)) for x in app)})
              AND e.ts >= {w.start_sql} AND e.ts <= {w.end_sql}
            GROUP BY ALL ORDER BY n DESC, hostname, e.gpu LIMIT 200""")
    return faults, apps


def _actions(src) -> list[dict[str, Any]]:
    """The newest rows of ``actions`` (drains, resumes and alerts of [actions]; docs/ACTIONS.md)."""
    if not has_table(src, "actions"):
        return []
    return src.query("""
        SELECT epoch(ts) AS ts, coalesce(slurm_node, node_id, pool, '') AS target, action, mode, outcome, kind,
               severity, coalesce(detail, reason, '') AS why, coalesce(rule, '') AS rule, coalesce(actor, '') AS actor
        FROM actions ORDER BY ts DESC, action_id DESC LIMIT 100""")


def _distributions(src, w: Window) -> dict[tuple[str, str], list[tuple[str, list[tuple[str, float]]]]]:
    """Per headline metric: [(pool, [(hostname, per-node median), ...]), ...]. One query per metric keeps each
    answer at one row per node (a live collector caps rows per query)."""
    out: dict[tuple[str, str], list[tuple[str, list[tuple[str, float]]]]] = {}
    for probe, metric, _ in HEADLINE:
        rows = src.query(f"""
            SELECT coalesce(n.pool, {_lit(NO_POOL)}) AS pool, n.hostname, median(m.value) AS value
            FROM probe_metrics m JOIN nodes n USING (node_id)
            WHERE m.started_at >= {w.start_sql} AND m.started_at < {w.end_sql}
              AND m.probe = {_lit(probe)} AND m.metric = {_lit(metric)} AND isfinite(m.value)
              AND {NOT_FABRIC_GROUP}
            GROUP BY ALL ORDER BY pool, n.hostname""")
        groups: dict[str, list[tuple[str, float]]] = {}
        for r in rows:
            groups.setdefault(r["pool"], []).append((str(r["hostname"]), float(r["value"])))
        out[(probe, metric)] = sorted(groups.items())
    return out


def _noisy(src, w: Window, flags: list[dict[str, Any]]) -> tuple[str, list[tuple[str, list[tuple[float, float]]]]]:
    """Noisy nodes over time, each value as % of the fleet median of the same metric and GPU model."""
    picks = [f for f in flags if f["kind"] == "noisy_neighbor_variance" and f["component"] in NOISY_SOURCES]
    picks.sort(key=lambda f: -(f["value"] or 0))
    # The worst flag of each node first (so several nodes show), then more flags of the same nodes.
    chosen, seen, nodes_seen = [], set(), set()
    for first_pass in (True, False):
        for f in picks:
            key = (f["node_id"], f["component"], f["gpu"])
            if key in seen or (first_pass and f["node_id"] in nodes_seen) or len(chosen) == MAX_NOISY_SERIES:
                continue
            seen.add(key)
            nodes_seen.add(f["node_id"])
            chosen.append((f["node_id"], f["hostname"] or f["node_id"], f["component"], f["gpu"]))
    title = "Nodes with open noisy-neighbor flags: flagged metric over time (% of the fleet median)"
    if not chosen:
        rows = src.query(f"""
            SELECT s.node_id, n.hostname, stddev_samp(s.step_time_p50_s) / avg(s.step_time_p50_s) AS cv
            FROM job_steps s JOIN nodes n USING (node_id)
            WHERE s.ts >= {w.start_sql} AND s.ts < {w.end_sql}
            GROUP BY ALL HAVING count(*) >= 5 ORDER BY cv DESC NULLS LAST LIMIT {MAX_NOISY_SERIES}""")
        chosen = [(r["node_id"], r["hostname"], "step_time", None) for r in rows]
        title = ("No noisy-neighbor flags open: the nodes with the most variable step time "
                 "(% of the fleet median)")
    series = []
    for node_id, host, comp, gpu in chosen:
        probe, metric = NOISY_SOURCES[comp]
        if probe == "job_steps":
            sql = f"""
                WITH ref AS (
                    SELECT median(s.step_time_p50_s) AS ref FROM job_steps s
                    WHERE s.ts >= {w.start_sql} AND s.ts < {w.end_sql}
                      AND s.job_name IN (SELECT job_name FROM job_steps WHERE node_id = {_lit(node_id)}))
                SELECT epoch(s.ts) AS t, median(s.step_time_p50_s) / any_value(ref.ref) * 100 AS v
                FROM job_steps s, ref
                WHERE s.node_id = {_lit(node_id)} AND s.ts >= {w.start_sql} AND s.ts < {w.end_sql}
                GROUP BY 1 ORDER BY 1"""
        else:
            gpu_cond = "" if gpu is None else f" AND m.gpu = {int(gpu)}"
            sql = f"""
                WITH ref AS (
                    SELECT median(m.value) AS ref FROM probe_metrics m JOIN nodes n USING (node_id)
                    WHERE m.probe = {_lit(probe)} AND m.metric = {_lit(metric)} AND {NOT_FABRIC_GROUP}
                      AND m.started_at >= {w.start_sql} AND m.started_at < {w.end_sql}
                      AND n.gpu_model IS NOT DISTINCT FROM
                          (SELECT gpu_model FROM nodes WHERE node_id = {_lit(node_id)}))
                SELECT epoch(m.started_at) AS t, avg(m.value) / any_value(ref.ref) * 100 AS v
                FROM probe_metrics m, ref
                WHERE m.node_id = {_lit(node_id)} AND m.probe = {_lit(probe)} AND m.metric = {_lit(metric)}
                  AND {NOT_FABRIC_GROUP} AND m.started_at >= {w.start_sql} AND m.started_at < {w.end_sql}{gpu_cond}
                GROUP BY 1 ORDER BY 1"""
        pts = [(float(r["t"]), float(r["v"])) for r in src.query(sql) if r["v"] is not None]
        label = f"{host} {comp}" + ("" if gpu is None else f" gpu{gpu}")
        series.append((label, pts))
    return title, series


MAX_HEATMAP_COLS = 48


def _bucket_s(span_s: float) -> int:
    """Hourly when the data spans 6 h or more (several hours per column past 48 h), finer otherwise."""
    if span_s >= 6 * 3600:
        return 3600 * max(1, math.ceil(span_s / 3600 / MAX_HEATMAP_COLS))
    for b in (60, 300, 600, 900, 1800):
        if span_s / b <= 30:
            return b
    return 3600


def _heatmap(src, w: Window) -> tuple[str, list[str], list[float], list[list[float | None]], int]:
    """Mean GPU utilization per node and time bucket. Node selection happens in SQL, so a live collector's
    row cap is never reached: at most MAX_HEATMAP_ROWS × MAX_HEATMAP_COLS rows come back."""
    use_rollup = False
    if has_table(src, "samples_1m"):
        n = src.query(f"SELECT count(*) AS n FROM samples_1m WHERE metric = 'gpu_util_percent' "
                      f"AND minute >= {w.start_sql} AND minute < {w.end_sql}")
        use_rollup = bool(n and n[0]["n"])
    if use_rollup:
        base = (f"SELECT node_id, epoch(minute) AS t, sum AS s, n AS c FROM samples_1m "
                f"WHERE metric = 'gpu_util_percent' AND gpu IS NOT NULL "
                f"AND minute >= {w.start_sql} AND minute < {w.end_sql}")
    else:
        base = (f"SELECT node_id, epoch(ts) AS t, value AS s, 1 AS c FROM samples "
                f"WHERE metric = 'gpu_util_percent' AND gpu IS NOT NULL AND ts >= {w.start_sql} AND ts < {w.end_sql}")
    span = src.query(f"SELECT min(t) AS lo, max(t) AS hi, count(DISTINCT node_id) AS nodes FROM ({base})")
    if not span or span[0]["lo"] is None:
        return "GPU utilization by node", [], [], [], 0
    lo, hi, total = float(span[0]["lo"]), float(span[0]["hi"]), int(span[0]["nodes"])
    b = _bucket_s(hi - lo + 60)
    rows = src.query(f"""
        WITH per AS (
            SELECT node_id, floor(t / {b}) * {b} AS bucket, sum(s) / sum(c) AS util
            FROM ({base}) GROUP BY ALL
        ),
        pick AS (   -- the least-utilized nodes when there are more than fit
            SELECT node_id FROM per GROUP BY node_id ORDER BY avg(util), node_id LIMIT {MAX_HEATMAP_ROWS}
        )
        SELECT per.node_id, n.hostname, coalesce(n.pool, {_lit(NO_POOL)}) AS pool, per.bucket, per.util
        FROM per JOIN pick USING (node_id) JOIN nodes n USING (node_id)""")
    cols = sorted({float(r["bucket"]) for r in rows})
    col_ix = {c: i for i, c in enumerate(cols)}
    nodes: dict[str, dict[str, Any]] = {}
    for r in rows:
        d = nodes.setdefault(r["node_id"], {"host": r["hostname"], "pool": r["pool"], "v": [None] * len(cols)})
        d["v"][col_ix[float(r["bucket"])]] = float(r["util"])
    picked = sorted(nodes.values(), key=lambda d: (d["pool"], d["host"]))
    unit = f"{b // 3600} hours" if b > 3600 else "hour" if b == 3600 else f"{b // 60} min"
    title = f"GPU utilization by node and {unit} (mean over the node's GPUs)"
    if total > MAX_HEATMAP_ROWS:
        title += f" — the {MAX_HEATMAP_ROWS} least-utilized of {total} nodes"
    return title, [f"{d['host']} ({d['pool']})" for d in picked], cols, [d["v"] for d in picked], b


def _link_heatmap(src, w: Window) -> tuple[str, list[str], list[list[float | None]], float]:
    """Node × node median link rate (a run's slower direction, Gbit/s) over the window's ok net_pair runs.
    With more nodes than fit, the nodes whose median link is slowest are kept; the selection and the
    per-link medians happen in SQL, so at most MAX_LINK_NODES² rows come back from a live collector."""
    if not has_table(src, "link_results"):
        return "Fabric link rates", [], [], 0.0
    rows = src.query(f"""
        WITH runs AS (
            SELECT least(node_a, node_b) AS a, greatest(node_a, node_b) AS b,
                   least(send_gbits_per_s, recv_gbits_per_s) AS gbits,
                   row_number() OVER (PARTITION BY coalesce(pair_id, node_a || '|' || node_b || started_at::VARCHAR)
                                      ORDER BY (reported_by = node_a) DESC, reported_by) AS rn
            FROM link_results
            WHERE probe = 'net_pair' AND status = 'ok' AND isfinite(send_gbits_per_s)
              AND isfinite(recv_gbits_per_s) AND started_at >= {w.start_sql} AND started_at < {w.end_sql}
        ),
        links AS (SELECT a, b, median(gbits) AS gbits FROM runs WHERE rn = 1 GROUP BY a, b),
        ends AS (SELECT a AS node_id, gbits FROM links UNION ALL SELECT b, gbits FROM links),
        pick AS (   -- the nodes with the slowest links when there are more than fit
            SELECT node_id, count(*) OVER () AS total FROM ends GROUP BY node_id
            ORDER BY median(gbits), node_id LIMIT {MAX_LINK_NODES}
        )
        SELECT l.a, l.b, l.gbits, na.hostname AS host_a, coalesce(na.pool, {_lit(NO_POOL)}) AS pool_a,
               nb.hostname AS host_b, coalesce(nb.pool, {_lit(NO_POOL)}) AS pool_b, pa.total
        FROM links l JOIN pick pa ON pa.node_id = l.a JOIN pick pb ON pb.node_id = l.b
        LEFT JOIN nodes na ON na.node_id = l.a LEFT JOIN nodes nb ON nb.node_id = l.b""")
    title = "Fabric link rate by node pair (median of the window's net_pair runs, slower direction)"
    if not rows:
        return title, [], [], 0.0
    names: dict[str, tuple[str, str]] = {}
    for r in rows:
        names[r["a"]] = (r["pool_a"], str(r["host_a"] or r["a"]))
        names[r["b"]] = (r["pool_b"], str(r["host_b"] or r["b"]))
    order = sorted(names, key=lambda n: names[n])
    ix = {n: i for i, n in enumerate(order)}
    values: list[list[float | None]] = [[None] * len(order) for _ in order]
    for r in rows:
        i, j = ix[r["a"]], ix[r["b"]]
        values[i][j] = values[j][i] = float(r["gbits"])
    total = int(rows[0]["total"])
    if total > len(order):
        title += f" — the {len(order)} nodes with the slowest links of {total}"
    vmax = max(v for row in values for v in row if v is not None)
    labels = [f"{names[n][1]} ({names[n][0]})" for n in order]
    return title, labels, values, vmax
