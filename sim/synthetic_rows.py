"""SYNTHETIC rows straight into a collector database, for analyzer tests and benchmarks.

Everything this module writes is labelled synthetic (``nodes.synthetic = true``, label ``synthetic=true``,
node ids starting ``synthetic-``). It is not a measurement and not the load generator: ``gpuagent-sim`` speaks
the real protocol to a real collector; this writes rows directly so that analyzer tests can set up exact
conditions (a penalty 1 % under a threshold, say) on a real DuckDB file, and so that the analysis-speed
benchmark can create ~29 M sample rows in seconds with SQL ``range()``.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from typing import Iterable, Mapping, Sequence

H100 = "NVIDIA H100 80GB HBM3"


def add_node(con, node_id: str, *, virtualized: bool | None, gpu_model: str | None = H100, gpu_count: int = 8,
             pcie_gen: int | None = 5, pcie_width: int | None = 16, pool: str = "synthetic-pool",
             price_per_gpu_hour: float | None = None, virt_type: str | None = None,
             labels: Mapping[str, str] | None = None, now: dt.datetime | None = None) -> None:
    """One synthetic node with its GPUs (nodes + gpus rows)."""
    now = now or dt.datetime(2026, 1, 1)
    lab = {"synthetic": "true", "pool": pool, **(labels or {})}
    vt = virt_type or ("kvm" if virtualized else "none")
    fp = json.dumps({"virtualized": bool(virtualized), "virt_type": vt,
                     "cpuid_hypervisor_bit": bool(virtualized),
                     "cpuid_hypervisor_vendor": "KVMKVMKVM" if virtualized else "", "synthetic": True})
    con.execute(
        """INSERT INTO nodes (node_id, machine_id, hostname, pool, price_per_gpu_hour, synthetic, labels,
                              gpu_count, gpu_model, virtualized, virt_type, fingerprint, first_seen, last_seen)
           VALUES (?, ?, ?, ?, ?, true, MAP(?::VARCHAR[], ?::VARCHAR[]), ?, ?, ?, ?, ?, ?, ?)""",
        [node_id, "machine-" + node_id, node_id, pool, price_per_gpu_hour, list(lab), list(lab.values()),
         gpu_count if gpu_model else 0, gpu_model, virtualized, vt, fp, now, now])
    if gpu_model:
        con.executemany(
            "INSERT INTO gpus (node_id, gpu, name, pcie_gen_max, pcie_width_max) VALUES (?, ?, ?, ?, ?)",
            [[node_id, g, gpu_model, pcie_gen, pcie_width] for g in range(gpu_count)])


def add_probe_runs(con, node_id: str, probe: str, metrics: Mapping[str, Sequence[float]],
                   times: Sequence[dt.datetime], *, gpu: int | None = None, params_key: str = "synthetic=1",
                   status: str = "ok") -> None:
    """Probe runs at ``times``; ``metrics[name][i]`` is run i's value (probe_results + probe_metrics)."""
    results, values = [], []
    for i, t in enumerate(times):
        results.append([node_id, probe, gpu, status, None if status == "ok" else "synthetic",
                        json.dumps({"synthetic": "1"}), params_key, "{}", t, t + dt.timedelta(seconds=1), 1.0])
        for name, seq in metrics.items():
            values.append([node_id, probe, gpu, params_key, t, name, float(seq[i])])
    con.executemany("INSERT INTO probe_results VALUES (?,?,?,?,?,?,?,?,?,?,?)", results)
    if values:
        con.executemany("INSERT INTO probe_metrics VALUES (?,?,?,?,?,?,?)", values)


def add_samples(con, rows: Iterable[tuple]) -> None:
    """(ts, node_id, gpu, metric, labels, value) rows into samples, in bulk through Arrow."""
    import pyarrow as pa  # noqa: PLC0415

    rows = list(rows)
    if not rows:
        return
    cols = list(zip(*rows))
    table = pa.table({"ts": pa.array(cols[0], pa.timestamp("us")), "node_id": pa.array(cols[1], pa.string()),
                      "gpu": pa.array(cols[2], pa.int16()), "metric": pa.array(cols[3], pa.string()),
                      "labels": pa.array(cols[4], pa.string()), "value": pa.array(cols[5], pa.float64())})
    con.register("_synthetic_samples", table)
    try:
        con.execute("INSERT INTO samples SELECT * FROM _synthetic_samples")
    finally:
        con.unregister("_synthetic_samples")


