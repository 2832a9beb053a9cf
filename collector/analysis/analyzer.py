"""The analyzer: turns stored telemetry into flags (virtualization overhead, noisy neighbors, utilization gaps).

All logic is plain SQL in ``collector/analysis/sql/``, run on one DuckDB connection in the order of
``steps.STEPS``: incremental 1-minute rollups first, then one file per flag kind writing *conditions*, then
one step that opens, updates and closes rows of ``flags``. This module only prepares parameters and the
small lookup tables (components and thresholds from docs/FLAGS.md, the reference baselines, declared
baselines, prices).

The collector's single-writer rule holds: inside the collector, a pass runs on the writer's connection
(``Writer.call``; each step is a transaction of its own); ``analyze_db`` runs a pass on a database file no collector
holds.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import re
import threading
import time
import tomllib
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping

from gpuagent.collector.analysis.steps import BASELINE, FINDINGS, FLAGS, STEPS, Step, pass_steps, rollup_steps
from gpuagent.common import hardware_faults
from gpuagent.common.errors import first_line
from gpuagent.common.sql_rows import insert_rows
from gpuagent.common.timeutil import utc_now

log = logging.getLogger("gpuagent.collector.analysis.analyzer")

KINDS = ("virtualization_overhead", "noisy_neighbor_variance", "utilization_gap")


class AnalyzerError(Exception):
    """A configuration or database problem, said in one sentence."""


# ----------------------------------------------------------------------------------------------- components

@dataclass(frozen=True)
class Component:
    """One thing a flag kind measures (docs/FLAGS.md is the source of truth for these rows)."""

    kind: str
    component: str
    probe: str          # probe registry name, or "job_steps"
    metric: str
    better: str         # higher, lower, points (steal: percentage points above the baseline)
    per_gpu: bool
    threshold: float    # virtualization_overhead: % (or points); noisy: CV
    critical: float
    label: str          # how a sentence names it
    unit: str           # the value's unit as stored in flags.unit
    unit_label: str     # how a sentence prints the unit
    advice: str = ""    # the actionable half of the sentence


_VO = "virtualization_overhead"
_NN = "noisy_neighbor_variance"

COMPONENTS: tuple[Component, ...] = (
    Component(_VO, "collective_busbw", "collective", "busbw_gbps", "higher", False, 10, 25,
              "collective busbw", "gbps", "GB/s",
              "check the VM's NVLink/NIC passthrough, GPUDirect RDMA and NCCL topology"),
    Component(_VO, "collective_latency", "collective", "small_msg_latency_us", "lower", False, 10, 25,
              "collective small-message latency", "us", "µs",
              "check the VM's NIC passthrough and vCPU pinning of the NCCL proxy threads"),
    Component(_VO, "h2d", "pcie", "h2d_gbps", "higher", True, 10, 25, "H2D", "gbps", "GB/s",
              "check PCIe passthrough, IOMMU/ATS settings and the NUMA placement of this VM"),
    Component(_VO, "d2h", "pcie", "d2h_gbps", "higher", True, 10, 25, "D2H", "gbps", "GB/s",
              "check PCIe passthrough, IOMMU/ATS settings and the NUMA placement of this VM"),
    Component(_VO, "gpu_compute", "gpu_compute", "bf16_tflops", "higher", True, 10, 25,
              "BF16 compute", "tflops", "TFLOPS",
              "check for vGPU time-slicing, MIG partitioning or capped clocks on this VM"),
    Component(_VO, "launch_latency", "gpu_compute", "launch_latency_us", "lower", True, 10, 25,
              "kernel launch latency", "us", "µs",
              "check vGPU scheduling and CPU contention on the host (pin the VM's vCPUs)"),
    Component(_VO, "storage_seq_read", "storage", "seq_read_gbps", "higher", False, 10, 25,
              "storage sequential read", "gbps", "GB/s",
              "check the virtual disk type and its provisioned throughput cap"),
    Component(_VO, "storage_seq_write", "storage", "seq_write_gbps", "higher", False, 10, 25,
              "storage sequential write", "gbps", "GB/s",
              "check the virtual disk type and its provisioned throughput cap"),
    Component(_VO, "storage_rand_read", "storage", "rand_read_iops", "higher", False, 10, 25,
              "storage random read", "iops", "IOPS",
              "check the virtual disk type and its provisioned IOPS cap"),
    Component(_VO, "host_syscall", "host", "syscall_ns", "lower", False, 10, 25,
              "syscall latency", "ns", "ns",
              "check for exits to the hypervisor (mitigations, no PV features) and vCPU pinning"),
    Component(_VO, "host_timer", "host", "clock_gettime_ns", "lower", False, 10, 25,
              "clock_gettime latency", "ns", "ns",
              "switch the guest clocksource to tsc if the host offers a stable TSC"),
    Component(_VO, "steal", "host", "cpu_steal_percent", "points", False, 2, 10,
              "CPU steal", "percent", "%",
              "ask the provider for dedicated vCPUs or move to a less contended host"),
    Component(_NN, "collective_busbw", "collective", "busbw_gbps", "higher", False, 0.10, 0.20,
              "collective busbw", "gbps", "GB/s"),
    Component(_NN, "h2d", "pcie", "h2d_gbps", "higher", True, 0.10, 0.20, "H2D", "gbps", "GB/s"),
    Component(_NN, "d2h", "pcie", "d2h_gbps", "higher", True, 0.10, 0.20, "D2H", "gbps", "GB/s"),
    Component(_NN, "gpu_compute", "gpu_compute", "bf16_tflops", "higher", True, 0.10, 0.20,
              "BF16 compute", "tflops", "TFLOPS"),
    Component(_NN, "storage_seq_read", "storage", "seq_read_gbps", "higher", False, 0.10, 0.20,
              "storage sequential read", "gbps", "GB/s"),
    Component(_NN, "storage_rand_read", "storage", "rand_read_iops", "higher", False, 0.10, 0.20,
              "storage random read", "iops", "IOPS"),
    Component(_NN, "storage_rand_read_p99", "storage", "rand_read_p99_latency_us", "lower", False, 0.25, 0.50,
              "storage random-read p99 latency", "us", "µs"),
    Component(_NN, "host_syscall", "host", "syscall_ns", "lower", False, 0.25, 0.50,
              "syscall latency", "ns", "ns"),
    Component(_NN, "host_pipe", "host", "pipe_roundtrip_us", "lower", False, 0.25, 0.50,
              "pipe round-trip latency", "us", "µs"),
    Component(_NN, "host_memcpy", "host", "memcpy_gbps", "higher", False, 0.10, 0.20,
              "memcpy bandwidth", "gbps", "GB/s"),
    # a fabric link's rate over its runs (61_link_variance.sql reads link_results, not probe_metrics)
    Component(_NN, "link", "net_pair", "link_gbits", "higher", False, 0.10, 0.20,
              "fabric link rate", "gbps", "Gbit/s"),
    Component(_NN, "step_time", "job_steps", "step_time_p50_s", "lower", False, 0.10, 0.20,
              "training step time", "s", "s"),
    # Passive (no tracker): threshold = the fraction of the job's progress lost while contended.
    Component(_NN, "co_tenant", "job_samples", "job_progress_percent", "higher", False, 0.20, 0.40,
              "job progress under co-tenant CPU use", "fraction", ""),
    Component(_NN, "hypervisor", "job_samples", "job_progress_percent", "higher", False, 0.20, 0.40,
              "job progress under CPU steal", "fraction", ""),
)

# What a declared value or a reference row may be for: the virtualization_overhead components, and a fabric
# link's rate (network_degraded, Gbit/s of the slower direction).
BASELINE_COMPONENTS = frozenset({c.component for c in COMPONENTS if c.kind == _VO} | {"net_pair_gbits"})


# ----------------------------------------------------------------------------------------------- config

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d)?\s*$")
_UNIT_S = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str | float | int) -> float:
    """'90s', '5m', '1h', '2d' or a number of seconds -> seconds."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m:
            raise AnalyzerError(f"cannot read duration {text!r}: use a number of seconds or e.g. 90s, 5m, 1h, 2d")
        value = float(m.group(1)) * _UNIT_S[m.group(2)]
    if value <= 0:
        raise AnalyzerError(f"duration {text!r} must be positive")
    return value


