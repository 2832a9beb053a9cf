"""A real Prometheus scrapes a real collector fed by the simulator (SYNTHETIC fleet) for more than 30 s.

Through Prometheus's HTTP API: the collector's series are there, their values agree with the collector's DuckDB
at the same moment, the analyzer's flags and findings appear as gpuagent_flag_open / gpuagent_finding_open,
and every dashboard expression over collector metrics returns data. `promtool check metrics` passes on the
endpoint, and the endpoint refuses a scrape without the collector's token.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from gpuagent import local_run
from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.ingest.server import CollectorError, start_collector
from gpuagent.sim.run import SimConfig, run_sim

from conftest import wait_for
from sim_helpers import fleet

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "packaging" / "grafana" / "gpuagent.json"
TOKEN = "prom-test-token"
# Metric name prefixes the collector exports; dashboard expressions naming only these are checked here.
COLLECTOR_PREFIXES = ("gpuagent_collector_", "gpuagent_finding_", "gpuagent_flag_")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                 reason="prometheus/promtool not installed (Debian package prometheus)")]


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback only, whatever *_proxy says


def _get(url: str, token: str | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing listens yet."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except urllib.error.URLError:
        return 0, b""


class Prom:
    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        code, body = _get(f"{self.base}/api/v1/query?{urllib.parse.urlencode(params)}")
        doc = json.loads(body)
        assert code == 200 and doc["status"] == "success", (expr, body[:300])
        return doc["data"]["result"]

    def scalar(self, expr: str, at: float | None = None) -> float:
        (r,) = self.query(expr, at)
        return float(r["value"][1])


@pytest.fixture
def collector(tmp_path):
    cfg = A.AnalyzerConfig(interval_s=3.0, window_s=3 * 3600.0, probe_window_s=3 * 3600.0)
    handle = start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", TOKEN, analyzer_config=cfg,
                             metrics_listen="127.0.0.1:0")
    yield handle
    handle.stop()


@pytest.fixture
def targets(collector, tmp_path):
    """job -> (address, token file or None). An agent target is one more line here once the agent exports."""
    token_file = tmp_path / "collector.token"
    token_file.write_text(TOKEN + "\n")
    return {"gpuagent-collector": (f"127.0.0.1:{collector.metrics.port}", token_file)}


@pytest.fixture
def prometheus(targets, tmp_path):
    jobs = []
    for job, (address, token_file) in targets.items():
        auth = (f"    authorization:\n      type: Bearer\n      credentials_file: {token_file}\n"
                if token_file else "")
        jobs.append(f"  - job_name: {job}\n{auth}    static_configs:\n      - targets: ['{address}']\n")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n" + "".join(jobs))
    port = local_run.free_port()
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: _get(f"http://127.0.0.1:{port}/-/ready")[0] == 200 if proc.poll() is None else
                 pytest.fail((tmp_path / "prometheus.log").read_text()[-2000:]), timeout=60, interval=0.2,
                 what="prometheus ready")
        yield Prom(port)
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _db(collector, sql: str):
    """Read the collector's database now (on its writer thread, so the answer is one consistent moment)."""
    return collector.writer.call(lambda con: con.execute(sql).fetchall()).result(timeout=60)