def add_job_samples(con, rows: Iterable[tuple]) -> None:
    """(ts, node_id, job_id, gpu, gpu_util_percent) rows into job_samples."""
    con.executemany(
        """INSERT INTO job_samples (ts, node_id, job_id, pid, rank, local_rank, gpu, gpu_util_percent,
                                    gpu_memory_bytes, cpu_percent, rss_bytes, read_bytes_per_s, write_bytes_per_s)
           VALUES (?, ?, ?, 1000, ?, ?, ?, ?, 0, 100, 0, 0, 0)""",
        [[ts, node, job, gpu, gpu, gpu, util] for ts, node, job, gpu, util in rows])


def add_job_steps(con, rows: Iterable[tuple]) -> None:
    """(ts, node_id, job_id, rank, step_time_p50_s, data_wait_fraction) rows into job_steps."""
    con.executemany(
        """INSERT INTO job_steps (ts, node_id, job_id, job_name, rank, pid, window_s, steps, step_time_p50_s,
                                  step_time_p95_s, step_time_max_s, step_time_mean_s, steps_per_s, samples_per_s,
                                  tokens_per_s, data_wait_fraction)
           VALUES (?, ?, ?, 'synthetic-job', ?, 1000, 10, 10, ?, ?, ?, ?, 1.0 / ?, 0, 0, ?)""",
        [[ts, node, job, rank, p50, p50 * 1.1, p50 * 1.2, p50, p50, dw] for ts, node, job, rank, p50, dw in rows])


def noisy(rng: random.Random, base: float, cv: float, n: int) -> list[float]:
    """n values around base with coefficient of variation cv (clipped positive)."""
    return [max(base * 1e-3, base * (1.0 + rng.gauss(0.0, cv))) for _ in range(n)]


def fill_gpu_fleet_samples(con, *, nodes: int, gpus: int, start: dt.datetime, seconds: int,
                           metrics: Sequence[str] = ("gpu_util_percent", "gpu_power_watts", "gpu_temperature_celsius"),
                           node_prefix: str = "synthetic-", chunk_s: int = 60) -> int:
    """Bulk 1 s GPU samples for a fleet with SQL range(), one chunk of seconds at a time (so rows arrive in
    time order, as ingest appends them); returns rows written."""
    metric_list = ", ".join(f"('{m}')" for m in metrics)
    for first in range(0, seconds, chunk_s):
        con.execute(f"""
            INSERT INTO samples
            SELECT $start::TIMESTAMP + to_seconds(s.range), '{node_prefix}' || lpad(n.range::VARCHAR, 5, '0'),
                   g.range::SMALLINT, m.metric, '',
                   CASE m.metric WHEN 'gpu_util_percent' THEN 75 + 20 * sin(n.range + g.range + s.range / 600.0)
                                 WHEN 'gpu_power_watts' THEN 400 + 200 * random()
                                 ELSE 40 + 30 * random() END
            FROM range($first, $last) s, range($nodes) n, range($gpus) g, (VALUES {metric_list}) m(metric)""",
                    {"start": start, "first": first, "last": min(seconds, first + chunk_s),
                     "nodes": nodes, "gpus": gpus})
    return seconds * nodes * gpus * len(metrics)


def add_link_runs(con, node_a: str, node_b: str, gbits: Sequence[float], times: Sequence[dt.datetime], *,
                  rtt_p50_us: float = 50.0, params_key: str = "synthetic=1", status: str = "ok",
                  reason: str | None = None, both_ends: bool = True,
                  nic_speed_mbits: tuple[int | None, int | None] = (None, None)) -> None:
    """SYNTHETIC net_pair runs of one link (link_results rows): run i at ``times[i]`` moves ``gbits[i]``
    each way; each end reports it, as agents do (``both_ends``), or the collector alone (a skip).
    ``nic_speed_mbits``: the line rate each end (a, b) reports for its own NIC (None: unknown)."""
    rows = []
    speed = {node_a: nic_speed_mbits[0], node_b: nic_speed_mbits[1]}
    for i, (g, t) in enumerate(zip(gbits, times)):
        pid = f"synthetic-{node_a}-{node_b}-{i}-{t.isoformat()}"
        metrics = [g, g, rtt_p50_us, rtt_p50_us * 2] if status == "ok" else [None] * 4
        ends = (node_a, node_b) if both_ends and status != "skipped" else ("collector",)
        for who in ends:
            rows.append([pid, node_a, node_b, "net_pair", params_key, *metrics, t,
                         t + dt.timedelta(seconds=3), status, reason, who, speed.get(who)])
    con.executemany("INSERT INTO link_results (pair_id, node_a, node_b, probe, params_key, send_gbits_per_s, "
                    "recv_gbits_per_s, rtt_p50_us, rtt_p99_us, started_at, ended_at, status, reason, reported_by, "
                    "nic_speed_mbits) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
