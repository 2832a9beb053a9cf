#!/usr/bin/env python3
"""Storage efficiency on SYNTHETIC fleet data: bytes per sample in DuckDB before and after compaction, and in
a real Prometheus TSDB built from the same samples, and in the Parquet lake; ingest throughput while compaction
runs.

1. ``gpuagent-sim`` (fixed seed) backfills ``--nodes`` x ``--hours`` ending on a whole hour into a real
   collector (in-process, real gRPC on loopback, fresh DuckDB file); the file is checkpointed and copied.
2. DuckDB before/after: the bytes the database uses (file minus free blocks plus WAL, see
   collector/store/maintenance.py) over the samples it holds, before and after every closed hour is
   compacted (collector/store/maintenance.py: a sorted rewrite per span in chunks of whole (node, metric) groups).
3. Prometheus: the same samples written as OpenMetrics text (one gauge family per metric; node_id, gpu and
   the sample's labels as labels; millisecond timestamps), converted with
   ``promtool tsdb create-blocks-from openmetrics``; the size of every file of the block directory over
   the samples.
4. Parquet: the lake exporter (collector/lake/export.py, what ``gpuagent-collector lake export`` runs) writes
   every closed hour of the compacted file to a local lake; the ``samples`` partitions' files over the samples.
5. Ingest during compaction: on the copy from step 1, a second simulated fleet (``--live-nodes``, the hour
   after the backfill, so none of it is compacted) streams while compaction rewrites the closed hours; its
   acknowledged samples over the wall time of the overlap, against the same fleet streamed without
   compaction and against a raw Arrow insert of the same rows into a fresh DuckDB file (no gRPC).

    python benchmarks/storage_efficiency.py --json                      # 100 nodes x 6 h (long)
    python benchmarks/storage_efficiency.py --nodes 10 --hours 2 --json  # a quick run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HOUR_NS = 3600 * 10**9
END_NS = 1_790_000_000 * 10**9 // (24 * HOUR_NS) * (24 * HOUR_NS)   # a fixed midnight: the same data every run


def _ts(ns: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.timezone.utc).replace(tzinfo=None)


def _sim(address: str, prefix: str, nodes: int, hours: float, end_ns: int, seed: int, streams: int):
    from gpuagent.sim.run import SimConfig, run_sim

    s = run_sim(SimConfig(collector=address, nodes=nodes, sim_hours=hours, seed=seed, prefix=prefix,
                          end_ns=end_ns, streams=streams, scenario="mixed"))
    if s.nodes_ok != nodes:
        raise SystemExit(f"the simulated fleet {prefix!r} was not fully acknowledged: {s.errors[:3]}")
    return s


def _used(handle, db_path: str) -> tuple[int, int, int]:
    """(bytes the database uses after a checkpoint, bytes of the blocks holding samples, samples held).

    The first counts every table (probes, jobs, the logs), so it overstates small runs; the second counts
    each block any samples segment lies in, whole.
    """
    from gpuagent.collector.store import disk_usage as du

    def f(c):
        c.execute("CHECKPOINT")
        return (du.measure(c, db_path).used_bytes, du.table_bytes(c, "samples"),
                c.execute("SELECT count(*) FROM samples").fetchone()[0])

    return handle.writer.call(f).result()


def _compact_all(handle, db_path: str, now: dt.datetime, span_s: float, duty: float
                 ) -> tuple[int, int, float, float]:
    """Compact every closed span through the writer; (spans, rows, seconds, longest writer hold in s)."""
    from gpuagent.collector.store import maintenance as mt
    from gpuagent.collector.store import maintenance_config as mc

    m = mt.Maintenance(db_path, mc.MaintenanceConfig(compact_span_s=span_s, compact_duty=duty, compaction=True), rollup=None,
                       now=lambda: now)
    call = lambda fn: handle.writer.call(fn).result()  # noqa: E731
    t0 = time.perf_counter()
    hours = call(m.closed_spans)
    rows = sum(mt.compact_span(call, m, h) for h in hours)
    return len(hours), rows, time.perf_counter() - t0, m.counters.compact_hold_max_s


def _om_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def write_openmetrics(db_path: str, out: Path) -> int:
    """The samples of ``db_path`` as OpenMetrics text, one gauge family per metric; returns lines written."""
    import duckdb

    con = duckdb.connect(db_path, read_only=True)
    n = 0
    try:
        metrics = [r[0] for r in con.execute("SELECT DISTINCT metric FROM samples ORDER BY 1").fetchall()]
        series = con.execute("SELECT DISTINCT node_id, gpu, labels FROM samples").fetchall()
        # Series labels, rendered once: node, gpu and the sample's own "k=v,k2=v2" labels (escaped '\,').
        rendered = {}
        for node, gpu, labels in series:
            parts = [f'node="{_om_label(node)}"']
            if gpu is not None:
                parts.append(f'gpu="{gpu}"')
            for kv in _split_labels(labels):
                k, _, v = kv.partition("=")
                parts.append(f'{k}="{_om_label(v)}"')
            rendered[(node, gpu, labels)] = "{" + ",".join(parts) + "}"
        with open(out, "w") as fh:
            for metric in metrics:
                fh.write(f"# TYPE {metric} gauge\n")
                cur = con.execute("SELECT node_id, gpu, labels, epoch_ms(ts), value FROM samples WHERE metric = ? "
                                  "ORDER BY node_id, gpu, labels, ts", [metric])
                while True:
                    chunk = cur.fetchmany(200_000)
                    if not chunk:
                        break
                    fh.writelines(f"{metric}{rendered[(a, b, c)]} {v!r} {ms / 1000:.3f}\n" for a, b, c, ms, v in chunk)
                    n += len(chunk)
            fh.write("# EOF\n")
    finally:
        con.close()
    return n


def _split_labels(labels: str) -> list[str]:
    out, cur, esc = [], [], False
    for ch in labels:
        if esc:
            cur.append(ch)
            esc = False
        elif ch == "\\":
            esc = True
        elif ch == ",":
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return [p for p in out if p]


def prometheus_bytes(om: Path, blocks: Path, promtool: str) -> tuple[int, float]:
    """(bytes of the TSDB block directory, seconds) after ``promtool tsdb create-blocks-from openmetrics``."""
    t0 = time.perf_counter()
    r = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(om), str(blocks)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"promtool failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return sum(p.stat().st_size for p in blocks.rglob("*") if p.is_file()), time.perf_counter() - t0


def lake_samples_bytes(db_path: str, lake_dir: Path, now: dt.datetime) -> tuple[int, int, float]:
    """(bytes, rows, seconds) of the ``samples`` partitions the lake exporter writes for ``db_path``: every
    closed hour exported by collector/lake/export.py (ZSTD, sorted), files counted whole."""
    import pyarrow.parquet as pq

    from gpuagent.collector.lake.export import export_db

    t0 = time.perf_counter()
    export_db(db_path, str(lake_dir), "s0", now=now)
    secs = time.perf_counter() - t0
    files = [p for p in (lake_dir / "samples").rglob("*.parquet") if p.is_file()]
    return (sum(p.stat().st_size for p in files), sum(pq.ParquetFile(p).metadata.num_rows for p in files), secs)


def arrow_insert_rate(rows) -> float:
    """Rows/s of one raw Arrow insert of ``rows`` into a fresh DuckDB file with the collector's schema."""
    import duckdb

    from gpuagent.collector.store import schema

    with tempfile.TemporaryDirectory(prefix="gpuagent-storage-ref-") as d:
        con = duckdb.connect(str(Path(d) / "ref.duckdb"))
        schema.migrate(con)
        con.execute("SET preserve_insertion_order = false")
        con.register("ref_rows", rows)
        t0 = time.perf_counter()
        con.execute("BEGIN TRANSACTION")
        con.execute("INSERT INTO samples SELECT ts, node_id, gpu, metric, labels, value FROM ref_rows")
        con.execute("COMMIT")
        rate = rows.num_rows / (time.perf_counter() - t0)
        con.close()
    return rate


