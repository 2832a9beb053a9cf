"""The fleet report, rendered from a DuckDB file the real collector filled (SYNTHETIC fleet over loopback),
opened in headless Chromium: no console errors, no resource fetches, and the plots are drawn.

Errors are caught two ways: Chromium's own console log on stderr (``--enable-logging=stderr``), and a
collector script injected into a copy of the page (window errors, failed resource loads, console.error)
that writes what it saw into the DOM, which ``--dump-dom`` returns. A negative control proves the harness
does catch a broken page. Network is pointed at a dead loopback proxy so nothing can be fetched.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import duckdb

from tools import needs
from click.testing import CliRunner

from gpuagent.collector.views.compare_sql import HEADLINE
from gpuagent.collector.views.report import write_report
from sim_helpers import FLEET_SPEC, fleet_db

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = needs("chromium")

COLLECTOR_JS = """<script>(function(){var errs=[];
window.addEventListener('error',function(e){var t=e.target;
 if(t&&t!==window&&(t.src||t.href)){errs.push('resource: '+(t.src||t.href));}else{errs.push('error: '+e.message);}},true);
window.addEventListener('unhandledrejection',function(e){errs.push('rejection: '+e.reason);});
var ce=console.error,cw=console.warn;
console.error=function(){errs.push('console.error: '+Array.prototype.join.call(arguments,' '));return ce.apply(console,arguments);};
console.warn=function(){errs.push('console.warn: '+Array.prototype.join.call(arguments,' '));return cw.apply(console,arguments);};
window.addEventListener('load',function(){setTimeout(function(){var p=document.createElement('pre');
 p.id='__test_errors';p.textContent=JSON.stringify(errs);document.body.appendChild(p);},0);});})();</script>"""


def open_in_chromium(html_path: Path, tmp: Path) -> tuple[str, list[str], list[str]]:
    """(dumped DOM, errors the injected collector saw, console lines Chromium logged)."""
    probe = tmp / f"probe-{html_path.name}"
    text = html_path.read_text(encoding="utf-8")
    assert "<head>" in text
    probe.write_text(text.replace("<head>", "<head>" + COLLECTOR_JS, 1), encoding="utf-8")
    res = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp / 'chrome-profile'}",
         "--proxy-server=127.0.0.1:9", "--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0",
         "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    dom = res.stdout
    m = re.search(r'<pre id="__test_errors">(.*?)</pre>', dom, re.S)
    assert m, "the injected error collector did not run (page did not finish loading?)"
    errors = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                        .replace("&gt;", ">"))
    console = [ln for ln in res.stderr.splitlines() if ":CONSOLE" in ln]
    return dom, errors, console


class SvgMarks(HTMLParser):
    """Counts, per <svg data-plot=...>, the elements whose class list contains 'mark'."""

    def __init__(self):
        super().__init__()
        self.plots: dict[str, dict[str, int]] = {}
        self._current: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg" and "data-plot" in a:
            self._current = a["data-plot"]
            self.plots[self._current] = {}
        elif self._current and "mark" in (a.get("class") or "").split():
            kind = [c for c in a["class"].split() if c != "mark"]
            key = f"{tag}.{kind[0] if kind else ''}"
            self.plots[self._current][key] = self.plots[self._current].get(key, 0) + 1

    def handle_endtag(self, tag):
        if tag == "svg":
            self._current = None


def _marks(dom: str) -> dict[str, dict[str, int]]:
    p = SvgMarks()
    p.feed(dom)
    return p.plots


def test_harness_catches_a_broken_page(tmp_path):
    """Negative control: a script error, a console.error and an external image are all reported."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><head><title>t</title></head><body><p>x</p>"
                   "<img src='https://example.invalid/pixel.png'>"
                   "<script>console.error('boom'); notDefined();</script></body></html>")
    _, errors, console = open_in_chromium(bad, tmp_path)
    assert any("notDefined" in e for e in errors)
    assert any(e.startswith("console.error: boom") for e in errors)
    assert any(e.startswith("resource: https://example.invalid/") for e in errors)
    assert any("notDefined" in ln for ln in console)


