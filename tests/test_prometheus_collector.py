"""A real Prometheus scrapes, for more than 30 s, a real agent (subprocess of the `gpuagent` CLI, the real
pynvml answered by the NVML emulator's SYNTHETIC 8 x H100 node on the real clock, and a tracked training
loop) and a real collector fed by that agent and by the simulator (SYNTHETIC fleet).

Through Prometheus's HTTP API: the agent's series are there and equal `gpuagent status --json` and the
collector's DuckDB for the same ticks (host metrics, and GPU metrics from the emulated NVML); the collector's
series agree with its DuckDB; the analyzer's flags and findings appear as gpuagent_flag_open /
gpuagent_finding_open; every PromQL expression of the Grafana dashboard returns data. `promtool check
metrics` passes on both endpoints, and the collector's refuses a scrape without its token.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tools import needs

from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.service import CollectorError, start_collector
from gpuagent.sim.run import SimConfig, run_sim

from agent_helpers import agent_env, read_status, stop
# DCGM_NAME_LINTS: the lints dcgm-exporter's own names cause on the agent's endpoint
from exporter_helpers import DCGM_NAME_LINTS
from conftest import free_port, wait_for
from nvml_emulator_fixture import H100_8GPU
from sim_helpers import fleet

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "packaging" / "grafana" / "gpuagent.json"
TOKEN = "prom-test-token"
JOB_ID = "prom-e2e-job"
MIB = 2 ** 20
# (Prometheus name, `gpuagent status --json` GPU field, DuckDB samples metric, scale from status to Prometheus)
GPU_CHECKS = [("DCGM_FI_DEV_GPU_UTIL", "util_percent", "gpu_util_percent", 1.0),
              ("DCGM_FI_DEV_MEM_COPY_UTIL", "mem_util_percent", "gpu_mem_util_percent", 1.0),
              ("DCGM_FI_DEV_MEMORY_TEMP", "memory_temperature_celsius", "gpu_memory_temperature_celsius", 1.0),
              ("DCGM_FI_DEV_POWER_USAGE", "power_watts", "gpu_power_watts", 1.0),
              ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "energy_consumed_mj", "gpu_energy_consumed_mj", 1.0),
              ("DCGM_FI_DEV_GPU_TEMP", "temperature_celsius", "gpu_temperature_celsius", 1.0),
              ("DCGM_FI_DEV_SM_CLOCK", "sm_clock_mhz", "gpu_sm_clock_mhz", 1.0),
              ("DCGM_FI_DEV_MEM_CLOCK", "mem_clock_mhz", "gpu_mem_clock_mhz", 1.0),
              ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "pcie_replay_count", "gpu_pcie_replay_count", 1.0),
              ("DCGM_FI_PROF_PCIE_TX_BYTES", "pcie_tx_bytes_per_s", "gpu_pcie_tx_bytes_per_s", 1.0),
              ("DCGM_FI_PROF_NVLINK_RX_BYTES", "nvlink_raw_rx_bytes_per_s", "gpu_nvlink_raw_rx_bytes_per_s", 1.0),
              ("gpuagent_gpu_power_limit_watts", "power_limit_watts", "gpu_power_limit_watts", 1.0)]
# (Prometheus name, `gpuagent status --json` host field, DuckDB samples metric, scale)
HOST_CHECKS = [("gpuagent_host_cpu_idle_ratio", "cpu_idle_percent", "cpu_idle_percent", 0.01),
               ("gpuagent_host_cpu_steal_ratio", "cpu_steal_percent", "cpu_steal_percent", 0.01),
               ("gpuagent_host_cpu_user_ratio", "cpu_user_percent", "cpu_user_percent", 0.01),
               ("gpuagent_host_load1", "load1", "load1", 1.0),
               ("gpuagent_host_load15", "load15", "load15", 1.0),
               ("gpuagent_host_memory_total_bytes", "mem_total_bytes", "mem_total_bytes", 1.0),
               ("gpuagent_host_memory_used_bytes", "mem_used_bytes", "mem_used_bytes", 1.0),
               ("gpuagent_host_memory_available_bytes", "mem_available_bytes", "mem_available_bytes", 1.0),
               ("gpuagent_host_context_switches_per_second", "context_switches_per_s", "context_switches_per_s", 1.0)]
# A training loop with the gpuagent.jobs tracker: ~20 steps/s, a data wait in each step.
TRAINING_LOOP = """
import sys, time
from gpuagent.jobs import track
t = track(name="prom-e2e", samples_per_step=32, tokens_per_step=4096, socket_path=sys.argv[1])
while True:
    time.sleep(0.01)
    t.data_ready()
    time.sleep(0.04)
    t.step()
