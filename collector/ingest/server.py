"""Starting and stopping the collector: listen policy, database, writer thread and the gRPC server.

``start_collector`` is the library entry point (tests and other tools use it); the
``gpuagent-collector serve`` command is a thin wrapper around it. The server runs grpc.aio on an
event loop in its own thread, so hundreds of long-lived agent streams cost no thread each. The
handlers are in servicer.py; the single writer thread (collector/store/writer.py) owns the DuckDB
connection.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import duckdb
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gpuagent.collector.ingest.auth import AuthInterceptor, AuthPolicy, TokenError
from gpuagent.collector.ingest.ratelog import OneLineServicerErrors, RateLimitedLog
from gpuagent.collector.ingest.rpc import SERVICE, add_collector_servicer
from gpuagent.collector.ingest.servicer import CollectorServicer
from gpuagent.collector.ingest.validate import Limits
from gpuagent.collector.store.db import DatabaseError, open_database
from gpuagent.collector.store.space import SpaceCheck
from gpuagent.collector.store.writer import DatabaseClosed, Writer
from gpuagent.common.errors import first_line

log = logging.getLogger("gpuagent.collector")

SERVICE_NAME = SERVICE


class CollectorError(RuntimeError):
    """The collector cannot start or keep running; the message is one sentence for a person."""


@dataclass(frozen=True)
class ServerOptions:
    max_message_bytes: int = 64 * 1024 * 1024
    max_inflight_samples: int = 2_000_000     # bound on samples validated but not yet committed (memory)
    memory_limit: str = "512MB"               # DuckDB's buffer manager limit (spills beyond it)
    query_max_rows: int = 10_000
    query_timeout_s: float = 60.0
    query_max_bytes: int = 16 * 1024 * 1024      # result size bound of one Query, measured in Arrow before JSON
    stop_grace_s: float = 2.0
    stream_takeover_idle_s: float = 60.0      # a node's stream silent this long (or 3 batch intervals) gives way


# ------------------------------------------------------------------------------- listen policy

def split_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port)."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", listen.strip())
    if not m:
        raise CollectorError(f"--listen {listen!r} is not HOST:PORT (for example 127.0.0.1:50051)")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if port > 65535:
        raise CollectorError(f"--listen {listen!r} has port {port}, above 65535")
    return host, port


def port_in_use(listen: str) -> bool:
    """True when HOST:PORT is already bound by another listener (checked before the database is opened,
    so a collector that cannot listen leaves no new database file behind). Port 0 is never in use."""
    import socket

    host, port = split_listen(listen)
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False           # an unresolvable host: the gRPC bind reports it
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as gRPC binds
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_listen_policy(listen: str, token: str | None, tls: bool, insecure: bool) -> None:
    """Refuse exposed setups that would let anyone on the network write or read the fleet's data.
    ``token`` is any credential setting (shared token, tokens file or client CA)."""
    host, _ = split_listen(listen)
    if is_loopback(host):
        return
    if not token:
        raise CollectorError(
            f"refusing to listen on {listen} without a token: beyond loopback anyone who can reach the port "
            "could write data and read the database, so pass --token or --token-file "
            "(or GPUAGENT_COLLECTOR_TOKEN), --tokens-file or --tls-client-ca")
    if not tls and not insecure:
        raise CollectorError(
            f"refusing to listen on {listen} in plaintext: the token and the data would cross the network "
            "unencrypted, so pass --tls-cert/--tls-key, or --insecure if the network is trusted")


# ------------------------------------------------------------------------------- TLS

class TlsFiles:
    """The server's TLS key, certificate and (for mutual TLS) client CA, re-readable for rotation.

    gRPC asks ``fetch`` at each new handshake; after ``reload`` it gets the new files, so new connections
    use them while established ones keep theirs."""

    def __init__(self, cert: str, key: str, client_ca: str | None):
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._config = self._read()
        self._fresh = False

    def _read(self):
        try:
            key, cert = Path(self.key).read_bytes(), Path(self.cert).read_bytes()
            ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        except OSError as exc:
            raise CollectorError(f"cannot read the TLS key, certificate or client CA: {exc.strerror}: "
                                 f"{exc.filename}") from None
        for what, data in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", ca)):
            if data is not None and b"-----BEGIN" not in data:
                raise CollectorError(f"{what} is not a PEM file")
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._config, self.fetch,
                                                   require_client_authentication=bool(self.client_ca))

    def reload(self) -> None:
        """Read the files again (CollectorError, keeping the current ones, when they are unusable)."""
        self._config = self._read()
        self._fresh = True

    def fetch(self):
        if not self._fresh:
            return None
        self._fresh = False
        return self._config


# ------------------------------------------------------------------------------- lifecycle

class CollectorHandle:
    """A running collector: ``.port``, ``.address``, ``.stop()``. Also a context manager."""

    def __init__(self, db_path: str, con: duckdb.DuckDBPyConnection, writer: Writer,
                 servicer: CollectorServicer, options: ServerOptions, policy: AuthPolicy | None = None,
                 tls: TlsFiles | None = None):
        self.db_path = db_path
        self.policy = policy
        self.tls = tls
        self.port: int = 0
        self.address: str = ""
        self._con = con
        self._writer = writer
        self._servicer = servicer
        self._options = options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self.analyzer = None   # the scheduled analysis thread (analyzer.AnalyzerThread), when running
        self.maintenance = None   # retention, disk guard, compaction (maintenance.MaintenanceThread)
        self.metrics = None    # the /metrics endpoint (views.metrics.MetricsServer), when serving
        self.fabric = None     # the fabric coordinator, when [fabric] is enabled
        self.exporter = None   # the lake exporter thread (lake/export.ExporterThread), when [lake] enabled
        self.actions = None    # drains and alerts after each pass (actions/engine.ActionsThread), when [actions] on

    def fabric_sweep(self, timeout: float | None = None):
        """Run one full pair-wise sweep on the collector's loop now; its outcomes."""
        return asyncio.run_coroutine_threadsafe(self.fabric.sweep(), self._loop).result(timeout)

    def fabric_group_round(self, timeout: float | None = None):
        """Run one round of collective groups on the collector's loop now; its outcomes."""
        return asyncio.run_coroutine_threadsafe(self.fabric.group_round(), self._loop).result(timeout)

    def fabric_rdma_sweep(self, timeout: float | None = None):
        """Run one pair-wise rdma_pair sweep on the collector's loop now; its outcomes."""
        return asyncio.run_coroutine_threadsafe(self.fabric.rdma_sweep(), self._loop).result(timeout)

    @property
    def writer(self) -> Writer:
        return self._writer

    @property
    def servicer(self) -> CollectorServicer:
        return self._servicer

    def reload(self) -> list[str]:
        """Re-read the tokens file and the TLS files (SIGHUP); established calls are untouched.
        Returns one sentence per part that could not be re-read (that part keeps its current setting)."""
        problems = []
        if self.policy is not None:
            try:
                self.policy.reload()
            except TokenError as exc:
                problems.append(str(exc))
        if self.tls is not None:
            try:
                self.tls.reload()
            except CollectorError as exc:
                problems.append(str(exc))
        return problems

    def problem(self) -> str | None:
        """None while the server and the writer work; else one sentence on what stopped working."""
        if self._writer.fatal is not None:
            return self._writer.fatal
        if not self._writer.alive():
            return "the database writer thread has stopped"
        if self._thread is not None and not self._thread.is_alive() and not self._closed:
            return "the gRPC server thread has stopped"
        return None

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, store everything already queued, commit and close the database."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._loop is not None and self._stop_event is not None and self._thread is not None:
            grace = self._options.stop_grace_s if grace is None else grace
            self._loop.call_soon_threadsafe(self._stop_event.set)
            self._thread.join(grace + 30)
        if self.maintenance is not None:
            self.maintenance.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self.exporter is not None:
            self.exporter.stop()
        if self.analyzer is not None:
            self.analyzer.stop()
        if self.actions is not None:
            self.actions.stop()
        self._writer.stop()
        self._servicer.close()
        try:
            self._writer.con.close()
        except duckdb.Error as exc:  # pragma: no cover - closing after a disk error
            log.error("closing the database failed: %s", first_line(exc))
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_collector(db_path: str | Path, listen: str = "127.0.0.1:0", token: str | None = None, *,
                    tls_cert: str | None = None, tls_key: str | None = None, insecure: bool = False,
                    tokens_file: str | None = None, tls_client_ca: str | None = None,
                    reflection: bool = False, limits: Limits = Limits(),
                    options: ServerOptions = ServerOptions(), analyzer_config=None,
                    analyze: bool = True, metrics_listen: str | None = None, fabric=None,
                    fabric_rounds: bool = True, lake_config=None, maintenance_config=None,
                    actions_config=None) -> CollectorHandle:
    """Open the database, start the writer and the gRPC server; return once it listens.

    With ``analyze`` (the default) an analysis pass runs every ``analyzer_config.interval_s`` on the writer
    (see collector/analysis/analyzer.py); ``analyzer_config`` also serves on-demand Analyze calls. ``metrics_listen``
    serves Prometheus metrics over HTTP there (views/metrics.py), behind the same token.

    ``fabric`` (a collector.fabric.coordinator.FabricConfig with enabled set) serves fabric assignments
    (``handle.fabric``); with ``fabric_rounds`` its sweeps run on their own every ``interval_s``.
    With ``maintenance_config`` (store/maintenance.py) retention, the disk guard and compaction run too.

    ``lake_config`` (lake/export.LakeConfig) turns on the background lake export and, with
    ``fleet_baselines``, takes the fleet baselines from the lake.

    ``actions_config`` (actions/config.ActionsConfig with enabled set) turns findings into Slurm drains or
    alerts after each scheduled pass, on the actions thread (``handle.actions``; docs/ACTIONS.md).

    Raises CollectorError (one sentence) when it cannot start: policy, lock held, bind failure.
    """
    db_path = str(db_path)
    tls = bool(tls_cert or tls_key)
    if tls and not (tls_cert and tls_key):
        raise CollectorError("TLS needs both --tls-cert and --tls-key")
    if tls_client_ca and not tls:
        raise CollectorError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    check_listen_policy(listen, token or tokens_file or tls_client_ca, tls, insecure)
    try:
        policy = AuthPolicy(token, tokens_file, client_certs=bool(tls_client_ca))
    except TokenError as exc:
        raise CollectorError(str(exc)) from None
    tls_files = TlsFiles(tls_cert, tls_key, tls_client_ca) if tls else None
    creds = tls_files.credentials() if tls_files else None
    if reflection:
        try:
            from grpc_reflection.v1alpha import reflection as grpc_reflection
        except ImportError:
            raise CollectorError("--reflection needs the grpcio-reflection package "
                                 "(pip install 'gpuagent[collector]')") from None
    if port_in_use(listen):
        raise CollectorError(f"cannot listen on {listen}: the address is in use or not available on this host")
    try:
        con = open_database(db_path, options.memory_limit)
    except DatabaseError as exc:
        raise CollectorError(str(exc)) from None
    readers = {"root": con.cursor()}     # every reader's cursor comes from here; None while reopening
    cursor_lock = threading.Lock()

    def cursor_factory():
        with cursor_lock:
            root = readers["root"]
            if root is None:
                raise DatabaseClosed("the database is being reopened after a fatal error")
            return root.cursor()

    def reopen(old):
        """Writer thread, after DuckDB invalidated the database: close it (and every reader's cursor with it),
        then open it again from its file and WAL."""
        with cursor_lock:
            readers["root"] = None
        try:
            old.close()
        except duckdb.Error as exc:
            log.info("closing the invalidated database: %s", first_line(exc))
        new = open_database(db_path, options.memory_limit)
        with cursor_lock:
            readers["root"] = new.cursor()
        return new

    on_file = db_path != ":memory:"
    writer = Writer(con, space=SpaceCheck(db_path) if on_file else None, reopen=reopen if on_file else None)
    servicer = CollectorServicer(writer, cursor_factory, limits, options, analyzer_config)
    policy.refusals = servicer.refusals
    handle = CollectorHandle(db_path, con, writer, servicer, options, policy, tls_files)
    started = threading.Event()
    failure: list[BaseException] = []

    async def main():
        loop = asyncio.get_running_loop()
        servicer.bind_loop(loop)
        handle._loop = loop
        handle._stop_event = asyncio.Event()
        interceptors = [AuthInterceptor(policy)] if policy.enabled else []
        server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", options.max_message_bytes),
                     ("grpc.max_send_message_length", options.max_message_bytes),
                     ("grpc.so_reuseport", 0)])
        add_collector_servicer(servicer, server)
        grpc_log = logging.getLogger("grpc._cython.cygrpc")
        if not any(isinstance(f, OneLineServicerErrors) for f in grpc_log.filters):
            grpc_log.addFilter(OneLineServicerErrors(RateLimitedLog(log)))
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if reflection:
            grpc_reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, grpc_reflection.SERVICE_NAME), server)
        try:
            port = server.add_secure_port(listen, creds) if creds else server.add_insecure_port(listen)
        except RuntimeError:
            port = 0
        if not port:
            raise CollectorError(f"cannot listen on {listen}: the address is in use or not available on this host")
        await server.start()
        if fabric is not None and fabric.enabled:
            from gpuagent.collector.fabric.coordinator import Coordinator, record_outcome  # noqa: PLC0415

            servicer.fabric = handle.fabric = Coordinator(fabric, record=lambda o: record_outcome(writer, o))
            if fabric_rounds:
                handle.fabric.start()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        host, _ = split_listen(listen)
        handle.port = port
        handle.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        started.set()
        await handle._stop_event.wait()
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(options.stop_grace_s)

    def run():
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported to start_collector's caller
            failure.append(exc)
            started.set()

    thread = threading.Thread(target=run, name="gpuagent-collector-grpc", daemon=True)
    handle._thread = thread
    thread.start()
    started.wait()
    if failure:
        handle._loop = None
        handle.stop()
        exc = failure[0]
        if isinstance(exc, CollectorError):
            raise exc
        raise CollectorError(f"the collector failed to start: {exc}") from exc
    if analyze:
        from gpuagent.collector.analysis import analyzer as an  # noqa: PLC0415

        loader = None
        if lake_config is not None and lake_config.fleet_baselines:
            from gpuagent.collector.lake.fleet import LakeBaselineLoader  # noqa: PLC0415

            loader = LakeBaselineLoader(lake_config.path)
        try:
            analysis = an.Analyzer(analyzer_config, loader)
        except an.AnalyzerError as exc:
            handle.stop()
            raise CollectorError(str(exc)) from None
        if actions_config is not None and actions_config.enabled:
            from gpuagent.collector.actions import engine as ax  # noqa: PLC0415

            handle.actions = ax.ActionsThread(
                ax.Actions(actions_config), ax.CollectorDb(cursor_factory, writer),
                on_error=lambda exc: log.error("actions after a pass failed: %s", first_line(exc))).start()
            servicer.after_pass = handle.actions.notify       # on-demand Analyze passes act too
            servicer.actions_idle = handle.actions.wait_idle

        def submit(fn):
            result = writer.call(fn).result()      # fn: Analyzer.run_pass, a transaction per step
            if handle.actions is not None:     # after the commit; the actions thread reads the findings itself
                handle.actions.notify(result.now)
            return result

        handle.analyzer = an.AnalyzerThread(
            analysis, submit, on_error=lambda exc: log.error("analysis pass failed: %s", exc)).start()
    if maintenance_config is not None:
        from gpuagent.collector.store import maintenance as mt  # noqa: PLC0415

        rollup = handle.analyzer.analyzer.rollup if handle.analyzer is not None else None
        handle.maintenance = mt.MaintenanceThread(
            mt.Maintenance(db_path, maintenance_config, rollup), lambda fn: writer.call(fn).result()).start()
    if metrics_listen:
        from gpuagent.collector.views.metrics import MetricsError, start_metrics  # noqa: PLC0415

        try:
            handle.metrics = start_metrics(writer, cursor_factory, servicer.claims.streams, metrics_listen, token)
        except MetricsError as exc:
            handle.stop()
            raise CollectorError(str(exc)) from None
    if lake_config is not None and lake_config.enabled:
        from gpuagent.collector.lake import export as lx  # noqa: PLC0415
        from gpuagent.collector.lake.layout import LakeError, open_lake  # noqa: PLC0415

        try:
            exporter = lx.Exporter(open_lake(lake_config.path, create=True), lake_config.shard_name,
                                   cursor_factory, lambda fn: writer.call(fn).result(), lake_config.grace_s)
        except LakeError as exc:
            handle.stop()
            raise CollectorError(str(exc)) from None
        except OSError as exc:
            handle.stop()
            raise CollectorError(f"cannot use the lake {lake_config.path}: {exc.strerror or exc}") from None
        handle.exporter = lx.ExporterThread(exporter, lake_config.interval_s).start()
    return handle
