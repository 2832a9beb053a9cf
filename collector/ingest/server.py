"""The collector's gRPC server: Register, Stream (batches in, acks out) and read-only Query.

``start_collector`` is the library entry point (tests and other tools use it); the
``gpuagent-collector serve`` command is a thin wrapper around it. The server runs grpc.aio on an
event loop in its own thread, so hundreds of long-lived agent streams cost no thread each.
Validation and Arrow conversion happen in the handlers; the single writer thread (writer.py) owns
the DuckDB connection and group-commits. An Ack is sent only after the commit holding its batch.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import errno
import ipaddress
import logging
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import duckdb
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gpuagent.collector.store.db import DatabaseError, open_database
from gpuagent.collector.views import sqlguard
from gpuagent.collector.ingest.auth import BearerTokenInterceptor
from gpuagent.collector.ingest.ratelog import OneLineServicerErrors, RateLimitedLog
from gpuagent.collector.ingest.rpc import Undecodable, add_collector_servicer
from gpuagent.collector.ingest.identity import INSTANCE_KEY, INTERVAL_KEY, NODE_KEY, NodeClaims, Refused
from gpuagent.collector.store.writer import (BatchError, Limits, Writer, find_node, mark_shared_machine_id, prepare_batch,
                                       register_node)
from gpuagent.proto import pb, pb_grpc

log = logging.getLogger("gpuagent.collector")

SERVICE_NAME = "gpuagent.v1.Collector"


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
    """Refuse exposed setups that would let anyone on the network write or read the fleet's data."""
    host, _ = split_listen(listen)
    if is_loopback(host):
        return
    if not token:
        raise CollectorError(
            f"refusing to listen on {listen} without a token: beyond loopback anyone who can reach the port "
            "could write data and read the database, so pass --token or --token-file "
            "(or GPUAGENT_COLLECTOR_TOKEN)")
    if not tls and not insecure:
        raise CollectorError(
            f"refusing to listen on {listen} in plaintext: the token and the data would cross the network "
            "unencrypted, so pass --tls-cert/--tls-key, or --insecure if the network is trusted")


# ------------------------------------------------------------------------------- servicer

_END = object()


class _StreamState:
    __slots__ = ("out", "pending", "idle", "claimed", "instance", "peer", "interval_s", "node_id")

    def __init__(self, instance: str | None = None, peer: str = "", interval_s: float = 0.0):
        self.out: asyncio.Queue = asyncio.Queue()
        self.pending = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.claimed: set[str] = set()      # nodes this stream streams as (identity.NodeClaims)
        self.instance = instance
        self.peer = peer
        self.interval_s = interval_s
        # The one node this stream writes as: from gpuagent-node-id, else its first batch. A stream never
        # switches node, so a client that registered several nodes cannot write one node's data as another.
        self.node_id: str | None = None

    def bind(self, node_id: str) -> str | None:
        """Bind to ``node_id`` on first use; the refusal sentence when the stream is bound to another node."""
        if self.node_id is None:
            self.node_id = node_id
            return None
        if node_id == self.node_id:
            return None
        return (f"this stream writes as node {self.node_id!r}, so a batch for node {node_id!r} is refused; "
                "open one stream per node")

    def evict(self, message: str) -> None:
        """Another stream took over this stream's node: end this one with ABORTED."""
        self.out.put_nowait(("ABORTED", message, None))


def _client_meta(context) -> tuple[str | None, str | None, float]:
    """(instance id, node id, batch interval s) an agent sends as metadata; None/0 when absent."""
    md = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    try:
        interval = max(0.0, min(float(md.get(INTERVAL_KEY, "0") or 0), 86_400.0))
    except ValueError:
        interval = 0.0
    return md.get(INSTANCE_KEY) or None, md.get(NODE_KEY) or None, interval


