"""The pool comparison as text: the aligned table, CSV and JSON of ``gpuagent-collector compare``.

compare.py computes a ``PoolComparison``; this module only formats one. The summary rows and probe cells
are shared with the HTML report (report_html.py), so both say the same figures the same way.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from gpuagent.collector.views.compare_sql import FLAG_KINDS, HEADLINE
from gpuagent.collector.views.comparison import PoolComparison


def fmt_value(v: float | None, digits: int = 3) -> str:
    """A compact human number: 3 significant digits, thousands grouped."""
    if v is None:
        return "-"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.{digits}f}"


def pool_rows(c: PoolComparison) -> list[tuple[str, list[str]]]:
    """(label, one cell per pool) rows of the summary table; shared by the text table and the report."""
    def cells(fn):
        return [fn(p) for p in c.pools]

    def pct(v):
        return "-" if v is None else f"{v:.1f} %"

    def money(v):
        return "no price" if v is None else f"${v:,.2f}"

    rows = [
        ("nodes (virtualized)", cells(lambda p: f"{p['nodes']} ({p['virtualized_nodes']})")),
        ("GPUs", cells(lambda p: str(p["gpus"]))),
        ("GPU model", cells(lambda p: p["gpu_models"] or "-")),
        ("GPU-hours sampled", cells(lambda p: f"{p['gpu_hours']:.1f}")),
        ("effective GPU utilization", cells(lambda p: pct(p["effective_util_percent"]))),
        ("GPU-minutes under 10 % util", cells(lambda p: pct(p["idle_minutes_percent"]))),
        ("price per GPU-hour", cells(lambda p: money(p["price_per_gpu_hour"]))),
        ("cost per effective GPU-hour", cells(lambda p: money(p["cost_per_effective_gpu_hour"]))),
        ("nodes flagged (any open flag)", cells(lambda p: f"{p['nodes_flagged_percent']:.0f} % "
                                                          f"({p['nodes_flagged']}/{p['nodes']})")),
    ]
    for k in FLAG_KINDS:
        rows.append((f"  {k}", cells(lambda p, k=k: f"{100.0 * p[f'{k}_nodes'] / p['nodes']:.0f} %"
                                     if p["nodes"] else "-")))
    if any(p["link_runs"] for p in c.pools):
        rows.append(("inter-node Gbit/s (median [p10])", cells(lambda p: _link_cell(p, c.reference_pool))))
        rows.append(("inter-node rtt p50 (median)", cells(
            lambda p: "-" if p["link_rtt_p50_us"] is None else f"{fmt_value(p['link_rtt_p50_us'])} us")))
    return rows


def _link_cell(p: dict[str, Any], reference_pool: str | None) -> str:
    if p["link_gbits_median"] is None:
        return "-"
    text = (f"{fmt_value(p['link_gbits_median'])} [{fmt_value(p['link_gbits_p10'])}], "
            f"{p['links']} link{'s' if p['links'] != 1 else ''}")
    if p["pool"] != reference_pool and p["link_gbits_vs_reference_percent"] is not None:
        text += f" ({round(p['link_gbits_vs_reference_percent']) or 0:+d}%)"
    return text


def probe_cell(r: dict[str, Any] | None, reference_pool: str | None) -> str:
    if r is None:
        return "-"
    text = f"{fmt_value(r['median'])} [{fmt_value(r['p10'])}–{fmt_value(r['p90'])}]"
    if r["spread_percent"] is not None:
        text += f" ±{r['spread_percent'] / 2:.0f}%"
    if r["pool"] != reference_pool:
        if r["vs_reference_percent"] is not None:
            text += f" ({round(r['vs_reference_percent']) or 0:+d}%)"
        elif r.get("vs_reference_points") is not None:
            text += f" ({r['vs_reference_points']:+.1f} pp)"
    return text


def _aligned(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in out)


def format_table(c: PoolComparison) -> str:
    lines = []
    if c.synthetic_nodes:
        lines.append(f"SYNTHETIC data: {c.synthetic_nodes} of {c.total_nodes} nodes are simulated (gpuagent-sim).")
    if c.window is None:
        lines.append("No data stored yet.")
        return "\n".join(lines)
    lines.append(f"Window: {c.window.iso('start')} to {c.window.iso('end')} (ends at the newest stored data)")
    pools = c.pool_names
    lines += ["", _aligned(["pool"] + pools, [[label] + cells for label, cells in pool_rows(c)])]
    if any(p["link_runs"] for p in c.pools):
        lines.append("inter-node: net_pair runs between two nodes of the pool in the window; a run's rate is "
                     "its slower direction")
    ref = f"; (±N%) vs {c.reference_pool}" if c.reference_pool else ""
    lines += ["", f"Probes: median [p10–p90] ±half-spread{ref}"]
    rows = []
    for probe, metric, better in HEADLINE:
        cells = [probe_cell(c.probe(p, probe, metric), c.reference_pool) for p in pools]
        if any(x != "-" for x in cells):
            rows.append([f"{probe} {metric} ({better} is better)"] + cells)
    lines.append(_aligned(["metric"] + pools, rows) if rows else "no probe runs in the window")
    lines += ["", "Throughput per GPU for the same job (median of step windows)"]
    if c.jobs:
        rows = [[j["job_name"], j["pool"], str(j["ranks"]), fmt_value(j["tokens_per_s_per_gpu"]),
                 fmt_value(j["samples_per_s_per_gpu"]), fmt_value(j["step_time_p50_s"])] for j in c.jobs]
        lines.append(_aligned(["job", "pool", "GPUs", "tokens/s/GPU", "samples/s/GPU", "step p50 s"], rows))
    else:
        lines.append("no job step data in the window")
    return "\n".join(lines)


def format_csv(c: PoolComparison) -> str:
    """Long form: section, pool, item, field, value."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["section", "pool", "item", "field", "value"])
    for p in c.pools:
        for k, v in p.items():
            if k != "pool":
                w.writerow(["pool", p["pool"], "", k, "" if v is None else v])
    for r in c.probes:
        for k in ("runs", "nodes", "median", "p10", "p90", "spread_percent", "vs_reference_percent",
                  "vs_reference_points"):
            w.writerow(["probe", r["pool"], f"{r['probe']}.{r['metric']}", k, "" if r[k] is None else r[k]])
    for j in c.jobs:
        for k in ("ranks", "windows", "tokens_per_s_per_gpu", "samples_per_s_per_gpu", "step_time_p50_s"):
            w.writerow(["job", j["pool"], j["job_name"], k, "" if j[k] is None else j[k]])
    return buf.getvalue()


def format_json(c: PoolComparison) -> str:
    return json.dumps(c.to_dict(), indent=2, sort_keys=True, default=str)


def formatter(fmt: str):
    return {"table": format_table, "csv": format_csv, "json": format_json}[fmt]
