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
import math
import random
from typing import Iterable, Mapping, Sequence

from gpuagent.common.sql_rows import insert_rows
from gpuagent.sim.fleet import HW_COMPONENTS

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
        insert_rows(con, "gpus (node_id, gpu, name, pcie_gen_max, pcie_width_max)",
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
    insert_rows(con, "probe_results", results)
    if values:
        insert_rows(con, "probe_metrics", values)


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
    insert_rows(con, "job_samples (ts, node_id, job_id, pid, rank, local_rank, gpu, gpu_util_percent, "
                     "gpu_memory_bytes, cpu_percent, rss_bytes, read_bytes_per_s, write_bytes_per_s)",
                [[ts, node, job, 1000, gpu, gpu, gpu, util, 0, 100.0, 0, 0.0, 0.0] for ts, node, job, gpu, util in rows])


def add_job_steps(con, rows: Iterable[tuple]) -> None:
    """(ts, node_id, job_id, rank, step_time_p50_s, data_wait_fraction) rows into job_steps."""
    insert_rows(con, "job_steps (ts, node_id, job_id, job_name, rank, pid, window_s, steps, step_time_p50_s, "
                     "step_time_p95_s, step_time_max_s, step_time_mean_s, steps_per_s, samples_per_s, "
                     "tokens_per_s, data_wait_fraction)",
                [[ts, node, job, "synthetic-job", rank, 1000, 10.0, 10, p50, p50 * 1.1, p50 * 1.2, p50, 1.0 / p50,
                  0.0, 0.0, dw] for ts, node, job, rank, p50, dw in rows])


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


def add_synthetic_fleet(con, nodes: int, gpus: int, start: dt.datetime) -> None:
    """``nodes`` SYNTHETIC nodes (ids ``synthetic-00000``...) of ``gpus`` H100s: even ones a bare-metal pool,
    odd ones a virtualized cloud pool."""
    con.execute("""
        INSERT INTO nodes (node_id, machine_id, hostname, pool, price_per_gpu_hour, synthetic, labels, gpu_count,
                           gpu_model, virtualized, virt_type, fingerprint, first_seen, last_seen)
        SELECT 'synthetic-' || lpad(n::VARCHAR, 5, '0'), 'm' || n, 'synthetic-' || n,
               CASE WHEN n % 2 = 0 THEN 'bare-metal' ELSE 'cloud-a' END, CASE WHEN n % 2 = 0 THEN 2.0 ELSE 3.5 END,
               true, MAP {'synthetic': 'true'}, $gpus, $model, n % 2 = 1,
               CASE WHEN n % 2 = 1 THEN 'kvm' ELSE 'none' END, '{"synthetic": true}', $start, $start
        FROM range($nodes) t(n)""", {"nodes": nodes, "gpus": gpus, "start": start, "model": H100})
    con.execute("""
        INSERT INTO gpus (node_id, gpu, name, pcie_gen_max, pcie_width_max)
        SELECT 'synthetic-' || lpad(n::VARCHAR, 5, '0'), g, $model, 5, 16
        FROM range($nodes) t(n), range($gpus) u(g)""", {"nodes": nodes, "gpus": gpus, "model": H100})


def fill_fleet_job_rows(con, *, nodes: int, gpus: int, start: dt.datetime, seconds: int,
                        sample_step_s: int = 10) -> None:
    """Jobs of 4 nodes each on an add_synthetic_fleet fleet, for ``seconds`` from ``start``: job samples every
    ``sample_step_s`` on every GPU except GPU 7 of every 10th node (a no_job gap to find), and 60 s job-step
    windows on every GPU, with every 50th node's ranks waiting 40 % of the time on input."""
    p = {"t0": start, "seconds": seconds, "nodes": nodes, "gpus": gpus}
    con.execute("""
        INSERT INTO job_samples (ts, node_id, job_id, pid, rank, local_rank, gpu, gpu_util_percent, gpu_memory_bytes,
                                 cpu_percent, rss_bytes, read_bytes_per_s, write_bytes_per_s)
        SELECT $t0::TIMESTAMP + to_seconds(s), 'synthetic-' || lpad(n::VARCHAR, 5, '0'), 'job-' || (n // 4), 1000 + g,
               (n % 4) * 8 + g, g, g, 75 + 20 * sin(n + g + s / 600.0), 1e10, 100, 1e9, 1e6, 0
        FROM range(0, $seconds, $step) a(s), range($nodes) b(n), range($gpus) c(g)
        WHERE NOT (n % 10 = 0 AND g = 7)""", {**p, "step": sample_step_s})
    con.execute("""
        INSERT INTO job_steps (ts, node_id, job_id, job_name, rank, pid, window_s, steps, step_time_p50_s,
                               step_time_p95_s, step_time_max_s, step_time_mean_s, steps_per_s, samples_per_s,
                               tokens_per_s, data_wait_fraction)
        SELECT $t0::TIMESTAMP + to_seconds(s), 'synthetic-' || lpad(n::VARCHAR, 5, '0'), 'job-' || (n // 4),
               'synthetic', (n % 4) * 8 + g, 1000 + g, 60, 120, 0.5 + 0.01 * random(), 0.55, 0.6, 0.5, 2, 64, 0,
               CASE WHEN n % 50 = 0 THEN 0.4 ELSE 0.02 END
        FROM range(0, $seconds, 60) a(s), range($nodes) b(n), range($gpus) c(g)""", p)


def fill_fleet_probe_rows(con, *, nodes: int, gpus: int, start: dt.datetime, first_s: int, seconds: int) -> None:
    """A host probe per node and a PCIe probe per GPU every 5 minutes (on the 300 s marks inside
    [first_s, first_s + seconds)) of an add_synthetic_fleet fleet; every 7th cloud node's probes read 20 % low."""
    for s in range(first_s - first_s % 300 + (300 if first_s % 300 else 0), first_s + seconds, 300):
        ts = start + dt.timedelta(seconds=s)
        for probe, metric, base, per_gpu in (("host", "syscall_ns", 120.0, False), ("pcie", "h2d_gbps", 53.0, True)):
            p = {"probe": probe, "per_gpu": per_gpu, "ts": ts, "nodes": nodes, "gpus": gpus}
            con.execute("""
                INSERT INTO probe_results SELECT 'synthetic-' || lpad(n::VARCHAR, 5, '0'), $probe,
                       CASE WHEN $per_gpu THEN g END, 'ok', NULL, '{}', 'synthetic=1', '{}', $ts, $ts, 1.0
                FROM range($nodes) t(n), range(CASE WHEN $per_gpu THEN $gpus ELSE 1 END) u(g)""", p)
            con.execute("""
                INSERT INTO probe_metrics SELECT 'synthetic-' || lpad(n::VARCHAR, 5, '0'), $probe,
                       CASE WHEN $per_gpu THEN g END, 'synthetic=1', $ts, $metric,
                       $base * (1 + 0.02 * (random() - 0.5)) * CASE WHEN n % 2 = 1 AND n % 7 = 0 THEN 0.8 ELSE 1 END
                FROM range($nodes) t(n), range(CASE WHEN $per_gpu THEN $gpus ELSE 1 END) u(g)""",
                        {**p, "metric": metric, "base": base})


def fill_fleet_link_rows(con, *, nodes: int, start: dt.datetime, first_s: int, seconds: int, rack: int = 50,
                         sweep_every_s: int = 1800) -> None:
    """SYNTHETIC full pair-wise net_pair sweeps within racks of ``rack`` consecutive nodes of an
    add_synthetic_fleet fleet, one sweep on each ``sweep_every_s`` mark (offset by half of it) inside
    [first_s, first_s + seconds): every pair of a rack once a sweep, reported by both ends, as agents do (the
    shape of flag_accuracy.py's sweeps, whose racks are 50 nodes). Every 50th node (n % 50 == 7) is a bad
    node: its links read 30 % of the others' 90 Gbit/s on a 100 GbE line."""
    half = sweep_every_s // 2
    first_mark = first_s - (first_s - half) % sweep_every_s
    if first_mark < first_s:
        first_mark += sweep_every_s
    for s in range(first_mark, first_s + seconds, sweep_every_s):
        p = {"ts": start + dt.timedelta(seconds=s), "nodes": nodes, "rack": rack, "sweep": s}
        con.execute("""
            INSERT INTO link_results (pair_id, node_a, node_b, probe, params_key, send_gbits_per_s,
                                      recv_gbits_per_s, rtt_p50_us, rtt_p99_us, started_at, ended_at, status,
                                      reason, reported_by, nic_speed_mbits)
            SELECT 'synthetic-' || i || '-' || j || '-' || $sweep, a, b, 'net_pair', 'synthetic=1', g, g, 50, 100,
                   $ts::TIMESTAMP + to_seconds((i % $rack) * 2), $ts::TIMESTAMP + to_seconds((i % $rack) * 2 + 3),
                   'ok', NULL, CASE WHEN e = 0 THEN a ELSE b END, 100000
            FROM (SELECT i, i + k AS j, 'synthetic-' || lpad(i::VARCHAR, 5, '0') AS a,
                         'synthetic-' || lpad((i + k)::VARCHAR, 5, '0') AS b,
                         (90 + (hash(i, i + k, $sweep) % 1000) / 1000.0) * CASE WHEN i % 50 = 7 OR (i + k) % 50 = 7 THEN 0.3 ELSE 1 END AS g
                  FROM range($nodes) t(i), range(1, $rack) u(k)
                  WHERE i + k < $nodes AND (i + k) // $rack = i // $rack), range(2) v(e)""", p)


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
    insert_rows(con, "link_results (pair_id, node_a, node_b, probe, params_key, send_gbits_per_s, "
                     "recv_gbits_per_s, rtt_p50_us, rtt_p99_us, started_at, ended_at, status, reason, reported_by, "
                     "nic_speed_mbits)", rows)


# ------------------------------------------------------------------------------------ hardware faults

# The second form of each fault class (inject_hw_<component> = 2 in sim/fleet.py).
HW_VARIANTS = {"xid": "", "ecc": "corrected", "row_remap": "failure", "retired_pages": "", "nvlink": "crc",
               "pcie_link": "width", "clocks": "power_brake", "ib_port": "symbol", "eth_link": "speed"}


def hardware_injection(inject: Mapping[str, float]) -> tuple[str | None, str]:
    """(fault, variant) for hardware_rows from a NodeSpec's inject mapping (sim/fleet.py HW_INJECT_KEYS)."""
    for c in HW_COMPONENTS:
        form = int(float(inject.get(f"hw_{c}", 0)))
        if form:
            return c, ("" if form == 1 else HW_VARIANTS[c])
    for key, fault, variant in (("hw_reset", "reset", ""), ("hw_reboot", "reboot", ""), ("hw_app_xid", "xid", "app")):
        if float(inject.get(key, 0)):
            return fault, variant
    return None, ""


def add_events(con, rows: Iterable[tuple]) -> None:
    """(ts, node_id, gpu, kind, message, value, attrs dict) rows into events (attrs stored as JSON)."""
    rows = list(rows)
    if not rows:
        return
    insert_rows(con, "events (ts, node_id, gpu, kind, message, value, attrs)",
                    [[ts, node, gpu, kind, msg, None if value is None else float(value),
                      json.dumps(attrs or {}, sort_keys=True)]
                     for ts, node, gpu, kind, msg, value, attrs in rows])


def hardware_rows(node_id: str, *, start: dt.datetime, points: int = 12, step_s: int = 300, gpus: int = 8,
                  nvlinks: int = 2, ib_ports: int = 2, fault: str | None = None, fault_gpu: int = 0,
                  variant: str = "", rng: random.Random | None = None, background: bool = True,
                  util: float = 90.0, at: int | None = None, magnitude: float = 1.0) -> tuple[list[tuple], list[tuple]]:
    """SYNTHETIC hardware telemetry of one node: (sample rows, event rows) in the contract's metric names
    (docs/METRICS.md; common/hardware_faults.toml reads them). ``points`` samples ``step_s`` apart from
    ``start``. A healthy node has steady counters with rare, sub-threshold background noise (a corrected ECC
    error, an NVLink CRC flit, an IB symbol error) when ``background``. ``fault`` injects one fault class at
    the middle sample on ``fault_gpu`` (or the node's first IB port / NIC); ``variant`` picks another form:
      xid: XID 79 from NVML and the same from kmsg 2 s later (one fault) | "app": XID 13 from one job only;
      ecc: +1 volatile uncorrectable | "corrected": corrected errors at 600/h;
      row_remap: pending | "failure": remap failure;   retired_pages: +1 double-bit-ECC page;
      nvlink: link 1 down | "crc": CRC flit errors at 1,200/h;   pcie_link: gen 3 of 5 under load | "width";
      clocks: hw_thermal 40 % of the time | "power_brake";   ib_port: port DOWN (1) | "symbol": 240/h;
      eth_link: 4 carrier changes | "speed": 25 of 100 Gb/s;
      "reset": every counter drops to 0 mid-window (a driver reload: never fires);
      "reboot": agent_start mid-window, then IB link_downed +1 and carrier +2 as the links come up (a planned reboot).
    ``at`` moves the injection to that sample (a state or a step fault); ``magnitude`` scales the rate and
    share faults (an ongoing condition over the whole window).
    """
    rng = rng or random.Random(hash(node_id) & 0xFFFF)
    times = [start + dt.timedelta(seconds=step_s * i) for i in range(points)]
    mid = points // 2 if at is None else max(1, min(points - 1, at))
    mag = float(magnitude)
    rows: list[tuple] = []
    events: list[tuple] = []
    reset = fault == "reset"

    def counter(gpu, metric, labels, base, rises: dict[int, float]):
        v = base
        for i, t in enumerate(times):
            v += rises.get(i, 0.0)
            rows.append((t, node_id, gpu, metric, labels, 0.0 + (v - base if reset and i >= mid else v)))

    def gauge(gpu, metric, labels, values):
        for t, v in zip(times, values):
            rows.append((t, node_id, gpu, metric, labels, float(v)))

    def noise(p: float) -> dict[int, float]:
        return {rng.randrange(1, points): 1.0} if background and rng.random() < p else {}

    after = [i >= mid for i in range(points)]
    for g in range(gpus):
        hit = g == fault_gpu
        base = rng.randrange(0, 50)
        gauge(g, "gpu_util_percent", "", [util] * points)
        gauge(g, "gpu_remapped_rows_pending", "",
              [1 if hit and fault == "row_remap" and variant == "" and a else 0 for a in after])
        gauge(g, "gpu_row_remap_failure", "",
              [1 if hit and fault == "row_remap" and variant == "failure" and a else 0 for a in after])
        counter(g, "gpu_remapped_rows_correctable_total", "", rng.randrange(0, 3), {})
        counter(g, "gpu_remapped_rows_uncorrectable_total", "", 0, {})
        counter(g, "gpu_ecc_uncorrected_total", "", 0,
                {mid: 1.0} if hit and fault == "ecc" and variant == "" else {})
        corr = ({i: 600.0 * mag * step_s / 3600 for i in range(1, points)} if hit and fault == "ecc" and variant == "corrected"
                else noise(0.3))
        counter(g, "gpu_ecc_corrected_total", "", base, corr)
        counter(g, "gpu_retired_pages_total", "cause=double_bit_ecc", 0,
                {mid: 1.0} if hit and fault == "retired_pages" else {})
        counter(g, "gpu_retired_pages_total", "cause=single_bit_ecc", rng.randrange(0, 2), {})
        gauge(g, "gpu_retired_pages_pending", "", [0] * points)
        gen, width = 5, 16
        gauge(g, "gpu_pcie_link_gen", "", [3 if hit and fault == "pcie_link" and variant == "" and a else gen
                                           for a in after])
        gauge(g, "gpu_pcie_link_width", "", [8 if hit and fault == "pcie_link" and variant == "width" and a else width
                                             for a in after])
        gauge(g, "gpu_pcie_link_gen_max", "", [gen] * points)
        gauge(g, "gpu_pcie_link_width_max", "", [width] * points)
        for link in range(nvlinks):
            down = hit and fault == "nvlink" and variant == "" and link == 1
            gauge(g, "gpu_nvlink_link_up", f"link={link}", [0 if down and a else 1 for a in after])
            for c in ("crc_flit", "crc_data", "replay", "recovery"):
                crc = hit and fault == "nvlink" and variant == "crc" and link == 0 and c == "crc_flit"
                counter(g, "gpu_nvlink_errors_total", f"counter={c},link={link}", rng.randrange(0, 20) if c != "recovery" else 0,
                        {i: 1200.0 * mag * step_s / 3600 for i in range(1, points)} if crc
                        else (noise(0.05) if c == "crc_flit" else {}))
        for reason in ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake", "sync_boost"):
            want = {"": "hw_thermal", "power_brake": "hw_power_brake"}.get(variant)
            share = min(0.9, 0.4 * mag) if hit and fault == "clocks" and reason == want else (0.3 if reason == "sw_power_cap" else 0.0)
            # NVML keeps no HW_SLOWDOWN duration; the agent counts it from the sampled mask (agent/samplers/gpu.py)
            metric = ("gpu_clock_event_sampled_seconds_total" if reason == "hw_slowdown"
                      else "gpu_clock_event_duration_seconds_total")
            counter(g, metric, f"reason={reason}", rng.randrange(0, 100),
                    {i: share * step_s for i in range(1, points)} if share else {})
    if fault == "xid":
        t = times[mid]
        if variant == "app":
            events.append((t, node_id, fault_gpu, "xid", "SYNTHETIC XID 13", 13,
                           {"xid": "13", "source": "nvml", "job_id": "synthetic-job-1"}))
        else:
            events.append((t, node_id, fault_gpu, "xid", "SYNTHETIC XID 79", 79, {"xid": "79", "source": "nvml"}))
            events.append((t + dt.timedelta(seconds=2), node_id, fault_gpu, "xid",
                           "NVRM: Xid (PCI:0000:18:00): 79, GPU has fallen off the bus. (SYNTHETIC)", 79,
                           {"source": "kmsg", "pci_bus_id": "0000:18:00.0"}))
    for p in range(ib_ports):
        dev, lab = f"mlx5_{p}", f"device=mlx5_{p},link_layer=InfiniBand,port=1"
        hit = p == 0
        gauge(-1, "ib_port_state", lab, [1 if hit and fault == "ib_port" and variant == "" and a else 4 for a in after])
        gauge(-1, "ib_port_phys_state", lab, [5] * points)
        gauge(-1, "ib_port_rate_gbps", lab, [400] * points)
        for c in ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors", "port_xmit_discards",
                  "local_link_integrity_errors", "excessive_buffer_overrun_errors"):
            rises: dict[int, float] = {}
            if hit and fault == "ib_port" and variant == "symbol" and c == "symbol_error":
                rises = {i: 240.0 * mag * step_s / 3600 for i in range(1, points)}
            elif hit and fault == "reboot" and c == "link_downed":
                rises = {mid: 1.0}
            elif c == "symbol_error":
                rises = noise(0.2)
            counter(-1, "ib_port_errors_total", f"counter={c},device={dev},port=1", rng.randrange(0, 5), rises)
    for n in range(1):
        dev = f"eth{n}"
        rises = {}
        if fault == "eth_link" and variant == "":
            rises = {mid: 2.0, min(mid + 1, points - 1): 2.0}
        elif fault == "reboot":
            rises = {mid: 2.0}
        counter(-1, "net_carrier_changes_total", f"device={dev}", 2, rises)
        gauge(-1, "net_link_speed_mbps", f"device={dev}",
              [25000 if fault == "eth_link" and variant == "speed" and a else 100000 for a in after])
        gauge(-1, "net_link_speed_max_mbps", f"device={dev}", [100000] * points)
    if fault == "reboot":
        # the node is back: the agent starts a minute before the sample that sees the links come up again
        events.append((times[mid] - dt.timedelta(seconds=60), node_id, -1, "agent_start",
                       "gpuagent started (SYNTHETIC reboot)", 0, {"synthetic": "true"}))
    return rows, events


