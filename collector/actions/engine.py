"""What the collector does about findings: after each analysis pass, drain, resume or alert (docs/ACTIONS.md).

``Actions.run_once`` reads the findings (never inside the analysis transaction), applies the policy and the
circuit breaker, runs scontrol (collector/actions/slurm.py) and records one ``actions`` row per decision.
``ActionsThread`` runs it on its own thread behind a one-slot queue, so a slow or hanging scontrol never
delays an analysis pass: a pass only drops a token in the slot, and passes that come while one is being
handled fold into one (the next read sees the newest findings anyway).

Who owns a drain: a node is "drained by gpuagent" (in a mode) from its last successful drain row until a
resume row that is not ``failed``. Only such a node is ever resumed, and only when no open finding of it
asks for a drain any more and Slurm still shows the state and the Reason (text and time stamp) that
gpuagent set; anything else means a person changed it, and it is left as it is (``skipped-manual``).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import pwd
import queue
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from gpuagent.collector.actions.config import ActionsConfig
from gpuagent.collector.actions.slurm import NodeState, Scontrol
from gpuagent.common.background import BackgroundThread
from gpuagent.common.errors import first_line
from gpuagent.common.timeutil import utc_now

log = logging.getLogger("gpuagent.collector.actions")

COLUMNS = ("ts", "pass_ts", "node_id", "slurm_node", "pool", "action", "mode", "finding_id", "kind", "severity",
           "reason", "command", "outcome", "detail", "slurm_state", "reason_time", "duration_s", "actor", "rule")
INSERT_SQL = f"INSERT INTO actions ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)})"
MAX_REASON = 250        # characters of the finding's sentence kept in Slurm's Reason
RESUME_TRIES = 3        # failed resumes of one drain before the node is left for a person (outcome gave-up)

# The nodes gpuagent holds drained, per mode: the last drain-or-release row of each node is a drain.
DRAINED_SQL = """
SELECT mode, slurm_node, node_id, pool, finding_id, reason, reason_time, action_id
FROM (SELECT *, row_number() OVER (PARTITION BY mode, slurm_node ORDER BY action_id DESC) AS rn
      FROM actions
      WHERE slurm_node IS NOT NULL
        AND ((action = 'drain' AND outcome IN ('ok', 'dry-run'))
             OR (action = 'resume' AND outcome <> 'failed')))
WHERE rn = 1 AND action = 'drain'
ORDER BY mode, slurm_node
"""
_NEW_FINDINGS_SQL = """
SELECT f.finding_id, f.scope, f.kind, f.node_id, coalesce(f.pool, n.pool), f.severity, f.sentence,
       nullif(n.labels['slurm_node'], '') AS slurm_label, n.hostname,
       EXISTS (SELECT 1 FROM actions a WHERE a.finding_id = f.finding_id AND a.mode = $mode
               AND a.outcome = 'skipped-breaker') AS held_back
FROM findings f LEFT JOIN nodes n ON n.node_id = f.node_id
WHERE f.state = 'open'
  AND NOT EXISTS (SELECT 1 FROM actions a WHERE a.finding_id = f.finding_id AND a.mode = $mode
                  AND a.action IN ('drain', 'alert') AND a.outcome <> 'skipped-breaker')
ORDER BY CASE f.severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END, f.first_seen, f.finding_id
"""
_OPEN_NODE_FINDINGS_SQL = ("SELECT node_id, kind, severity, finding_id FROM findings "
                           "WHERE state = 'open' AND scope = 'node'")
_POOL_SIZES_SQL = "SELECT coalesce(pool, ''), count(*) FROM nodes GROUP BY 1"
_DRAINS_SINCE_SQL = ("SELECT count(*) FROM actions WHERE mode = ? AND action = 'drain' "
                     "AND outcome IN ('ok', 'dry-run') AND ts >= ?")
_FAILED_RESUMES_SQL = ("SELECT count(*) FROM actions WHERE mode = ? AND slurm_node = ? AND action = 'resume' "
                       "AND outcome = 'failed' AND action_id > ?")
COUNTS_SQL = "SELECT action, mode, outcome, count(*) FROM actions GROUP BY ALL ORDER BY ALL"


def default_actor() -> str:
    """Who acts: this collector's host and the OS user its scontrol runs as (Slurm records that user): the
    effective uid's name, not $USER, which the environment can set to anything."""
    uid = os.geteuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:              # no passwd entry: the uid is still who Slurm sees
        user = f"uid {uid}"
    return f"gpuagent-collector on {socket.gethostname()} as {user}"


