"""The collector's Prometheus ``/metrics``: its own health, open findings and open flags.

Off by default (``serve --metrics-listen HOST:PORT`` or ``[metrics] listen`` in the collector config). The
exposition is prometheus_client's; this module only gathers the values:

- counters and gauges the ingest path already keeps (the writer's stats, queue depth, connected streams) are
  read at scrape time, and a commit latency histogram is fed by the writer after each commit;
- what lives in DuckDB (node last-seen, analysis passes, findings, flags) is read through a read cursor, never
  on the writer thread, and cached for ``cache_s`` so that several scrapers cost one read.

With a collector token set, every request must carry ``Authorization: Bearer <token>`` (Prometheus:
``authorization: {credentials_file: ...}``, see packaging/prometheus/scrape.yml).
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder

from gpuagent.collector.actions.engine import COUNTS_SQL, DRAINED_SQL
from gpuagent.collector.analysis.steps import pass_steps
from gpuagent.common.errors import first_line
from gpuagent.common.hostport import AddressError, is_loopback, split_host_port

log = logging.getLogger("gpuagent.collector.metrics")

COMMIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class MetricsError(RuntimeError):
    """The metrics endpoint cannot start; one sentence."""


def _labels(value: Any) -> str:
    return "" if value is None else str(value)


class _DbSnapshot:
    """What a scrape reads from DuckDB, taken at most every ``cache_s`` seconds."""

    def __init__(self, cursor_factory: Callable[[], Any], cache_s: float):
        self._cursor_factory = cursor_factory
        self._cache_s = cache_s
        self._lock = threading.Lock()
        self._at = -1e18
        self._data: dict[str, Any] | None = None
        self.errors = 0

    def get(self) -> dict[str, Any] | None:
        with self._lock:
            if time.monotonic() - self._at >= self._cache_s:
                try:
                    self._data = self._read()
                except Exception as exc:  # noqa: BLE001 - a scrape reports the read error and keeps the rest
                    self.errors += 1
                    self._data = None
                    log.warning("metrics: reading the database failed: %s", first_line(exc))
                self._at = time.monotonic()
            return self._data

    def _read(self) -> dict[str, Any]:
        cur = self._cursor_factory()
        try:
            now = datetime.now(timezone.utc).replace(tzinfo=None)
            nodes = cur.execute("SELECT node_id, coalesce(pool, ''), last_seen FROM nodes").fetchall()
            runs = cur.execute("SELECT count(*), arg_max(rollup_s + flags_s, ended_at), max(ended_at), "
                               "arg_max(failed_steps, ended_at) FROM analysis_runs").fetchone()
            step_failures = cur.execute("SELECT step, count(*) FROM analysis_failures GROUP BY step").fetchall()
            findings = cur.execute(
                "SELECT kind, scope, coalesce(node_id, ''), coalesce(pool, ''), severity, count(*), sum(flags) "
                "FROM findings WHERE state = 'open' GROUP BY ALL").fetchall()
            flags = cur.execute(
                "SELECT kind, coalesce(component, ''), node_id, coalesce(gpu::VARCHAR, ''), severity, value, baseline "
                "FROM flags WHERE state = 'open'").fetchall()
            actions = cur.execute(COUNTS_SQL).fetchall()
            drained = cur.execute(f"SELECT mode, count(*) FROM ({DRAINED_SQL}) GROUP BY mode").fetchall()
        finally:
            cur.close()
        return {"now": now, "nodes": nodes, "runs": runs, "findings": findings, "flags": flags, "actions": actions,
                "drained": drained, "step_failures": step_failures}


# What gpuagent_collector_analysis_step_failures counts: the rollup and each step after it, by SQL file.
ANALYSIS_STEP_NAMES = ("rollup", *(s.sql_file for s in pass_steps()))


class _Collector:
    """prometheus_client custom collector: builds every non-histogram family at scrape time."""

    def __init__(self, source: "CollectorMetrics"):
        self._src = source

    def describe(self):
        return []   # families depend on the data; no describe-time collection

    def collect(self):
        src = self._src
        stats = dict(src.writer.stats)
        for name, key, text in (
                ("gpuagent_collector_ingested_samples", "samples", "Samples committed to the database."),
                ("gpuagent_collector_ingested_batches", "batches", "Agent batches committed."),
                ("gpuagent_collector_duplicate_batches", "duplicates", "Resent batches acknowledged and ignored."),
                ("gpuagent_collector_failed_batches", "failed_batches", "Batches that could not be stored."),
                ("gpuagent_collector_database_reopens", "reopens",
                 "Times the database was reopened in place after DuckDB invalidated it.")):
            c = CounterMetricFamily(name, text)
            c.add_metric([], float(stats.get(key, 0)))
            yield c
        g = GaugeMetricFamily("gpuagent_collector_database_closed",
                              "1 while the database is closed after a fatal error (batches are refused), else 0.")
        g.add_metric([], 0.0 if src.writer.closed_reason is None else 1.0)
        yield g
        g = GaugeMetricFamily("gpuagent_collector_writer_queue_depth", "Items waiting for the writer thread.")
        g.add_metric([], float(src.writer.queue_depth()))
        yield g
        g = GaugeMetricFamily("gpuagent_collector_streams_connected", "Agent streams currently holding a node.")
        g.add_metric([], float(src.streams()))
        yield g
        snap = src.snapshot.get()
        c = CounterMetricFamily("gpuagent_collector_metrics_read_errors",
                                "Scrapes whose database read failed (their database series are missing).")
        c.add_metric([], float(src.snapshot.errors))
        yield c
        if snap is None:
            return
        now = snap["now"]
        g = GaugeMetricFamily("gpuagent_collector_node_last_seen_age_seconds",
                              "Seconds since the node's last stored batch (the collector touches it every few s).",
                              labels=["node", "pool"])
        for node, pool, last_seen in snap["nodes"]:
            if last_seen is not None:
                g.add_metric([node, pool], max(0.0, (now - last_seen).total_seconds()))
        yield g
        n_runs, last_s, last_end, last_failed = snap["runs"]
        c = CounterMetricFamily("gpuagent_collector_analysis_passes", "Analysis passes stored in analysis_runs.")
        c.add_metric([], float(n_runs or 0))
        yield c
        # Every step from the start, at 0 until it fails, so increase(...[1h]) > 0 can alert on the first one.
        failures = {step: 0 for step in ANALYSIS_STEP_NAMES} | dict(snap["step_failures"])
        c = CounterMetricFamily("gpuagent_collector_analysis_step_failures",
                                "Analysis steps that failed and were rolled back alone (analysis_failures).",
                                labels=["step"])
        for step, n in sorted(failures.items()):
            c.add_metric([step], float(n))
        yield c
        if n_runs:
            g = GaugeMetricFamily("gpuagent_collector_analysis_last_pass_failed_steps",
                                  "Steps of the latest analysis pass that could not run (0: a whole pass).")
            g.add_metric([], float(last_failed or 0))
            yield g
        if last_s is not None:
            g = GaugeMetricFamily("gpuagent_collector_analysis_pass_duration_seconds",
                                  "Duration of the latest analysis pass (rollups + flags + findings).")
            g.add_metric([], float(last_s))
            yield g
            g = GaugeMetricFamily("gpuagent_collector_analysis_last_pass_timestamp_seconds",
                                  "Unix time the latest analysis pass ended.")
            g.add_metric([], last_end.replace(tzinfo=timezone.utc).timestamp())
            yield g
        labels = ["kind", "scope", "node", "pool", "severity"]
        fo = GaugeMetricFamily("gpuagent_finding_open", "Open findings (one per cause) with these labels.",
                               labels=labels)
        ff = GaugeMetricFamily("gpuagent_finding_flags", "Open flags grouped into those findings.", labels=labels)
        for kind, scope, node, pool, severity, n, nflags in snap["findings"]:
            fo.add_metric([kind, scope, node, pool, severity], float(n))
            ff.add_metric([kind, scope, node, pool, severity], float(nflags or 0))
        yield fo
        yield ff
        labels = ["kind", "component", "node", "gpu", "severity"]
        fl = GaugeMetricFamily("gpuagent_flag_open", "Open flags (1 each).", labels=labels)
        fv = GaugeMetricFamily("gpuagent_flag_value", "The flag's measured value, in the flag's unit.", labels=labels)
        fb = GaugeMetricFamily("gpuagent_flag_baseline", "What the flag's value was compared with (absent: none).",
                               labels=labels)
        for kind, comp, node, gpu, severity, value, baseline in snap["flags"]:
            key = [kind, comp, node, gpu, severity]
            fl.add_metric(key, 1.0)
            if value is not None:
                fv.add_metric(key, float(value))
            if baseline is not None:
                fb.add_metric(key, float(baseline))
        yield fl
        yield fv
        yield fb
        c = CounterMetricFamily("gpuagent_collector_actions", "Actions on findings ([actions], docs/ACTIONS.md), "
                                "dry or real, by what and how it went.", labels=["action", "mode", "outcome"])
        for action, mode, outcome, n in snap["actions"]:
            c.add_metric([action, mode, outcome], float(n))
        yield c
        g = GaugeMetricFamily("gpuagent_collector_nodes_drained",
                              "Slurm nodes gpuagent holds drained now (in dry-run: would hold).", labels=["mode"])
        drained = dict(snap["drained"])
        for mode in ("dry-run", "enforce"):
            g.add_metric([mode], float(drained.get(mode, 0)))
        yield g


class CollectorMetrics:
    """The registry behind the endpoint; ``writer`` is the collector's Writer, ``streams`` counts streams."""

    def __init__(self, writer, cursor_factory: Callable[[], Any], streams: Callable[[], int], cache_s: float = 5.0):
        self.writer = writer
        self.streams = streams
        self.snapshot = _DbSnapshot(cursor_factory, cache_s)
        self.registry = CollectorRegistry(auto_describe=False)
        self.commit_seconds = Histogram("gpuagent_collector_commit_duration_seconds",
                                        "Seconds per group commit of agent batches.", buckets=COMMIT_BUCKETS,
                                        registry=self.registry)
        self.registry.register(_Collector(self))

    def observe_commit(self, seconds: float) -> None:
        self.commit_seconds.observe(seconds)


