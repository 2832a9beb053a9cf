"""The collector's live web console (issue 48), against a real collector fed by gpuagent-sim (SYNTHETIC) over
loopback gRPC, with the tokens file's roles: each view answers with the numbers SQL gives on the same
database, links lead from a finding to its node and job, auth refuses what it must, and in headless Chromium
every view loads with no script error and nothing fetched (screenshots kept under build/test-artefacts)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from html import unescape
from pathlib import Path
from urllib.parse import quote

import pytest

from gpuagent.collector import service as server
from gpuagent.collector.views import client
from gpuagent.collector.views.compare import run_compare
from gpuagent.sim.run import SimConfig, run_sim
from sim_helpers import FABRIC_GBITS, FABRIC_SWEEPS, fleet
from test_report_chromium import COLLECTOR_JS
from tools import needs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
ARTEFACTS = ROOT / "build" / "test-artefacts" / "console"
ADMIN, QUERY, INGEST = "console-admin-token", "console-query-token", "console-ingest-token"


@pytest.fixture(scope="module")
def console(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    tokens = tmp / "tokens.toml"
    tokens.write_text(f'[[token]]\nname = "ops"\ntoken = "{ADMIN}"\nrole = "admin"\n\n'
                      f'[[token]]\nname = "viewer"\ntoken = "{QUERY}"\nrole = "query"\n\n'
                      f'[[token]]\nname = "agents"\ntoken = "{INGEST}"\nrole = "ingest"\nnodes = ["*"]\n')
    col = server.start_collector(tmp / "c.duckdb", "127.0.0.1:0", tokens_file=str(tokens), analyze=False,
                                 ui_listen="127.0.0.1:0")
    try:
        cfg = SimConfig(collector=col.address, token=INGEST, sim_hours=2.0, interval_s=10.0, batch_s=600.0, seed=7,
                        streams=8, fabric_sweeps=FABRIC_SWEEPS, fabric_gbits=FABRIC_GBITS)
        summary = run_sim(cfg, fleet(fabric=True))
        assert summary.nodes_ok == len(fleet()), summary.errors
        client.analyze(col.address, window_s=86400, token=ADMIN)
        yield col, f"http://127.0.0.1:{col.console.port}"
    finally:
        col.stop()


def get(url: str, token: str | None = QUERY, cookie: str | None = None, method: str = "GET"):
    req = urllib.request.Request(url, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if cookie:
        req.add_header("Cookie", cookie)
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(req, timeout=30) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a, **k):
        return None


def sql(col, text: str) -> list:
    return client.query(col.address, text, token=QUERY).rows


def cells(html: str, table_class: str) -> list[list[str]]:
    m = re.search(rf'<table class="{table_class}">.*?<tbody>(.*?)</tbody>', html, re.S)
    assert m, f"no table {table_class}"
    return [[unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<td>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", m.group(1), re.S)]


# ------------------------------------------------------------------------------------------ auth

def test_no_token_is_401_with_no_data_and_an_ingest_token_is_403(console):
    col, base = console
    code, body, headers = get(base + "/", token=None)
    assert code == 401 and "sim-0001" not in body and "Bearer" in headers.get("WWW-Authenticate", "")
    code, body, _ = get(base + "/node/sim-0001", token=None)
    assert code == 401 and "sim-0001" not in body
    code, body, _ = get(base + "/", token=INGEST)
    assert code == 403 and "query role" in body and "sim-0001" not in body
    code, body, _ = get(base + "/", token="not-a-token")
    assert code == 401 and "sim-0001" not in body
    assert get(base + "/", token=QUERY)[0] == 200 and get(base + "/", token=ADMIN)[0] == 200


def test_login_exchanges_a_query_token_for_a_session_cookie(console):
    _, base = console
    code, _, headers = get(base + "/login?token=" + INGEST, token=None)
    assert code == 303           # a valid token is a login; the pages then check its role
    code, body, _ = get(base + "/", token=None, cookie=headers["Set-Cookie"].split(";")[0])
    assert code == 403
    assert get(base + "/login?token=wrong", token=None)[0] == 401
    code, _, headers = get(base + "/login?token=" + QUERY, token=None)
    cookie = headers["Set-Cookie"]
    assert code == 303 and headers["Location"] == "/" and "HttpOnly" in cookie and "SameSite=Strict" in cookie
    code, body, _ = get(base + "/", token=None, cookie=cookie.split(";")[0])
    assert code == 200 and "sim-0001" in body
    assert get(base + "/", token=None, cookie="gpuagent_console=forged")[0] == 401


def test_the_console_writes_nothing_and_refuses_to_start_beyond_loopback_without_auth(console, tmp_path):
    _, base = console
    for method in ("POST", "PUT", "DELETE"):
        assert get(base + "/", method=method)[0] == 405
    with pytest.raises(server.CollectorError, match="would show the fleet's data to anyone"):
        server.start_collector(tmp_path / "open.duckdb", "127.0.0.1:0", analyze=False, ui_listen="0.0.0.0:0")
    with pytest.raises(server.CollectorError, match="--ui-listen 'nowhere'"):
        server.start_collector(tmp_path / "bad.duckdb", "127.0.0.1:0", analyze=False, ui_listen="nowhere")


def test_bad_input_is_one_sentence_and_an_unknown_node_is_404(console):
    _, base = console
    code, body, _ = get(base + "/?metric=drop_tables")
    assert code == 400 and "is not one the heatmap offers" in body
    code, body, _ = get(base + "/findings?page=two")
    assert code == 400 and "is not a number" in body
    code, body, _ = get(base + "/node/no-such-node")
    assert code == 404 and "not in this collector's database" in body


# ------------------------------------------------------------------------------------------ numbers

def test_fleet_view_numbers_match_sql(console):
    col, base = console
    code, page, _ = get(base + "/?window=24h")
    assert code == 200 and 'id="synthetic"' in page and "SYNTHETIC" in page
    for severity, n in sql(col, "SELECT severity, count(*) FROM v_open_findings GROUP BY 1"):
        assert re.search(rf'id="open-{severity}">{n} {severity}<', page), (severity, n)
    assert sum(n for _, n in sql(col, "SELECT severity, count(*) FROM v_open_findings GROUP BY 1")) > 0
    rows = {r[0]: r for r in cells(page, "pools")}
    # the pools as `gpuagent-collector compare` gives them over the same live collector, and open flags per pool
    cmp = json.loads(run_compare(None, col.address, window="24h", fmt="json", token=QUERY))
    assert set(rows) == {p["pool"] for p in cmp["pools"]}
    for p in cmp["pools"]:
        lost = p["gpu_hours"] - p["effective_gpu_hours"]
        assert rows[p["pool"]][5] == f"{lost:,.1f}" and rows[p["pool"]][1] == f"{p['nodes']:,.0f}", (p, rows[p["pool"]])
    for pool, n in sql(col, "SELECT n.pool, count(*) FROM flags f JOIN nodes n USING (node_id) "
                            "WHERE f.state = 'open' GROUP BY 1"):
        assert rows[pool][7] == str(n), (pool, rows[pool])
    (nodes,) = sql(col, "SELECT count(DISTINCT node_id) FROM samples_1m WHERE metric = 'gpu_util_percent'")[0]
    assert f"{nodes} nodes with gpu_util_percent in the newest 10 minutes" in page
    data = json.loads(re.search(r"var d=(\[.*?\]),pools=", page, re.S).group(1))
    assert {d[0] for d in data} == {r[0] for r in sql(col, "SELECT DISTINCT node_id FROM samples_1m "
                                                           "WHERE metric = 'gpu_util_percent'")}


def test_the_fleet_pages_default_window_is_the_newest_hour_of_rollups(console):
    col, base = console
    code, page, _ = get(base + "/")
    assert code == 200 and "over the 1h before the newest rollup minute" in page
    rows = {r[0]: r for r in cells(page, "pools")}
    want = dict(sql(col, """
        WITH e AS (SELECT max(minute) AS m FROM samples_1m)
        SELECT coalesce(n.pool, '(no pool)'), count(*) / 60e0 FROM samples_1m s JOIN nodes n USING (node_id) CROSS JOIN e
        WHERE s.metric = 'gpu_util_percent' AND s.gpu IS NOT NULL AND s.minute > e.m - INTERVAL 1 HOUR
        GROUP BY 1"""))
    assert want and set(want) <= set(rows)
    for pool, gpu_hours in want.items():
        assert rows[pool][3] == f"{gpu_hours:,.1f}", (pool, gpu_hours, rows[pool])
    assert get(base + "/?window=2d")[0] == 400


def test_findings_view_pages_filters_and_links_to_node_and_job(console):
    col, base = console
    (total,) = sql(col, "SELECT count(*) FROM findings WHERE state = 'open'")[0]
    code, page, _ = get(base + "/findings")
    assert code == 200 and f"({total} rows)" in page or f"{total} rows" in page
    rows = cells(page, "findings")
    assert len(rows) == min(total, 50)
    kind = sql(col, "SELECT kind FROM findings WHERE state = 'open' GROUP BY 1 ORDER BY count(*) DESC LIMIT 1")[0][0]
    (n_kind,) = sql(col, f"SELECT count(*) FROM findings WHERE state = 'open' AND kind = '{kind}'")[0]
    _, filtered, _ = get(base + f"/findings?kind={quote(kind)}")
    assert {r[1] for r in cells(filtered, "findings")} == {kind} and len(cells(filtered, "findings")) == min(n_kind, 50)
    # a finding on a node links to that node with the finding's window, and to the jobs on it then
    m = re.search(r'<a href="(/node/[^"]+\?start=\d+&amp;end=\d+)">', page)
    assert m, "no finding links to its node"
    code, node_page, _ = get(base + unescape(m.group(1)))
    assert code == 200 and "<h2>GPUs</h2>" in node_page and "<svg" in node_page
    jobs = re.findall(r'<a href="(/job/[^"]+)">', page + node_page)
    assert jobs, "neither the findings nor the node link to a job"
    code, job_page, _ = get(base + unescape(jobs[0]))
    assert code == 200 and '<table class="job-nodes">' in job_page


def test_node_view_shows_its_gpus_flags_and_links_as_sql_has_them(console):
    col, base = console
    node_id, host = sql(col, "SELECT node_id, hostname FROM nodes WHERE hostname = 'sim-0001'")[0]
    _, page, _ = get(base + f"/node/{quote(node_id)}")
    assert f"Node {host}" in page
    assert [int(r[0]) for r in cells(page, "gpus")] == [g for (g,) in sql(
        col, f"SELECT gpu FROM gpus WHERE node_id = '{node_id}' ORDER BY gpu")]
    (open_flags,) = sql(col, f"SELECT count(*) FROM flags WHERE node_id = '{node_id}' AND state = 'open'")[0]
    assert sum(1 for r in cells(page, "flags") if r[0] == "open") == open_flags
    assert "sim-0002" in page      # the bad link of the fleet's fabric (sim_helpers.BAD_LINK) is a fabric row
    # the page reads link_results for this node only; its rows must be the link_matrix_latest view's
    want = sorted((peer, probe, f"{gbits:,.1f}" if gbits is not None else "–") for peer, probe, gbits in sql(col, f"""
        SELECT CASE WHEN node_a = '{node_id}' THEN node_b ELSE node_a END, probe, send_gbits_per_s
        FROM link_matrix_latest WHERE '{node_id}' IN (node_a, node_b)"""))
    assert want and sorted((r[0], r[1], r[2]) for r in cells(page, "links")) == want


def test_job_view_numbers_match_sql(console):
    col, base = console
    job_id, n_nodes = sql(col, "SELECT job_id, count(DISTINCT node_id) FROM jobs GROUP BY 1 ORDER BY 2 DESC, 1 LIMIT 1")[0]
    _, page, _ = get(base + f"/job/{quote(job_id)}")
    assert len(cells(page, "job-nodes")) == n_nodes
    (n_gpus,) = sql(col, f"SELECT count(*) FROM (SELECT DISTINCT node_id, gpu FROM job_samples_1m "
                         f"WHERE job_id = '{job_id}' AND gpu >= 0)")[0]
    assert len(cells(page, "job-gpus")) == n_gpus


def test_pool_view_lists_its_nodes(console):
    col, base = console
    pool, n = sql(col, "SELECT pool, count(*) FROM nodes GROUP BY 1 ORDER BY 1 LIMIT 1")[0]
    _, page, _ = get(base + f"/pool/{quote(pool)}")
    assert len(cells(page, "nodes")) == n and f"Pool {pool}" in page


# ------------------------------------------------------------------------------------------ browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(args: list[str], profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                           "--virtual-time-budget=4000", "--enable-logging=stderr", "--v=0", *args],
                          capture_output=True, text=True, timeout=120)


@needs("chromium")
def test_every_view_loads_in_headless_chromium_without_errors_or_fetches(console, tmp_path):
    col, base = console
    profile = tmp_path / "profile"
    # the browser logs in once (the cookie stays in its profile), as a person opening the printed link does
    res = chromium(["--dump-dom", f"{base}/login?token={QUERY}"], profile)
    assert res.returncode == 0 and 'id="heatmap"' in res.stdout, res.stderr[-2000:]
    node_id = sql(col, "SELECT node_id FROM nodes WHERE hostname = 'sim-0004'")[0][0]
    job_id = sql(col, "SELECT job_id FROM jobs ORDER BY job_id LIMIT 1")[0][0]
    pool = sql(col, "SELECT pool FROM nodes WHERE hostname = 'sim-0004'")[0][0]
    views = {"fleet": "/", "findings": "/findings", "pool": f"/pool/{quote(pool)}",
             "node": f"/node/{quote(node_id)}", "job": f"/job/{quote(job_id)}"}
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    for name, path in views.items():
        res = chromium(["--dump-dom", base + path], profile)
        assert res.returncode == 0, res.stderr[-2000:]
        dom = res.stdout
        assert "SYNTHETIC data" in dom and "Login needed" not in dom, (name, dom[:500])
        console_lines = [ln for ln in res.stderr.splitlines() if ":CONSOLE" in ln or "Refused to" in ln]
        assert console_lines == [], (name, console_lines)
        shot = ARTEFACTS / f"{name}.png"
        res = chromium([f"--screenshot={shot}", "--window-size=1280,1600", "--hide-scrollbars", base + path], profile)
        assert res.returncode == 0 and shot.stat().st_size > 10_000, (name, res.stderr[-1000:])
    # the heatmap canvas is drawn from the page's own data (its script ran: a taller canvas than the default)
    probe = tmp_path / "probe.html"
    _, fleet_page, _ = get(base + "/")
    probe.write_text(fleet_page.replace("<head>", "<head>" + COLLECTOR_JS, 1))
    res = chromium(["--proxy-server=127.0.0.1:9", "--dump-dom", probe.as_uri()], profile)
    errors = json.loads(unescape(re.search(r'<pre id="__test_errors">(.*?)</pre>', res.stdout, re.S).group(1)))
    assert errors == [] and re.search(r'<canvas id="heatmap" width="960" height="\d+"', res.stdout)