def slurm_name(hostname: str | None, node_id: str | None, label: str | None = None) -> str:
    """The Slurm NodeName of a collector node: its ``slurm_node`` label as given, where the agent sets one;
    else its hostname's short form (node id when it has none)."""
    if label:
        return label
    return (hostname or node_id or "").split(".")[0]


class Db(Protocol):
    def query(self, sql: str, params: list | dict | None = None) -> list[tuple]: ...
    def insert(self, row: dict[str, Any]) -> None: ...


class ConnectionDb:
    """A DuckDB connection this code owns (``analyze --db``, tests): reads and writes on it directly."""

    def __init__(self, con):
        self.con = con

    def query(self, sql, params=None):
        return self.con.execute(sql, params or []).fetchall()

    def insert(self, row):
        self.con.execute(INSERT_SQL, [row.get(c) for c in COLUMNS])


class CollectorDb:
    """Inside the collector: reads on a read cursor, the writes as short calls on the single writer."""

    def __init__(self, cursor_factory: Callable[[], Any], writer):
        self.cursor_factory = cursor_factory
        self.writer = writer

    def query(self, sql, params=None):
        cur = self.cursor_factory()
        try:
            return cur.execute(sql, params or []).fetchall()
        finally:
            cur.close()

    def insert(self, row):
        values = [row.get(c) for c in COLUMNS]
        self.writer.call(lambda con: con.execute(INSERT_SQL, values)).result()


@dataclass
class _Held:
    slurm_node: str
    node_id: str | None
    pool: str
    finding_id: int | None
    reason: str | None
    reason_time: str | None
    action_id: int


