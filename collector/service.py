"""Starting and stopping the whole collector: the handle, and one small start step per subsystem.

``start_collector`` is the library entry point (tests and other tools use it); ``gpuagent-collector serve``
is a thin wrapper around it. In order: the front door is checked (listen policy, TLS, tokens) before the
database opens, so a refused start leaves no new database file; then the database and its single writer
(collector/store/), the gRPC server (collector/ingest/server.py) with the fabric coordinator on its loop,
and, as configured, the analysis thread with the actions behind it, maintenance, ``/metrics`` and the lake
export. Start-up lives here, above the subsystems it starts, so none of them imports another's start-up.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import duckdb
import grpc

from gpuagent.collector.ingest.auth import AuthPolicy, TokenError
from gpuagent.collector.ingest.listen import (CollectorError, TlsFiles, check_listen_policy, check_tls_options,
                                              port_in_use)
from gpuagent.collector.ingest.options import ServerOptions
from gpuagent.collector.ingest.server import GrpcServer, reflection_module
from gpuagent.collector.ingest.servicer import CollectorServicer
from gpuagent.collector.ingest.validate import Limits
from gpuagent.collector.store.db import DatabaseError, open_database
from gpuagent.collector.store.space import SpaceCheck
from gpuagent.collector.store.writer import DatabaseClosed, StorageError, Writer
from gpuagent.common.errors import first_line

log = logging.getLogger("gpuagent.collector")


class CollectorHandle:
    """A running collector: ``.port``, ``.address``, ``.stop()``. Also a context manager."""

    def __init__(self, db_path: str, writer: Writer, servicer: CollectorServicer, options: ServerOptions,
                 policy: AuthPolicy | None = None, tls: TlsFiles | None = None):
        self.db_path = db_path
        self.policy = policy
        self.tls = tls
        self.port: int = 0
        self.address: str = ""
        self._writer = writer
        self._servicer = servicer
        self._options = options
        self.grpc: GrpcServer | None = None   # the gRPC server (ingest/server.py), once started
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self.analyzer = None   # the scheduled analysis thread (analyzer.AnalyzerThread), when running
        self.maintenance = None   # retention, disk guard, compaction (maintenance.MaintenanceThread)
        self.metrics = None    # the /metrics endpoint (views.metrics.MetricsServer), when serving
        self.console = None    # the web console (views.console.ConsoleServer), when serving
        self.fabric = None     # the fabric coordinator, when [fabric] is enabled
        self.exporter = None   # the lake exporter thread (lake/export.ExporterThread), when [lake] enabled
        self.actions = None    # drains and alerts after each pass (actions/engine.ActionsThread), when [actions] on

    def fabric_sweep(self, timeout: float | None = None):
        """Run one full pair-wise sweep on the collector's loop now; its outcomes."""
        return self.grpc.run_on_loop(self.fabric.sweep(), timeout)

    def fabric_group_round(self, timeout: float | None = None):
        """Run one round of collective groups on the collector's loop now; its outcomes."""
        return self.grpc.run_on_loop(self.fabric.group_round(), timeout)

    def fabric_rdma_sweep(self, timeout: float | None = None):
        """Run one pair-wise rdma_pair sweep on the collector's loop now; its outcomes."""
        return self.grpc.run_on_loop(self.fabric.rdma_sweep(), timeout)

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
        if self.grpc is not None and not self.grpc.alive() and not self._closed:
            return "the gRPC server thread has stopped"
        return None

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, store everything already queued, commit and close the database."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.grpc is not None:
            self.grpc.stop(self._options.stop_grace_s if grace is None else grace)
        for part in (self.console, self.maintenance, self.metrics, self.exporter, self.analyzer, self.actions):
            if part is not None:
                part.stop()
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
                    actions_config=None, ui_listen: str | None = None,
                    ui_fleet_cache_s: float | None = None) -> CollectorHandle:
    """Open the database, start the writer and the gRPC server; return once it listens.

    With ``analyze`` (the default) an analysis pass runs every ``analyzer_config.interval_s`` on the writer
    (see collector/analysis/analyzer.py); ``analyzer_config`` also serves on-demand Analyze calls. ``metrics_listen``
    serves Prometheus metrics over HTTP there (views/metrics.py), behind the same token; ``ui_listen`` the
    read-only web console (views/console.py), behind the same policy (a token with the query role).

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
    policy, tls_files = check_front_door(listen, token, tls_cert, tls_key, insecure, tokens_file, tls_client_ca)
    creds = tls_files.credentials() if tls_files else None
    grpc_reflection = reflection_module() if reflection else None
    if port_in_use(listen):
        raise CollectorError(f"cannot listen on {listen}: the address is in use or not available on this host")
    readers = ReaderCursors(db_path, options.memory_limit)
    writer = start_writer(db_path, readers)
    servicer = CollectorServicer(writer, readers.cursor, limits, options, analyzer_config)
    policy.refusals = servicer.refusals
    handle = CollectorHandle(db_path, writer, servicer, options, policy, tls_files)
    start_grpc(handle, listen, policy, options, creds, grpc_reflection, fabric, fabric_rounds)
    try:
        if analyze:
            start_analysis(handle, readers, analyzer_config, lake_config, actions_config)
        if maintenance_config is not None:
            start_maintenance(handle, maintenance_config)
        if metrics_listen:
            start_metrics(handle, readers, metrics_listen, token)
        if ui_listen:
            start_console(handle, readers, ui_listen, policy, ui_fleet_cache_s)
        if lake_config is not None and lake_config.enabled:
            start_lake(handle, readers, lake_config)
    except CollectorError:
        handle.stop()
        raise
    return handle


# ------------------------------------------------------------------------------- the steps, in order

def check_front_door(listen: str, token: str | None, tls_cert: str | None, tls_key: str | None, insecure: bool,
                     tokens_file: str | None, tls_client_ca: str | None) -> tuple[AuthPolicy, TlsFiles | None]:
    """The token policy and the TLS files, or CollectorError when the setup would expose the fleet's data."""
    tls = check_tls_options(tls_cert, tls_key, tls_client_ca)
    check_listen_policy(listen, token or tokens_file or tls_client_ca, tls, insecure)
    try:
        policy = AuthPolicy(token, tokens_file, client_certs=bool(tls_client_ca))
    except TokenError as exc:
        raise CollectorError(str(exc)) from None
    return policy, TlsFiles(tls_cert, tls_key, tls_client_ca) if tls else None


