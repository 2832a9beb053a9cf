"""Compaction and the rollups on real DuckDB files with SYNTHETIC rows: a compacted span rolls up exactly as the
same data left alone, while new rows arrive between chunks and checkpoints renumber rowids under the
watermark."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import duckdb
import pytest

from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.store import maintenance as mt
from gpuagent.collector.store import maintenance_config as mc
from gpuagent.collector.store import schema

SPAN = dt.datetime(2026, 1, 1, 6, 0)      # a closed 1-hour span
NODES, GPUS, METRICS = 6, 4, ("gpu_util_percent", "gpu_power_watts", "gpu_sm_clock_mhz")
PER_NODE = GPUS * len(METRICS) * 3600     # one node's rows in the span (1 s sampling)


def _arrival_order_span(con) -> None:
    """Every node's series for the span, ts-major as batches arrive; whole-number values so that sums come
    out the same in any order."""
    con.execute("""INSERT INTO samples
                   SELECT ?::TIMESTAMP + to_seconds(s), 'synthetic-n' || n, g::SMALLINT, m, '',
                          ((s * 7 + n * 13 + g * 5 + len(m)) % 101)::DOUBLE
                   FROM range(3600) a(s), range(?) b(n), range(?) c(g), unnest(?) d(m)
                   ORDER BY s, n, g, m""", [SPAN, NODES, GPUS, list(METRICS)])


def _append(cons, ts: dt.datetime, rows: int, salt: int) -> None:
    """The same ``rows`` new SYNTHETIC rows (from ``ts`` on, one node) into every connection in ``cons``."""
    for c in cons:
        c.execute("""INSERT INTO samples SELECT ?::TIMESTAMP + to_milliseconds(r * 10), 'synthetic-live', 0,
                     'gpu_util_percent', '', ((r * 31 + ?) % 97)::DOUBLE FROM range(?) t(r)""", [ts, salt, rows])


def _rollups(con):
    return con.execute("SELECT minute, node_id, gpu, metric, labels, n, sum, avg, min, max FROM samples_1m "
                       "ORDER BY ALL").fetchall()


def _raw(con):
    return con.execute("SELECT ts, node_id, gpu, metric, labels, value FROM samples ORDER BY ALL").to_arrow_table()


@pytest.mark.parametrize("renew", [False, True], ids=["one-snapshot", "snapshot-renewed-every-chunk"])
def test_compacted_span_rolls_up_as_the_same_data_uncompacted_across_rowid_renumbering(tmp_path, renew):
    # With one snapshot for the span DuckDB renumbers rowids only at the span's checkpoint; with the snapshot
    # renewed before every chunk (as a long compaction does once the WAL grows) it renumbers between chunks
    # too, with rows not yet rolled up behind the ones that move.
    a_path, b_path = str(tmp_path / "a.duckdb"), str(tmp_path / "b.duckdb")
    a = duckdb.connect(a_path)
    schema.migrate(a)
    _arrival_order_span(a)
    an = A.Analyzer()
    assert A.run_in_transaction(a, an.rollup) == NODES * PER_NODE
    a.execute("CHECKPOINT")
    a.close()
    shutil.copyfile(a_path, b_path)            # b: the same data, never compacted
    a, b = duckdb.connect(a_path), duckdb.connect(b_path)
    try:
        class Hooked(mt.Maintenance):
            def compact_chunk(self, con, *args):
                before_chunk()
                n = super().compact_chunk(con, *args)
                after_chunk()
                return n

        m = Hooked(a_path, mc.MaintenanceConfig(compact_span_s=3600.0, compact_chunk_rows=PER_NODE,
                                                compact_duty=1.0, compaction=True), an.rollup,
                   now=lambda: SPAN + dt.timedelta(hours=2))
        if renew:
            m.snapshot_wal_bytes = -1
        assert m.closed_spans(a) == [SPAN]
        live = SPAN + dt.timedelta(hours=1, minutes=5)  # the next span, still open
        state = {"chunks": 0, "appended": 0, "renumbered": 0, "pending": 0}

        def before_chunk() -> None:
            """A checkpoint, as DuckDB's automatic one may take one here; then the rows appended since the
            last chunk are rolled up (every other time; else the chunk's own rollup reads them)."""
            # since the last chunk ended: a renewed snapshot checkpoints before the next chunk is read
            hi_before = state.get("hi_before") or a.execute("SELECT max(rowid) FROM samples").fetchone()[0]
            try:
                a.execute("CHECKPOINT")
            except duckdb.TransactionException:
                assert not renew    # refused while the span's snapshot is open and rows were updated
            state["renumbered"] += a.execute("SELECT max(rowid) FROM samples").fetchone()[0] < hi_before
            if state["chunks"] % 2 == 1:
                # Exactly the rows appended since the last rollup are read: nothing rolled up twice or rebuilt.
                assert A.run_in_transaction(a, an.rollup) == state["pending"]

        def after_chunk() -> None:
            k = state["chunks"]
            rows = 20_000 + 1_000 * k
            _append((a, b), live + dt.timedelta(minutes=k), rows, k)
            if k == 0:       # late rows for the span: one node already compacted, one not yet
                for c in (a, b):
                    c.execute("INSERT INTO samples VALUES (?, 'synthetic-n0', 0, 'gpu_util_percent', '', 7.0), "
                              "(?, 'synthetic-n5', 1, 'gpu_power_watts', '', 9.0)",
                              [SPAN + dt.timedelta(minutes=3), SPAN + dt.timedelta(minutes=50)])
                rows += 2
            state["chunks"] += 1
            state["appended"] += rows
            state["pending"] = rows
            state["hi_before"] = a.execute("SELECT max(rowid) FROM samples").fetchone()[0]

        compacted = mt.compact_span(lambda fn: fn(a), m, SPAN)
        assert state["chunks"] == NODES
        # No vacuum while one snapshot is open; renewed, DuckDB renumbers rows between chunks.
        assert (state["renumbered"] > 0) == renew and m.counters.compact_snapshots_renewed == (NODES if renew else 0)
        # The span's checkpoint dropped the row groups its chunks emptied: every later row moved down, the
        # rows appended after the last chunk among them, and the next pass reads exactly those.
        assert a.execute("SELECT max(rowid) FROM samples").fetchone()[0] < state["hi_before"]
        assert A.run_in_transaction(a, an.rollup) == state["pending"]
        assert compacted == NODES * PER_NODE + 1    # the late row for the node not yet compacted went with it
        assert m.closed_spans(a) == []

        A.run_in_transaction(b, an.rollup)
        assert _raw(a).equals(_raw(b))
        rolled = _rollups(a)
        assert rolled == _rollups(b)
        assert sum(r[5] for r in rolled) == NODES * PER_NODE + state["appended"]
        # And the span really was rewritten in series order: its rows of node n0 come before those of n1.
        first_n1 = a.execute("SELECT min(rowid) FROM samples WHERE node_id = 'synthetic-n1' AND ts < ?",
                             [SPAN + dt.timedelta(hours=1)]).fetchone()[0]
        assert a.execute("SELECT max(rowid) FROM samples WHERE node_id = 'synthetic-n0' AND ts < ? "
                         "AND value <> 7.0", [SPAN + dt.timedelta(hours=1)]).fetchone()[0] < first_n1
    finally:
        a.close()
        b.close()


def test_compaction_is_on_by_default_and_in_the_packaged_config():
    root = Path(__file__).resolve().parents[1]
    assert mc.MaintenanceConfig().compaction
    assert mc.MaintenanceConfig.from_toml(root / "packaging" / "collector.toml") == mc.MaintenanceConfig()
    assert not mc.MaintenanceConfig.from_mapping({"storage": {"compaction": False}}).compaction


def test_compaction_yields_to_the_disk_guard_when_space_is_short(tmp_path):
    # A volume can never have 2^62 bytes free: the cheap look says the guard may be needed, so the span is
    # left as it is and not marked, and the thread's next turn runs the guard first.
    path = str(tmp_path / "c.duckdb")
    con = duckdb.connect(path)
    try:
        schema.migrate(con)
        _arrival_order_span(con)
        before = _raw(con)
        short = mt.Maintenance(path, mc.MaintenanceConfig(compact_span_s=3600.0, min_free_bytes=1 << 62,
                                                          compaction=True), None,
                               now=lambda: SPAN + dt.timedelta(hours=2))
        assert mt.space_short(short)
        assert mt.compact_span(lambda fn: fn(con), short, SPAN) == 0
        assert short.closed_spans(con) == [SPAN] and short.counters.compacted_rows == 0
        assert _raw(con).equals(before)
        room = mt.Maintenance(path, mc.MaintenanceConfig(compact_span_s=3600.0, min_free_bytes=1,
                                                         compaction=True), None,
                              now=lambda: SPAN + dt.timedelta(hours=2))
        assert not mt.space_short(room)
        assert mt.compact_span(lambda fn: fn(con), room, SPAN) == NODES * PER_NODE
        assert room.closed_spans(con) == []
    finally:
        con.close()