class CollectorServicer(pb_grpc.CollectorServicer):
    def __init__(self, writer: Writer, cursor_factory, limits: Limits, options: ServerOptions,
                 analyzer_config=None):
        self._writer = writer
        self._analyzer_config = analyzer_config
        self._cursor_factory = cursor_factory
        self._limits = limits
        self._options = options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight = 0
        self._waiters: collections.deque = collections.deque()   # (n_samples, future), first come first served
        self._query_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpuagent-query")
        self.claims = NodeClaims(takeover_idle_s=options.stream_takeover_idle_s)
        self._refusals_logged: set[tuple[str, str | None]] = set()
        self.refusals: collections.Counter = collections.Counter()   # refused requests by cause
        self.client_errors = RateLimitedLog(log)

    async def _refuse_undecodable(self, request, context) -> None:
        """Answer a request that is not valid protobuf: INVALID_ARGUMENT, one rate-limited log line."""
        if isinstance(request, Undecodable):
            self.refusals["undecodable"] += 1
            self.client_errors.warning(f"undecodable {request.type_name}",
                                       f"refused a request from {context.peer()}: {request.sentence()}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.sentence())

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def close(self) -> None:
        self._query_pool.shutdown(wait=False, cancel_futures=True)

    # -- Register
    async def Register(self, request: pb.RegisterRequest, context):
        await self._refuse_undecodable(request, context)
        node = request.node
        if not node.machine_id or not node.hostname:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "Register needs node.hostname and node.machine_id")
        writer = self._writer
        instance, _, interval = _client_meta(context)
        peer = context.peer()

        def do(con):
            node_id = register_node(con, node)
            writer.known_nodes.add(node_id)
            writer.node_identity[node_id] = (node.machine_id, node.hostname)
            return node_id, writer.node_seqs(node_id).highest

        try:
            if instance:
                # Before anything is written: a second agent as this node must not overwrite its row, and must
                # not get its last_committed_seq (it would drop its own spooled batches up to it).
                known = await asyncio.wrap_future(writer.call(
                    lambda con: find_node(con, node.hostname, node.machine_id)))
                if known:
                    await self._claim(known, node.machine_id, node.hostname, instance, peer, interval, None)
            node_id, highest = await asyncio.wrap_future(writer.call(do))
            if instance:
                await self._claim(node_id, node.machine_id, node.hostname, instance, peer, interval, None)
        except Refused as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except BatchError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        except duckdb.Error as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the collector could not store the registration: {str(exc).splitlines()[0]}")
        log.info("registered node %s (machine_id %s, hostname %s)", node_id, node.machine_id, node.hostname)
        return pb.RegisterResponse(node_id=node_id, last_committed_seq=highest)

    async def _claim(self, node_id: str, machine_id: str, hostname: str, instance: str | None, peer: str,
                     interval: float, owner) -> None:
        """Claim ``node_id`` (identity.NodeClaims); log a refusal once per agent, and a machine-id shared
        with another live host once per pair (also recorded in nodes.machine_id_shared_with)."""
        try:
            await self.claims.acquire(node_id, machine_id, hostname, instance, peer, interval, owner)
        except Refused as exc:
            key = (node_id, instance or peer)
            if key not in self._refusals_logged:
                self._refusals_logged.add(key)
                log.warning("refused a second agent for node %s from %s: %s", node_id, peer, exc)
            raise
        for sentence, other, other_host in self.claims.newly_shared(node_id, machine_id, hostname):
            log.warning("%s", sentence)

            def mark(con, a=node_id, b=other, ha=hostname, hb=other_host):
                mark_shared_machine_id(con, a, [hb])
                mark_shared_machine_id(con, b, [ha])

            fut = self._writer.call(mark)
            fut.add_done_callback(lambda f: f.exception() and log.error(
                "recording the shared machine-id failed: %s", f.exception()))

    async def _claim_stream(self, state: _StreamState, node_id: str) -> None:
        machine_id, hostname = self._writer.node_identity.get(node_id, ("", node_id))
        await self._claim(node_id, machine_id, hostname, state.instance, state.peer, state.interval_s, state)
        state.claimed.add(node_id)

    # -- Stream
    def _deliver(self, state: _StreamState, n_samples: int, ack, exc) -> None:
        """Runs on the event loop: the writer finished a batch of this stream."""
        if exc is not None:
            state.out.put_nowait(("UNAVAILABLE", f"{exc}; resend it later", None))
        else:
            state.out.put_nowait(ack)
        state.pending -= 1
        if state.pending == 0:
            state.idle.set()
        self._inflight -= n_samples
        self._grant()

    def _fits(self, n: int) -> bool:
        return self._inflight == 0 or self._inflight + n <= self._options.max_inflight_samples

    def _grant(self) -> None:
        """Admit waiting batches in arrival order while they fit (wakes only those, not every stream)."""
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if not fut.done():
                self._inflight += n
                fut.set_result(None)

    async def _reserve(self, n: int) -> None:
        """Wait until ``n`` more samples fit the in-flight bound (memory), then count them in."""
        if not self._waiters and self._fits(n):
            self._inflight += n
            return
        fut = self._loop.create_future()
        self._waiters.append((n, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._inflight -= n       # granted just as the stream went away: give it back
                self._grant()
            raise

    async def _read(self, request_iterator, state: _StreamState) -> None:
        loop = self._loop
        error = None
        try:
            async for batch in request_iterator:
                try:
                    if isinstance(batch, Undecodable):
                        self.refusals["undecodable"] += 1
                        self.client_errors.warning(f"undecodable {batch.type_name}",
                                                   f"refused a stream from {state.peer}: {batch.sentence()}")
                        error = ("INVALID_ARGUMENT", batch.sentence(), None)
                        break
                    refusal = state.bind(batch.node_id)
                    if refusal:
                        self.refusals["stream_other_node"] += 1
                        error = ("PERMISSION_DENIED", f"batch seq {batch.seq}: {refusal}", batch.seq)
                        break
                    if batch.node_id and batch.node_id not in self._writer.known_nodes:
                        raise BatchError("FAILED_PRECONDITION",
                                         f"node {batch.node_id!r} is not registered with this collector; "
                                         "call Register first")
                    if batch.node_id in state.claimed:
                        if not self.claims.holds(batch.node_id, state):
                            break       # taken over (evict() queued the ABORTED status); store nothing more
                    elif batch.node_id:
                        try:
                            await self._claim_stream(state, batch.node_id)
                        except Refused as exc:
                            error = ("ALREADY_EXISTS", str(exc), None)
                            break
                    prepared = prepare_batch(batch, self._limits)
                except BatchError as exc:
                    error = (exc.code, f"batch seq {batch.seq}: {exc.message}", batch.seq)
                    break
                n = prepared.n_samples
                await self._reserve(n)
                state.pending += 1
                state.idle.clear()

                def callback(ack, exc, _state=state, _n=n):
                    try:
                        loop.call_soon_threadsafe(self._deliver, _state, _n, ack, exc)
                    except RuntimeError:
                        pass    # the server has stopped: nobody waits for this ack; the agent resends

                self._writer.submit(prepared, callback)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken request stream ends this stream only
            error = ("INTERNAL", f"reading the stream failed: {exc}", None)
        await state.idle.wait()
        state.out.put_nowait(error if error else _END)

    async def Stream(self, request_iterator, context):
        instance, node_id, interval = _client_meta(context)
        state = _StreamState(instance, context.peer(), interval)
        if node_id:
            state.bind(node_id)
        if node_id and node_id in self._writer.known_nodes:
            # Claimed as the stream opens, so that a second agent is refused even before a batch is due.
            try:
                await self._claim_stream(state, node_id)
            except Refused as exc:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        reader = asyncio.ensure_future(self._read(request_iterator, state))
        try:
            while True:
                item = await state.out.get()
                if item is _END:
                    return
                if isinstance(item, tuple):
                    code, message, seq = item
                    if seq is not None:
                        # The agent's sender reads this to know which batch was refused.
                        context.set_trailing_metadata((("gpuagent-seq", str(seq)),))
                    await context.abort(grpc.StatusCode[code], message)
                yield item
        finally:
            reader.cancel()
            self.claims.release(state)

    # -- Query
    async def Query(self, request: pb.QueryRequest, context):
        await self._refuse_undecodable(request, context)
        cap = self._options.query_max_rows
        max_rows = min(request.max_rows, cap) if request.max_rows else cap
        timeout_s = self._options.query_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            timeout_s = max(0.001, min(timeout_s, remaining))
        cursor = self._cursor_factory()
        work = asyncio.get_running_loop().run_in_executor(
            self._query_pool, sqlguard.run_readonly, cursor, request.sql, max_rows, timeout_s,
            self._options.query_max_bytes)
        try:
            result = await work
        except asyncio.CancelledError:
            # The client went away or its deadline passed: stop the query so it frees its worker and memory.
            cursor.interrupt()
            raise
        except sqlguard.QueryRefused as exc:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except sqlguard.QueryFailed as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.QueryResponse(columns=result.columns, column_types=result.column_types,
                                rows_json=result.rows_json(), truncated=result.truncated)

    # -- Analyze
    async def Analyze(self, request: pb.AnalyzeRequest, context):
        """One analysis pass now, on the writer thread (the single-writer rule), then the open flags."""
        from gpuagent.collector.analysis import analyzer as an  # noqa: PLC0415 - only the analyzer needs it

        await self._refuse_undecodable(request, context)
        config = self._analyzer_config or an.AnalyzerConfig()
        if not math.isfinite(request.window_s) or request.window_s < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"window_s must be a finite number of seconds, 0 or more (0: the default), "
                                f"not {request.window_s}")
        if request.window_s > 0:
            config = an.with_window(config, request.window_s)
        limit = request.max_flags or 1000
        try:
            analyzer = an.Analyzer(config)
            result = await asyncio.wrap_future(
                self._writer.call(lambda con: an.run_in_transaction(con, analyzer.run_pass)))
            flags = await asyncio.get_running_loop().run_in_executor(
                self._query_pool, lambda: an.open_flags(self._cursor_factory(), limit + 1))
        except an.AnalyzerError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except duckdb.Error as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the analysis pass failed in the database: {str(exc).splitlines()[0]}")
        return pb.AnalyzeResponse(pass_json=an.dumps(result.as_dict()), flags_json=an.dumps(flags[:limit]),
                                  truncated=len(flags) > limit)


# ------------------------------------------------------------------------------- lifecycle

class CollectorHandle:
    """A running collector: ``.port``, ``.address``, ``.stop()``. Also a context manager."""

    def __init__(self, db_path: str, con: duckdb.DuckDBPyConnection, writer: Writer,
                 servicer: CollectorServicer, options: ServerOptions):
        self.db_path = db_path
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
        self.metrics = None    # the /metrics endpoint (views.metrics.MetricsServer), when serving

    @property
    def writer(self) -> Writer:
        return self._writer

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
        if self.metrics is not None:
            self.metrics.stop()
        if self.analyzer is not None:
            self.analyzer.stop()
        self._writer.stop()
        self._servicer.close()
        try:
            self._con.close()
        except duckdb.Error as exc:  # pragma: no cover - closing after a disk error
            log.error("closing the database failed: %s", str(exc).splitlines()[0])
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_collector(db_path: str | Path, listen: str = "127.0.0.1:0", token: str | None = None, *,
                    tls_cert: str | None = None, tls_key: str | None = None, insecure: bool = False,
                    reflection: bool = False, limits: Limits = Limits(),
                    options: ServerOptions = ServerOptions(), analyzer_config=None,
                    analyze: bool = True, metrics_listen: str | None = None) -> CollectorHandle:
    """Open the database, start the writer and the gRPC server; return once it listens.

    With ``analyze`` (the default) an analysis pass runs every ``analyzer_config.interval_s`` on the writer
    (see collector/analyzer.py); ``analyzer_config`` also serves on-demand Analyze calls. ``metrics_listen``
    serves Prometheus metrics over HTTP there (views/metrics.py), behind the same token.

    Raises CollectorError (one sentence) when it cannot start: policy, lock held, bind failure.
    """
    db_path = str(db_path)
    tls = bool(tls_cert or tls_key)
    if tls and not (tls_cert and tls_key):
        raise CollectorError("TLS needs both --tls-cert and --tls-key")
    check_listen_policy(listen, token, tls, insecure)
    creds = None
    if tls:
        try:
            creds = grpc.ssl_server_credentials([(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())])
        except OSError as exc:
            raise CollectorError(f"cannot read the TLS key or certificate: {exc.strerror}: {exc.filename}") from None
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
    reader_root = con.cursor()
    cursor_lock = threading.Lock()

    def cursor_factory():
        with cursor_lock:
            return reader_root.cursor()

    writer = Writer(con)
    servicer = CollectorServicer(writer, cursor_factory, limits, options, analyzer_config)
    handle = CollectorHandle(db_path, con, writer, servicer, options)
    started = threading.Event()
    failure: list[BaseException] = []

    async def main():
        loop = asyncio.get_running_loop()
        servicer.bind_loop(loop)
        handle._loop = loop
        handle._stop_event = asyncio.Event()
        interceptors = [BearerTokenInterceptor(token)] if token else []
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

        try:
            analysis = an.Analyzer(analyzer_config)
        except an.AnalyzerError as exc:
            handle.stop()
            raise CollectorError(str(exc)) from None
        handle.analyzer = an.AnalyzerThread(
            analysis, lambda fn: writer.call(lambda c: an.run_in_transaction(c, fn)).result(),
            on_error=lambda exc: log.error("analysis pass failed: %s", exc)).start()
    if metrics_listen:
        from gpuagent.collector.views.metrics import MetricsError, start_metrics  # noqa: PLC0415

        try:
            handle.metrics = start_metrics(writer, cursor_factory, servicer.claims.streams, metrics_listen, token)
        except MetricsError as exc:
            handle.stop()
            raise CollectorError(str(exc)) from None
    return handle