class ReaderCursors:
    """The database's root connection and the cursors every reader takes from it (``cursor``).

    While the writer reopens a database DuckDB invalidated (``reopen``, on the writer thread) there is no
    root, and a reader gets DatabaseClosed instead of a cursor of the dead connection."""

    def __init__(self, db_path: str, memory_limit: str):
        self.db_path, self.memory_limit = db_path, memory_limit
        try:
            self.con = open_database(db_path, memory_limit)
        except DatabaseError as exc:
            raise CollectorError(str(exc)) from None
        self._root: duckdb.DuckDBPyConnection | None = self.con.cursor()
        self._lock = threading.Lock()

    def cursor(self) -> duckdb.DuckDBPyConnection:
        with self._lock:
            if self._root is None:
                raise DatabaseClosed("the database is being reopened after a fatal error")
            return self._root.cursor()

    def reopen(self, old: duckdb.DuckDBPyConnection) -> duckdb.DuckDBPyConnection:
        """Writer thread, after DuckDB invalidated the database: close it (and every reader's cursor with it),
        then open it again from its file and WAL."""
        with self._lock:
            self._root = None
        try:
            old.close()
        except duckdb.Error as exc:
            log.info("closing the invalidated database: %s", first_line(exc))
        new = open_database(self.db_path, self.memory_limit)
        with self._lock:
            self._root = new.cursor()
        return new


def start_writer(db_path: str, readers: ReaderCursors) -> Writer:
    """The single writer over the database; on a file, with its disk-space check and reopening."""
    on_file = db_path != ":memory:"
    return Writer(readers.con, space=SpaceCheck(db_path) if on_file else None,
                  reopen=readers.reopen if on_file else None)


def start_grpc(handle: CollectorHandle, listen: str, policy: AuthPolicy, options: ServerOptions,
               creds: grpc.ServerCredentials | None, grpc_reflection, fabric, fabric_rounds: bool) -> None:
    """The gRPC server, listening when this returns; the fabric coordinator starts on its loop."""
    def on_serving() -> None:
        if fabric is not None and fabric.enabled:
            start_fabric(handle, fabric, fabric_rounds)

    handle.grpc = GrpcServer(handle.servicer, policy, options, listen, creds, grpc_reflection, on_serving)
    try:
        handle.grpc.start()
    except CollectorError:
        handle.stop()
        raise
    handle.port, handle.address = handle.grpc.port, handle.grpc.address


def start_fabric(handle: CollectorHandle, fabric, fabric_rounds: bool) -> None:
    """On the server's loop: the coordinator that hands out pair and group rounds (docs/FABRIC.md)."""
    from gpuagent.collector.fabric.coordinator import Coordinator, counter_flagged_nodes, record_outcome  # noqa: PLC0415

    writer = handle.writer
    handle.servicer.fabric = handle.fabric = Coordinator(fabric, record=lambda o: record_outcome(writer, o),
                                                         counter_suspects=lambda: writer.call(counter_flagged_nodes))
    if fabric_rounds:
        handle.fabric.start()