def _live(address: str, args, tag: str, until: threading.Event | None) -> tuple[int, float]:
    """Stream simulated live fleets (the hour after the backfill) until ``until`` is set, or once."""
    samples, t0, i = 0, time.perf_counter(), 0
    while True:
        s = _sim(address, f"{tag}{i}", args.live_nodes, args.live_hours, END_NS + HOUR_NS, args.seed + 1 + i,
                 args.streams)
        samples += s.samples
        i += 1
        if until is None or until.is_set():
            return samples, time.perf_counter() - t0


def run(args) -> dict:
    from gpuagent.collector.service import start_collector

    work = Path(tempfile.mkdtemp(prefix="gpuagent-storage-", dir=args.workdir))
    out: dict = {"benchmark": "storage_efficiency", "synthetic": True, "nodes": args.nodes, "hours": args.hours,
                 "gpus_per_node": 8, "seed": args.seed, "interval_s": 1.0}
    try:
        db = str(work / "a.duckdb")
        h = start_collector(db, analyze=False)
        try:
            t0 = time.perf_counter()
            s = _sim(h.address, "sim", args.nodes, args.hours, END_NS, args.seed, args.streams)
            out["backfill_samples_per_s"] = round(s.samples / (time.perf_counter() - t0))
            before, before_tbl, n = _used(h, db)
        finally:
            h.stop()
        out["samples"] = n
        out["duckdb_bytes_before"] = before
        out["duckdb_bytes_per_sample_before"] = round(before / n, 3)
        out["samples_table_bytes_per_sample_before"] = round(before_tbl / n, 3)
        shutil.copyfile(db, work / "b.duckdb")

        # Prometheus from the same samples.
        om = work / "samples.om"
        lines = write_openmetrics(db, om)
        assert lines == n, (lines, n)
        prom, prom_s = prometheus_bytes(om, work / "prom", args.promtool)
        om.unlink()
        out["prometheus_bytes"] = prom
        out["prometheus_bytes_per_sample"] = round(prom / n, 3)
        out["prometheus_note"] = "promtool tsdb create-blocks-from openmetrics, default block duration (2 h)"

        # DuckDB after compaction (nothing else running).
        now = _ts(END_NS + HOUR_NS)      # every span of the backfill closed
        h = start_collector(db, analyze=False)
        try:
            hours, rows, secs, hold = _compact_all(h, db, now, args.span_hours * 3600, 1.0)
            after, after_tbl, n2 = _used(h, db)
        finally:
            h.stop()
        assert n2 == n and rows == n, (n, n2, rows)
        out.update({"compact_span_hours": args.span_hours, "compacted_spans": hours, "compaction_s": round(secs, 1),
                    "compaction_rows_per_s": round(rows / secs),
                    "compaction_longest_writer_hold_s": round(hold, 2),
                    "duckdb_bytes_after": after, "duckdb_bytes_per_sample_after": round(after / n, 3),
                    "samples_table_bytes_per_sample_after": round(after_tbl / n, 3),
                    "duckdb_file_bytes_after": os.stat(db).st_size})
        out["duckdb_bytes_note"] = ("duckdb_bytes_*: the whole database's used blocks plus WAL after a checkpoint; "
                                    "samples_table_*: the 256 KiB blocks holding samples segments")
        # Prometheus's blocks hold samples only, so the comparable DuckDB figure is the samples table's.
        out["target_after_le_prometheus"] = (out["samples_table_bytes_per_sample_after"]
                                             <= out["prometheus_bytes_per_sample"])

        # The Parquet lake: the real exporter (gpuagent-collector lake export) on the same file.
        lake_bytes, lake_rows, lake_s = lake_samples_bytes(db, work / "lake", now)
        assert lake_rows == n, (lake_rows, n)
        out.update({"parquet_lake_samples_bytes": lake_bytes,
                    "parquet_lake_bytes_per_sample": round(lake_bytes / n, 3),
                    "parquet_lake_export_s": round(lake_s, 1),
                    "parquet_vs_prometheus": round(lake_bytes / prom, 3),
                    "target_parquet_le_0_6_prometheus": lake_bytes <= 0.6 * prom})

        if args.no_live:
            return out
        # Ingest while compaction runs, on the uncompacted copy.
        db_b = str(work / "b.duckdb")
        h = start_collector(db_b, analyze=False)
        try:
            idle_samples, idle_s = _live(h.address, args, "idle", None)
            done = threading.Event()
            result: dict = {}

            def compact():
                try:
                    result["c"] = _compact_all(h, db_b, now, args.span_hours * 3600, args.duty)
                finally:
                    done.set()

            th = threading.Thread(target=compact)
            th.start()
            busy_samples, busy_s = _live(h.address, args, "busy", done)
            th.join()
            live_rows = h.writer.call(lambda c: c.execute(
                "SELECT ts, node_id, gpu, metric, labels, value FROM samples WHERE node_id IN "
                "(SELECT node_id FROM nodes WHERE hostname LIKE 'busy%')").to_arrow_table()).result()
        finally:
            h.stop()
        out.update({"live_nodes": args.live_nodes,
                    "ingest_samples_per_s_idle": round(idle_samples / idle_s),
                    "ingest_samples_per_s_during_compaction": round(busy_samples / busy_s),
                    "ingest_during_compaction_samples": busy_samples,
                    "compact_duty": args.duty,
                    "compaction_s_with_ingest": round(result["c"][2], 1),
                    "compaction_longest_writer_hold_s_with_ingest": round(result["c"][3], 2),
                    "raw_arrow_insert_rows_per_s": round(arrow_insert_rate(live_rows))})
        out["ingest_during_compaction_vs_raw_arrow"] = round(
            out["ingest_samples_per_s_during_compaction"] / out["raw_arrow_insert_rows_per_s"], 3)
        out["ingest_during_compaction_vs_idle"] = round(
            out["ingest_samples_per_s_during_compaction"] / out["ingest_samples_per_s_idle"], 3)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            out["workdir"] = str(work)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--hours", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--live-nodes", type=int, default=10, help="the fleet that streams during compaction")
    p.add_argument("--live-hours", type=float, default=0.25, help="simulated span of one live run")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--span-hours", type=int, default=6, help="storage.compact_span, in hours")
    p.add_argument("--duty", type=float, default=0.3,
                   help="storage.compact_duty while the live fleet streams (alone, compaction runs at 1.0)")
    p.add_argument("--promtool", default=shutil.which("promtool") or "/usr/bin/promtool")
    p.add_argument("--workdir", default=None, help="where the temporary files go (default: the system temp)")
    p.add_argument("--keep", action="store_true", help="keep the databases and TSDB blocks")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-live", action="store_true",
                   help="skip part 5 (ingest during compaction; benchmarks/ingest.py --during-compaction measures it too)")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.hours <= 0 or args.live_nodes < 1:
        p.error("--nodes and --live-nodes must be at least 1 and --hours positive")
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        live = (f"; ingest during compaction {result['ingest_samples_per_s_during_compaction']:,}/s vs raw Arrow "
                f"insert {result['raw_arrow_insert_rows_per_s']:,}/s" if "raw_arrow_insert_rows_per_s" in result else "")
        print(f"{result['samples']:,} SYNTHETIC samples: DuckDB {result['duckdb_bytes_per_sample_before']} -> "
              f"{result['duckdb_bytes_per_sample_after']} bytes/sample after compaction; Prometheus TSDB "
              f"{result['prometheus_bytes_per_sample']}; Parquet lake {result['parquet_lake_bytes_per_sample']}"
              f"{live}")
    sys.exit(0)


if __name__ == "__main__":
    main()