def _dashboard_exprs() -> list[tuple[str, str]]:
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for p in doc["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def _names(expr: str) -> set[str]:
    names = set(re.findall(r"\b([A-Za-z_:][A-Za-z0-9_:]*)\s*(?:\{|\[|\)|$|\s*[<>=!*/+-]|\s+(?:or|and|unless)\b)", expr))
    keywords = {"sum", "max", "min", "avg", "count", "rate", "increase", "by", "on", "group_left", "vector",
                "histogram_quantile", "or", "and", "le", "time"}
    return {n for n in names if n not in keywords and (n.startswith("gpuagent_") or n.startswith("DCGM_") or n == "up")}


def test_prometheus_scrapes_the_collector_and_agrees_with_duckdb(collector, prometheus, targets, tmp_path):
    address, _ = targets["gpuagent-collector"]
    # Without the token: refused, and nothing leaks.
    code, body = _get(f"http://{address}/metrics")
    assert code == 401 and b"gpuagent_" not in body
    code, _ = _get(f"http://{address}/metrics", token="wrong")
    assert code == 401

    started = time.time()
    # A backfilled SYNTHETIC fleet (3 bare-metal, 3 cloud-a with slower PCIe, 2 cloud-b), then live batches.
    summary = run_sim(SimConfig(collector=collector.address, token=TOKEN, sim_hours=2.0, interval_s=10.0,
                                batch_s=600.0, seed=7, streams=8), fleet())
    assert summary.nodes_ok == 8, summary.errors
    live = run_sim(SimConfig(collector=collector.address, token=TOKEN, duration_s=max(5.0, 32.0 - (time.time() - started)),
                             interval_s=1.0, batch_s=2.0, seed=8, streams=8), fleet())
    assert live.nodes_ok == 8, live.errors
    assert time.time() - started >= 30.0

    # Freeze the analysis so flags and findings are one state, then wait for a scrape that read it (cache 5 s).
    collector.analyzer.stop()
    collector.analyzer.run_once()
    settle_from = time.time()
    wait_for(lambda: prometheus.query(f"timestamp(gpuagent_collector_writer_queue_depth) > {settle_from + 6}"),
             timeout=30, interval=0.5, what="a scrape after the final pass")
    at = time.time()

    # Ingested samples: the counter equals what the database logged (all batches committed by now).
    (stored,) = _db(collector, "SELECT sum(n_samples) FROM ingest_log")[0]
    assert prometheus.scalar("gpuagent_collector_ingested_samples_total", at) == float(stored) > 0
    # ... and it rose over the >= 30 s that Prometheus watched.
    rng = prometheus.query("gpuagent_collector_ingested_samples_total[60s]", at)[0]["values"]
    assert len(rng) >= 20 and float(rng[-1][1]) > float(rng[0][1])
    assert float(rng[-1][0]) - float(rng[0][0]) >= 25

    # Open flags: the same set in Prometheus and in DuckDB.
    flags = _db(collector, "SELECT kind, component, node_id, coalesce(gpu::VARCHAR, ''), severity, value, baseline "
                           "FROM flags WHERE state = 'open'")
    assert any(f[0] == "virtualization_overhead" and f[1] in ("h2d", "d2h") for f in flags)
    prom_flags = {(m["metric"]["kind"], m["metric"].get("component", ""), m["metric"]["node"], m["metric"].get("gpu", ""),
                   m["metric"]["severity"]) for m in prometheus.query("gpuagent_flag_open", at)}
    assert prom_flags == {f[:5] for f in flags}
    values = {(m["metric"]["kind"], m["metric"]["node"], m["metric"].get("component", ""), m["metric"].get("gpu", "")):
              float(m["value"][1])
              for m in prometheus.query("gpuagent_flag_value", at)}
    for kind, comp, node, gpu, _sev, value, _base in flags:
        assert values[(kind, node, comp, gpu)] == pytest.approx(value, rel=1e-9)
    # Findings: the pool-wide PCIe penalty of cloud-a is one pool finding.
    findings = _db(collector, "SELECT kind, scope, coalesce(node_id, ''), coalesce(pool, ''), severity "
                              "FROM findings WHERE state = 'open'")
    prom_findings = prometheus.query("gpuagent_finding_open", at)
    assert sum(float(m["value"][1]) for m in prom_findings) == len(findings) > 0
    assert ("virtualization_overhead", "pool", "", "cloud-a") in {f[:4] for f in findings}
    assert any(m["metric"].get("scope") == "pool" and m["metric"].get("pool") == "cloud-a" for m in prom_findings)
    # Last-seen age per node, for every node.
    ages = prometheus.query("gpuagent_collector_node_last_seen_age_seconds", at)
    assert {m["metric"]["node"] for m in ages} == {r[0] for r in _db(collector, "SELECT node_id FROM nodes")}
    assert prometheus.scalar("gpuagent_collector_commit_duration_seconds_count", at) >= 1
    assert prometheus.scalar("gpuagent_collector_analysis_passes_total", at) >= 1

    # promtool check metrics on the endpoint.
    code, body = _get(f"http://{address}/metrics", token=TOKEN)
    assert code == 200
    r = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert r.returncode == 0, (r.stdout + r.stderr).decode()

    # Every dashboard expression over collector metrics returns data from this Prometheus.
    exprs = [(title, e) for title, e in _dashboard_exprs()
             if _names(e) and all(n.startswith(COLLECTOR_PREFIXES) for n in _names(e))]
    assert len(exprs) >= 12
    empty = [(title, e) for title, e in exprs if not prometheus.query(e, at)]
    assert not empty, empty


def test_dashboard_names_only_what_gpuagent_exports():
    exported_agent = {"up", "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_TEMP",
                      "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_XID_ERRORS", "gpuagent_collector_last_ack_age_seconds",
                      "gpuagent_spool_dropped_batches_total", "gpuagent_job_samples_per_second",
                      "gpuagent_job_data_wait_ratio"}
    names = set().union(*(_names(e) for _t, e in _dashboard_exprs()))
    collector_names = {n for n in names if n.startswith(COLLECTOR_PREFIXES)}
    metrics_src = (ROOT / "collector" / "views" / "metrics.py").read_text()
    for n in collector_names:
        base = re.sub(r"_(total|bucket|count|sum)$", "", n)
        assert f'"{base}' in metrics_src, n
    assert names - collector_names <= exported_agent, sorted(names - collector_names - exported_agent)


def test_metrics_beyond_loopback_without_a_token_is_refused(tmp_path):
    with pytest.raises(CollectorError, match="refusing to serve metrics on 0.0.0.0:0 without a token"):
        start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", analyze=False, metrics_listen="0.0.0.0:0")
