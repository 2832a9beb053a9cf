"""The report's fabric link heatmap, read structurally from the SVG (no browser needed): one coloured cell
per measured link and direction of the matrix, grey for pairs never measured, the bad path the reddest,
and the node cap keeping the nodes with the slowest links. Data: the SYNTHETIC fleet of sim_helpers, stored
by the real collector, with net_pair sweeps (cloud-a at 0.6 x, sim-0001 <-> sim-0002 at 0.3 x)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import duckdb
import pytest

from gpuagent.collector.views import report, report_data
from gpuagent.collector.views.compare import DbSource, compare_pools
from sim_helpers import BAD_LINK, CLOUD_A_NET, FABRIC_GBITS, FLEET_SPEC, fleet_db


class Cells(HTMLParser):
    """(class, fill, tooltip) of every <rect> with a <title> inside the <svg data-plot=plot_id>."""

    def __init__(self, plot_id: str):
        super().__init__()
        self.plot_id, self.inside, self.cells, self.labels = plot_id, False, [], []
        self._rect: dict | None = None
        self._col_label = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.inside = a.get("data-plot") == self.plot_id
        elif self.inside and tag == "rect" and "cell" in (a.get("class") or "").split():
            self._rect = {"class": a["class"], "fill": a["fill"], "tip": ""}
        elif self.inside and tag == "text" and a.get("class") == "col-label":
            self._col_label = True

    def handle_data(self, data):
        if self._rect is not None:
            self._rect["tip"] += data
        elif self._col_label:
            self.labels.append(data)

    def handle_endtag(self, tag):
        if tag == "rect" and self._rect is not None:
            self.cells.append(self._rect)
            self._rect = None
        elif tag == "text":
            self._col_label = False
        elif tag == "svg":
            self.inside = False


def _cells(html: str) -> Cells:
    p = Cells("link-heatmap")
    p.feed(html)
    return p


def _red(fill: str) -> float:
    """How red a ramp colour is (red minus green channel)."""
    return int(fill[1:3], 16) - int(fill[3:5], 16)


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    return fleet_db(tmp_path_factory)


def test_link_heatmap_draws_each_measured_link(fx):
    src = DbSource(str(fx.db))
    try:
        html = report.render_report(src, 86400.0)
    finally:
        src.close()
    got = _cells(html)
    n = len(FLEET_SPEC)
    assert len(got.cells) == n * n and len(got.labels) == n
    marks = [c for c in got.cells if "mark" in c["class"].split()]
    # pairs within each pool: bare-metal 3, cloud-a 3, cloud-b 1 -> 7 links, each drawn at (a, b) and (b, a)
    assert len(marks) == 2 * 7
    assert all(c["tip"].endswith("not measured") for c in got.cells if c not in marks)
    by_pair = {}
    for c in marks:
        m = re.match(r"(\S+) \((\S+)\) × (\S+) \((\S+)\): ([0-9.]+) Gbit/s$", c["tip"])
        assert m, c["tip"]
        assert m.group(2) == m.group(4)                  # pairs never cross the pool
        by_pair[(m.group(1), m.group(3))] = (float(m.group(5)), c["fill"])
    bad = (BAD_LINK[0], BAD_LINK[1])
    assert by_pair[bad][0] == pytest.approx(FABRIC_GBITS * BAD_LINK[2], rel=0.1)
    assert by_pair[bad] == by_pair[bad[::-1]]            # symmetric
    # the bad path is the reddest cell; cloud-a's links redder than the healthy bare-metal ones
    assert max(by_pair.items(), key=lambda kv: _red(kv[1][1]))[0] in (bad, bad[::-1])
    assert by_pair[("sim-0004", "sim-0005")][0] == pytest.approx(FABRIC_GBITS * CLOUD_A_NET, rel=0.1)
    assert _red(by_pair[("sim-0004", "sim-0005")][1]) > _red(by_pair[("sim-0001", "sim-0003")][1])
    assert "<section id='fabric'><h2>Fabric links</h2>" in html


def test_link_heatmap_keeps_the_nodes_with_the_slowest_links(fx, monkeypatch):
    monkeypatch.setattr(report_data, "MAX_LINK_NODES", 3)
    src = DbSource(str(fx.db))
    try:
        c = compare_pools(src, 86400.0)
        title, labels, values, vmax = report_data._link_heatmap(src, c.window)
    finally:
        src.close()
    assert title.endswith(f"the 3 nodes with the slowest links of {len(FLEET_SPEC)}")
    # cloud-a's links (0.6 x) are slower than the median link of sim-0001/-0002 (one 0.3 x, one 1 x)
    assert labels == ["sim-0004 (cloud-a)", "sim-0005 (cloud-a)", "sim-0006 (cloud-a)"]
    assert sum(v is not None for row in values for v in row) == 6
    assert vmax == pytest.approx(FABRIC_GBITS * CLOUD_A_NET, rel=0.1)


def test_no_fabric_runs_says_so(tmp_path):
    from gpuagent.collector.store import schema

    db = tmp_path / "empty.duckdb"
    con = duckdb.connect(str(db))
    schema.migrate(con)
    con.close()
    out = tmp_path / "r.html"
    report.write_report(str(out), db=str(db))
    html = out.read_text(encoding="utf-8")
    assert "<section id='fabric'>" in html and "No data." in html.split("<section id='fabric'>")[1]
