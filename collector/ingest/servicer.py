"""The Collector service's handlers: Register, Stream (batches in, acks out), Query and Analyze.

Validation and Arrow conversion happen here, on the event loop (collector/ingest/validate.py); the single
writer thread (collector/store/writer.py) owns the DuckDB connection and group-commits. An Ack is sent only
after the commit holding its batch. Who may stream as a node is decided in identity.py.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
from typing import TYPE_CHECKING

import duckdb
import grpc

from gpuagent.collector.ingest.auth import current_principal
from gpuagent.collector.ingest.flow import InflightBudget
from gpuagent.collector.ingest import raw_requests as raw_requests_mod
from gpuagent.collector.ingest.identity import NodeClaims, Refused
from gpuagent.collector.ingest.raw_requests import RawRequests
from gpuagent.collector.ingest.ratelog import RateLimitedLog
from gpuagent.collector.ingest.rpc import Undecodable
from gpuagent.collector.ingest.validate import BatchError, Limits, SeriesCache, prepare_batch
from gpuagent.collector.store.nodes import InvalidNode, find_node, mark_shared_machine_id, register_node
from gpuagent.collector.store.writer import StorageError, Writer
from gpuagent.collector.views import sqlguard
from gpuagent.common.errors import first_line
from gpuagent.proto import pb, pb_grpc
from gpuagent.proto.wire import INSTANCE_KEY, INTERVAL_KEY, NODE_KEY

if TYPE_CHECKING:
    from gpuagent.collector.ingest.options import ServerOptions

log = logging.getLogger("gpuagent.collector")

_END = object()
MAX_ANALYZE_WINDOW_S = 100 * 365.25 * 86400.0   # an Analyze window longer than this is a mistake, not a question
MAX_WAIT_ACTIONS_S = 120.0    # an Analyze call waits at most this long for the actions after its pass


class _StreamState:
    __slots__ = ("out", "pending", "idle", "claimed", "instance", "peer", "interval_s", "node_id", "principal",
                 "series_cache")

    def __init__(self, instance: str | None = None, peer: str = "", interval_s: float = 0.0, principal=None):
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
        self.principal = principal            # the credential's holder (auth.Principal): which nodes it may write
        self.series_cache = SeriesCache()     # the stream's last series dictionary, derived once (validate.py)

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
        self.after_pass = None     # called with the pass's time after an Analyze pass commits ([actions])
        self.raw_requests = RawRequests(writer, cursor_factory)     # raw windows asked of nodes (acks carry them)
        self.actions_idle = None   # wait_idle(timeout_s) of the actions thread: an Analyze call can wait for them
        self._cursor_factory = cursor_factory
        self._limits = limits
        self._options = options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._budget = InflightBudget(options.max_inflight_samples)
        self._query_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpuagent-query")
        # Analyze calls that wait for the actions (up to MAX_WAIT_ACTIONS_S each) hold these threads, not the loop's
        self._wait_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpuagent-wait")
        self.claims = NodeClaims(takeover_idle_s=options.stream_takeover_idle_s)
        self._refusals_logged: set[tuple[str, str | None]] = set()
        self.refusals: collections.Counter = collections.Counter()   # refused requests by cause
        self.client_errors = RateLimitedLog(log)
        self.fabric = None      # collector/fabric/coordinator.Coordinator when [fabric] is enabled

    async def _refuse_undecodable(self, request, context) -> None:
        """Answer a request that is not valid protobuf: INVALID_ARGUMENT, one rate-limited log line."""
        if isinstance(request, Undecodable):
            self.refusals["undecodable"] += 1
            self.client_errors.warning(f"undecodable {request.type_name}",
                                       f"refused a request from {context.peer()}: {request.sentence()}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.sentence())

    def _node_refusal(self, principal, node_id: str) -> str | None:
        """The PERMISSION_DENIED sentence (counted) when ``principal`` may not write as ``node_id``."""
        if principal is None:
            return None
        hostname = self._writer.node_identity.get(node_id, ("", node_id))[1]
        refusal = principal.node_refusal(hostname)
        if refusal:
            self.refusals["node_not_allowed"] += 1
        return refusal

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def close(self) -> None:
        self._query_pool.shutdown(wait=False, cancel_futures=True)
        self._wait_pool.shutdown(wait=False, cancel_futures=True)

    # -- Register
    async def Register(self, request: pb.RegisterRequest, context):
        await self._refuse_undecodable(request, context)
        node = request.node
        if not node.machine_id or not node.hostname:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "Register needs node.hostname and node.machine_id")
        refusal = current_principal().node_refusal(node.hostname)
        if refusal:
            self.refusals["node_not_allowed"] += 1
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"Register refused: {refusal}")
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
        except InvalidNode as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (duckdb.Error, StorageError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the collector could not store the registration: {first_line(exc)}")
        log.info("registered node %s (machine_id %s, hostname %s)", node_id, node.machine_id, node.hostname)
        if self.fabric is not None:
            self.fabric.register(node_id, node.fabric_address, dict(node.labels), node.path_port)
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
        self._budget.release(n_samples)

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
                    first = state.node_id is None
                    refusal = state.bind(batch.node_id)
                    if not refusal and first and batch.node_id:
                        refusal = self._node_refusal(state.principal, batch.node_id)
                        if refusal:
                            error = ("PERMISSION_DENIED", f"batch seq {batch.seq}: {refusal}", batch.seq)
                            break
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
                    prepared = prepare_batch(batch, self._limits, series_cache=state.series_cache)
                    if self.fabric is not None and self.fabric.config.paths:
                        # suspect paths: rechecked from their other end next epoch, and (targeted) bandwidth runs
                        self.fabric.paths.note_batch(batch)
                except BatchError as exc:
                    error = (exc.code, f"batch seq {batch.seq}: {exc.message}", batch.seq)
                    break
                n = prepared.n_samples
                await self._budget.reserve(n)
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
        state = _StreamState(instance, context.peer(), interval, current_principal())
        if node_id:
            state.bind(node_id)
            refusal = self._node_refusal(state.principal, node_id)
            if refusal:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"Stream refused: {refusal}")
        if node_id and node_id in self._writer.known_nodes:
            # Claimed as the stream opens, so that a second agent is refused even before a batch is due.
            try:
                await self._claim_stream(state, node_id)
            except Refused as exc:
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
            try:      # what an earlier stream of this node was asked and did not answer
                await asyncio.get_running_loop().run_in_executor(self._query_pool, self.raw_requests.reload, node_id)
            except (duckdb.Error, StorageError) as exc:
                log.warning("raw-window requests of node %s not reloaded: %s", node_id, first_line(exc))
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
                if state.node_id is not None and isinstance(item, pb.Ack):
                    asked = self.raw_requests.take(state.node_id)
                    if asked:
                        item.raw_requests.extend(asked)
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
        # The caller's deadline, when it comes first, stops the query here too; the answer is then the
        # deadline's code, not "too slow": the stop can reach the caller a hair before its own deadline does.
        by_deadline = remaining is not None and remaining < timeout_s
        if remaining is not None:
            timeout_s = max(0.001, min(timeout_s, remaining))
        try:
            cursor = self._cursor_factory()
        except (duckdb.Error, StorageError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the database cannot answer now ({first_line(exc)}); try again in a few seconds")
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
        except sqlguard.QueryStopped as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED if by_deadline else grpc.StatusCode.INVALID_ARGUMENT,
                                str(exc))
        except sqlguard.QueryFailed as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except sqlguard.QueryUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
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
                                f"window_s must be positive and finite, in seconds (or 0 for the default), "
                                f"not {request.window_s}")
        if request.window_s > MAX_ANALYZE_WINDOW_S:
            # datetime arithmetic overflows long before 1e300 s (timedelta tops out near 2.7 million years)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"window_s must be at most {MAX_ANALYZE_WINDOW_S:.0f} s (100 years), "
                                f"not {request.window_s:g}")
        if request.window_s > 0:
            config = an.with_window(config, request.window_s)
        if not math.isfinite(request.wait_actions_s) or not 0 <= request.wait_actions_s <= MAX_WAIT_ACTIONS_S:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"wait_actions_s must be from 0 to {MAX_WAIT_ACTIONS_S:.0f} seconds, "
                                f"not {request.wait_actions_s:g}")
        limit = request.max_flags or 1000
        try:
            analyzer = an.Analyzer(config)
            result = await asyncio.wrap_future(
                self._writer.call(analyzer.run_pass))
            flags = await asyncio.get_running_loop().run_in_executor(
                self._query_pool, lambda: an.open_flags(self._cursor_factory(), limit + 1))
            if result.opened:
                await asyncio.get_running_loop().run_in_executor(
                    self._query_pool, self.raw_requests.after_pass, result.now)
        except an.AnalyzerError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (duckdb.Error, StorageError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the analysis pass failed in the database: {first_line(exc)}")
        actions: list[dict] = []
        pending = False
        if self.after_pass is not None:      # only hands the actions thread a token; the pass never waits on it
            loop = asyncio.get_running_loop()
            watermark = await loop.run_in_executor(self._query_pool, self._last_action_id)
            self.after_pass(result.now)
            if request.wait_actions_s > 0 and self.actions_idle is not None:
                # The caller asked to see them: wait (this call only, on a pool of its own) until the thread is
                # idle, then read the rows it wrote after this pass committed.
                idle = await loop.run_in_executor(self._wait_pool, self.actions_idle, request.wait_actions_s)
                pending = not idle
                actions = await loop.run_in_executor(self._query_pool, lambda: self._actions_after(watermark))
        return pb.AnalyzeResponse(pass_json=an.dumps(result.as_dict()), flags_json=an.dumps(flags[:limit]),
                                  truncated=len(flags) > limit, actions_json=an.dumps(actions),
                                  actions_pending=pending)

    # -- raw windows (docs/RESOLUTION.md)
    async def RequestRawWindow(self, request: pb.RawWindowAsk, context):
        await self._refuse_undecodable(request, context)
        if not math.isfinite(request.seconds) or not 0 < request.seconds <= raw_requests_mod.MAX_SECONDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"seconds must be more than 0 and at most {raw_requests_mod.MAX_SECONDS:.0f} "
                                f"(a day), not {request.seconds:g}")
        if request.node_id not in self._writer.known_nodes:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"node {request.node_id!r} is not registered with this collector")
        try:
            rid = await asyncio.get_running_loop().run_in_executor(
                self._query_pool, self.raw_requests.ask, request.node_id, request.seconds,
                request.reason or "asked")
        except (duckdb.Error, StorageError) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the request could not be stored: {first_line(exc)}")
        return pb.RawWindowAskReply(request_id=rid)

    def _last_action_id(self) -> int:
        cur = self._cursor_factory()
        try:
            return cur.execute("SELECT coalesce(max(action_id), 0) FROM actions").fetchone()[0]
        finally:
            cur.close()

    def _actions_after(self, action_id: int) -> list[dict]:
        cur = self._cursor_factory()
        try:
            res = cur.execute("SELECT * FROM actions WHERE action_id > ? ORDER BY action_id", [action_id])
            cols = [d[0] for d in res.description]
            return [dict(zip(cols, r)) for r in res.fetchall()]
        finally:
            cur.close()

    # -- Fabric (collector/fabric/coordinator.py)
    async def Assignments(self, request: pb.AssignmentsRequest, context):
        await self._refuse_undecodable(request, context)
        if self.fabric is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "fabric probes are off on this collector")
        if request.node_id not in self._writer.known_nodes:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"node {request.node_id!r} is not registered with this collector; call Register first")
        queue = self.fabric.attach(request.node_id)
        try:
            while True:
                msg = await queue.get()
                if msg is None:
                    return      # a newer stream for this node took over
                yield msg
        finally:
            self.fabric.detach(request.node_id, queue)

    async def AnswerAssignment(self, request: pb.AssignmentAnswer, context):
        await self._refuse_undecodable(request, context)
        if self.fabric is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "fabric probes are off on this collector")
        return pb.AssignmentAnswerAck(known=self.fabric.answer(request))
