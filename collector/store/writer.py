"""The only code that writes batches to the collector's DuckDB file.

One thread owns one DuckDB connection. gRPC handlers validate a batch and turn it into Arrow tables
(collector/ingest/validate.py), then hand the ``PreparedBatch`` to the writer's queue. The writer takes
whatever has queued up (group commit: many batches, many streams, one transaction), inserts each table's
rows through Arrow in bulk (statements from store/tables.py), records every (node_id, seq) in
``ingest_log`` and commits. Only then does it call each batch's callback with the Ack. A (node_id, seq)
already in ``ingest_log`` is acked with ``duplicate=True`` and nothing of it is stored, so at-least-once
delivery stores exactly once.

Before each commit the writer checks that the volume keeps room to checkpoint (store/space.py): DuckDB
answers a full disk during a commit's WAL write with a clean error, but during a checkpoint it invalidates
the database. A batch without that room is refused (the agent keeps it and resends), never half-stored.

Another program can still fill the volume under a checkpoint. Then DuckDB invalidates the database, and the
writer closes it and opens it again in place (``reopen``), from its file and write-ahead log, retrying
every few seconds while that fails for want of space. Batches meanwhile get UNAVAILABLE and stay with
their agents; the seqs are re-read from ``ingest_log`` afterwards, so a batch whose commit reached the WAL
before the checkpoint failed is acknowledged as a duplicate, not stored twice.
"""

from __future__ import annotations

import datetime as dt
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import duckdb
import pyarrow as pa

from gpuagent.collector.store import tables
from gpuagent.collector.store.fabric_rows import group_results_sql, link_results_sql
from gpuagent.collector.store.seqset import SeqSet
from gpuagent.collector.store.space import SpaceCheck
from gpuagent.common.errors import first_line
from gpuagent.common.timeutil import utc_now
from gpuagent.proto import pb

log = logging.getLogger("gpuagent.collector.store.writer")


class StorageError(RuntimeError):
    """The database could not store a batch (disk full, I/O error, ...)."""


class NoSpace(StorageError):
    """The volume lacks room for a commit plus a checkpoint after it; nothing was written."""


class DatabaseClosed(StorageError):
    """The database was invalidated and is closed until the writer reopens it; nothing was written."""


def is_fatal(exc: BaseException) -> bool:
    """True for an error after which DuckDB refuses every statement until the database is reopened."""
    return isinstance(exc, duckdb.FatalException) or "database has been invalidated" in str(exc)


def _space_error(text: str) -> bool:
    return "no space left" in text.lower() or "enospc" in text.lower()


REOPEN_RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0)     # waits between attempts to reopen, the last one repeating


@dataclass
class PreparedBatch:
    """A validated batch as Arrow tables, one attribute per name in ``tables.BATCH_TABLES`` (None: no rows)."""

    node_id: str
    seq: int
    n_samples: int
    samples: pa.Table | None
    probe_results: pa.Table | None
    probe_metrics: pa.Table | None
    job_samples: pa.Table | None
    job_steps: pa.Table | None
    events: pa.Table | None
    job_seen: pa.Table | None
    job_end: pa.Table | None
    counts: tuple[int, int, int, int, int]    # samples, probe results, job samples, job steps, events
    samples_summary: pa.Table | None = None
    raw_windows: pa.Table | None = None
    raw_answered: pa.Table | None = None


# ---------------------------------------------------------------------------------------- writer

AckCallback = Callable[[pb.Ack | None, Exception | None], None]


@dataclass
class _BatchItem:
    prepared: PreparedBatch
    callback: AckCallback


@dataclass
class _CallItem:
    fn: Callable[[duckdb.DuckDBPyConnection], Any]
    future: Future = field(default_factory=Future)


_STOP = object()
# Each node's newest commit time into nodes.last_seen, for a list of nodes at once.
_TOUCH_SQL = ("UPDATE nodes SET last_seen = greatest(nodes.last_seen, v.ts) "      # a Register since may be newer
              "FROM (SELECT unnest(?) AS node_id, unnest(?) AS ts) v WHERE nodes.node_id = v.node_id")


def _refuse(item: _BatchItem, kind: type[StorageError], why: str) -> None:
    """Answer a batch that was not stored: ``callback(None, kind(one sentence))``."""
    err = kind(f"the collector could not store batch seq {item.prepared.seq} of node {item.prepared.node_id}: {why}")
    try:
        item.callback(None, err)
    except Exception:  # noqa: BLE001
        log.exception("ack callback failed")