def passive_job_rows(node_id: str, job_id: str, *, start: dt.datetime, seconds: float, tick_s: float = 1.0,
                     progress: float = 130.0, source: str = "cpu_share", rng: random.Random | None = None,
                     noise: float = 0.03, contention: tuple[float, float | None] | None = None,
                     neighbour: str = "stress-ng-cpu", neighbour_cpu: float = 150.0, lost: float = 0.4,
                     own_phase: tuple[float, float] | None = None, own_drop: float = 0.4,
                     filler: str | None = None, psi_idle: float = 3.0, psi_contended: float = 60.0,
                     ended: bool = False, neighbour_io_mb_per_s: float | None = None,
                     own_io_phase: tuple[float, float] | None = None, neighbour_net_mb_per_s: float | None = None,
                     own_net_phase: tuple[float, float] | None = None, rtt_ms: float | None = 0.2,
                     rtt_contended_ms: float = 8.0, job_fills_link: bool = False,
                     busy_mb_per_s: float = 100.0, job_mb_per_s: float = 40.0,
                     filler_net_mb_per_s: float | None = None,
                     neighbour_job_mb_factor: float | None = None) -> tuple[list[tuple], list[tuple]]:
    """SYNTHETIC agent ticks of one job seen passively (agent/samplers/job_discovery.py's series), as sample rows.

    ``contention = (t0_s, t1_s)``: a co-tenant ``neighbour`` uses ``neighbour_cpu`` % of a core from t0 to t1
    seconds (t1 None: until the end) and the job's progress falls by ``lost``; CPU pressure (PSI cpu some
    avg10) follows the kernel's 10 s average towards ``psi_contended``. ``own_phase = (t0_s, t1_s)``: the job's
    own slower phase (progress falls by ``own_drop``, nobody else to blame); with ``filler`` a command soaks
    up the CPU the job left idle in that phase, which raises no pressure. Background: two small commands
    (5-12 % of a core) and one steady disk writer (1.5-2 MB/s). ``ended``: the job ends at ``seconds`` (its
    last 2 s wind down, and a job_end event).
    ``neighbour_io_mb_per_s``: the co-tenant is a disk neighbour instead: during the contention it reads and
    writes that many MB/s (job_neighbour_process_io_bytes_per_s) with little CPU (15 % of a core), and I/O
    pressure (PSI io some) rises in place of CPU pressure. ``own_io_phase = (t0_s, t1_s)``: the job's own I/O
    phase: its progress falls by ``own_drop`` and I/O pressure rises, with no neighbour's I/O.
    ``neighbour_net_mb_per_s``: the co-tenant is a network neighbour instead: during the contention it sends
    and receives that many MB/s off the node (job_neighbour_process_net_bytes_per_s) with little CPU, and the
    RTT of the job's own connections (job_tcp_srtt_ms, ``rtt_ms`` otherwise; None: the job has no connections
    off the node) rises to ``rtt_contended_ms``, their send rate while busy (job_tcp_busy_send_rate_bytes_per_s,
    ``busy_mb_per_s``) dips by a fifth. With ``job_fills_link`` the job fills its link itself: its queue is full
    already (RTT 10 ms, only 1.3 times that with the neighbour), and the neighbour takes a share of the link
    (busy send rate divided by 2.5), as measured with a real DDP job and iperf3 on a 100 Mbit/s tbf link
    (tests/test_jobs_passive_network.py). ``own_net_phase = (t0_s, t1_s)``: the job's own network phase
    (a dataset shard download): its progress falls by ``own_drop``, its own traffic (job_tcp_bytes_per_s,
    ``job_mb_per_s`` otherwise) triples and its RTT rises to ``rtt_contended_ms``; with ``filler_net_mb_per_s``
    a command outside the job (rclone) moves that many MB/s off the node in the job's own phases (its own
    slower, I/O or network phase), on a link the job does not use. A network neighbour cuts the job's own
    traffic as it cuts its progress (by half the loss; on a link the job fills, by 2.5), or multiplies it by
    ``neighbour_job_mb_factor`` where given (a job whose traffic holds up while its RTT rises).
    Returns (sample rows for add_samples, event rows for add_events)."""
    rng = rng or random.Random(0)
    # the network series draw from their own generator, so the CPU and disk series stay as they were drawn
    net_rng = random.Random(f"{node_id}/{job_id}/net")
    rows: list[tuple] = []
    lab = f"job_id={job_id}"
    psi = psi_io = psi_idle
    decay = math.exp(-tick_s / 10.0)        # the kernel's avg10: a 10 s exponential average
    n = int(seconds / tick_s)
    for i in range(n):
        s = i * tick_s
        t = start + dt.timedelta(seconds=s)
        p = progress * (1 + rng.gauss(0, noise))
        others = {"sshd": 5 + 2 * rng.random(), "python3": 8 + 4 * rng.random()}
        contended = contention is not None and contention[0] <= s < (contention[1] if contention[1] is not None
                                                                     else float("inf"))
        disk = {"systemd-journal": 1.5 + 0.5 * rng.random()}     # MB/s: a steady writer of its own
        net = {"node_exporter": 1.0 + 0.5 * net_rng.random()}     # MB/s off the node: scrapes, ssh
        base_rtt = 10.0 if job_fills_link else rtt_ms
        rtt = None if rtt_ms is None else base_rtt * (1 + 0.2 * net_rng.random())
        busy = None if rtt_ms is None else busy_mb_per_s * (1 + net_rng.gauss(0, noise))
        job_mb = job_mb_per_s * (1 + net_rng.gauss(0, noise))
        if contended:
            p *= 1 - lost
            if neighbour_io_mb_per_s is not None:
                others[neighbour] = 15 * (1 + rng.gauss(0, noise))
                disk[neighbour] = neighbour_io_mb_per_s * (1 + rng.gauss(0, noise))
            elif neighbour_net_mb_per_s is not None:
                others[neighbour] = 15 * (1 + rng.gauss(0, noise))
                net[neighbour] = neighbour_net_mb_per_s * (1 + net_rng.gauss(0, noise))
                if rtt is not None and job_fills_link:
                    rtt, busy, job_mb = rtt * 1.3, busy / 2.5, job_mb / 2.5
                elif rtt is not None:
                    rtt, busy = rtt_contended_ms * (1 + 0.2 * net_rng.random()), busy * 0.8
                    job_mb *= 1 - lost / 2
                if rtt is not None and neighbour_job_mb_factor is not None:
                    job_mb = job_mb_per_s * neighbour_job_mb_factor * (1 + net_rng.gauss(0, noise))
            else:
                others[neighbour] = neighbour_cpu * (1 + rng.gauss(0, noise))
        own_io = own_io_phase is not None and own_io_phase[0] <= s < own_io_phase[1]
        own_net = own_net_phase is not None and own_net_phase[0] <= s < own_net_phase[1]
        if own_net and rtt is not None:
            rtt, job_mb = rtt_contended_ms * (1 + 0.2 * net_rng.random()), job_mb * 3
        if (own_phase and own_phase[0] <= s < own_phase[1]) or own_io or own_net:
            p *= 1 - own_drop
            if filler:
                others[filler] = progress * own_drop * (1 + rng.gauss(0, noise))
            if filler_net_mb_per_s is not None:
                net["rclone"] = filler_net_mb_per_s * (1 + net_rng.gauss(0, noise))
        if ended and s >= seconds - 2:
            p *= 0.3 * rng.random()      # wind-down: the ranks tear the process group down and exit
        cpu_wait = contended and neighbour_io_mb_per_s is None and neighbour_net_mb_per_s is None
        io_wait = own_io or (contended and neighbour_io_mb_per_s is not None)
        psi = psi * decay + (psi_contended if cpu_wait else psi_idle) * (1 - decay)
        psi_io = psi_io * decay + (psi_contended if io_wait else psi_idle) * (1 - decay)
        rows += [(t, node_id, None, "job_progress_percent", f"{lab},source={source}", max(0.0, p)),
                 (t, node_id, None, "job_neighbour_cpu_percent", lab, sum(others.values())),
                 (t, node_id, None, "psi_cpu_some_avg10_percent", "", psi),
                 (t, node_id, None, "psi_io_some_avg10_percent", "", psi_io)]
        rows += [(t, node_id, None, "job_neighbour_process_cpu_percent", f"{lab},comm={c},pid={1000 + k}", v)
                 for k, (c, v) in enumerate(sorted(others.items()))]
        rows += [(t, node_id, None, "job_neighbour_process_io_bytes_per_s", f"{lab},comm={c},pid={2000 + k}",
                  v * 1e6) for k, (c, v) in enumerate(sorted(disk.items()))]
        rows += [(t, node_id, None, "job_neighbour_process_net_bytes_per_s", f"{lab},comm={c},pid={3000 + k}",
                  v * 1e6) for k, (c, v) in enumerate(sorted(net.items()))]
        if rtt is not None:
            rows += [(t, node_id, None, "job_tcp_srtt_ms", lab, rtt),
                     (t, node_id, None, "job_tcp_busy_send_rate_bytes_per_s", lab, busy * 1e6),
                     (t, node_id, None, "job_tcp_bytes_per_s", lab, job_mb * 1e6)]
    events = []
    if ended:
        last = start + dt.timedelta(seconds=(n - 1) * tick_s)
        events.append((last + dt.timedelta(seconds=3), node_id, None, "job_end", f"job {job_id} ended", None,
                       {"job_id": job_id, "source": "synthetic"}))
    return rows, events
