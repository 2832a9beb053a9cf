"""The fleet report (``gpuagent-collector report --out report.html``): one self-contained HTML file.

It opens offline: styles, the few lines of script (table sorting, flag filter) and every plot (inline SVG
from :mod:`gpuagent.collector.views.svgplot`) are inside the file; nothing is fetched. Content:

- open findings (one per cause, worst first);
- fleet summary (nodes, pools, GPUs, open flags, lost GPU-hours), marked SYNTHETIC when simulated nodes
  are in the data;
- hardware health: open hardware_fault flags (one per node fault, with its action and cited source) and
  the application XIDs of the window (attributed to the job, not the hardware);
- open flags with their sentences;
- the pool comparison (:mod:`gpuagent.collector.views.compare`);
- plots: per-probe distributions by pool (per-node medians), noisy nodes over time, a GPU
  utilization heatmap by node and time bucket (hourly when the data spans ≥ 6 h, finer otherwise), and
  a node × node heatmap of fabric link rates (net_pair runs in link_results).
"""

from __future__ import annotations

import math
import os
import tempfile
from datetime import datetime, timezone
from html import escape
from typing import Any

from gpuagent.collector.views import svgplot
from gpuagent.collector.views.jobs_by import jobs_by
from gpuagent.common import hardware_faults
from gpuagent.collector.views.compare import (FLAG_KINDS, HEADLINE, NO_POOL, NOT_FABRIC_GROUP, CompareError,
                                        PoolComparison, Window, _lit, compare_pools, fmt_value, has_table,
                                        open_source, parse_window, pool_rows, probe_cell)

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

UNITS = {"gbps": "GB/s", "tflops": "TFLOPS", "us": "µs", "ns": "ns", "iops": "IOPS", "percent": "%"}
SEVERITY_ORDER = "CASE f.severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END"


class ReportError(CompareError):
    """The report cannot be written (bad output path, no source); one sentence."""


# ------------------------------------------------------------------------------------------ data


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


