"""Ingest benchmark (synthetic data): a real collector process and N concurrent agent streams over loopback.

Starts `gpuagent-collector serve` on a fresh DuckDB file, then client processes that each hold many
streams (one registered synthetic node per stream) and send pre-serialized batches as fast as the
collector acks them (a small window of unacked batches per stream, as the agent's sender keeps).
The throughput is what was *durably committed*: the growth of sum(ingest_log.n_samples), read through
the collector's own Query RPC, over a measurement window after a warm-up.

In the same run it measures the reference: a raw Arrow bulk insert of the same rows into a fresh
DuckDB file with the same schema, no gRPC, no validation.

    python benchmarks/ingest.py --json                 # 100 streams, ~20 s
    python benchmarks/ingest.py --streams 20 --duration 5
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

    t0 = time.time_ns() - 3600 * 10**9
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


def run(args) -> dict:
    import psutil

    load_at_start = round(os.getloadavg()[0], 2)
    ref_rates, ref_cpu = reference_insert(args.batch_samples, args.series, args.reference_rows, 5)
    work = Path(tempfile.mkdtemp(prefix="gpuagent-ingest-bench-"))
    db = work / "bench.duckdb"
    port_file = work / "port"
    log = open(work / "collector.log", "w")
    collector = subprocess.Popen([sys.executable, "-m", "gpuagent.collector", "serve", "--listen", "127.0.0.1:0",
                                  "--db", str(db), "--port-file", str(port_file), "--no-analyze",
                                  *(["--memory-limit", args.memory_limit] if args.memory_limit else [])],
                                 stdout=log, stderr=subprocess.STDOUT)
    clients = []
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if collector.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the collector did not start: {(work / 'collector.log').read_text()}")
            time.sleep(0.05)
        target = f"127.0.0.1:{int(port_file.read_text())}"
        cproc = psutil.Process(collector.pid)
        run_s = args.warmup + args.duration
        per = [args.streams // args.clients + (1 if i < args.streams % args.clients else 0) for i in range(args.clients)]
        for i, n in enumerate(per):
            if n == 0:
                continue
            clients.append(subprocess.Popen(
                [sys.executable, __file__, "--_worker", "--target", target, "--worker-id", str(i),
                 "--streams-here", str(n), "--run-s", str(run_s), "--batch-samples", str(args.batch_samples),
                 "--series", str(args.series), "--window", str(args.window)],
                stdout=subprocess.PIPE, text=True))
        time.sleep(args.warmup)
        cpu0 = sum(cproc.cpu_times()[:2])
        s0, t0 = _committed(target), time.monotonic()
        peak_rss = 0
        while time.monotonic() - t0 < args.duration:
            peak_rss = max(peak_rss, cproc.memory_info().rss)
            time.sleep(0.2)
        s1, t1 = _committed(target), time.monotonic()
        cpu1 = sum(cproc.cpu_times()[:2])
        worker_results = []
        for c in clients:
            out, _ = c.communicate(timeout=run_s + 120)
            worker_results.append(json.loads(out.strip().splitlines()[-1]))
        total_committed = _committed(target)
        peak_rss = max(peak_rss, _vm_hwm_bytes(collector.pid))
        collector.send_signal(signal.SIGTERM)
        collector.wait(120)
    finally:
        for p in [*clients, collector]:
            if p.poll() is None:
                p.kill()
                p.wait()
        log.close()
    rate = (s1 - s0) / (t1 - t0)
    # the reference again after the run, so that both see similar machine load
    more_rates, more_cpu = reference_insert(args.batch_samples, args.series, args.reference_rows, 5)
    ref = statistics.median(ref_rates + more_rates)
    ref_cpu_ns = statistics.median(ref_cpu + more_cpu)
    collector_cpu_ns = (cpu1 - cpu0) / max(1, s1 - s0) * 1e9
    import re

    m = re.search(r"([0-9.]+) s in commits", (work / "collector.log").read_text())
    commit_s = float(m.group(1)) if m else None
    p50s = [w["ack_latency_p50_s"] for w in worker_results if w["ack_latency_p50_s"] is not None]
    result = {
        "benchmark": "ingest",
        "synthetic": True,
        "data": "synthetic batches (pre-serialized, same samples resent with new seqs), loopback gRPC",
        "streams": args.streams,
        "client_processes": len(clients),
        "batch_samples": args.batch_samples,
        "series_per_batch": args.series,
        "window_batches_per_stream": args.window,
        "measured_s": round(t1 - t0, 2),
        "samples_per_second": round(rate),
        "batches_per_second": round(rate / args.batch_samples, 1),
        "collector_cpu_percent": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
        "writer_commit_s_whole_run": commit_s,
        "loadavg_1m_at_start": load_at_start,
        "analysis_passes": "off (--no-analyze) so that only ingest is measured",
        "collector_peak_rss_bytes": peak_rss,
        "reference_arrow_insert_rows_per_second": round(ref),
        "ratio_to_reference": round(rate / ref, 3),
        "reference_note": "median of 10 raw Arrow inserts (5 before, 5 after the run) of --reference-rows rows",
        "collector_cpu_ns_per_sample": round(collector_cpu_ns),
        "reference_cpu_ns_per_row": round(ref_cpu_ns),
        "cpu_cost_ratio_to_reference": round(collector_cpu_ns / ref_cpu_ns, 2),
        "ack_latency_p50_s_median_over_clients": round(statistics.median(p50s), 4) if p50s else None,
        "acked_samples_total": sum(w["acked_samples"] for w in worker_results),
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
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    ap.add_argument("--worker-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--streams-here", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--run-s", type=float, default=10.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._worker:
        print(json.dumps(asyncio.run(_worker(args))))
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