@dataclass(frozen=True)
class DeclaredBaseline:
    """A baseline the operator declares in the collector config ([[baselines.declared]])."""

    component: str
    value: float
    gpu_model_like: str | None = None
    params_like: str | None = None
    note: str = ""


@dataclass(frozen=True)
class AnalyzerConfig:
    """Analyzer settings; the TOML sections are [analyzer], [baselines] and [pricing] (docs/FLAGS.md)."""

    interval_s: float = 60.0
    window_s: float = 3600.0            # samples, jobs and step times
    probe_window_s: float = 6 * 3600.0  # probe runs (VO values, noise series): probes run far less often
    baseline_lookback_s: float = 86400.0
    baseline_refresh_s: float = 900.0
    min_baseline_nodes: int = 3
    theoretical_threshold_percent: float = 40.0
    significance_z: float = 1.0     # one-sided ~84 %: the overhead exceeds the threshold with that confidence
    min_runs: int = 5
    noise_k: float = 3.0
    min_fleet_nodes: int = 3
    corroboration_steal_percent: float = 1.0
    corroboration_psi_percent: float = 10.0
    neighbour_cpu_percent: float = 25.0   # % of one core a neighbour must add over its usual level
    neighbour_io_mb_per_s: float = 20.0   # MB/s of disk I/O a neighbour must add over its usual level
    neighbour_net_mb_per_s: float = 10.0  # MB/s of TCP traffic off the node a neighbour must add over its usual level
    neighbour_net_slowdown: float = 1.5   # times the job's own connections must slow (RTT up, busy send rate down)
    job_warmup_s: float = 10.0            # a passively seen job's start-up (imports, rendezvous) is not progress
    job_winddown_s: float = 3.0           # nor is an ended job's wind-down (process-group teardown, exit)
    min_minutes: int = 10
    idle_util_percent: float = 10.0
    input_bound_util_percent: float = 70.0
    data_wait_fraction: float = 0.25
    iowait_percent: float = 20.0
    cpu_busy_percent: float = 90.0
    gap_fraction: float = 0.25
    pool_finding_fraction: float = 0.5   # more than this share of a pool flagged alike: one pool finding
    pool_finding_min_nodes: int = 3
    fabric_runs: int = 3                # network_degraded: a link's rate is the median of its last runs
    fabric_slow_fraction: float = 0.5   # a link under this share of its pool's median is slow
    fabric_min_links: int = 3           # a node is judged once this many of its links were measured
    # Steps that judge each node alone (Step.by_node) run in pieces of at most this many nodes: their memory
    # is bounded by the piece, not the fleet (at 10,000 nodes one piece ran out of the 512 MB default, issue 27).
    piece_nodes: int = 2000
    # The rollups read new raw rows in chunks of at most this many (rowids); memory follows the chunk.
    rollup_chunk_rows: int = 5_000_000
    thresholds: Mapping[str, float] = field(default_factory=dict)   # "kind.component" -> threshold
    declared: tuple[DeclaredBaseline, ...] = ()
    pool_prices: Mapping[str, float] = field(default_factory=dict)
    reference_path: str | None = None   # None: the shipped collector/analysis/baselines.toml
    metrics_listen: str | None = None   # [metrics] listen: the collector's /metrics (read by `serve`)

    @classmethod
    def from_mapping(cls, doc: Mapping[str, Any]) -> "AnalyzerConfig":
        """Build from a parsed collector TOML document; unknown keys are one clear error."""
        # [fabric]: fabric/coordinator.py; [auth]: collector/cli.py (serve); [storage]: store/maintenance.py;
        # [lake]: lake/export.py and store/maintenance.py; [actions]: collector/actions/config.py.
        unknown = sorted(set(doc) - {"analyzer", "baselines", "pricing", "metrics", "fabric", "auth", "storage",
                                     "lake", "actions"})
        if unknown:
            raise AnalyzerError(f"unknown table or key {unknown[0]!r} in the collector config (expected "
                                "[analyzer], [[baselines.declared]], [pricing], [metrics], [fabric], [auth], "
                                "[storage], [lake] and [actions])")
        for table in ("analyzer", "baselines", "pricing"):
            if not isinstance(doc.get(table, {}), Mapping):
                raise AnalyzerError(f"[{table}] in the collector config must be a table")
        metrics = doc.get("metrics", {})
        if not isinstance(metrics, Mapping):
            raise AnalyzerError("[metrics] in the collector config must be a table")
        extra = sorted(set(metrics) - {"listen"})
        if extra:
            raise AnalyzerError(f"unknown key metrics.{extra[0]} (only listen = \"HOST:PORT\" goes there)")
        if "listen" in metrics and (not isinstance(metrics["listen"], str) or not metrics["listen"].strip()):
            raise AnalyzerError("[metrics] listen must be an address like \"127.0.0.1:9403\"")
        extra = sorted(set(doc.get("baselines") or {}) - {"declared"})
        if extra:
            raise AnalyzerError(f"unknown key baselines.{extra[0]} (only [[baselines.declared]] rows go there)")
        section = dict(doc.get("analyzer") or {})
        known = {f.name for f in fields(cls)} - {"declared", "pool_prices", "thresholds", "metrics_listen"}
        kwargs: dict[str, Any] = {}
        thresholds = section.pop("thresholds", {}) or {}
        if not isinstance(thresholds, Mapping):
            raise AnalyzerError("[analyzer] thresholds must be a table like { \"virtualization_overhead.h2d\" = 8 }")
        thresholds = dict(thresholds)
        for key, value in section.items():
            name = key
            if key in ("interval", "window", "probe_window", "baseline_lookback", "baseline_refresh"):
                name = key + "_s"
            if name not in known:
                raise AnalyzerError(f"unknown [analyzer] setting {key!r}")
            if name.endswith("_s") and not name.endswith("_per_s"):     # a duration, not a rate
                kwargs[name] = parse_duration(value)
            elif name == "reference_path":
                kwargs[name] = str(value)
            else:
                try:
                    kwargs[name] = type(getattr(cls, name))(value)
                except (TypeError, ValueError):
                    raise AnalyzerError(f"[analyzer] {key} must be a number, got {value!r}") from None
        for name in ("piece_nodes", "rollup_chunk_rows"):
            if kwargs.get(name, 1) < 1:
                raise AnalyzerError(f"[analyzer] {name} must be at least 1, got {kwargs[name]!r}")
        for name in ("neighbour_cpu_percent", "neighbour_io_mb_per_s", "neighbour_net_mb_per_s"):
            # a margin of 0 or less would make every tick of every command an episode
            if name in kwargs and not (math.isfinite(kwargs[name]) and kwargs[name] > 0):
                raise AnalyzerError(f"[analyzer] {name} must be a positive number, got {section[name]!r}")
        if "neighbour_net_slowdown" in kwargs and not (math.isfinite(kwargs["neighbour_net_slowdown"])
                                                       and kwargs["neighbour_net_slowdown"] > 1):
            # a factor of 1 or less is no slowdown: any connection would corroborate a network neighbour
            raise AnalyzerError("[analyzer] neighbour_net_slowdown must be a number greater than 1, "
                                f"got {section['neighbour_net_slowdown']!r}")
        valid = {f"{c.kind}.{c.component}" for c in COMPONENTS}
        for key, value in thresholds.items():
            if key not in valid:
                raise AnalyzerError(f"unknown threshold {key!r}: use kind.component, e.g. virtualization_overhead.h2d")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise AnalyzerError(f"[analyzer] threshold {key} must be a number, got {value!r}")
            thresholds[key] = float(value)
        declared = []
        components = BASELINE_COMPONENTS
        for i, row in enumerate((doc.get("baselines") or {}).get("declared") or []):
            if not isinstance(row, Mapping):
                raise AnalyzerError(f"[[baselines.declared]] #{i + 1} must be a table")
            extra = sorted(set(row) - {"component", "value", "gpu_model_like", "params_like", "note"})
            if extra:
                raise AnalyzerError(f"[[baselines.declared]] #{i + 1}: unknown key {extra[0]!r} (known: component, "
                                    "value, gpu_model_like, params_like, note)")
            comp = row.get("component")
            if comp not in components:
                raise AnalyzerError(f"[[baselines.declared]] #{i + 1}: unknown component {comp!r} "
                                    f"(one of {', '.join(sorted(components))})")
            if not isinstance(row.get("value"), (int, float)):
                raise AnalyzerError(f"[[baselines.declared]] #{i + 1}: value must be a number")
            declared.append(DeclaredBaseline(comp, float(row["value"]), row.get("gpu_model_like"),
                                             row.get("params_like"), str(row.get("note", ""))))
        prices = {}
        for pool, price in (doc.get("pricing") or {}).items():
            if not isinstance(price, (int, float)):
                raise AnalyzerError(f"[pricing] {pool} must be a price per GPU-hour (a number)")
            prices[str(pool)] = float(price)
        return cls(**kwargs, thresholds=thresholds, declared=tuple(declared), pool_prices=prices,
                   metrics_listen=metrics.get("listen"))

    @classmethod
    def from_toml(cls, path: str | Path) -> "AnalyzerConfig":
        try:
            with open(path, "rb") as fh:
                return cls.from_mapping(tomllib.load(fh))
        except FileNotFoundError:
            raise AnalyzerError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise AnalyzerError(f"config file {path} is not valid TOML: {exc}") from None


