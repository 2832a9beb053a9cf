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

The queries are report_data.py's, the HTML of each section report_html.py's; this module lays out the page
and writes the file.
"""

from __future__ import annotations

import os
import tempfile
from datetime import datetime, timezone
from html import escape
from typing import Any

from gpuagent.collector.views import svgplot
from gpuagent.collector.views.compare import CompareError, compare_pools, open_source, parse_window
from gpuagent.collector.views.compare_sql import HEADLINE
from gpuagent.collector.views.jobs_by import jobs_by
from gpuagent.collector.views.report_data import (_actions, _distributions, _findings, _flags, _health, _heatmap,
                                                  _link_heatmap, _noisy)
from gpuagent.collector.views.report_html import (CSS, SCRIPT, _actions_html, _compare_html, _findings_html,
                                                  _flags_html, _health_html, _jobs_by_html, _summary_html)

UNITS = {"gbps": "GB/s", "tflops": "TFLOPS", "us": "µs", "ns": "ns", "iops": "IOPS", "percent": "%"}


class ReportError(CompareError):
    """The report cannot be written (bad output path, no source); one sentence."""


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