"""

pytestmark = [pytest.mark.slow,
              needs("prometheus", "promtool")]


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

    def by_gpu(self, expr: str, at: float) -> dict[int, float]:
        return {int(m["metric"]["gpu"]): float(m["value"][1]) for m in self.query(expr, at)}


@pytest.fixture
def collector(tmp_path):
    # Baselines recomputed every pass: the first passes run while the backfill is still arriving, and a
    # baseline of 2 of the 3 bare-metal nodes would otherwise stand for the default 15 min.
    cfg = A.AnalyzerConfig(interval_s=3.0, window_s=3 * 3600.0, probe_window_s=3 * 3600.0, baseline_refresh_s=0.0)
    handle = start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", TOKEN, analyzer_config=cfg,
                             metrics_listen="127.0.0.1:0")
    yield handle
    handle.stop()


class RunningAgent:
    """`gpuagent run` (the real CLI and pynvml) over an emulated node (``emu``), and a tracked training loop."""

    def __init__(self, tmp_path: Path, collector_address: str, emu):
        self.port = free_port()
        self.state = tmp_path / "agent-state"
        cfg = tmp_path / "agent.toml"
        cfg.write_text(f'[collector]\ntoken = "{TOKEN}"\n[probes]\nenabled = false\n'
                       f'[exporter]\nlisten = "127.0.0.1:{self.port}"\n')
        env = agent_env(tmp_path, GPUAGENT_CONFIG=str(cfg))
        self.log = open(tmp_path / "agent.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuagent.agent.cli", "run",
                                      "--collector", collector_address, "--state-dir", str(self.state),
                                      "--interval", "1", "--batch-interval", "1",
                                      # every sample raw: each tick's exposed values are compared with its rows
                                      "--summary-interval", "0"],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=emu.env(env))
        self.job = subprocess.Popen([sys.executable, "-c", TRAINING_LOOP, env["GPUAGENT_JOBS_SOCKET"]],
                                    stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=dict(env, GPUAGENT_JOB_ID=JOB_ID))

    def status(self) -> dict:
        out = subprocess.run([sys.executable, "-m", "gpuagent.agent.cli", "status", "--json", "--state-dir",
                              str(self.state)], capture_output=True, text=True, cwd=ROOT, timeout=60,
                             env=agent_env(self.state.parent))
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def stop(self) -> None:
        if self.job.poll() is None:
            self.job.kill()
            self.job.wait(10)
        try:
            assert stop(self.proc, timeout=30) == 0
        finally:
            self.log.close()


@pytest.fixture
def agent(collector, tmp_path, nvml_emulator):
    # the real clock: counters (energy, PCIe, NVLink) move between ticks; root, so MIG calls answer
    emu = nvml_emulator(H100_8GPU, clock="real", privileged=True, activate=False)
    a = RunningAgent(tmp_path, collector.address, emu)
    try:
        wait_for(lambda: (st := read_status(a.state)) and st.get("pid") == a.proc.pid
                 and any(j["job_id"] == JOB_ID and j.get("samples_per_s") for j in st.get("jobs", []))
                 if a.proc.poll() is None else pytest.fail((tmp_path / "agent.log").read_text()[-2000:]),
                 timeout=60, interval=0.2, what="the agent running with the tracked job's throughput")
        yield a
    finally:
        a.stop()


@pytest.fixture
def targets(collector, agent, tmp_path):
    """job -> (address, token file or None, scrape interval). The agent is scraped twice per tick, so
    every tick is scraped at least once (a status read of any tick has a scrape to compare with)."""
    token_file = tmp_path / "collector.token"
    token_file.write_text(TOKEN + "\n")
    return {"gpuagent-collector": (f"127.0.0.1:{collector.metrics.port}", token_file, "1s"),
            "gpuagent": (f"127.0.0.1:{agent.port}", None, "1s")}    # a 500 ms timeout once missed on loaded CI


@pytest.fixture
def prometheus(targets, tmp_path):
    jobs = []
    for job, (address, token_file, interval) in targets.items():
        auth = (f"    authorization:\n      type: Bearer\n      credentials_file: {token_file}\n"
                if token_file else "")
        jobs.append(f"  - job_name: {job}\n    scrape_interval: {interval}\n    scrape_timeout: {interval}\n"
                    f"{auth}    static_configs:\n      - targets: ['{address}']\n")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n" + "".join(jobs))
    port = free_port()
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


def _agent_tick_scrapes(prometheus: Prom, at: float) -> dict[int, float]:
    """tick end (ns, within the ~0.2 us a float64 of seconds keeps) -> the time of a scrape that read it."""
    (series,) = prometheus.query('gpuagent_agent_last_tick_timestamp_seconds{job="gpuagent"}[60s]', at)
    return {round(float(v) * 1e9): float(t) for t, v in series["values"]}


def _scrape_of(prometheus: Prom, tick_ns: int) -> float | None:
    return next((t for k, t in _agent_tick_scrapes(prometheus, time.time()).items() if abs(k - tick_ns) <= 1000),
                None)


def _stored(collector, node: str, metric: str, gpu: int | None, tick_ns: int) -> float | None:
    """The value of ``metric`` the agent had at the tick that ended at ``tick_ns``: its latest sample
    taken up to then (a tick's samples carry its start time, which precedes its end)."""
    gpu_sql = "gpu IS NULL" if gpu is None else f"gpu = {gpu}"
    rows = _db(collector, f"SELECT value FROM samples WHERE node_id = '{node}' AND metric = '{metric}' AND {gpu_sql} "
                          f"AND labels = '' AND epoch_ns(ts) <= {tick_ns} ORDER BY ts DESC LIMIT 1")
    return rows[0][0] if rows else None


def _check_agent(prometheus: Prom, agent: RunningAgent, collector) -> None:
    """The agent's series equal `gpuagent status --json` and the collector's DuckDB for the same ticks."""
    # `gpuagent status --json`, until a status's tick is one Prometheus scraped (both twice a tick: soon).
    def status_with_scrape():
        st = agent.status()
        tick = int(st["updated_ns"])
        scraped = wait_for(lambda: _scrape_of(prometheus, tick) or
                           (None if time.time_ns() - tick < 5e9 else -1), timeout=30, interval=0.25,
                           what="a scrape of the status's tick")
        return (st, scraped) if scraped > 0 else None
    st, t_scrape = wait_for(status_with_scrape, timeout=120, interval=0.1, what="a status read of a scraped tick")
    assert prometheus.scalar('gpuagent_agent_ticks_total{job="gpuagent"}', t_scrape) == st["counters"]["ticks"]
    gpus = {g["index"]: g for g in st["gpus"]}
    assert len(gpus) == 8
    for name, field, _metric, scale in GPU_CHECKS:
        want = {i: g[field] * scale for i, g in gpus.items() if g.get(field) is not None}
        assert want, f"status has no {field}"
        assert prometheus.by_gpu(f'{name}{{job="gpuagent"}}', t_scrape) == pytest.approx(want, rel=1e-12), name
    for name, field, _metric, scale in HOST_CHECKS:
        assert st["host"][field] is not None, field
        assert prometheus.scalar(f'{name}{{job="gpuagent"}}', t_scrape) == pytest.approx(st["host"][field] * scale,
                                                                                      rel=1e-12), name
    assert prometheus.scalar('gpuagent_spool_backlog_bytes{job="gpuagent"}', t_scrape) == st["spool"]["backlog_bytes"]
    assert prometheus.scalar('gpuagent_collector_connected{job="gpuagent"}', t_scrape) == 1.0
    (job,) = [j for j in st["jobs"] if j["job_id"] == JOB_ID]
    for name, field in (("gpuagent_job_steps_per_second", "steps_per_s"),
                        ("gpuagent_job_samples_per_second", "samples_per_s"),
                        ("gpuagent_job_tokens_per_second", "tokens_per_s"),
                        ("gpuagent_job_data_wait_ratio", "data_wait_fraction")):
        assert prometheus.scalar(f'{name}{{job_id="{JOB_ID}"}}', t_scrape) == pytest.approx(job[field], rel=1e-12)
    assert job["samples_per_s"] == pytest.approx(32 * job["steps_per_s"]) and 0 < job["data_wait_fraction"] < 1

    # DuckDB: three ticks spread over the last ~30 s, each as Prometheus scraped it and as the collector stored it.
    node = st["node"]["node_id"]
    ticks = sorted(_agent_tick_scrapes(prometheus, t_scrape + 0.01).items())
    assert len(ticks) >= 20, f"{len(ticks)} agent ticks scraped in 60 s"
    chosen = [ticks[0], ticks[len(ticks) // 2], ticks[-1]]
    last_tick = chosen[-1][0]
    wait_for(lambda: _db(collector, f"SELECT max(epoch_ns(ts)) FROM samples WHERE node_id = '{node}'")[0][0] or 0
             >= last_tick - 2e9 and agent.status()["collector"]["last_ack_ns"] > last_tick,
             timeout=60, interval=0.5, what="the collector holding the chosen ticks")
    for tick, at in chosen:
        for name, _field, metric, scale in GPU_CHECKS:
            got = prometheus.by_gpu(f'{name}{{job="gpuagent"}}', at)
            want = {i: v * scale for i in range(8) if (v := _stored(collector, node, metric, i, tick)) is not None}
            assert got == pytest.approx(want, rel=1e-9) and want, (name, tick)
        for name, _field, metric, scale in HOST_CHECKS:
            want = _stored(collector, node, metric, None, tick)
            assert want is not None and prometheus.scalar(f'{name}{{job="gpuagent"}}', at) == pytest.approx(
                want * scale, rel=1e-9), (name, tick)


def test_prometheus_scrapes_agent_and_collector_and_agrees_with_status_and_duckdb(collector, agent, prometheus,
                                                                                  targets, tmp_path):
    address, _, _ = targets["gpuagent-collector"]
    agent_address, _, _ = targets["gpuagent"]
    # Without the token: refused, and nothing leaks.
    code, body = _get(f"http://{address}/metrics")
    assert code == 401 and b"gpuagent_" not in body
    code, _ = _get(f"http://{address}/metrics", token="wrong")
    assert code == 401

    started = time.time()
    # A backfilled SYNTHETIC fleet (3 bare-metal, 3 cloud-a with slower PCIe, 2 cloud-b), then live batches,
    # while the real agent sends its own (emulated-NVML) ticks to the same collector.
    summary = run_sim(SimConfig(collector=collector.address, token=TOKEN, sim_hours=2.0, interval_s=10.0,
                                batch_s=600.0, seed=7, streams=8), fleet())
    assert summary.nodes_ok == 8, summary.errors
    live = run_sim(SimConfig(collector=collector.address, token=TOKEN, duration_s=max(5.0, 32.0 - (time.time() - started)),
                             interval_s=1.0, batch_s=2.0, seed=8, streams=8), fleet())
    assert live.nodes_ok == 8, live.errors
    assert time.time() - started >= 30.0

    # The agent: >= 30 s of scrapes, every tick's series present, values equal to status and DuckDB.
    up = prometheus.query('up{job="gpuagent"}[60s]')[0]["values"]
    assert float(up[-1][0]) - float(up[0][0]) >= 25 and all(v == "1" for _t, v in up)
    _check_agent(prometheus, agent, collector)
    code, agent_text = _get(f"http://{agent_address}/metrics")
    assert code == 200
    r = subprocess.run(["promtool", "check", "metrics"], input=agent_text, capture_output=True, timeout=60)
    problems = [line for line in (r.stdout + r.stderr).decode().splitlines() if line.strip()]
    assert [p for p in problems if not any(re.fullmatch(d, p) for d in DCGM_NAME_LINTS)] == [], problems

    # Freeze the analysis so flags and findings are one state, then wait for a scrape that read it (cache 5 s).
    collector.analyzer.stop()
    collector.analyzer.run_once()
    settle_from = time.time()
    wait_for(lambda: prometheus.query(f"timestamp(gpuagent_collector_writer_queue_depth) > {settle_from + 6}"),
             timeout=30, interval=0.5, what="a scrape after the final pass")
    at = time.time()

    # Ingested samples rose over the >= 30 s that Prometheus watched.
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
    # Last-seen age per node, for every node (the sim's and the real agent's).
    ages = prometheus.query("gpuagent_collector_node_last_seen_age_seconds", at)
    assert {m["metric"]["node"] for m in ages} == {r[0] for r in _db(collector, "SELECT node_id FROM nodes")}
    assert prometheus.scalar("gpuagent_collector_commit_duration_seconds_count", at) >= 1
    assert prometheus.scalar("gpuagent_collector_analysis_passes_total", at) >= 1

    # promtool check metrics on the collector's endpoint.
    code, body = _get(f"http://{address}/metrics", token=TOKEN)
    assert code == 200
    r = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert r.returncode == 0, (r.stdout + r.stderr).decode()

    # Every dashboard expression (agent and collector panels) returns data from this Prometheus.
    exprs = _dashboard_exprs()
    assert len(exprs) >= 25
    empty = [(title, e) for title, e in exprs if not prometheus.query(e, at)]
    assert not empty, empty

    # With the agent stopped and its last batch stored, the ingest counter equals what the database logged.
    agent.stop()
    def counter_matches_db():
        (stored,) = _db(collector, "SELECT sum(n_samples) FROM ingest_log")[0]
        scraped_from = time.time()
        wait_for(lambda: prometheus.query(f"timestamp(gpuagent_collector_writer_queue_depth) > {scraped_from + 6}"),
                 timeout=30, interval=0.5, what="a collector scrape after reading the database")
        return prometheus.scalar("gpuagent_collector_ingested_samples_total", time.time()) == float(stored) > 0
    wait_for(counter_matches_db, timeout=90, interval=0, what="the ingest counter equal to the ingest log")


def test_dashboard_names_only_what_gpuagent_exports():
    """Each name is one the agent (agent/surface/exporter.py) or the collector (collector/views/metrics.py) exports;
    the end-to-end test above shows each expression returns data. Some agent names start gpuagent_collector_
    (the agent's link to the collector), so the source decides, not the prefix."""
    names = set().union(*(_names(e) for _t, e in _dashboard_exprs()))
    assert len(names) >= 20
    sources = {"collector": (ROOT / "collector" / "views" / "metrics.py").read_text(),
               "agent": "".join((ROOT / "agent" / "surface" / f).read_text()      # the exporter's modules
                                for f in ("exporter.py", "dcgm_names.py", "dcgm_families.py",
                                          "gpuagent_families.py"))}
    unknown = []
    for n in sorted(names - {"up"}):
        base = re.sub(r"_(total|bucket|count|sum)$", "", n)
        if not any(f'"{base}"' in src or f'"{n}"' in src for src in sources.values()):
            unknown.append(n)
    assert not unknown, unknown


def test_metrics_beyond_loopback_without_a_token_is_refused(tmp_path):
    with pytest.raises(CollectorError, match="refusing to serve metrics on 0.0.0.0:0 without a token"):
        start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", analyze=False, metrics_listen="0.0.0.0:0")