def _actions_html(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p class='muted' id='no-actions'>No actions: [actions] is off, or no finding called for one.</p>"
    body = "".join("<tr class='action'>" + _td(_ts(r["ts"]), r["ts"]) + _td(str(r["target"])) + _td(str(r["action"]))
                   + _td(str(r["mode"])) + _td(str(r["outcome"])) + _td(f"{r['kind'] or ''} {r['severity'] or ''}")
                   + _td(str(r["why"])) + _td(str(r["rule"])) + _td(str(r["actor"])) + "</tr>" for r in rows)
    return ("<div class='scroll'><table class='sortable' id='actions-table'><thead><tr><th>when</th><th>node</th>"
            "<th>action</th><th>mode</th><th>outcome</th><th>finding</th><th>why</th><th>rule</th><th>by</th>"
            "</tr></thead><tbody>"
            + body + "</tbody></table></div>")


def _jobs_by_html(by: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return f"<p class='muted' id='no-jobs-by-{by}'>No jobs in the window.</p>"
    body = "".join("<tr>" + _td(str(r["group"])) + _td(str(r["jobs"]), r["jobs"]) + _td(str(r["nodes"]), r["nodes"])
                   + _td(f"{r['gpu_hours']:.2f}", r["gpu_hours"])
                   + _td("-" if r["mean_gpu_util_percent"] is None else f"{r['mean_gpu_util_percent']:.0f} %",
                         r["mean_gpu_util_percent"]) + "</tr>" for r in rows)
    return (f"<div class='scroll'><table class='sortable' id='jobs-by-{by}'><thead><tr><th>{by}</th><th>jobs</th>"
            "<th>nodes</th><th>GPU-hours held</th><th>mean GPU util</th></tr></thead><tbody>" + body
            + "</tbody></table></div>")


def _health_html(faults: list[dict[str, Any]], apps: list[dict[str, Any]]) -> str:
    out = []
    if not faults:
        out.append("<p class='muted' id='no-hardware-faults'>No open hardware faults.</p>")
    else:
        crit = sum(1 for f in faults if f["severity"] == "critical")
        comps: dict[str, int] = {}
        for f in faults:
            comps[str(f["component"])] = comps.get(str(f["component"]), 0) + 1
        out.append(f"<p id='health-summary'>{len(faults)} open hardware faults ({crit} critical) on "
                   f"{len({f['node_id'] for f in faults})} nodes: "
                   + escape(", ".join(f"{k} {v}" for k, v in sorted(comps.items()))) + ".</p>")
        rows = []
        for f in faults:
            sev = str(f["severity"])
            rows.append("<tr class='hw-fault'>"
                        f"<td class='sev sev-{escape(sev)}'>{escape(sev)}</td>"
                        + _td(str(f["hostname"])) + _td(str(f["pool"]))
                        + _td("host" if f["gpu"] is None else str(f["gpu"])) + _td(str(f["component"]))
                        + _td(_ts(f["first_seen"]), f["first_seen"]) + _td(str(f["sentence"]))
                        + _td(str(f["source"] or "")) + "</tr>")
        out.append("<div class='scroll'><table class='sortable' id='health-table'><thead><tr><th>severity</th>"
                   "<th>node</th><th>pool</th><th>GPU</th><th>component</th><th>since</th><th>fault and action</th>"
                   "<th>source</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")
    if apps:
        out.append("<h3>Application XIDs (the job's, not the hardware's)</h3><table id='app-xids'><thead><tr>"
                   "<th>node</th><th>GPU</th><th>XID</th><th>reports</th><th>last</th></tr></thead><tbody>"
                   + "".join("<tr>" + _td(str(a["hostname"])) + _td("-" if a["gpu"] is None else str(a["gpu"]))
                             + _td(str(a["xid"])) + _td(str(a["n"]), a["n"], "num") + _td(_ts(a["last_seen"]))
                             + "</tr>" for a in apps)
                   + "</tbody></table>")
    return "".join(out)


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


# ------------------------------------------------------------------------------------------ HTML

CSS = """
:root { --fg:#1d2330; --muted:#667; --line:#dde1e7; --bg:#f6f7f9; --warn:#b7791f; --crit:#c53030; --info:#3b6fb6; }
* { box-sizing: border-box; }
body { margin:0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color:var(--fg); background:var(--bg); }
header { background:#1d2330; color:#fff; padding:18px 28px; }
header h1 { margin:0 0 4px; font-size:21px; }
header .sub { color:#c8cfdb; font-size:13px; }
main { padding:8px 28px 40px; max-width:1400px; }
section { background:#fff; border:1px solid var(--line); border-radius:8px; padding:14px 18px; margin:16px 0; }
h2 { font-size:17px; margin:0 0 10px; }
h3 { font-size:14px; margin:14px 0 6px; }
.synthetic { background:#fff4d6; border:1px solid #e5c46b; color:#6b4e00; padding:8px 12px; border-radius:6px; margin:14px 0 0; font-weight:600; }
.cards { display:flex; flex-wrap:wrap; gap:10px; }
.card { border:1px solid var(--line); border-radius:6px; padding:8px 14px; min-width:150px; }
.card .v { font-size:22px; font-weight:650; }
.card .k { color:var(--muted); font-size:12px; }
table { border-collapse:collapse; width:100%; font-size:13px; }
th, td { text-align:left; padding:5px 8px; border-bottom:1px solid var(--line); vertical-align:top; }
th { background:#f0f2f5; position:sticky; top:0; }
table.sortable th { cursor:pointer; user-select:none; }
table.sortable th:after { content:" \\2195"; color:#aab; font-size:11px; }
td.num { text-align:right; font-variant-numeric: tabular-nums; white-space:nowrap; }
.sev { font-weight:600; text-transform:uppercase; font-size:11px; }
.sev-critical { color:var(--crit); } .sev-warning { color:var(--warn); } .sev-info { color:var(--info); }
.muted { color:var(--muted); }
.grid { display:flex; flex-wrap:wrap; gap:10px; }
.scroll { max-height:520px; overflow:auto; border:1px solid var(--line); border-radius:6px; }
#flags-table td:nth-child(4), #flags-table td:nth-child(5), #flags-table td:nth-child(9) { white-space:nowrap; }
#flags-table td:last-child { min-width:420px; }
input[type=search] { padding:5px 8px; width:320px; border:1px solid #bbc; border-radius:5px; margin-bottom:8px; }
svg.plot { background:#fff; border:1px solid var(--line); border-radius:6px; }
footer { color:var(--muted); font-size:12px; padding:0 28px 24px; }
"""

# Table sorting and the flag filter. Written for this report; no library.
SCRIPT = """
(function () {
  function cellValue(td) {
    var s = td.getAttribute('data-sort');
    if (s !== null && s !== '' && !isNaN(Number(s))) { return Number(s); }
    return td.textContent.trim().toLowerCase();
  }
  var tables = document.querySelectorAll('table.sortable');
  Array.prototype.forEach.call(tables, function (table) {
    var heads = table.querySelectorAll('thead th');
    Array.prototype.forEach.call(heads, function (th, col) {
      th.addEventListener('click', function () {
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        var dir = th.getAttribute('data-dir') === 'asc' ? -1 : 1;
        th.setAttribute('data-dir', dir === 1 ? 'asc' : 'desc');
        rows.sort(function (a, b) {
          var x = cellValue(a.cells[col]), y = cellValue(b.cells[col]);
          if (typeof x === 'number' && typeof y === 'number') { return (x - y) * dir; }
          return String(x).localeCompare(String(y)) * dir;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
  var filter = document.getElementById('flag-filter');
  if (filter) {
    filter.addEventListener('input', function () {
      var q = filter.value.trim().toLowerCase();
      var rows = document.querySelectorAll('#flags-table tbody tr');
      var shown = 0;
      Array.prototype.forEach.call(rows, function (r) {
        var hit = !q || r.textContent.toLowerCase().indexOf(q) !== -1;
        r.style.display = hit ? '' : 'none';
        if (hit) { shown += 1; }
      });
      var count = document.getElementById('flag-count');
      if (count) { count.textContent = shown + ' shown'; }
    });
  }
  document.body.setAttribute('data-ready', '1');
})();
"""


def _td(text: str, sort: Any = None, cls: str = "") -> str:
    attrs = ""
    if sort is not None:
        attrs += f' data-sort="{escape(str(sort))}"'
    if cls:
        attrs += f' class="{cls}"'
    return f"<td{attrs}>{escape(text)}</td>"


def _ts(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(float(t), timezone.utc).strftime("%Y-%m-%d %H:%M")


def _summary_html(c: PoolComparison, flags_total: int, flags: list[dict[str, Any]]) -> str:
    gpus = sum(p["gpus"] for p in c.pools)
    virt = sum(p["virtualized_nodes"] for p in c.pools)
    gpu_hours = sum(p["gpu_hours"] for p in c.pools)
    eff = sum(p["effective_gpu_hours"] for p in c.pools)
    by_kind = {k: 0 for k in FLAG_KINDS}
    lost = 0.0
    for f in flags:
        by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
        if f["kind"] == "utilization_gap" and f["unit"] in ("gpu_hours", "GPU-hours", "gpu-hours") and f["value"]:
            lost += float(f["value"])
    cards = [
        (str(c.total_nodes), f"nodes ({virt} virtualized)"),
        (str(len(c.pools)), "pools"),
        (str(gpus), "GPUs"),
        (f"{gpu_hours:,.1f}", "GPU-hours sampled in the window"),
        (f"{(eff / gpu_hours * 100) if gpu_hours else 0:.1f} %", "effective GPU utilization"),
        (str(flags_total), "open flags"),
    ]
    cards += [(str(by_kind.get(k, 0)), f"open {k}") for k in FLAG_KINDS]
    if lost:
        cards.append((f"{lost:,.1f}", "GPU-hours lost (open utilization_gap flags)"))
    return "<div class='cards'>" + "".join(
        f"<div class='card'><div class='v'>{escape(v)}</div><div class='k'>{escape(k)}</div></div>"
        for v, k in cards) + "</div>"


def _flags_html(flags: list[dict[str, Any]], total: int) -> str:
    if not flags:
        return "<p class='muted' id='no-flags'>No open flags.</p>"
    head = ["severity", "kind", "component", "node", "pool", "GPU", "value", "baseline", "since", "sentence"]
    rows = []
    for f in flags:
        sev = str(f["severity"])
        val = "-" if f["value"] is None else f"{fmt_value(float(f['value']))} {f['unit'] or ''}".strip()
        base = ("no baseline" if f["baseline"] is None
                else f"{fmt_value(float(f['baseline']))} ({f['baseline_source'] or '?'})")
        rank = {"critical": 0, "warning": 1}.get(sev, 2)
        rows.append("<tr class='flag'>"
                    f"<td data-sort='{rank}' class='sev sev-{escape(sev)}'>{escape(sev)}</td>"
                    + _td(str(f["kind"])) + _td(str(f["component"] or "-"))
                    + _td(str(f["hostname"] or f["node_id"])) + _td(str(f["pool"]))
                    + _td("-" if f["gpu"] is None else str(f["gpu"]), -1 if f["gpu"] is None else f["gpu"], "num")
                    + _td(val, f["value"], "num") + _td(base, f["baseline"], "num")
                    + _td(_ts(f["first_seen"]), f["first_seen"]) + _td(str(f["sentence"])) + "</tr>")
    more = f" (showing the first {len(flags)} of {total})" if total > len(flags) else ""
    return (f"<input type='search' id='flag-filter' placeholder='filter flags (node, pool, kind, text)'> "
            f"<span class='muted' id='flag-count'>{len(flags)} shown{more}</span>"
            "<div class='scroll'><table class='sortable' id='flags-table'><thead><tr>"
            + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>" + "".join(rows)
            + "</tbody></table></div>")


def _findings_html(findings: list[dict[str, Any]]) -> str:
    if not findings:
        return "<p class='muted' id='no-findings'>No open findings.</p>"
    rows = []
    for f in findings:
        sev = str(f["severity"])
        where = f"pool {f['pool']}" if f["scope"] == "pool" else f"{f['node_id']} ({f['pool'] or NO_POOL})"
        rows.append("<tr class='finding'>"
                    f"<td class='sev sev-{escape(sev)}'>{escape(sev)}</td>"
                    + _td(str(f["kind"])) + _td(where) + _td(str(f["flags"]), f["flags"], "num")
                    + _td(str(f["sentence"])) + "</tr>")
    return ("<div class='scroll'><table id='findings-table'><thead><tr><th>severity</th><th>kind</th><th>where</th>"
            "<th>flags</th><th>finding</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")


def _compare_html(c: PoolComparison) -> str:
    if c.window is None:
        return "<p class='muted'>No data stored yet.</p>"
    pools = c.pool_names
    out = ["<table id='pool-summary'><thead><tr><th>pool</th>" + "".join(f"<th>{escape(p)}</th>" for p in pools)
           + "</tr></thead><tbody>"]
    for label, cells in pool_rows(c):
        out.append("<tr>" + _td(label) + "".join(_td(x, cls="num") for x in cells) + "</tr>")
    out.append("</tbody></table>")
    ref = f" In brackets: difference of the median from <b>{escape(c.reference_pool)}</b>." if c.reference_pool else ""
    out.append(f"<h3>Probes</h3><p class='muted'>Median [p10–p90] ± half the p10–p90 spread, over the window's "
               f"runs.{ref}</p>")
    out.append("<table id='pool-probes'><thead><tr><th>probe metric</th>"
               + "".join(f"<th>{escape(p)}</th>" for p in pools) + "</tr></thead><tbody>")
    for probe, metric, better in HEADLINE:
        cells = [probe_cell(c.probe(p, probe, metric), c.reference_pool) for p in pools]
        if any(x != "-" for x in cells):
            out.append("<tr>" + _td(f"{probe} {metric} ({better} is better)")
                       + "".join(_td(x, cls="num") for x in cells) + "</tr>")
    out.append("</tbody></table>")
    out.append("<h3>Throughput per GPU for the same job</h3>")
    if c.jobs:
        out.append("<table class='sortable' id='pool-jobs'><thead><tr><th>job</th><th>pool</th><th>GPUs</th>"
                   "<th>tokens/s per GPU</th><th>samples/s per GPU</th><th>step time p50 (s)</th></tr></thead><tbody>")
        for j in c.jobs:
            out.append("<tr>" + _td(j["job_name"]) + _td(j["pool"]) + _td(str(j["ranks"]), j["ranks"], "num")
                       + _td(fmt_value(j["tokens_per_s_per_gpu"]), j["tokens_per_s_per_gpu"], "num")
                       + _td(fmt_value(j["samples_per_s_per_gpu"]), j["samples_per_s_per_gpu"], "num")
                       + _td(fmt_value(j["step_time_p50_s"]), j["step_time_p50_s"], "num") + "</tr>")
        out.append("</tbody></table>")
    else:
        out.append("<p class='muted'>No job step data in the window.</p>")
    return "".join(out)


def render_report(src, window_s: float = 86400.0, reference_pool: str | None = None,
                  source_label: str = "") -> str:
    """Build the report HTML from a DbSource or RpcSource."""
    c = compare_pools(src, window_s, reference_pool)
    flags, flags_total = _flags(src)
    findings = _findings(src)
    w = c.window
    hw_faults, app_xids = _health(src, w)
    actions = _actions(src)
    by_partition, by_account = jobs_by(src, "partition", window_s), jobs_by(src, "account", window_s)
    plots_dist, noisy_svg, heat_svg, link_svg = [], "", "", ""
    if w is not None:
        dists = _distributions(src, w)
        for probe, metric, better in HEADLINE:
            groups = dists.get((probe, metric), [])
            unit = UNITS.get(metric.rsplit("_", 1)[-1], "")
            plots_dist.append(svgplot.box_strip(f"dist-{probe}-{metric}", f"{probe}: {metric}", unit, groups,
                                                note=f"{better} is better; one point per node"))
        title, series = _noisy(src, w, flags)
        noisy_svg = svgplot.lines("noisy-over-time", title, "% of fleet median", series, reference=100.0,
                                  width=980)
        htitle, rows, cols, values, b = _heatmap(src, w)
        heat_svg = svgplot.heatmap("util-heatmap", htitle, rows, cols, values, b, width=980)
        ltitle, lnodes, lvalues, lmax = _link_heatmap(src, w)
        lmax = svgplot.nice_ticks(0.0, lmax)[-1] if lmax > 0 else 1.0
        link_svg = svgplot.heatmap("link-heatmap", ltitle, lnodes, list(range(len(lnodes))), lvalues, 0,
                                   vmax=lmax, unit="Gbit/s", width=980, col_labels=lnodes,
                                   empty="no fabric (net_pair) runs in the window", missing="not measured")
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    window_text = "no data" if w is None else f"{w.iso('start')} to {w.iso('end')}"
    synthetic = ""
    if c.synthetic_nodes:
        synthetic = (f"<div class='synthetic' id='synthetic-banner'>SYNTHETIC DATA: {c.synthetic_nodes} of "
                     f"{c.total_nodes} nodes were simulated by gpuagent-sim; their figures are generated, "
                     f"not measured.</div>")
    body = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        "<meta name='viewport' content='width=device-width, initial-scale=1'>",
        f"<title>gpuagent fleet report — {escape(window_text)}</title>",
        f"<style>{CSS}</style></head><body>",
        "<header><h1>gpuagent fleet report</h1>",
        f"<div class='sub'>Window {escape(window_text)} (ends at the newest stored data) · source "
        f"{escape(source_label)} · generated {now}</div></header><main>",
        synthetic,
        "<section id='findings'><h2>Open findings</h2>"
        "<p class='muted'>One row per cause, worst first; the flags behind them are listed further down.</p>",
        _findings_html(findings), "</section>",
        "<section id='health'><h2>Hardware health</h2>"
        "<p class='muted'>Open hardware_fault flags, one per node fault, with the action from the cited rule "
        "(common/hardware_faults.toml; docs/FLAGS.md).</p>", _health_html(hw_faults, app_xids), "</section>",
        "<section id='actions'><h2>Actions</h2><p class='muted'>Drains, resumes and alerts the collector decided "
        "from findings, newest first (docs/ACTIONS.md); dry-run rows changed nothing.</p>", _actions_html(actions),
        "</section>",
        "<section id='jobs-by'><h2>Jobs by partition and account</h2><p class='muted'>As Slurm names them "
        "(docs/SLURM.md); (none): jobs no scheduler named. GPU-hours held: each job's GPUs from their first to "
        "their last sample in the window.</p>", _jobs_by_html("partition", by_partition),
        _jobs_by_html("account", by_account), "</section>",
        "<section id='summary'><h2>Fleet summary</h2>", _summary_html(c, flags_total, flags), "</section>",
        "<section id='flags'><h2>Open flags</h2>", _flags_html(flags, flags_total), "</section>",
        "<section id='compare'><h2>Pool comparison</h2>", _compare_html(c), "</section>",
        "<section id='distributions'><h2>Probe results by pool</h2>"
        "<p class='muted'>Each point is one node's median over the window; box p25–p75, whiskers p10–p90.</p>"
        "<div class='grid'>", "".join(plots_dist) or "<p class='muted'>No data.</p>", "</div></section>",
        "<section id='noisy'><h2>Noisy nodes over time</h2>", noisy_svg or "<p class='muted'>No data.</p>",
        "</section>",
        "<section id='utilization'><h2>GPU utilization</h2>", heat_svg or "<p class='muted'>No data.</p>",
        "</section>",
        "<section id='fabric'><h2>Fabric links</h2>"
        "<p class='muted'>Each cell is one link between two nodes: red is slow against the fastest link, "
        "grey is a pair not measured (pairs never cross the fabric scope, by default the pool).</p>",
        link_svg or "<p class='muted'>No data.</p>", "</section>",
        "</main><footer>Written by gpuagent-collector report. Self-contained: no external resources.</footer>",
        f"<script>{SCRIPT}</script></body></html>",
    ]
    return "\n".join(body)


def write_report(out: str, db: str | None = None, target: str | None = None, window: str = "24h",
                 token: str | None = None, reference_pool: str | None = None,
                 tls_ca: str | None = None, client_cert: str | None = None,
                 client_key: str | None = None) -> dict[str, Any]:
    """The library call behind ``gpuagent-collector report``: writes ``out`` atomically, returns a summary."""
    seconds = parse_window(window)
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise ReportError(f"cannot write {out}: directory {out_dir} does not exist")
    src = open_source(db, target, token, tls_ca, client_cert, client_key)
    try:
        html = render_report(src, seconds, reference_pool, source_label=src.label)
    finally:
        src.close()
    try:
        fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=out_dir)
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)   # a report is for sharing: the usual file mode, not mkstemp's 0600
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(html)
        os.replace(tmp, out)
    except OSError as exc:
        raise ReportError(f"cannot write {out}: {exc.strerror}") from None
    return {"out": out, "bytes": len(html.encode()), "svg_plots": html.count("<svg class=\"plot"),
            "synthetic": "id='synthetic-banner'" in html}