class Writer:
    """Owns the writing connection and the thread that uses it. Thread-safe ``submit``/``call``."""

    def __init__(self, con: duckdb.DuckDBPyConnection, *, group_max_samples: int = 2_000_000,
                 group_max_batches: int = 2000, node_touch_interval_s: float = 5.0,
                 space: SpaceCheck | None = None,
                 reopen: Callable[[duckdb.DuckDBPyConnection], duckdb.DuckDBPyConnection] | None = None):
        self._con = con
        self.space = space            # None: no room check (a database in memory)
        # reopen(old) closes ``old`` and returns a new connection (raising when it cannot open one); None: an
        # invalidated database stops the writer for good (``fatal``).
        self._reopen = reopen
        self.closed_reason: str | None = None   # set while the database is closed after a fatal error
        self._reopen_tries = 0
        self._reopen_at = 0.0
        self._q: queue.Queue = queue.Queue()
        self._group_max_samples = group_max_samples
        self._group_max_batches = group_max_batches
        self._node_touch_interval_s = node_touch_interval_s
        self._seqs: dict[str, SeqSet] = {}
        # nodes.last_seen: the nodes that committed since the last touch, written in one UPDATE at most every
        # node_touch_interval_s. An UPDATE per commit (the nodes of that group) cost a scan of ``nodes`` each
        # time: 23 % of the collector's CPU while 30,000 synthetic nodes streamed (py-spy, 2026-12-03).
        self._untouched: dict[str, dt.datetime] = {}     # node -> the time of its newest commit
        self._touch_due = 0.0
        rows = con.execute("SELECT node_id, machine_id, hostname FROM nodes").fetchall()
        self.known_nodes: set[str] = {r[0] for r in rows}
        # node_id -> (machine_id, hostname), for the stream claims (identity.py); updated at Register.
        self.node_identity: dict[str, tuple[str, str]] = {r[0]: (r[1], r[2]) for r in rows}
        self.stats = {"groups": 0, "batches": 0, "duplicates": 0, "samples": 0, "failed_batches": 0,
                      "refused_no_space": 0, "commit_s": 0.0, "reopens": 0}
        self.fatal: str | None = None     # set when the database cannot be written any more
        self.commit_observer: Callable[[float], None] | None = None   # seconds per commit (the /metrics histogram)
        self._last_error_log = -1e9
        self._thread = threading.Thread(target=self._run, name="gpuagent-writer", daemon=True)
        self._stopped = False
        self._thread.start()

    # -- API for other threads
    def submit(self, prepared: PreparedBatch, callback: AckCallback) -> None:
        """Queue a batch; ``callback(ack, None)`` runs in the writer thread after commit (or
        ``callback(None, exc)`` when it could not be stored)."""
        self._q.put(_BatchItem(prepared, callback))

    def call(self, fn: Callable[[duckdb.DuckDBPyConnection], Any]) -> Future:
        """Run ``fn(con)`` in the writer thread (for Register and other writes); returns a Future."""
        item = _CallItem(fn)
        self._q.put(item)
        return item.future

    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The current writing connection (a new one after a reopen); for closing it at shutdown."""
        return self._con

    def queue_depth(self) -> int:
        return self._q.qsize()

    def stop(self, timeout: float | None = None) -> None:
        """Store everything queued so far, then end the thread (the caller closes the connection)."""
        if not self._stopped:
            self._stopped = True
            self._q.put(_STOP)
        self._thread.join(timeout)

    # -- writer thread
    def _run(self) -> None:
        pending: list = []
        while True:
            if pending:
                item = pending.pop(0)
            elif self.closed_reason is not None and self.fatal is None:
                try:
                    item = self._q.get(timeout=max(0.0, self._reopen_at - time.monotonic()))
                except queue.Empty:
                    self._try_reopen()
                    continue
            else:
                item = self._q.get()
            if item is _STOP:
                self._touch_now()
                return
            if self.closed_reason is not None and self.fatal is None and time.monotonic() >= self._reopen_at:
                self._try_reopen()
            if self.closed_reason is not None:
                self._refuse_closed(item)
                continue
            if isinstance(item, _CallItem):
                self._run_call(item)
                continue
            group = [item]
            n = item.prepared.n_samples
            while n < self._group_max_samples and len(group) < self._group_max_batches:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(nxt, _BatchItem):
                    pending.append(nxt)
                    break
                group.append(nxt)
                n += nxt.prepared.n_samples
            self._store_group(group)

    def _touch_now(self) -> None:
        """At stop: the nodes.last_seen still held back (a failure only loses those few seconds' precision)."""
        if not self._untouched or self.closed_reason is not None:
            return
        try:
            self._con.execute(_TOUCH_SQL, [list(self._untouched), list(self._untouched.values())])
            self._untouched.clear()
        except duckdb.Error as exc:
            log.warning("could not write the nodes' last_seen at stop: %s", first_line(exc))

    def _run_call(self, item: _CallItem) -> None:
        if not item.future.set_running_or_notify_cancel():
            return
        try:
            item.future.set_result(item.fn(self._con))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            if is_fatal(exc):     # first, so that the caller sees the writer's state after it
                self._database_failed(first_line(exc))
            item.future.set_exception(exc)

    # -- an invalidated database: close it, reopen it in place
    def _database_failed(self, why: str) -> None:
        """The database refuses every statement from now on: close it and reopen it (or stop, without reopen)."""
        if self._reopen is None:
            self.fatal = (f"the database can no longer be written ({why}); stopping so that a restart "
                          "can recover it from its write-ahead log")
            self.closed_reason = why
            return
        if self.closed_reason is None:
            log.error("the database was invalidated (%s); closing it and reopening it from its file and "
                      "write-ahead log; batches are refused meanwhile and stay with their agents", why)
        self.closed_reason = why
        self._reopen_tries = 0
        self._try_reopen()

    def _try_reopen(self) -> None:
        try:
            con = self._reopen(self._con)
        except Exception as exc:  # noqa: BLE001 - decided on below
            text = first_line(exc)
            if not _space_error(text):
                self.fatal = (f"the database was invalidated ({self.closed_reason}) and cannot be reopened: "
                              f"{text}")
                log.error("%s", self.fatal)
                return
            wait = REOPEN_RETRY_S[min(self._reopen_tries, len(REOPEN_RETRY_S) - 1)]
            self._reopen_tries += 1
            self._reopen_at = time.monotonic() + wait
            log.warning("reopening the database failed (%s); trying again in %.0f s", text, wait)
            return
        self._con = con
        # Re-read what the old connection may have held wrongly: a commit can reach the WAL and then fail.
        self._seqs.clear()
        rows = con.execute("SELECT node_id, machine_id, hostname FROM nodes").fetchall()
        self.known_nodes.update(r[0] for r in rows)
        self.node_identity.update({r[0]: (r[1], r[2]) for r in rows})
        if self.space is not None:
            self.space.reopened()
        self.stats["reopens"] += 1
        log.warning("reopened the database after it was invalidated (%s); storing again", self.closed_reason)
        self.closed_reason = None
        self._reopen_tries = 0

    def _refuse_closed(self, item) -> None:
        text = (f"the database is closed after a fatal error ({self.closed_reason}) and "
                + ("can be written again only after the collector restarts" if self.fatal is not None
                   else "the collector is reopening it"))
        if isinstance(item, _CallItem):
            if item.future.set_running_or_notify_cancel():
                item.future.set_exception(DatabaseClosed(text))
            return
        self.stats["failed_batches"] += 1
        _refuse(item, DatabaseClosed, text)

    def node_seqs(self, node_id: str) -> SeqSet:
        """Stored seqs of a node (loaded once from ingest_log, then kept current). Writer thread only."""
        st = self._seqs.get(node_id)
        if st is None:
            # Runs of consecutive seqs (gaps and islands): seq minus its rank is constant along a run.
            st = SeqSet([(int(a), int(b)) for a, b in self._con.execute(
                "SELECT min(seq), max(seq) FROM (SELECT seq, seq - row_number() OVER (ORDER BY seq) AS run "
                "FROM ingest_log WHERE node_id = ?) GROUP BY run", [node_id]).fetchall()])
            self._seqs[node_id] = st
        return st

    def _store_group(self, group: list[_BatchItem]) -> None:
        try:
            fresh, dup = [], []
            claimed: set[tuple[str, int]] = set()
            for it in group:
                p = it.prepared
                key = (p.node_id, p.seq)
                if key in claimed or p.seq in self.node_seqs(p.node_id):
                    dup.append(it)
                else:
                    claimed.add(key)
                    fresh.append(it)
            if fresh:
                started = time.perf_counter()
                self._commit(fresh)
                took = time.perf_counter() - started
                self.stats["commit_s"] += took
                if self.commit_observer is not None:
                    self.commit_observer(took)
        except Exception as exc:  # noqa: BLE001
            first = first_line(exc)
            fatal = is_fatal(exc)
            io_error = isinstance(exc, (duckdb.IOException, duckdb.TransactionException, duckdb.FatalException,
                                        OSError))
            if isinstance(exc, NoSpace) and len(group) > 1:
                # Smaller commits may fit where the whole group does not.
                for it in group:
                    self._store_group([it])
                return
            if isinstance(exc, NoSpace):
                self.stats["refused_no_space"] += 1
            elif len(group) > 1 and not io_error:
                # A data problem validation did not catch: store one by one so that one batch fails alone.
                log.warning("group commit of %d batches failed (%s); retrying one by one", len(group), first)
                for it in group:
                    self._store_group([it])
                return
            self.stats["failed_batches"] += len(group)
            now = time.monotonic()
            if now - self._last_error_log >= 10.0:
                self._last_error_log = now
                log.error("could not store %d batch(es); they are refused and the agents keep them: %s",
                          len(group), first)
            if fatal:
                self._database_failed(first)
            kind = NoSpace if isinstance(exc, NoSpace) else StorageError
            for it in group:
                _refuse(it, kind, first)
            return
        for it in fresh:
            self.node_seqs(it.prepared.node_id).add(it.prepared.seq)
        self.stats["groups"] += 1
        self.stats["batches"] += len(fresh)
        self.stats["duplicates"] += len(dup)
        self.stats["samples"] += sum(it.prepared.n_samples for it in fresh)
        dup_ids = {id(it) for it in dup}
        for it in group:
            p = it.prepared
            ack = pb.Ack(seq=p.seq, duplicate=id(it) in dup_ids,
                         highest_committed_seq=self.node_seqs(p.node_id).highest)
            try:
                it.callback(ack, None)
            except Exception:  # noqa: BLE001
                log.exception("ack callback failed")

    def _commit(self, items: list[_BatchItem]) -> None:
        con = self._con
        if self.space is not None:
            size = sum(t.nbytes for it in items for t in (getattr(it.prepared, d.name) for d in tables.BATCH_TABLES)
                       if t is not None)
            short = self.space.shortfall(con, size)
            if short is not None:
                raise NoSpace(f"{short}; refused before the disk fills")
        now = utc_now()
        con.execute("BEGIN TRANSACTION")
        registered = []
        try:
            for decl in tables.BATCH_TABLES:
                found = [t for t in (getattr(it.prepared, decl.name) for it in items) if t is not None]
                if not found:
                    continue
                con.register(decl.view, found[0] if len(found) == 1 else pa.concat_tables(found))
                registered.append(decl.view)
                con.execute(decl.insert_sql)
            if tables.PROBE_RESULTS.view in registered:
                metrics_view = tables.PROBE_METRICS.view if tables.PROBE_METRICS.view in registered else None
                con.execute(link_results_sql(tables.PROBE_RESULTS.view, metrics_view))
                con.execute(group_results_sql(tables.PROBE_RESULTS.view, metrics_view))
            log_decl = tables.INGEST_LOG
            con.register(log_decl.view, log_decl.from_rows(
                [(it.prepared.node_id, it.prepared.seq, now, *it.prepared.counts) for it in items]))
            registered.append(log_decl.view)
            con.execute(log_decl.insert_sql)
            mono = time.monotonic()
            touch = None
            if mono >= self._touch_due:
                touch = {**self._untouched, **{it.prepared.node_id: now for it in items}}
                con.execute(_TOUCH_SQL, [list(touch), list(touch.values())])
            con.execute("COMMIT")
            if touch is not None:
                self._untouched.clear()
                self._touch_due = mono + self._node_touch_interval_s
            else:
                self._untouched.update((it.prepared.node_id, now) for it in items)
            if self.space is not None:
                self.space.committed(size)
        except BaseException:
            try:
                con.execute("ROLLBACK")
            except duckdb.Error:
                pass
            raise
        finally:
            for view in registered:
                con.unregister(view)


