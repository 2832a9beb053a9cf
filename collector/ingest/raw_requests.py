"""Raw-window requests: the collector asks a node for the 1 s samples of its summarised series (docs/RESOLUTION.md).

A request is a raw_requests row (written on the writer, like every write) and an entry in memory. The node's
next ack carries it (pb.Ack.raw_requests), and the agent answers in RawWindow parts of later batches; ingest
stores them in raw_windows and fills in the row's answered_at, rows and held_since. Requests come from two
places: a flag that a pass opened (its node's last ``flag_window_s``), and a person (the RequestRawWindow RPC,
`gpuagent-collector raw-window`). A request that no ack carried before the collector stopped, or that was
carried but never answered (the stream broke), is sent again when the node's next stream opens, while it is
younger than ``flag_window_s``; the agent answers each id once.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
import threading
from typing import Any, Callable

from gpuagent.common.timeutil import utc_now
from gpuagent.proto import pb

log = logging.getLogger("gpuagent.collector.raw_requests")

DEFAULT_FLAG_WINDOW_S = 900.0        # the agent's default raw_keep_s: what a node still holds
MAX_SECONDS = 86_400.0


def _ns(t: dt.datetime) -> int:
    return int(t.replace(tzinfo=dt.timezone.utc).timestamp() * 1e9)


class RawRequests:
    """The requests not yet carried by an ack, per node. Thread-safe; ``take`` is called on the event loop."""

    def __init__(self, writer, cursor_factory: Callable[[], Any], flag_window_s: float = DEFAULT_FLAG_WINDOW_S):
        self._writer = writer
        self._cursor_factory = cursor_factory
        self.flag_window_s = flag_window_s
        self._lock = threading.Lock()
        self._pending: dict[str, list[pb.RawWindowRequest]] = {}

    # -- asking (any thread but the writer's, which these calls wait for)
    def ask(self, node_id: str, seconds: float, reason: str, now: dt.datetime | None = None) -> str:
        """Ask ``node_id`` for its last ``seconds``; returns the request id once the row is committed."""
        rows = self._insert([(node_id, seconds, reason)], now)
        return rows[0].request_id

    def _insert(self, asks: list[tuple[str, float, str]], now: dt.datetime | None) -> list[pb.RawWindowRequest]:
        now = now or utc_now()
        reqs, rows = [], []
        for node_id, seconds, reason in asks:
            rid = secrets.token_hex(8)
            since = now - dt.timedelta(seconds=min(seconds, MAX_SECONDS))
            rows.append((rid, node_id, since, now, reason, now))
            reqs.append((node_id, pb.RawWindowRequest(request_id=rid, since_ns=_ns(since), until_ns=_ns(now))))
        self._writer.call(lambda con: con.executemany(
            "INSERT INTO raw_requests (request_id, node_id, since, until, reason, requested_at) "
            "VALUES (?, ?, ?, ?, ?, ?)", rows)).result()
        self._queue(reqs)
        return [r for _, r in reqs]

    def _queue(self, reqs: list[tuple[str, pb.RawWindowRequest]]) -> None:
        with self._lock:
            for node_id, r in reqs:
                self._pending.setdefault(node_id, []).append(r)

    def after_pass(self, now: dt.datetime) -> int:
        """Ask every node with a flag this pass opened (first_seen = the pass's time) for its last
        ``flag_window_s``, one request per node. Returns how many were asked."""
        cur = self._cursor_factory()
        try:
            rows = cur.execute("SELECT node_id, string_agg(DISTINCT kind, ', ' ORDER BY kind) FROM flags "
                               "WHERE state = 'open' AND first_seen = ? AND node_id IS NOT NULL GROUP BY node_id "
                               "ORDER BY node_id", [now]).fetchall()
        finally:
            cur.close()
        if not rows:
            return 0
        self._insert([(node, self.flag_window_s, f"flag opened: {kinds}") for node, kinds in rows], now)
        log.info("asked %d node(s) with new flags for their raw windows", len(rows))
        return len(rows)

    # -- carrying (the servicer, on the event loop)
    def take(self, node_id: str) -> list[pb.RawWindowRequest]:
        """The node's requests for the ack being sent; their sent_at is written on the writer, not awaited."""
        with self._lock:
            reqs = self._pending.pop(node_id, None)
        if not reqs:
            return []
        ids, now = [r.request_id for r in reqs], utc_now()
        self._writer.call(lambda con: con.execute(
            "UPDATE raw_requests SET sent_at = ? WHERE list_contains(?, request_id)", [now, ids]))
        return reqs

    def reload(self, node_id: str, now: dt.datetime | None = None) -> int:
        """Queue the node's unanswered requests younger than flag_window_s again (a new stream opened)."""
        now = now or utc_now()
        cur = self._cursor_factory()
        try:
            rows = cur.execute("SELECT request_id, since, until FROM raw_requests WHERE node_id = ? "
                               "AND answered_at IS NULL AND requested_at > ?",
                               [node_id, now - dt.timedelta(seconds=self.flag_window_s)]).fetchall()
        finally:
            cur.close()
        with self._lock:
            known = {r.request_id for r in self._pending.get(node_id, [])}
        fresh = [(node_id, pb.RawWindowRequest(request_id=rid, since_ns=_ns(s), until_ns=_ns(u)))
                 for rid, s, u in rows if rid not in known]
        self._queue(fresh)
        return len(fresh)

    def has_pending(self, node_id: str) -> bool:
        with self._lock:
            return bool(self._pending.get(node_id))
