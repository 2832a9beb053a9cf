"""Retention and the disk guard on backfilled SYNTHETIC fleet data (gpuagent-sim over real gRPC, real DuckDB)."""

from __future__ import annotations

import datetime as dt
import threading
import time

from gpuagent.collector.ingest.server import start_collector
from gpuagent.collector.store import maintenance as mt
from gpuagent.sim.run import SimConfig, run_sim

END_NS = 1_790_000_000 * 10**9 // (3600 * 10**9) * (3600 * 10**9)   # a fixed whole hour
END = dt.datetime.fromtimestamp(END_NS / 1e9, dt.timezone.utc).replace(tzinfo=None)


def _sim(address, prefix, hours, seed):
    return run_sim(SimConfig(collector=address, nodes=3, gpus=2, sim_hours=hours, interval_s=10.0, batch_s=600.0,
                             seed=seed, streams=3, prefix=prefix, end_ns=END_NS))


def test_retention_deletes_exactly_the_old_raw_rows_keeps_rollups_and_ingest_continues(tmp_path):
    handle = start_collector(tmp_path / "c.duckdb")
    try:
        assert _sim(handle.address, "old", 4.0, 1).nodes_ok == 3
        call = lambda fn: handle.writer.call(fn).result()  # noqa: E731
        rollup = handle.analyzer.analyzer.rollup
        call(lambda c: rollup(c))
        bound = END - dt.timedelta(hours=2)
        old_rows, total_before = call(lambda c: c.execute(
            "SELECT count(*) FILTER (WHERE ts < ?), count(*) FROM samples", [bound]).fetchone())
        rollup_before = call(lambda c: c.execute("SELECT count(*), sum(n) FROM samples_1m").fetchone())
        assert old_rows > 0 and total_before > old_rows
        m = mt.Maintenance(str(tmp_path / "c.duckdb"),
                           mt.MaintenanceConfig(raw_retention_s=2 * 3600, slice_s=1200.0), rollup, now=lambda: END)
        live = {}

        def ingest():      # newer than the bound: none of it may be deleted
            t0 = time.perf_counter()
            s = _sim(handle.address, "live", 1.0, 2)
            live["samples"], live["s"], live["ok"] = s.samples, time.perf_counter() - t0, s.nodes_ok

        th = threading.Thread(target=ingest)
        th.start()
        deleted = mt.run_retention(call, m)
        th.join()
        assert live["ok"] == 3
        print(f"ingest during the purge: {live['samples'] / live['s']:.0f} samples/s ({live['samples']} samples)")
        assert deleted["samples"] == old_rows
        left_old, total_after = call(lambda c: c.execute(
            "SELECT count(*) FILTER (WHERE ts < ?), count(*) FROM samples", [bound]).fetchone())
        assert left_old == 0
        assert total_after == total_before - old_rows + live["samples"]
        logged = call(lambda c: c.execute("SELECT sum(rows) FROM retention_log WHERE tbl = 'samples' "
                                          "AND reason = 'retention'").fetchone()[0])
        assert logged == old_rows and m.counters.deleted["samples"] == old_rows
        # Rollups keep the deleted minutes, and the next pass counts every raw row exactly once.
        call(lambda c: rollup(c))
        n_1m_old = call(lambda c: c.execute("SELECT sum(n) FROM samples_1m WHERE minute < ?", [bound]).fetchone()[0])
        assert n_1m_old == old_rows
        assert call(lambda c: c.execute("SELECT sum(n) FROM samples_1m").fetchone()[0]) == \
            rollup_before[1] + live["samples"]
    finally:
        handle.stop()