def test_report_loads_without_errors_and_draws_plots(tmp_path, tmp_path_factory):
    fx = fleet_db(tmp_path_factory)
    out = tmp_path / "report.html"
    info = write_report(str(out), db=str(fx.db), window="24h")
    html = out.read_text(encoding="utf-8")
    assert info["bytes"] == len(html.encode()) and html.startswith("<!DOCTYPE html>")
    # Self-contained: no fetchable reference (the SVG xmlns is a name, not a fetch).
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.I)
    assert "url(" not in html and "@import" not in html and "<link" not in html

    dom, errors, console = open_in_chromium(out, tmp_path)
    assert errors == []
    assert console == []
    assert 'data-ready="1"' in dom                      # the report's own script ran to its end
    assert "SYNTHETIC DATA: 8 of 8 nodes" in dom

    marks = _marks(dom)
    n_nodes = len(FLEET_SPEC)
    for probe, metric, _ in HEADLINE:
        plot = marks[f"dist-{probe}-{metric}"]
        if metric == "busbw_gbps" or probe != "collective":
            assert plot.get("circle.point") == n_nodes, (probe, metric, plot)   # one point per node
            assert plot.get("rect.box") == 3                                  # one box per pool
    noisy = marks["noisy-over-time"]
    assert noisy.get("path.line", 0) >= 1 and noisy.get("circle.point", 0) >= 5
    heat = marks["util-heatmap"]
    cols = heat["rect.cell"] // n_nodes
    assert heat["rect.cell"] == n_nodes * cols and 20 <= cols <= 30          # 2 h in 5-minute buckets
    # Heatmap colours follow utilization: the idle-half node has red cells, the healthy ones none.
    assert re.search(r"sim-0007 \(cloud-b\) [0-9:]+: [0-9] %", dom)
    assert not re.search(r"sim-0001 \(bare-metal\) [0-9:]+: [0-9] %", dom)

    con = duckdb.connect(str(fx.db), read_only=True)
    try:
        open_flags = con.execute("SELECT count(*) FROM flags WHERE state = 'open'").fetchone()[0]
        sentences = [r[0] for r in con.execute("SELECT sentence FROM flags WHERE state = 'open' LIMIT 20").fetchall()]
    finally:
        con.close()
    rows = re.findall(r"<tr class=\"flag\">", dom)
    assert len(rows) == open_flags
    assert open_flags > 0
    from html import escape
    for s in sentences:
        assert escape(s, quote=False) in dom

    # The same report through the live collector's Query RPC (written before the analyzer ran, so no
    # flags) draws the same distribution and heatmap marks.
    via_rpc = _marks(fx.report_via_target.read_text(encoding="utf-8"))
    for name in ("dist-pcie-h2d_gbps", "dist-storage-seq_read_gbps", "util-heatmap"):
        assert via_rpc[name] == marks[name], name

    # A screenshot for people (CI keeps it as an artifact if it wants); the size shows it rendered.
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--user-data-dir={tmp_path / 'chrome-shot'}", "--proxy-server=127.0.0.1:9",
                    "--window-size=1400,3000", f"--screenshot={shot}", out.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 50_000


def test_empty_database_report_loads(tmp_path):
    """A collector that stored nothing yet still gets a valid page that says so."""
    from gpuagent.collector.store import schema

    db = tmp_path / "empty.duckdb"
    con = duckdb.connect(str(db))
    schema.migrate(con)
    con.close()
    out = tmp_path / "empty.html"
    write_report(str(out), db=str(db))
    dom, errors, console = open_in_chromium(out, tmp_path)
    assert errors == [] and console == []
    assert "No data stored yet." in dom and "No open flags." in dom and "SYNTHETIC" not in dom


def test_report_cli_errors_are_one_sentence(tmp_path, tmp_path_factory):
    from gpuagent.collector.cli import main

    fx = fleet_db(tmp_path_factory)
    runner = CliRunner()
    res = runner.invoke(main, ["report", "--out", str(tmp_path / "nodir" / "r.html"), "--db", str(fx.db)])
    assert res.exit_code == 1 and "directory" in res.output and "does not exist" in res.output
    res = runner.invoke(main, ["report", "--out", str(tmp_path / "r.html"), "--db", str(tmp_path / "none.duckdb")])
    assert res.exit_code == 1 and "does not exist" in res.output and "Traceback" not in res.output
    res = runner.invoke(main, ["report", "--out", str(tmp_path / "r.html"), "--db", str(fx.db), "--window", "0h"])
    assert res.exit_code == 1 and "is not a positive duration" in res.output
    res = runner.invoke(main, ["report", "--out", str(tmp_path / "r.html"), "--db", str(fx.db)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "r.html").stat().st_size > 10_000 and "SYNTHETIC" in res.output