def load_reference(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The reference baseline rows (collector/analysis/baselines.toml); every row must cite its source."""
    if path is None:
        text = resources.files("gpuagent.collector.analysis").joinpath("baselines.toml").read_text()
        where = "collector/analysis/baselines.toml"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise AnalyzerError(f"cannot read reference baselines {path}: {exc.strerror}") from None
        where = str(path)
    try:
        rows = tomllib.loads(text).get("row", [])
    except tomllib.TOMLDecodeError as exc:
        raise AnalyzerError(f"{where} is not valid TOML: {exc}") from None
    out = []
    for i, row in enumerate(rows):
        for key in ("component", "value", "unit", "basis", "source"):
            if key not in row:
                raise AnalyzerError(f"{where} row {i + 1} lacks {key!r} (every row cites its source and basis)")
        if row["basis"] not in ("theoretical", "measured", "definition"):
            raise AnalyzerError(f"{where} row {i + 1}: basis must be theoretical, measured or definition")
        if row["component"] not in BASELINE_COMPONENTS:
            raise AnalyzerError(f"{where} row {i + 1}: unknown component {row['component']!r} "
                                f"(one of {', '.join(sorted(BASELINE_COMPONENTS))})")
        speed = row.get("link_mbits")
        if speed is not None and (isinstance(speed, bool) or not isinstance(speed, int) or speed <= 0):
            raise AnalyzerError(f"{where} row {i + 1}: link_mbits must be a line rate in whole Mbit/s "
                                f"(100 GbE = 100000), got {speed!r}")
        out.append(row)
    return out


def _hw_params() -> dict[str, Any]:
    """The hardware_fault step's scalar settings, from common/hardware_faults.toml."""
    rs = hardware_faults.rules()
    return {"hw_boot_kind": rs.reboot_event_kind, "hw_grace_s": rs.reboot_grace_s, "hw_settle_s": rs.reboot_state_settle_s, "hw_dedup_s": rs.dedup_window_s,
            "hw_app_jobs": rs.application_repeat_jobs, "hw_min_cover_s": rs.min_cover_s,
            "hw_xid_default_action": rs.xid_default.action, "hw_xid_default_severity": rs.xid_default.severity,
            "hw_xid_source": rs.xid_default.source}


# ----------------------------------------------------------------------------------------------- SQL

def _sql_dir():
    return resources.files("gpuagent.collector.analysis").joinpath("sql")


def load_sql(steps: tuple[Step, ...] = STEPS) -> dict[str, list[str]]:
    """Statements of each step's SQL file, by step name."""
    out = {}
    for step in steps:
        entry = _sql_dir().joinpath(step.sql_file)
        if not entry.is_file():
            raise AnalyzerError(f"analysis SQL file {step.sql_file} is missing from the installed package")
        out[step.name] = split_sql(entry.read_text())
    return out


def split_sql(text: str) -> list[str]:
    """Statements of a SQL file: split at ';' that ends a line (comments stripped; no ';' in strings)."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("--")]
    out, cur = [], []
    for ln in lines:
        cur.append(ln)
        if ln.rstrip().endswith(";"):
            stmt = "\n".join(cur).strip()
            if stmt.rstrip(";").strip():
                out.append(stmt)
            cur = []
    if "\n".join(cur).strip():
        out.append("\n".join(cur).strip())
    return out


_PARAM = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


def _run(con, stmt: str, params: Mapping[str, Any]):
    used = {name: params[name] for name in _PARAM.findall(stmt)}
    return con.execute(stmt, used) if used else con.execute(stmt)


_PIECE = re.compile(r"\$(pieces|piece)\b")


def _piece_literals(stmt: str, piece: int, pieces: int) -> str:
    """A piece's statement with ``$piece`` and ``$pieces`` written in as integer literals: DuckDB pushes
    ``hash(node_id) % 15 = 3`` into the table scan, but not the same filter with parameters, and then every
    piece paid for the whole fleet's rows (a 200-node piece of 2,000 nodes: 3.9 s with parameters, 0.3 s
    with literals). Both are integers the analyzer computed, so nothing from outside enters the SQL text."""
    values = {"piece": int(piece), "pieces": int(pieces)}
    return _PIECE.sub(lambda m: str(values[m.group(1)]), stmt)


# ----------------------------------------------------------------------------------------------- analyzer

@dataclass(frozen=True)
class PassResult:
    """What one analysis pass did; also written to analysis_runs."""

    now: dt.datetime
    rollup_rows_in: int
    rollup_s: float
    flags_s: float
    conditions: int
    opened: int
    updated: int
    closed: int
    step_s: Mapping[str, float] = field(default_factory=dict)   # seconds per analysis SQL file
    findings_opened: int = 0
    findings_closed: int = 0
    failed: Mapping[str, str] = field(default_factory=dict)     # step (SQL file, or 'rollup') -> why it failed

    @property
    def total_s(self) -> float:
        return self.rollup_s + self.flags_s

    def as_dict(self) -> dict[str, Any]:
        return {"now": self.now.isoformat(), "rollup_rows_in": self.rollup_rows_in,
                "rollup_s": round(self.rollup_s, 4), "flags_s": round(self.flags_s, 4),
                "total_s": round(self.total_s, 4), "conditions": self.conditions, "opened": self.opened,
                "updated": self.updated, "closed": self.closed,
                "findings_opened": self.findings_opened, "findings_closed": self.findings_closed,
                "step_s": {k: round(v, 4) for k, v in self.step_s.items()}, "failed_steps": dict(self.failed)}


def _row_key(con, source: str, rowid: int) -> int | None:
    row = con.execute(f"SELECT hash(s) FROM {source} s WHERE rowid = ?", [rowid]).fetchone()
    return None if row is None else int(row[0])


# The rollup watermark is a row count, not a rowid. DuckDB renumbers rowids whenever a checkpoint drops or
# merges row groups that hold deleted rows, but it never reorders the rows that stay, and it appends new rows
# after all others. Raw rows are only ever deleted or rewritten once they are rolled up (store/maintenance.py
# rolls up first and re-sets the count in the same transaction as the change), so the rolled-up rows are
# always the first ``last_count`` rows in rowid order and the rows not yet rolled up are the last
# count(*) - last_count: in whatever numbering the table has now, rowid in (max(rowid) - that, max(rowid)].
# ``last_key`` (the hash of the last rolled-up row, NULL when maintenance set the count) and the tail's
# row count check that nothing else deleted rows behind the analyzer's back; when either disagrees the
# rollup rebuilds. ``last_rowid`` is max(rowid) at the last analyzer pass, kept for reading only.


def watermark_of(con, source: str) -> tuple[int, int, int | None]:
    """(max rowid, row count, hash of the row at max rowid) of a rollup source, as a watermark."""
    hi, count = con.execute(f"SELECT max(rowid), count(*) FROM {source}").fetchone()
    hi = -1 if hi is None else int(hi)
    return hi, int(count), (_row_key(con, source, hi) if hi >= 0 else None)


def _rowid_span(con, source: str, lo: int, hi: int) -> tuple[Any, Any, int]:
    """(first minute, last minute, rows) of the rows of ``source`` with rowid in (lo, hi]."""
    dmin, dmax, n = con.execute(
        f"SELECT date_trunc('minute', min(ts)), date_trunc('minute', max(ts)), count(*) "
        f"FROM {source} WHERE rowid > $lo AND rowid <= $hi", {"lo": lo, "hi": hi}).fetchone()
    return dmin, dmax, int(n)


def set_watermark(con, source: str, hi: int, count: int, key: int | None) -> None:
    con.execute("INSERT OR REPLACE INTO rollup_watermarks (source, last_rowid, updated_at, last_count, last_key) "
                "VALUES (?, ?, ?, ?, ?)", [source, hi, utc_now(), count, key])


def mark_all_rolled_up(con, source: str) -> None:
    """Record every row ``source`` holds as rolled up, inside the transaction that changed them (maintenance:
    the rows it deleted or rewrote were rolled up just before). Rowids of rows this transaction wrote are
    not final until it commits, so only the count is set; the next pass sets the key again."""
    con.execute(f"UPDATE rollup_watermarks SET last_count = (SELECT count(*) FROM {source}), last_key = NULL, "
                "updated_at = ? WHERE source = ?", [utc_now(), source])


def rolled_up_rowid(con, source: str, hi: int, count: int) -> int | None:
    """The highest rowid, in the numbering ``con`` sees now, of the rows of ``source`` already rolled up
    (-1: none); None when the watermark cannot tell (then the rollup rebuilds). ``hi`` and ``count`` are
    ``source``'s max(rowid) and count(*) in the same snapshot. Rows above it number count - last_count; the
    caller checks that (a hole among them means rows were deleted that were never rolled up)."""
    wm = con.execute("SELECT last_count, last_key FROM rollup_watermarks WHERE source = ?", [source]).fetchone()
    if wm is None:
        return -1
    last_count, last_key = wm
    if last_count is None:
        return None
    fresh = count - int(last_count)
    lo = hi - fresh
    if fresh < 0 or lo < -1 or (last_count > 0 and lo < 0):
        return None
    if last_key is not None and last_count > 0 and _row_key(con, source, lo) != int(last_key):
        return None
    return lo


class Analyzer:
    """Runs analysis passes on a connection that may write (the writer's)."""

    def __init__(self, config: AnalyzerConfig | None = None,
                 baselines_loader: Callable[[Any, dt.datetime], int] | None = None):
        """``baselines_loader(con, now)``, when given, fills fleet_baselines (and the class noise medians,
        _nn_fleet_lake) in place of the baseline step: a shard of a larger fleet takes what needs the whole
        fleet from the lake (collector/lake/fleet.py)."""
        self.config = config or AnalyzerConfig()
        self.baselines_loader = baselines_loader
        self.reference = load_reference(self.config.reference_path)
        try:
            hardware_faults.rules()
        except hardware_faults.RulesError as exc:
            raise AnalyzerError(str(exc).rstrip(".")) from None
        self.sql = load_sql()
        # Which steps' temp tables each step's SQL names, worked out from the SQL files: a table name is a
        # whole word of the SQL. (One regex search per table and step cost 0.14 CPU-s per Analyzer, and tests
        # and the CLI make hundreds; the words of each step once cost a few ms.)
        tables = {t for st in STEPS for t in st.temp_tables}
        self._reads = {st.name: tables & set(re.findall(r"\w+", "\n".join(self.sql[st.name]))) for st in STEPS}

    def _needs_failed(self, step: Step, failed: Mapping[str, str]) -> tuple[str, str] | None:
        """(table, step file) when the step reads a temp table of an earlier step that failed this pass."""
        for earlier in STEPS[:STEPS.index(step)]:
            if earlier.sql_file in failed:
                for t in earlier.temp_tables:
                    if t in self._reads[step.name]:
                        return t, earlier.sql_file
        return None

    def _done_with(self, step: Step) -> tuple[str, ...]:
        """The step's temp tables that no later step's SQL names: dropped as soon as the step is done, so a
        pass holds (in memory, or spilled) only what is still to be read, not every step's intermediates."""
        later = set().union(*(self._reads[st.name] for st in STEPS[STEPS.index(step) + 1:]))
        return tuple(t for t in step.temp_tables if t not in later)

    # -- rollups -----------------------------------------------------------------------------------------

    def rollup(self, con) -> int:
        """Bring samples_1m and job_samples_1m up to date; returns the raw rows read."""
        total = 0
        for step in rollup_steps():
            source = step.source
            hi, count, key = watermark_of(con, source)
            lo = rolled_up_rowid(con, source, hi, count)
            if lo is None or _rowid_span(con, source, lo, hi)[2] != hi - lo:
                # Rows went that were never rolled up, or the watermark is from before this scheme: rebuild
                # the minutes the raw table still holds; older rollup minutes (past raw retention) stay.
                log.warning("rollup of %s: the watermark does not match the table; rebuilding the minutes "
                            "its raw rows cover", source)
                con.execute(f"DELETE FROM {source}_1m WHERE minute >= "
                            f"(SELECT date_trunc('minute', min(ts)) FROM {source})")
                lo = -1
            total += self._rollup_chunks(con, step, lo, hi)
            set_watermark(con, source, hi, count, key)
        return total

    def _rollup_chunks(self, con, step: Step, lo: int, hi: int) -> int:
        """Roll up the rows with rowid in (lo, hi] in chunks of at most rollup_chunk_rows rowids, one after
        another: a chunk's GROUP BY holds one group per minute and series of its rows, so its memory follows
        the chunk, not the backlog (a 30,000-node fleet's first hour, 72 M rows, ran out of 512 MB in one).
        The merge into the 1-minute table is exact for a minute split across chunks (10_rollup_samples.sql)."""
        total = 0
        for c_lo in range(lo, hi, self.config.rollup_chunk_rows):
            c_hi = min(hi, c_lo + self.config.rollup_chunk_rows)
            dmin, dmax, n = _rowid_span(con, step.source, c_lo, c_hi)
            if n:
                params = {"lo": c_lo, "hi": c_hi, "dmin": dmin, "dmax": dmax}
                for stmt in self.sql[step.name]:
                    _run(con, stmt, params)
                total += n
        return total

    # -- flags -------------------------------------------------------------------------------------------

    def _lookup_tables(self, con) -> None:
        cfg = self.config
        con.execute("""CREATE OR REPLACE TEMP TABLE _components (kind VARCHAR, component VARCHAR, probe VARCHAR,
            metric VARCHAR, better VARCHAR, per_gpu BOOLEAN, threshold DOUBLE, critical DOUBLE, label VARCHAR,
            unit VARCHAR, unit_label VARCHAR, advice VARCHAR)""")
        rows = []
        for c in COMPONENTS:
            thr = float(cfg.thresholds.get(f"{c.kind}.{c.component}", c.threshold))
            crit = max(c.critical, thr)
            rows.append([c.kind, c.component, c.probe, c.metric, c.better, c.per_gpu, thr, crit, c.label,
                         c.unit, c.unit_label, c.advice])
        insert_rows(con, "_components", rows)
        con.execute("""CREATE OR REPLACE TEMP TABLE _ref_baselines (component VARCHAR, gpu_model_like VARCHAR,
            pcie_gen INTEGER, pcie_width INTEGER, params_like VARCHAR, value DOUBLE, unit VARCHAR, basis VARCHAR,
            source VARCHAR, link_mbits INTEGER)""")
        if self.reference:
            insert_rows(con, "_ref_baselines", [
                [r["component"], r.get("gpu_model_like"), r.get("pcie_gen"), r.get("pcie_width"),
                 r.get("params_like"), float(r["value"]), r["unit"], r["basis"], r["source"], r.get("link_mbits")]
                for r in self.reference])
        con.execute("""CREATE OR REPLACE TEMP TABLE _declared_baselines (component VARCHAR, gpu_model_like VARCHAR,
            params_like VARCHAR, value DOUBLE, note VARCHAR)""")
        if cfg.declared:
            insert_rows(con, "_declared_baselines", [
                [d.component, d.gpu_model_like, d.params_like, d.value, d.note] for d in cfg.declared])
        # hardware_fault (70_hardware_fault.sql): the rules of common/hardware_faults.toml, the node's too.
        con.execute("""CREATE OR REPLACE TEMP TABLE _hw_rules (name VARCHAR, component VARCHAR, metric VARCHAR,
            kind VARCHAR, severity VARCHAR, action VARCHAR, source VARCHAR, sentence VARCHAR, label_key VARCHAR,
            label_value VARCHAR, op VARCHAR, value DOUBLE, threshold_per_hour DOUBLE, threshold_share DOUBLE, max_metric VARCHAR,
            load_metric VARCHAR, load_min DOUBLE, reboot_explains BOOLEAN)""")
        insert_rows(con, "_hw_rules", [list(r.values()) for r in hardware_faults.rule_rows()])
        con.execute("""CREATE OR REPLACE TEMP TABLE _hw_xids (kind VARCHAR, xid INTEGER, component VARCHAR,
            severity VARCHAR, application BOOLEAN, description VARCHAR, action VARCHAR, source VARCHAR)""")
        insert_rows(con, "_hw_xids", [list(r.values()) for r in hardware_faults.xid_rows()])
        con.execute("CREATE OR REPLACE TEMP TABLE _pool_prices (pool VARCHAR, price_per_gpu_hour DOUBLE)")
        if cfg.pool_prices:
            insert_rows(con, "_pool_prices", list(cfg.pool_prices.items()))
        # The whole fleet's noise medians per class, for a shard: the lake loader fills it (collector/lake/fleet.py).
        con.execute("""CREATE OR REPLACE TEMP TABLE _nn_fleet_lake (component VARCHAR, peer_key VARCHAR,
            fleet_cv DOUBLE, nodes BIGINT)""")
        con.execute("""CREATE OR REPLACE TEMP TABLE _conditions (node_id VARCHAR, gpu SMALLINT, kind VARCHAR,
            component VARCHAR, severity VARCHAR, value DOUBLE, unit VARCHAR, baseline DOUBLE,
            baseline_source VARCHAR, evidence VARCHAR, sentence VARCHAR)""")
        con.execute("""CREATE OR REPLACE TEMP TABLE _evaluated (node_id VARCHAR, gpu SMALLINT, kind VARCHAR,
            component VARCHAR)""")
        con.execute("""CREATE OR REPLACE TEMP MACRO _fmt(x) AS CASE WHEN x IS NULL THEN 'n/a'
            WHEN abs(x) >= 100 THEN printf('%.0f', x) WHEN abs(x) >= 1 THEN printf('%.1f', x)
            ELSE printf('%.2f', x) END""")
        con.execute("""CREATE OR REPLACE TEMP MACRO _num(x) AS CASE WHEN x IS NOT NULL AND x = round(x)
            THEN printf('%.0f', x) ELSE _fmt(x) END""")
        con.execute("""CREATE OR REPLACE TEMP MACRO _hours(h) AS CASE WHEN h >= 1 AND h = round(h) THEN printf('%.0f h', h)
            WHEN h >= 1 THEN printf('%.1f h', h) ELSE printf('%.0f min', h * 60) END""")

    def _baselines_stale(self, con, now: dt.datetime) -> bool:
        """Fleet baselines are recomputed when older than baseline_refresh (or computed for a later time)."""
        last = con.execute("SELECT max(computed_at) FROM fleet_baselines").fetchone()[0]
        return (last is None or last > now
                or (now - last).total_seconds() >= self.config.baseline_refresh_s)

    def params(self, now: dt.datetime) -> dict[str, Any]:
        cfg = self.config
        return {
            "now": now,
            "window_start": now - dt.timedelta(seconds=cfg.window_s),
            "probe_window_start": now - dt.timedelta(seconds=cfg.probe_window_s),
            "lookback_start": now - dt.timedelta(seconds=cfg.baseline_lookback_s),
            "window_hours": cfg.window_s / 3600.0, "probe_window_hours": round(cfg.probe_window_s / 3600.0, 3),
            "min_baseline_nodes": cfg.min_baseline_nodes,
            "theoretical_threshold": cfg.theoretical_threshold_percent, "vo_z": cfg.significance_z,
            "min_runs": cfg.min_runs, "noise_k": cfg.noise_k, "min_fleet_nodes": cfg.min_fleet_nodes,
            "corr_steal": cfg.corroboration_steal_percent, "corr_psi": cfg.corroboration_psi_percent,
            "neighbour_cpu": cfg.neighbour_cpu_percent, "neighbour_io": cfg.neighbour_io_mb_per_s,
            "neighbour_net": cfg.neighbour_net_mb_per_s, "net_slowdown": cfg.neighbour_net_slowdown,
            "job_warmup_s": cfg.job_warmup_s,
            "job_winddown_s": cfg.job_winddown_s, "psi_rise": cfg.corroboration_psi_percent / 2,
            "min_minutes": cfg.min_minutes, "idle_util": cfg.idle_util_percent,
            "input_util": cfg.input_bound_util_percent, "data_wait": cfg.data_wait_fraction,
            "iowait": cfg.iowait_percent, "cpu_busy": cfg.cpu_busy_percent, "gap_fraction": cfg.gap_fraction,
            "pool_fraction": cfg.pool_finding_fraction, "pool_min_nodes": cfg.pool_finding_min_nodes,
            "fabric_runs": cfg.fabric_runs, "fabric_slow_fraction": cfg.fabric_slow_fraction,
            "fabric_min_links": cfg.fabric_min_links,
            **_hw_params(),
        }

    def run_pass(self, con, now: dt.datetime | None = None) -> PassResult:
        """One pass: rollups, then every flag kind, then the flags table and findings.

        Each step runs in a transaction of its own (call with none open). A step that fails is rolled back
        alone and the other kinds still run: its open flags stay as they were, the failure is kept in
        analysis_failures, as an ``analysis_step_failed`` event and as an ``analysis_incomplete`` flag
        (so a finding says which step could not run, and why), and the next pass tries it again. Only a
        failure of the final step (flags, findings) fails the pass, after recording it."""
        now = now or utc_now()
        failed: dict[str, str] = {}
        t0 = time.perf_counter()
        try:
            rows_in = run_in_transaction(con, self.rollup)
        except Exception as exc:  # noqa: BLE001 - recorded; the flag steps read the rollups as they are
            rows_in = 0
            failed["rollup"] = _step_error("rollup", exc)
        t1 = time.perf_counter()
        params = self.params(now)
        self._lookup_tables(con)
        counts: dict[str, int] = {}
        step_s: dict[str, float] = {}
        skipped_kinds: set[str] = set()
        ran: list[Step] = []
        final: list[Step] = []
        for step in pass_steps():
            if step.produces in (FLAGS, FINDINGS):
                final.append(step)
                continue
            if step.produces == BASELINE and self.baselines_loader is None and not self._baselines_stale(con, now):
                continue
            ts = time.perf_counter()
            try:
                needs = self._needs_failed(step, failed)
                if needs:
                    raise AnalyzerError(f"not run: it reads {needs[0]} of {needs[1]}, which failed this pass")
                if step.produces == BASELINE and self.baselines_loader is not None:
                    run_in_transaction(con, lambda c: self.baselines_loader(c, now))
                    step_s["fleet_baselines (lake)"] = time.perf_counter() - ts
                    ran.append(step)        # it stands in for the step: a failure of it closes when it runs
                    continue
                counts.update(run_in_transaction(con, lambda c, st=step: self._run_step(c, st, params)))
                ran.append(step)
                for table in self._done_with(step):
                    con.execute(f"DROP TABLE IF EXISTS {table}")
            except Exception as exc:  # noqa: BLE001 - this step alone is rolled back; the others go on
                failed[step.sql_file] = _step_error(step.sql_file, exc)
                if step.kind:
                    skipped_kinds.add(step.kind)
                log.error("analysis step %s failed (rolled back; the other steps go on): %s", step.sql_file,
                          failed[step.sql_file])
            step_s[step.sql_file] = time.perf_counter() - ts

        current = [final[0].sql_file]      # the final step running, for the failure's name

        def finish(c) -> int:
            _record_step_conditions(c, ran, failed, skipped_kinds)
            for step in final:
                current[0] = step.sql_file
                ts = time.perf_counter()
                counts.update(self._run_step(c, step, params))
                step_s[step.sql_file] = time.perf_counter() - ts
            n = c.execute("SELECT count(*) FROM _conditions").fetchone()[0]
            _record_failures(c, now, failed)
            return int(n)

        try:
            conditions = run_in_transaction(con, finish)
        except Exception as exc:
            failed[current[0]] = _step_error(current[0], exc)
            run_in_transaction(con, lambda c: _record_failures(c, now, failed))
            raise AnalyzerError(f"analysis pass could not update the flags: {first_line(exc)}") from exc
        t2 = time.perf_counter()
        result = PassResult(now, rows_in, t1 - t0, t2 - t1, conditions,
                            counts.get("opened", 0), counts.get("updated", 0), counts.get("closed", 0), step_s,
                            counts.get("findings_opened", 0), counts.get("findings_closed", 0), failed)
        con.execute("INSERT INTO analysis_runs VALUES (?,?,?,?,?,?,?,?,?,?,?)", [
            now, utc_now(), self.config.window_s, rows_in, result.rollup_s, result.flags_s, result.conditions,
            result.opened, result.updated, result.closed, len(failed)])
        # Temp tables live as long as the connection, which inside the collector is the writer's: free them.
        for table in (*(t for step in STEPS for t in step.temp_tables), "_skipped_kinds"):
            con.execute(f"DROP TABLE IF EXISTS {table}")
        return result

    def pieces(self, con, step: Step) -> int:
        """How many pieces of nodes the step runs in: 1, or enough that none has over piece_nodes nodes."""
        if not step.by_node:
            return 1
        nodes = con.execute("SELECT count(*) FROM nodes").fetchone()[0]
        return max(1, math.ceil(nodes / self.config.piece_nodes))

    def _run_step(self, con, step: Step, params: Mapping[str, Any]) -> dict[str, int]:
        """Run one step's statements (once per piece of nodes for a by_node step); returns the row counts of
        the result columns it declares."""
        counts: dict[str, int] = {}
        pieces = self.pieces(con, step)
        if step.by_node:
            # A context step's pieces append to its tables (CREATE TEMP TABLE IF NOT EXISTS, then INSERT):
            # start from none, whatever an earlier pass that stopped short left behind.
            for table in step.temp_tables:
                con.execute(f"DROP TABLE IF EXISTS {table}")
        for piece in range(pieces):
            for stmt in self.sql[step.name]:
                try:
                    res = _run(con, _piece_literals(stmt, piece, pieces) if step.by_node else stmt, params)
                except Exception as exc:  # a bug in our SQL: name the file so it can be found
                    where = f"piece {piece + 1} of {pieces} of the nodes: " if pieces > 1 else ""
                    raise AnalyzerError(f"analysis step {step.sql_file} failed: {where}{exc}") from exc
                column = res.description[0][0] if res.description else None
                if column in step.counts:
                    counts[column] = len(res.fetchall())
        missing = [name for name in step.counts if name not in counts]
        if missing:
            raise AnalyzerError(f"analysis step {step.sql_file} returned no {missing[0]!r} column")
        return counts


# A node id no host can have (parentheses are not allowed in host names): what the collector itself reports.
COLLECTOR_NODE = "(collector)"
INCOMPLETE_KIND = "analysis_incomplete"


def _step_error(step: str, exc: BaseException) -> str:
    text = first_line(exc)
    prefix = f"analysis step {step} failed: "
    return text[len(prefix):] if text.startswith(prefix) else text


def _record_step_conditions(con, ran: list[Step], failed: Mapping[str, str], skipped_kinds: set[str]) -> None:
    """An analysis_incomplete condition per failed step (it opens a flag, hence a finding) and an evaluated
    row per step that ran (its flag closes); and the kinds whose flags must not close as stale this pass."""
    for step, error in failed.items():
        con.execute("INSERT INTO _conditions VALUES (?, NULL, ?, ?, 'warning', NULL, NULL, NULL, 'none', ?, ?)", [
            COLLECTOR_NODE, INCOMPLETE_KIND, step, json.dumps({"step": step, "error": error}),
            f"analysis could not run step {step}: {error}; its flags are kept as they were and the next pass "
            f"tries again"])
    for step in ran:
        con.execute("INSERT INTO _evaluated VALUES (?, NULL, ?, ?)", [COLLECTOR_NODE, INCOMPLETE_KIND, step.sql_file])
    if "rollup" not in failed:
        con.execute("INSERT INTO _evaluated VALUES (?, NULL, ?, 'rollup')", [COLLECTOR_NODE, INCOMPLETE_KIND])
    con.execute("CREATE OR REPLACE TEMP TABLE _skipped_kinds (kind VARCHAR)")
    if skipped_kinds:
        insert_rows(con, "_skipped_kinds", [[k] for k in sorted(skipped_kinds)])


def _record_failures(con, now: dt.datetime, failed: Mapping[str, str]) -> None:
    for step, error in failed.items():
        con.execute("INSERT INTO analysis_failures VALUES (?, ?, ?)", [now, step, error])
        con.execute("INSERT INTO events (ts, node_id, gpu, kind, message, value, attrs) "
                    "VALUES (?, ?, NULL, 'analysis_step_failed', ?, NULL, ?)",
                    [now, COLLECTOR_NODE, f"analysis could not run step {step}: {error}", json.dumps({"step": step})])


# ----------------------------------------------------------------------------------------------- entry points

def run_in_transaction(con, fn: Callable[[Any], Any]):
    """Run fn(con) inside one transaction on a connection this code owns (no collector running)."""
    con.execute("BEGIN TRANSACTION")
    try:
        out = fn(con)
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")
    return out


def analyze_db(path: str | Path, config: AnalyzerConfig | None = None,
               now: dt.datetime | None = None,
               baselines_loader: Callable[[Any, dt.datetime], int] | None = None,
               memory_limit: str | None = None) -> PassResult:
    """One pass directly on a database file (the collector must be stopped: DuckDB allows one writer).

    The file is opened and migrated the way the collector opens it, so the pass runs as it would there: at
    the collector's memory limit unless ``memory_limit`` says otherwise (DuckDB's own default is 80 % of
    the machine's memory: a 30,000-node pass grew to 16 GB with it).
    """
    from gpuagent.collector.store import db  # noqa: PLC0415 - the collector extra

    path = Path(path)
    if not path.exists():   # open_database would create it
        raise AnalyzerError(f"database {path} does not exist")
    try:
        con = db.open_database(path, memory_limit or db.DEFAULT_MEMORY_LIMIT)
    except db.DatabaseError as exc:
        raise AnalyzerError(f"{exc}{_LIVE_HINT}") from None
    try:
        analyzer = Analyzer(config, baselines_loader)
        return analyzer.run_pass(con, now)
    finally:
        con.close()


# store.db words why a file cannot be opened; what to do instead is this command's to say.
_LIVE_HINT = "; a database held by a running collector is analysed with `gpuagent-collector analyze --target HOST:PORT`"


def open_flags_in(path: str | Path, limit: int = 1000) -> list[dict[str, Any]]:
    """Open flags of a database file no collector holds (read-only)."""
    from gpuagent.collector.store import db  # noqa: PLC0415

    try:
        con = db.open_readonly(path)
    except db.DatabaseError as exc:
        raise AnalyzerError(f"{exc}{_LIVE_HINT}") from None
    try:
        return open_flags(con, limit)
    finally:
        con.close()


def open_flags(con, limit: int = 1000) -> list[dict[str, Any]]:
    """Open flags, worst first, as dicts (for the CLI and the RPC)."""
    cur = con.execute("SELECT * FROM v_open_flags LIMIT ?", [limit])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


def open_findings_in(path: str | Path, limit: int = 1000) -> list[dict[str, Any]]:
    """Open findings of a database file no collector holds (read-only)."""
    from gpuagent.collector.store import db  # noqa: PLC0415

    try:
        con = db.open_readonly(path)
    except db.DatabaseError as exc:
        raise AnalyzerError(f"{exc}{_LIVE_HINT}") from None
    try:
        return open_findings(con, limit)
    finally:
        con.close()


FINDINGS_SQL = "SELECT * FROM v_open_findings LIMIT {limit}"


def open_findings(con, limit: int = 1000) -> list[dict[str, Any]]:
    """Open findings, worst first, as dicts."""
    cur = con.execute(FINDINGS_SQL.format(limit=int(limit)))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


class AnalyzerThread:
    """Runs a pass every ``interval_s`` through ``submit`` (a transaction on the writer) until stopped."""

    def __init__(self, analyzer: Analyzer, submit: Callable[[Callable[[Any], Any]], Any],
                 on_error: Callable[[BaseException], None] | None = None):
        self.analyzer = analyzer
        self._submit = submit
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="analyzer", daemon=True)
        self.last: PassResult | None = None
        self.last_error: str | None = None
        self.passes = 0

    def start(self) -> "AnalyzerThread":
        self._thread.start()
        return self

    def run_once(self) -> PassResult:
        result = self._submit(self.analyzer.run_pass)
        self.last, self.passes = result, self.passes + 1
        return result

    def _loop(self) -> None:
        while not self._stop.wait(self.analyzer.config.interval_s):
            try:
                self.run_once()
                self.last_error = None
            except Exception as exc:  # keep analysing next interval; the collector keeps ingesting
                self.last_error = str(exc)
                if self._on_error:
                    self._on_error(exc)

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)


def config_with(config: AnalyzerConfig, **changes: Any) -> AnalyzerConfig:
    """A copy of config with some settings changed (frozen dataclasses)."""
    return replace(config, **changes)


def with_window(config: AnalyzerConfig, window_s: float) -> AnalyzerConfig:
    """An on-demand pass over one window: samples and probe runs alike (`analyze --window`)."""
    return replace(config, window_s=window_s, probe_window_s=window_s)


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=str, sort_keys=True)