class Actions:
    """The policy, the breaker and the Slurm calls; ``run_once`` after each pass."""

    def __init__(self, config: ActionsConfig, scontrol: Scontrol | None = None,
                 clock: Callable[[], dt.datetime] = utc_now, actor: str | None = None):
        self.config = config
        self.scontrol = scontrol or Scontrol(config.scontrol, config.scontrol_timeout_s)
        self.clock = clock
        self.actor = actor or default_actor()

    def _now(self) -> dt.datetime:
        """Naive UTC, as the actions table keeps it. A naive clock value is UTC already (timeutil.utc_now);
        astimezone() would read it as local time and shift every row by the host's offset from UTC."""
        t = self.clock()
        return t if t.tzinfo is None else t.astimezone(dt.timezone.utc).replace(tzinfo=None)

    def run_once(self, db: Db, pass_ts: dt.datetime | None = None) -> list[dict[str, Any]]:
        """Resume what no open finding needs drained any more, then decide every new finding. Returns the rows
        written (each is written as soon as it is decided)."""
        mode = self.config.mode
        done: list[dict[str, Any]] = []

        def record(row: dict[str, Any]) -> None:
            row = {"ts": self._now(), "pass_ts": pass_ts, "mode": mode, "actor": self.actor, **row}
            db.insert(row)
            done.append(row)
            (log.warning if row["action"] != "alert" or row["outcome"] != "recorded" else log.info)(
                "%s", action_line(row))

        held = {r[1]: _Held(r[1], r[2], r[3] or "", r[4], r[5], r[6], r[7])
                for r in db.query(DRAINED_SQL) if r[0] == mode}
        open_findings = db.query(_OPEN_NODE_FINDINGS_SQL)
        wanted = {node for node, kind, sev, _fid in open_findings if self.config.action_for(kind, sev) == "drain"}
        still_open = {fid for _n, _k, _s, fid in open_findings}
        for name, h in list(held.items()):
            if h.node_id in wanted:
                continue
            why = ("the policy no longer drains for the finding it drained for" if h.finding_id in still_open
                   else "the finding it drained for closed")
            row = {**self._resume(db, h, why), "rule": why}
            record(row)
            if row["outcome"] != "failed":
                del held[name]
        pools = {p: n for p, n in db.query(_POOL_SIZES_SQL)}
        hour_ago = self._now() - dt.timedelta(hours=1)
        drains_hour = db.query(_DRAINS_SINCE_SQL, [mode, hour_ago])[0][0]
        for fid, scope, kind, node_id, pool, severity, sentence, label, hostname, held_back in db.query(
                _NEW_FINDINGS_SQL, {"mode": mode}):
            action, rule = self.config.rule_for(kind, severity)
            if held_back and (scope != "node" or action != "drain"):
                continue     # alerted already, when the breaker held it back; the policy no longer drains it
            base = {"finding_id": fid, "kind": kind, "severity": severity, "node_id": node_id, "pool": pool,
                    "rule": rule}
            if scope != "node" or action != "drain":
                record({**base, "action": "alert", "outcome": "recorded", "reason": sentence,
                        "slurm_node": slurm_name(hostname, node_id, label) if node_id else None,
                        "detail": "the policy says alert" if scope == "node" else "a pool finding is only alerted"})
                continue
            name = slurm_name(hostname, node_id, label)
            reason = self.reason(sentence)
            base.update(slurm_node=name, reason=reason,
                        command=self.scontrol.command(*Scontrol.drain_args(name, reason)))
            if name in held:
                record({**base, "action": "drain", "outcome": "skipped-held",
                        "detail": f"already drained by gpuagent for finding {held[name].finding_id}"})
                continue
            bound = self._breaker(held, pools, (pool or ""), drains_hour)
            if bound:
                # Held back: alerted once; decided again each pass and drained once the breaker has room.
                if not held_back:
                    record({**base, "action": "alert", "outcome": "skipped-breaker", "detail": bound})
                continue
            row = self._drain(base)
            record(row)
            if row["outcome"] in ("ok", "dry-run"):
                held[name] = _Held(name, node_id, pool or "", fid, row.get("reason"), row.get("reason_time"), -1)
                drains_hour += 1
        return done

    def reason(self, sentence: str) -> str:
        # One line; Slurm drops a trailing double quote from a Reason, so none goes in.
        text = " ".join(str(sentence or "").split()).replace('"', "'")
        if len(text) > MAX_REASON:
            text = text[: MAX_REASON - 3] + "..."
        return self.config.reason_prefix + text

    def _breaker(self, held: dict[str, _Held], pools: dict[str, int], pool: str, drains_hour: int) -> str | None:
        """None when one more drain stays within every bound; else which bound, in one sentence."""
        cfg = self.config
        if len(held) + 1 > cfg.max_nodes:
            return f"circuit breaker: {len(held)} nodes already drained by gpuagent (max_nodes = {cfg.max_nodes})"
        in_pool = sum(1 for h in held.values() if h.pool == pool)
        size = pools.get(pool, 0)
        if (in_pool + 1) * 100 > cfg.max_pool_percent * size:
            return (f"circuit breaker: draining one more of pool {pool or '(none)'}'s {size} nodes "
                    f"({in_pool} drained by gpuagent) would pass max_pool_percent = {cfg.max_pool_percent:g}")
        if drains_hour + 1 > cfg.max_drains_per_hour:
            return (f"circuit breaker: {drains_hour} drains in the last hour "
                    f"(max_drains_per_hour = {cfg.max_drains_per_hour})")
        return None

    def _drain(self, base: dict[str, Any]) -> dict[str, Any]:
        name = base["slurm_node"]
        if not self.config.enforce:
            return {**base, "action": "drain", "outcome": "dry-run", "detail": "dry-run: Slurm was not asked"}
        res, node = self.scontrol.show_node(name)
        spent = res.seconds
        if not res.ok or node is None:
            return {**base, "action": "drain", "outcome": "failed", "duration_s": spent,
                    "detail": res.error or f"scontrol show node {name} named no node"}
        if node.drained:
            return {**base, "action": "drain", "outcome": "skipped-manual", "slurm_state": node.state,
                    "duration_s": spent,
                    "detail": f"already {node.state} with reason {node.reason!r} "
                              f"(by {node.reason_user or '?'} at {node.reason_time or '?'}): not gpuagent's to change"}
        res = self.scontrol.run(*Scontrol.drain_args(name, base["reason"]))
        spent += res.seconds
        if not res.ok:
            return {**base, "action": "drain", "outcome": "failed", "detail": res.error, "duration_s": spent}
        after_res, after = self.scontrol.show_node(name)
        spent += after_res.seconds
        row = {**base, "action": "drain", "outcome": "ok", "duration_s": spent}
        if after is not None:
            # What Slurm shows is what the resume rule compares with later.
            row.update(reason=after.reason or base["reason"], slurm_state=after.state, reason_time=after.reason_time)
        else:
            row["detail"] = f"drained, but reading the node back failed: {after_res.error}"
        return row

    def _resume(self, db: Db, h: _Held, why: str = "the finding it drained for closed") -> dict[str, Any]:
        base = {"action": "resume", "node_id": h.node_id, "slurm_node": h.slurm_node, "pool": h.pool or None,
                "finding_id": h.finding_id, "reason": h.reason,
                "command": self.scontrol.command(*Scontrol.resume_args(h.slurm_node))}
        if not self.config.enforce:
            return {**base, "outcome": "dry-run", "detail": "no open finding needs it drained; dry-run"}
        tries = db.query(_FAILED_RESUMES_SQL, [self.config.mode, h.slurm_node, h.action_id])[0][0]
        if tries >= RESUME_TRIES:
            return {**base, "outcome": "gave-up",
                    "detail": f"{tries} resumes failed: the node is left drained for a person"}
        res, node = self.scontrol.show_node(h.slurm_node)
        if not res.ok or node is None:
            return {**base, "outcome": "failed", "duration_s": res.seconds,
                    "detail": res.error or f"scontrol show node {h.slurm_node} named no node"}
        changed = self._changed(h, node)
        if changed:
            return {**base, "outcome": "skipped-manual", "slurm_state": node.state, "duration_s": res.seconds,
                    "detail": f"{changed} since gpuagent drained it: left as it is"}
        run = self.scontrol.run(*Scontrol.resume_args(h.slurm_node))
        return {**base, "outcome": "ok" if run.ok else "failed", "slurm_state": node.state,
                "duration_s": res.seconds + run.seconds, "detail": run.error or why}

    @staticmethod
    def _changed(h: _Held, node: NodeState) -> str | None:
        if not node.drained:
            return f"the node is {node.state}, no longer drained"
        if node.reason != (h.reason or ""):
            return f"the reason is now {node.reason!r}"
        if h.reason_time and node.reason_time != h.reason_time:
            return f"the reason was set again at {node.reason_time} (by {node.reason_user or '?'})"
        return None


