"""The fleet report's HTML: its styles and script, and one function per table or section of rows.

Kept apart from report.py, which gathers the data (report_data.py) and the plots (svgplot.py) and lays out
the page, so the markup and its escaping live in one place. Every cell goes through ``_td``, which escapes.
"""

from __future__ import annotations

from datetime import datetime, timezone
from html import escape
from typing import Any

from gpuagent.collector.views.compare import PoolComparison
from gpuagent.collector.views.compare_format import fmt_value, pool_rows, probe_cell
from gpuagent.collector.views.compare_sql import FLAG_KINDS, HEADLINE, NO_POOL

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