def _handler(metrics: CollectorMetrics, token: str | None):
    expected = f"Bearer {token}".encode() if token else None

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path not in ("/metrics", "/"):
                self._reply(404, b"not found: the metrics are at /metrics\n")
                return
            if expected is not None:
                got = (self.headers.get("Authorization") or "").encode()
                if not hmac.compare_digest(got, expected):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Bearer realm="gpuagent-collector"')
                    body = b"this collector requires 'Authorization: Bearer <token>' (its --token)\n"
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
            encoder, content_type = choose_encoder(self.headers.get("Accept"))
            try:
                body = encoder(metrics.registry)
            except Exception as exc:  # noqa: BLE001 - one sentence to the scraper, the collector keeps running
                self._reply(500, f"cannot produce the metrics: {first_line(exc)}\n".encode())
                return
            self._reply(200, body, content_type)

        def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8"):
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):  # scrapes every few seconds: not worth a log line each
            pass

    return Handler


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """The HTTP endpoint in its own thread; ``.port`` once bound, ``.stop()`` to close it."""

    def __init__(self, metrics: CollectorMetrics, listen: str, token: str | None):
        try:
            host, port = split_host_port(listen, "--metrics-listen")
        except AddressError as exc:
            raise MetricsError(f"cannot read the metrics address {listen!r}: {first_line(exc)}") from None
        if not token and not is_loopback(host):
            raise MetricsError(f"refusing to serve metrics on {listen} without a token: beyond loopback they "
                               "name every node and flag, so pass --token or --token-file, or listen on 127.0.0.1")
        self.metrics = metrics
        server_class = _IPv6Server if ":" in host else ThreadingHTTPServer
        try:
            self._server = server_class((host.strip("[]"), port), _handler(metrics, token))
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics on {listen}: {exc.strerror or exc}") from None
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="gpuagent-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def start_metrics(writer, cursor_factory, streams: Callable[[], int], listen: str, token: str | None,
                  cache_s: float = 5.0) -> MetricsServer:
    """Serve the collector's metrics on ``listen``; the writer reports each commit's duration to it."""
    metrics = CollectorMetrics(writer, cursor_factory, streams, cache_s)
    server = MetricsServer(metrics, listen, token)
    writer.commit_observer = metrics.observe_commit
    return server
