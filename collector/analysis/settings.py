"""The analyzer's settings: ``AnalyzerConfig`` from collector.toml's [analyzer], [baselines], [pricing] and
[metrics] (docs/FLAGS.md), checked once, every mistake one sentence naming the section and key.

``collector/config.py`` hands the parsed file here; ``AnalyzerConfigError`` is both the collector config's
error and an ``AnalyzerError``, so callers of either keep catching it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from gpuagent.collector.analysis.components import BASELINE_COMPONENTS, COMPONENTS
from gpuagent.collector.analysis.errors import AnalyzerError
from gpuagent.collector.config_file import CollectorConfigError, check_tables, duration, read_toml


class AnalyzerConfigError(CollectorConfigError, AnalyzerError):
    """A bad [analyzer], [baselines], [pricing] or [metrics] value; the message is one sentence."""


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
    vo_min_runs: int = 3            # virtualization_overhead: runs (own, or all GPUs' pooled) before a judgement
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
    # network_degraded from the cheap layer (path probes, 62_path_tomography.sql): the window of summaries and
    # suspects it reads (at least one full cycle of the pinglists, docs/FABRIC.md), how many distinct healthy
    # peers must name a node before its own slow summary makes it the bad node, and the loss share above which
    # a node's own paths are lossy (and above five times its pool's).
    path_window_s: float = 1800.0
    path_min_reporters: int = 2
    path_link_reports: int = 2          # a suspect path without loss: reports before it is a link's fault
    path_loss_floor: float = 0.01
    path_late_factor: float = 3.0
    path_late_floor_us: float = 100.0
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
        check_tables(doc, AnalyzerConfigError)   # [fabric], [auth], [storage], [lake], [actions]: collector/config.py
        metrics = doc.get("metrics", {})
        extra = sorted(set(metrics) - {"listen"})
        if extra:
            raise AnalyzerConfigError(f"unknown key metrics.{extra[0]} (only listen = \"HOST:PORT\" goes there)")
        if "listen" in metrics and (not isinstance(metrics["listen"], str) or not metrics["listen"].strip()):
            raise AnalyzerConfigError("[metrics] listen must be an address like \"127.0.0.1:9403\"")
        extra = sorted(set(doc.get("baselines") or {}) - {"declared"})
        if extra:
            raise AnalyzerConfigError(f"unknown key baselines.{extra[0]} (only [[baselines.declared]] rows go there)")
        section = dict(doc.get("analyzer") or {})
        known = {f.name for f in fields(cls)} - {"declared", "pool_prices", "thresholds", "metrics_listen"}
        kwargs: dict[str, Any] = {}
        thresholds = section.pop("thresholds", {}) or {}
        if not isinstance(thresholds, Mapping):
            raise AnalyzerConfigError("[analyzer] thresholds must be a table like { \"virtualization_overhead.h2d\" = 8 }")
        thresholds = dict(thresholds)
        for key, value in section.items():
            name = key
            if key in ("interval", "window", "probe_window", "baseline_lookback", "baseline_refresh"):
                name = key + "_s"
            if name not in known:
                raise AnalyzerConfigError(f"unknown [analyzer] setting {key!r}")
            if name.endswith("_s") and not name.endswith("_per_s"):     # a duration, not a rate
                kwargs[name] = duration("analyzer", key, value, AnalyzerConfigError)
            elif name == "reference_path":
                kwargs[name] = str(value)
            else:
                try:
                    kwargs[name] = type(getattr(cls, name))(value)
                except (TypeError, ValueError):
                    raise AnalyzerConfigError(f"[analyzer] {key} must be a number, got {value!r}") from None
        for name in ("piece_nodes", "rollup_chunk_rows", "vo_min_runs"):
            if kwargs.get(name, 1) < 1:
                raise AnalyzerConfigError(f"[analyzer] {name} must be at least 1, got {kwargs[name]!r}")
        for name in ("neighbour_cpu_percent", "neighbour_io_mb_per_s", "neighbour_net_mb_per_s"):
            # a margin of 0 or less would make every tick of every command an episode
            if name in kwargs and not (math.isfinite(kwargs[name]) and kwargs[name] > 0):
                raise AnalyzerConfigError(f"[analyzer] {name} must be a positive number, got {section[name]!r}")
        if "neighbour_net_slowdown" in kwargs and not (math.isfinite(kwargs["neighbour_net_slowdown"])
                                                       and kwargs["neighbour_net_slowdown"] > 1):
            # a factor of 1 or less is no slowdown: any connection would corroborate a network neighbour
            raise AnalyzerConfigError("[analyzer] neighbour_net_slowdown must be a number greater than 1, "
                                f"got {section['neighbour_net_slowdown']!r}")
        valid = {f"{c.kind}.{c.component}" for c in COMPONENTS}
        for key, value in thresholds.items():
            if key not in valid:
                raise AnalyzerConfigError(f"[analyzer] unknown threshold {key!r}: use kind.component, e.g. virtualization_overhead.h2d")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise AnalyzerConfigError(f"[analyzer] threshold {key} must be a number, got {value!r}")
            thresholds[key] = float(value)
        declared = []
        components = BASELINE_COMPONENTS
        for i, row in enumerate((doc.get("baselines") or {}).get("declared") or []):
            if not isinstance(row, Mapping):
                raise AnalyzerConfigError(f"[[baselines.declared]] #{i + 1} must be a table")
            extra = sorted(set(row) - {"component", "value", "gpu_model_like", "params_like", "note"})
            if extra:
                raise AnalyzerConfigError(f"[[baselines.declared]] #{i + 1}: unknown key {extra[0]!r} (known: component, "
                                    "value, gpu_model_like, params_like, note)")
            comp = row.get("component")
            if comp not in components:
                raise AnalyzerConfigError(f"[[baselines.declared]] #{i + 1}: unknown component {comp!r} "
                                    f"(one of {', '.join(sorted(components))})")
            if not isinstance(row.get("value"), (int, float)):
                raise AnalyzerConfigError(f"[[baselines.declared]] #{i + 1}: value must be a number")
            declared.append(DeclaredBaseline(comp, float(row["value"]), row.get("gpu_model_like"),
                                             row.get("params_like"), str(row.get("note", ""))))
        prices = {}
        for pool, price in (doc.get("pricing") or {}).items():
            if not isinstance(price, (int, float)):
                raise AnalyzerConfigError(f"[pricing] {pool} must be a price per GPU-hour (a number)")
            prices[str(pool)] = float(price)
        return cls(**kwargs, thresholds=thresholds, declared=tuple(declared), pool_prices=prices,
                   metrics_listen=metrics.get("listen"))

    @classmethod
    def from_toml(cls, path: str | Path) -> "AnalyzerConfig":
        """The analyzer's sections of a collector config file (collector/config.py reads all of them)."""
        return cls.from_mapping(read_toml(path))