def action_line(row: dict[str, Any]) -> str:
    """One line for a person: ``analyze`` prints one per action of the pass."""
    where = row.get("slurm_node") or row.get("pool") or "-"
    text = row.get("detail") if row["outcome"] not in ("ok", "dry-run", "recorded") else row.get("reason")
    fid = f" finding {row['finding_id']}" if row.get("finding_id") is not None else ""
    return f"action {row['action']} {where} [{row['mode']}] {row['outcome']}{fid}: {text or ''}".rstrip(": ")


def recent_actions(cur, limit: int = 100) -> list[dict[str, Any]]:
    """The newest actions, newest first, as dicts (for the report and other views)."""
    res = cur.execute(f"SELECT action_id, {', '.join(COLUMNS)} FROM actions ORDER BY action_id DESC LIMIT ?",
                      [int(limit)])
    cols = [d[0] for d in res.description]
    return [dict(zip(cols, r)) for r in res.fetchall()]


class ActionsThread:
    """``run_once`` on its own thread; ``notify`` (after each pass) never blocks."""

    def __init__(self, actions: Actions, db: Db, on_error: Callable[[BaseException], None] | None = None):
        self.actions = actions
        self.db = db
        self._on_error = on_error
        self._slot: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Condition()
        self._pending = 0      # notified passes not yet handled (0 or 1: they fold into one)
        self._worker = BackgroundThread("gpuagent-actions", self._loop)
        self._stop = self._worker.stopping
        self.handled = 0
        self.last: list[dict[str, Any]] = []
        self.last_error: str | None = None

    def start(self) -> "ActionsThread":
        self._worker.start()
        return self

    def notify(self, pass_ts: dt.datetime | None = None) -> None:
        with self._idle:
            try:
                self._slot.put_nowait(pass_ts)
                self._pending += 1
            except queue.Full:
                pass     # a pass already waits: it will read the newest findings

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                pass_ts = self._slot.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self.last = self.actions.run_once(self.db, pass_ts)
                self.last_error = None
            except Exception as exc:  # noqa: BLE001 - keep acting on later passes
                self.last_error = first_line(exc)
                if self._on_error:
                    self._on_error(exc)
            finally:
                with self._idle:
                    self._pending -= 1
                    self.handled += 1
                    self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """True once nothing waits in the slot and no run is in progress (tests, shutdown)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self._worker.stop(timeout)