def start_analysis(handle: CollectorHandle, readers: ReaderCursors, analyzer_config, lake_config,
                   actions_config) -> None:
    """The scheduled analysis pass on the writer, and the actions after each pass when [actions] is on."""
    from gpuagent.collector.analysis import analyzer as an  # noqa: PLC0415

    loader = None
    if lake_config is not None and lake_config.fleet_baselines:
        from gpuagent.collector.lake.fleet import LakeBaselineLoader  # noqa: PLC0415

        loader = LakeBaselineLoader(lake_config.path)
    try:
        analysis = an.Analyzer(analyzer_config, loader)
    except an.AnalyzerError as exc:
        raise CollectorError(str(exc)) from None
    if actions_config is not None and actions_config.enabled:
        start_actions(handle, readers, actions_config)
    writer = handle.writer

    def submit(fn):
        result = writer.call(fn).result()      # fn: Analyzer.run_pass, a transaction per step
        if result.opened:       # the raw windows of nodes with new flags (docs/RESOLUTION.md)
            try:
                handle.servicer.raw_requests.after_pass(result.now)
            except (duckdb.Error, StorageError) as exc:
                log.warning("raw windows for the new flags were not asked for: %s", first_line(exc))
        if handle.actions is not None:     # after the commit; the actions thread reads the findings itself
            handle.actions.notify(result.now)
        return result

    handle.analyzer = an.AnalyzerThread(
        analysis, submit, on_error=lambda exc: log.error("analysis pass failed: %s", exc)).start()


def start_actions(handle: CollectorHandle, readers: ReaderCursors, actions_config) -> None:
    """The actions thread behind a one-slot queue; on-demand Analyze passes notify it too (docs/ACTIONS.md)."""
    from gpuagent.collector.actions import engine as ax  # noqa: PLC0415

    handle.actions = ax.ActionsThread(
        ax.Actions(actions_config), ax.CollectorDb(readers.cursor, handle.writer),
        on_error=lambda exc: log.error("actions after a pass failed: %s", first_line(exc))).start()
    handle.servicer.after_pass = handle.actions.notify
    handle.servicer.actions_idle = handle.actions.wait_idle


def start_maintenance(handle: CollectorHandle, maintenance_config) -> None:
    """Retention, the disk guard and compaction as short calls on the writer (store/maintenance.py)."""
    from gpuagent.collector.store import maintenance as mt  # noqa: PLC0415

    writer = handle.writer
    rollup = handle.analyzer.analyzer.rollup if handle.analyzer is not None else None
    handle.maintenance = mt.MaintenanceThread(
        mt.Maintenance(handle.db_path, maintenance_config, rollup), lambda fn: writer.call(fn).result()).start()


def start_metrics(handle: CollectorHandle, readers: ReaderCursors, metrics_listen: str, token: str | None) -> None:
    """Prometheus ``/metrics`` over HTTP on ``metrics_listen``, behind the collector's token (views/metrics.py)."""
    from gpuagent.collector.views import metrics as mx  # noqa: PLC0415

    try:
        handle.metrics = mx.start_metrics(handle.writer, readers.cursor, handle.servicer.claims.streams,
                                          metrics_listen, token)
    except mx.MetricsError as exc:
        raise CollectorError(str(exc)) from None


def start_console(handle: CollectorHandle, readers: ReaderCursors, ui_listen: str, policy: AuthPolicy,
                  fleet_cache_s: float | None = None) -> None:
    """The read-only web console on ``ui_listen`` (views/console.py), on reader cursors: HTTPS with the
    collector's own TLS files when it has them (a client certificate from its client CA is a credential)."""
    from gpuagent.collector.views import console as cx  # noqa: PLC0415

    try:
        handle.console = cx.start_console(readers.cursor, policy, ui_listen, fleet_cache_s, handle.tls)
    except cx.ConsoleError as exc:
        raise CollectorError(str(exc)) from None


def start_lake(handle: CollectorHandle, readers: ReaderCursors, lake_config) -> None:
    """The background export of closed hours to the Parquet lake (docs/LAKE.md)."""
    from gpuagent.collector.lake import export as lx  # noqa: PLC0415
    from gpuagent.collector.lake.layout import LakeError, open_lake  # noqa: PLC0415

    writer = handle.writer
    try:
        exporter = lx.Exporter(open_lake(lake_config.path, create=True), lake_config.shard_name,
                               readers.cursor, lambda fn: writer.call(fn).result(), lake_config.grace_s)
    except LakeError as exc:
        raise CollectorError(str(exc)) from None
    except OSError as exc:
        raise CollectorError(f"cannot use the lake {lake_config.path}: {exc.strerror or exc}") from None
    handle.exporter = lx.ExporterThread(exporter, lake_config.interval_s).start()
