"""Ingest benchmark (synthetic data): a real collector process and N concurrent agent streams over loopback.

Starts `gpuagent-collector serve` on a fresh DuckDB file, then client processes that each hold many
streams (one registered synthetic node per stream) and send pre-serialized batches as fast as the
collector acks them (a small window of unacked batches per stream, as the agent's sender keeps).
The throughput is what was *durably committed*: the growth of sum(ingest_log.n_samples), read through
the collector's own Query RPC, over a measurement window after a warm-up.

In the same run it measures the reference: a raw Arrow bulk insert of the same rows into a fresh
DuckDB file with the same schema, no gRPC, no validation.

``--during-compaction`` measures what compaction (on by default, docs/COLLECTOR.md) costs ingest: a closed
6-hour span of SYNTHETIC samples is backfilled once in arrival order; then, alternately on fresh copies of
that file, the same streams run against a collector with ``[storage] compaction = false`` and against one
with the storage defaults, whose maintenance thread rewrites the span meanwhile (the window opens once a
rewritten chunk is in, and the run says whether compaction was still going when it closed). Medians over
``--rounds`` of each.

    python benchmarks/ingest.py --json                 # 100 streams, ~20 s
    python benchmarks/ingest.py --streams 20 --duration 5
    python benchmarks/ingest.py --during-compaction --streams 20 --duration 12 --json   # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_SAMPLES_PER_S = 1_000_000
RSS_LIMIT_BYTES = 1 << 30


# ------------------------------------------------------------------------------------ data

def synthetic_batch(node_id: str, seq: int, n_samples: int, n_series: int, t0_ns: int):
    """A batch shaped like an 8-GPU node's telemetry: ``n_series`` series, ``n_samples`` values."""
    from gpuagent.proto import pb

    b = pb.Batch(node_id=node_id, seq=seq, created_ns=t0_ns)
    metrics = ["gpu_util_percent", "gpu_power_watts", "gpu_temperature_celsius", "gpu_sm_clock_mhz",
               "gpu_memory_used_bytes", "gpu_pcie_tx_bytes_per_s", "cpu_user_percent", "cpu_steal_percent",
               "disk_read_bytes_per_s", "net_rx_bytes_per_s"]
    for i in range(n_series):
        m = metrics[i % len(metrics)]
        s = b.samples.series.add(id=i, metric=m, gpu=(i % 8) if m.startswith("gpu_") else -1)
        if m.startswith(("cpu_", "disk_", "net_")):
            s.labels[{"c": "cpu", "d": "device", "n": "nic"}[m[0]]] = str(i)
    per_tick = n_series
    b.samples.ts_ns.extend(t0_ns + (k // per_tick) * 1_000_000_000 for k in range(n_samples))
    b.samples.series_id.extend(k % per_tick for k in range(n_samples))
    b.samples.value.extend(float(k % 997) * 0.5 for k in range(n_samples))
    return b


def batch_bytes(node_id: str, seq: int, samples_field: bytes) -> bytes:
    """Serialized Batch = node_id (field 1) + seq (field 2) + pre-serialized samples (field 4)."""
    from gpuagent.proto.wire import length_delimited, varint

    nid = node_id.encode()
    return length_delimited(1, nid) + b"\x10" + varint(seq) + samples_field


# ------------------------------------------------------------------------------------ client worker

async def _worker(args) -> dict:
    import grpc

    from gpuagent.proto import pb, pb_grpc
    from gpuagent.proto.wire import length_delimited

    t0 = time.time_ns() - int(args.ts_offset_s * 10**9)
    template = synthetic_batch("x", 1, args.batch_samples, args.series, t0)
    samples_field = length_delimited(4, template.samples.SerializeToString())
    deadline = time.monotonic() + args.run_s
    latencies: list[float] = []
    acked_samples = 0

    async with grpc.aio.insecure_channel(args.target, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.CollectorStub(ch)
        stream_rpc = ch.stream_stream("/gpuagent.v1.Collector/Stream", request_serializer=lambda b: b,
                                      response_deserializer=pb.Ack.FromString)

        async def one_stream(k: int) -> None:
            info = pb.NodeInfo(hostname=f"bench-{args.worker_id}-{k}", machine_id=f"bench-{args.worker_id}-{k}",
                               labels={"synthetic": "true", "pool": "bench"})
            node_id = (await stub.Register(pb.RegisterRequest(node=info))).node_id
            call = stream_rpc()
            window = asyncio.Semaphore(args.window)
            sent_at: dict[int, float] = {}

            async def reader():
                nonlocal acked_samples
                async for ack in call:
                    latencies.append(time.monotonic() - sent_at.pop(ack.seq))
                    acked_samples += args.batch_samples
                    window.release()

            rtask = asyncio.ensure_future(reader())
            seq = 0
            while time.monotonic() < deadline:
                await window.acquire()
                seq += 1
                sent_at[seq] = time.monotonic()
                await call.write(batch_bytes(node_id, seq, samples_field))
            await call.done_writing()
            await rtask

        await asyncio.gather(*(one_stream(k) for k in range(args.streams_here)))
    latencies.sort()
    return {"acked_samples": acked_samples, "acks": len(latencies),
            "ack_latency_p50_s": latencies[len(latencies) // 2] if latencies else None,
            "ack_latency_p99_s": latencies[int(len(latencies) * 0.99)] if latencies else None}


# ------------------------------------------------------------------------------------ reference

def reference_insert(batch_samples: int, series: int, rows: int, repeats: int) -> tuple[list[float], list[float]]:
    """Raw Arrow bulk inserts of the same rows into a fresh DuckDB file (same schema, one transaction each).

    Returns (rows/s of each insert, CPU ns per row of each insert); CPU time is less disturbed than wall
    time when other work shares the machine.
    """
    import resource

    import duckdb
    import pyarrow as pa

    from gpuagent.collector.store import schema
    from gpuagent.collector.ingest.validate import prepare_batch

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t0 = time.time_ns() - 3600 * 10**9
    one = prepare_batch(synthetic_batch("bench-ref", 1, batch_samples, series, t0)).samples
    table = pa.concat_tables([one] * max(1, rows // batch_samples))
    rates, cpu_ns = [], []
    with tempfile.TemporaryDirectory(prefix="gpuagent-ingest-ref-") as d:
        con = duckdb.connect(str(Path(d) / "ref.duckdb"))
        schema.migrate(con)
        con.execute("SET preserve_insertion_order = false")     # as the collector sets it
        con.register("ref_rows", table)
        for _ in range(repeats):
            start, c0 = time.perf_counter(), cpu_s()
            con.execute("BEGIN TRANSACTION")
            con.execute("INSERT INTO samples SELECT ts, node_id, gpu, metric, labels, value FROM ref_rows")
            con.execute("COMMIT")
            rates.append(table.num_rows / (time.perf_counter() - start))
            cpu_ns.append((cpu_s() - c0) / table.num_rows * 1e9)
        con.close()
    return rates, cpu_ns


# ------------------------------------------------------------------------------------ driver

def _committed(target: str) -> int:
    from gpuagent.collector.views import client

    return int(client.query(target, "SELECT coalesce(sum(n_samples), 0) FROM ingest_log").rows[0][0])


def _vm_hwm_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class _Collector:
    """``gpuagent-collector serve`` on ``db`` in a subprocess, with a [storage] table written to a config file."""

    def __init__(self, work: Path, db: Path, args, storage: dict[str, object], name: str = "collector"):
        import psutil

        self.db = db
        self.log_path = work / f"{name}.log"
        port_file = work / f"{name}.port"
        config = work / f"{name}.toml"
        config.write_text("[storage]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in storage.items()))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpuagent.collector", "serve", "--listen", "127.0.0.1:0", "--db", str(db),
             "--port-file", str(port_file), "--no-analyze", "--config", str(config),
             *(["--memory-limit", args.memory_limit] if args.memory_limit else [])],
            stdout=self._log, stderr=subprocess.STDOUT)
        self.clients: list[subprocess.Popen] = []
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"the collector did not start: {self.log_path.read_text()}")
            time.sleep(0.05)
        self.target = f"127.0.0.1:{int(port_file.read_text())}"
        self.cproc = psutil.Process(self.proc.pid)

    def start_clients(self, args, run_s: float, ts_offset_s: float) -> None:
        per = [args.streams // args.clients + (1 if i < args.streams % args.clients else 0) for i in range(args.clients)]
        for i, n in enumerate(per):
            if n == 0:
                continue
            self.clients.append(subprocess.Popen(
                [sys.executable, __file__, "--_worker", "--target", self.target, "--worker-id", str(i),
                 "--streams-here", str(n), "--run-s", str(run_s), "--batch-samples", str(args.batch_samples),
                 "--series", str(args.series), "--window", str(args.window), "--ts-offset-s", str(ts_offset_s)],
                stdout=subprocess.PIPE, text=True))

    def window(self, duration: float) -> dict:
        """Samples durably committed over ``duration`` seconds, the collector's CPU, peak RSS and largest
        write-ahead log meanwhile."""
        cpu0 = sum(self.cproc.cpu_times()[:2])
        s0, t0 = _committed(self.target), time.monotonic()
        peak_rss = peak_wal = last_wal = checkpoints = 0
        while time.monotonic() - t0 < duration:
            peak_rss = max(peak_rss, self.cproc.memory_info().rss)
            wal = self.wal_bytes()
            checkpoints += wal < last_wal       # the log folded into the file
            peak_wal, last_wal = max(peak_wal, wal), wal
            time.sleep(0.2)
        s1, t1 = _committed(self.target), time.monotonic()
        cpu1 = sum(self.cproc.cpu_times()[:2])
        return {"samples": s1 - s0, "seconds": t1 - t0, "cpu_s": cpu1 - cpu0, "peak_rss": peak_rss,
                "peak_wal": peak_wal, "checkpoints": checkpoints}

    def wal_bytes(self) -> int:
        try:
            return os.stat(str(self.db) + ".wal").st_size
        except FileNotFoundError:
            return 0

    def client_results(self, run_s: float) -> list[dict]:
        out = []
        for c in self.clients:
            text, _ = c.communicate(timeout=run_s + 120)
            out.append(json.loads(text.strip().splitlines()[-1]))
        return out

    def end_clients(self) -> None:
        for c in self.clients:
            if c.poll() is None:
                c.kill()
                c.wait()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)

    def close(self) -> None:
        for p in [*self.clients, self.proc]:
            if p.poll() is None:
                p.kill()
                p.wait()
        self._log.close()


def run(args) -> dict:
    load_at_start = round(os.getloadavg()[0], 2)
    ref_rates, ref_cpu = reference_insert(args.batch_samples, args.series, args.reference_rows, 5)
    work = Path(tempfile.mkdtemp(prefix="gpuagent-ingest-bench-"))
    # Compaction off: the batches' timestamps (an hour ago) may lie in a closed span, and only ingest is measured.
    col = _Collector(work, work / "bench.duckdb", args, {"compaction": False})
    try:
        run_s = args.warmup + args.duration
        col.start_clients(args, run_s, 3600.0)
        time.sleep(args.warmup)
        w = col.window(args.duration)
        worker_results = col.client_results(run_s)
        total_committed = _committed(col.target)
        peak_rss = max(w["peak_rss"], _vm_hwm_bytes(col.proc.pid))
        col.stop()
    finally:
        col.close()
    rate = w["samples"] / w["seconds"]
    # the reference again after the run, so that both see similar machine load
    more_rates, more_cpu = reference_insert(args.batch_samples, args.series, args.reference_rows, 5)
    ref = statistics.median(ref_rates + more_rates)
    ref_cpu_ns = statistics.median(ref_cpu + more_cpu)
    collector_cpu_ns = w["cpu_s"] / max(1, w["samples"]) * 1e9
    import re

    m = re.search(r"([0-9.]+) s in commits", col.log_path.read_text())
    commit_s = float(m.group(1)) if m else None
    p50s = [r["ack_latency_p50_s"] for r in worker_results if r["ack_latency_p50_s"] is not None]
    result = {
        "benchmark": "ingest",
        "synthetic": True,
        "data": "synthetic batches (pre-serialized, same samples resent with new seqs), loopback gRPC",
        "streams": args.streams,
        "client_processes": len(col.clients),
        "batch_samples": args.batch_samples,
        "series_per_batch": args.series,
        "window_batches_per_stream": args.window,
        "measured_s": round(w["seconds"], 2),
        "samples_per_second": round(rate),
        "batches_per_second": round(rate / args.batch_samples, 1),
        "collector_cpu_percent": round(100 * w["cpu_s"] / w["seconds"], 1),
        "writer_commit_s_whole_run": commit_s,
        "loadavg_1m_at_start": load_at_start,
        "analysis_passes": "off (--no-analyze) so that only ingest is measured",
        "compaction": "off ([storage] compaction = false) so that only ingest is measured",
        "collector_peak_rss_bytes": peak_rss,
        "reference_arrow_insert_rows_per_second": round(ref),
        "ratio_to_reference": round(rate / ref, 3),
        "reference_note": "median of 10 raw Arrow inserts (5 before, 5 after the run) of --reference-rows rows",
        "collector_cpu_ns_per_sample": round(collector_cpu_ns),
        "reference_cpu_ns_per_row": round(ref_cpu_ns),
        "cpu_cost_ratio_to_reference": round(collector_cpu_ns / ref_cpu_ns, 2),
        "ack_latency_p50_s_median_over_clients": round(statistics.median(p50s), 4) if p50s else None,
        "acked_samples_total": sum(r["acked_samples"] for r in worker_results),
        "committed_samples_total": total_committed,
        "target_samples_per_second": TARGET_SAMPLES_PER_S,
        "meets_target": rate >= TARGET_SAMPLES_PER_S,
        "rss_limit_bytes": RSS_LIMIT_BYTES,
        "meets_rss_limit": peak_rss <= RSS_LIMIT_BYTES,
        "cpu_count": os.cpu_count(),
        "note": "client processes share the machine's cores with the collector",
    }
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return result


# ------------------------------------------------------------------------------------ during compaction

SPAN_S = 6 * 3600          # storage.compact_span's default
START_WAIT_S = 40.0        # the first full pass is 5 s after start; then a chunk is read, sorted and written
GRACE_S = 600              # storage.compact_grace's default
METRICS = ("gpu_util_percent", "gpu_power_watts", "gpu_temperature_celsius", "gpu_sm_clock_mhz",
           "gpu_memory_used_bytes", "gpu_pcie_tx_bytes_per_s", "cpu_user_percent", "cpu_steal_percent",
           "disk_read_bytes_per_s", "net_rx_bytes_per_s")


def prepare_backfill(db: Path, nodes: int, span_end_s: int) -> int:
    """One closed compaction span of SYNTHETIC samples as agents deliver them (time-major, every node's series
    interleaved): ``nodes`` nodes x 100 series (80 per-GPU, 20 host series with labels) at 1 s, ending at
    ``span_end_s``. Returns the rows written."""
    import duckdb

    from gpuagent.collector.store import schema

    con = duckdb.connect(str(db))
    try:
        schema.migrate(con)
        con.execute("""
            INSERT INTO samples
            SELECT to_timestamp(?::BIGINT + s)::TIMESTAMP, 'synthetic-backfill-' || n,
                   CASE WHEN i < 80 THEN (i % 8)::SMALLINT END,
                   (?::VARCHAR[])[CASE WHEN i < 80 THEN 1 + i // 8 % 6 ELSE 7 + i % 4 END],
                   CASE WHEN i < 80 THEN '' ELSE 'dev=' || i END,
                   ((s * 7 + i * 13 + n) % 997) * 0.5
            FROM range(?) a(s), range(?) b(n), range(100) c(i)
            ORDER BY s, n, i""", [span_end_s - SPAN_S, list(METRICS), SPAN_S, nodes])
        con.execute("CHECKPOINT")
        return con.execute("SELECT count(*) FROM samples").fetchone()[0]
    finally:
        con.close()


def _compaction_state(target: str, span_end: str) -> tuple[bool, int]:
    """(whether a compacted chunk already lies after live rows, spans marked compacted), read over Query.

    Live rows are newer than every backfill row; a backfill row with a higher rowid than some live row can
    only be one compaction rewrote (DuckDB keeps the order of rows, whatever it renumbers)."""
    from gpuagent.collector.views import client

    row = client.query(target, f"""
        SELECT coalesce((SELECT max(rowid) FROM samples WHERE ts < TIMESTAMP '{span_end}')
                        > (SELECT min(rowid) FROM samples WHERE ts >= TIMESTAMP '{span_end}'), false),
               (SELECT count(*) FROM compacted_hours)""").rows[0]
    return bool(row[0]), int(row[1])


def run_during_compaction(args) -> dict:
    """Ingest alone and ingest while compaction rewrites a closed span, alternately on copies of one backfilled
    database, ``--rounds`` times each; medians."""
    import shutil

    loads = [round(os.getloadavg()[0], 2)]
    ref_rates, _ = reference_insert(args.batch_samples, args.series, args.reference_rows, 5)
    now_s = int(time.time())
    span_end_s = (now_s - GRACE_S) // SPAN_S * SPAN_S          # the newest closed span ends here
    span_end = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(span_end_s))
    work = Path(tempfile.mkdtemp(prefix="gpuagent-ingest-compaction-"))
    runs: dict[str, list[dict]] = {"alone": [], "during_compaction": []}
    try:
        prepared = work / "backfill.duckdb"
        t0 = time.perf_counter()
        backfill_rows = prepare_backfill(prepared, args.backfill_nodes, span_end_s)
        prepare_s = time.perf_counter() - t0
        # Both kinds alike, long enough that compaction (first pass 5 s in) has written its first chunk.
        warmup = max(args.warmup, 20.0)
        run_s = warmup + args.duration
        for r in range(args.rounds):
            modes = ["alone", "during_compaction"] if r % 2 == 0 else ["during_compaction", "alone"]
            for mode in modes:
                db = work / f"{mode}-{r}.duckdb"
                shutil.copyfile(prepared, db)
                loads.append(round(os.getloadavg()[0], 2))
                # Storage defaults but the switch, and passes every 5 s so that compaction starts 5 s in.
                col = _Collector(work, db, args, {"compaction": mode != "alone", "interval": "5s"},
                                 name=f"{mode}-{r}")
                try:
                    # The live batches are a minute old: in the open span, never compacted here.
                    col.start_clients(args, run_s + START_WAIT_S, 60.0)
                    t_start = time.monotonic()
                    time.sleep(warmup)
                    started, _ = _compaction_state(col.target, span_end)
                    while mode != "alone" and not started and time.monotonic() - t_start < START_WAIT_S:
                        time.sleep(0.5)
                        started, _ = _compaction_state(col.target, span_end)
                    waited = time.monotonic() - t_start
                    w = col.window(args.duration)
                    _, spans_done = _compaction_state(col.target, span_end)
                    col.end_clients()      # their own figures are not needed here
                    col.stop()
                finally:
                    col.close()
                w.update(rate=w["samples"] / w["seconds"], compaction_started=started, waited_s=waited,
                         compaction_still_running=spans_done == 0)
                runs[mode].append(w)
                db.unlink()
                Path(str(db) + ".wal").unlink(missing_ok=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    more_rates, _ = reference_insert(args.batch_samples, args.series, args.reference_rows, 5)
    loads.append(round(os.getloadavg()[0], 2))
    alone = [w["rate"] for w in runs["alone"]]
    during = [w["rate"] for w in runs["during_compaction"]]
    ratio = statistics.median(during) / statistics.median(alone)
    busy = runs["during_compaction"]
    return {
        "benchmark": "ingest_during_compaction",
        "synthetic": True,
        "data": ("a closed 6 h span of synthetic samples backfilled in arrival order; live synthetic batches "
                 "(pre-serialized, a minute old, resent with new seqs) over loopback gRPC"),
        "backfill_rows": backfill_rows,
        "backfill_nodes": args.backfill_nodes,
        "backfill_prepare_s": round(prepare_s, 1),
        "storage": "defaults (compact_span 6h, compact_chunk_rows 250000, compact_duty 0.3) but interval 5s; "
                   "compaction = false for the runs alone",
        "analysis_passes": "off (--no-analyze) in both",
        "streams": args.streams,
        "batch_samples": args.batch_samples,
        "rounds": args.rounds,
        "warmup_s": max(args.warmup, 20.0),
        "measured_s_each": args.duration,
        "samples_per_second_alone": [round(x) for x in alone],
        "samples_per_second_during_compaction": [round(x) for x in during],
        "median_samples_per_second_alone": round(statistics.median(alone)),
        "median_samples_per_second_during_compaction": round(statistics.median(during)),
        "ratio_during_to_alone": round(ratio, 3),
        "target_ratio": 0.7,
        "meets_target": ratio >= 0.7,
        "collector_cpu_percent_alone": [round(100 * w["cpu_s"] / w["seconds"], 1) for w in runs["alone"]],
        "collector_cpu_percent_during_compaction": [round(100 * w["cpu_s"] / w["seconds"], 1) for w in busy],
        "collector_peak_rss_bytes_alone": [w["peak_rss"] for w in runs["alone"]],
        "collector_peak_rss_bytes_during_compaction": [w["peak_rss"] for w in busy],
        "peak_wal_bytes_alone": [w["peak_wal"] for w in runs["alone"]],
        "peak_wal_bytes_during_compaction": [w["peak_wal"] for w in busy],
        "checkpoints_seen_alone": [w["checkpoints"] for w in runs["alone"]],
        "checkpoints_seen_during_compaction": [w["checkpoints"] for w in busy],
        "compaction_running_throughout": all(w["compaction_started"] and w["compaction_still_running"]
                                             for w in busy),
        "compaction_started_before_window": [w["compaction_started"] for w in busy],
        "window_opened_s_after_clients": {k: [round(w["waited_s"], 1) for w in v] for k, v in runs.items()},
        "compaction_still_running_after_window": [w["compaction_still_running"] for w in busy],
        "reference_arrow_insert_rows_per_second": round(statistics.median(ref_rates + more_rates)),
        "reference_note": "median of 10 raw Arrow inserts (5 before, 5 after the runs) of --reference-rows rows",
        "loadavg_1m": loads,
        "cpu_count": os.cpu_count(),
        "note": "client processes share the machine's cores with the collector",
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--streams", type=int, default=100, help="concurrent agent streams (one node each)")
    ap.add_argument("--clients", type=int, default=2, help="client processes holding the streams")
    ap.add_argument("--batch-samples", type=int, default=10_000, help="samples per batch")
    ap.add_argument("--series", type=int, default=500, help="series per batch")
    ap.add_argument("--window", type=int, default=4, help="unacked batches in flight per stream")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds measured")
    ap.add_argument("--reference-rows", type=int, default=500_000, help="rows in each reference insert")
    ap.add_argument("--memory-limit", default=None, help="the collector's --memory-limit (default: its own)")
    ap.add_argument("--during-compaction", action="store_true",
                    help="ingest alone against ingest while compaction rewrites a closed span (medians over --rounds)")
    ap.add_argument("--rounds", type=int, default=3, help="--during-compaction: runs of each kind")
    ap.add_argument("--backfill-nodes", type=int, default=2,
                    help="--during-compaction: nodes in the backfilled span (2.16 M rows each)")
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--worker-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--streams-here", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--run-s", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--ts-offset-s", type=float, default=3600.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        print(json.dumps(asyncio.run(_worker(args))))
        return
    if args.during_compaction:
        result = run_during_compaction(args)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"ingest (synthetic): {result['median_samples_per_second_alone']:,} samples/s alone, "
                  f"{result['median_samples_per_second_during_compaction']:,} while compacting (ratio "
                  f"{result['ratio_during_to_alone']}, medians of {result['rounds']}); reference Arrow insert "
                  f"{result['reference_arrow_insert_rows_per_second']:,} rows/s")
        return
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"ingest (synthetic): {result['samples_per_second']:,} samples/s durably committed over "
              f"{result['streams']} streams; reference Arrow insert {result['reference_arrow_insert_rows_per_second']:,}"
              f" rows/s (ratio {result['ratio_to_reference']}); collector peak RSS "
              f"{result['collector_peak_rss_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
