"""The [storage] settings of retention, the disk guard and compaction (and whether [lake] is on), read and
checked once from the collector's TOML: ``MaintenanceConfig`` and the one-sentence ``MaintenanceConfigError``.

Kept apart from the maintenance steps so the config can be read (``gpuagent-collector serve`` checks it at
start-up) without the code that runs on the writer. ``collector/config.py`` hands it the parsed collector.toml;
its error is one of that file's errors (``CollectorConfigError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuagent.collector.config_file import CollectorConfigError, read_toml
from gpuagent.common.durations import parse_duration

DAY_S = 86_400.0


class MaintenanceConfigError(CollectorConfigError):
    """A [storage] or [lake] setting is not usable; the message is one sentence."""


def _seconds(name: str, value: Any) -> float:

    try:
        seconds = parse_duration(value)
    except (ValueError, TypeError):
        raise MaintenanceConfigError(f"storage.{name} must be a duration such as 7d, 12h or 30m, "
                                     f"not {value!r}") from None
    if seconds <= 0:
        raise MaintenanceConfigError(f"storage.{name} must be positive, not {value!r}")
    return seconds


def _bytes(name: str, value: Any) -> int:
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):]
    try:
        out = int(float(num) * units[unit])
    except (ValueError, KeyError):
        raise MaintenanceConfigError(f"storage.{name} must be a size such as 500GB or 2GiB, not {value!r}") from None
    if out < 0:
        raise MaintenanceConfigError(f"storage.{name} must not be negative, not {value!r}")
    return out


@dataclass(frozen=True)
class MaintenanceConfig:
    raw_retention_s: float = 7 * DAY_S
    rollup_retention_s: float = 400 * DAY_S
    probe_retention_s: float = 400 * DAY_S
    job_retention_s: float = 90 * DAY_S
    event_retention_s: float = 90 * DAY_S
    flag_retention_s: float = 400 * DAY_S
    link_retention_s: float = 400 * DAY_S
    max_db_bytes: int = 0                 # 0: no size bound
    min_free_bytes: int = 1 << 30          # floor of free space on the database's volume (0: off)
    interval_s: float = 60.0               # retention and compaction passes
    guard_interval_s: float = 5.0          # disk guard checks (cheap: stat + PRAGMA)
    # Once over a bound, the guard deletes until max_db_bytes is undercut, and min_free_bytes exceeded, by
    # this fraction, so one crossing does not become a deletion every check.
    guard_hysteresis: float = 0.05
    slice_s: float = 3600.0                # one delete covers at most this much time
    compaction: bool = True
    compact_grace_s: float = 600.0         # a span is closed this long after its end (late batches)
    # Compaction rewrites whole spans of this many hours (dividing a day). DuckDB bit-packs timestamps in
    # groups of 2048 values, and a group that crosses from one series to the next stores full-width
    # deltas: the longer a series' run, the fewer such groups (1 s samples: ~2.2 bytes/ts per hour-long
    # run, ~0.4 per 6-hour run). Longer spans leave more recent data uncompacted and hold the writer longer.
    compact_span_s: float = 6 * 3600.0
    # One writer call rewrites whole (node, metric) groups of at most this many rows (a metric is never
    # split): the writer's hold per call stays around a fraction of a second however large the fleet.
    compact_chunk_rows: int = 250_000
    # The share of wall time compaction may take: after each chunk it pauses (1 - duty) / duty times as
    # long as the chunk took, so ingest and queries keep the writer and the CPUs most of the time.
    compact_duty: float = 0.3
    lake_enabled: bool = False
    lake_path: str | None = None

    _DURATIONS = ("raw_retention", "rollup_retention", "probe_retention", "job_retention", "event_retention",
                  "flag_retention", "link_retention", "interval", "guard_interval", "slice", "compact_grace",
                  "compact_span")

    @classmethod
    def from_mapping(cls, doc: dict) -> "MaintenanceConfig":
        """From a parsed collector TOML: ``[storage]`` and ``[lake]`` (both optional)."""
        st = doc.get("storage") or {}
        kwargs: dict[str, Any] = {}
        for key, value in st.items():
            if key in cls._DURATIONS:
                kwargs[f"{key}_s"] = _seconds(key, value)
            elif key in ("max_db_bytes", "min_free_bytes"):
                kwargs[key] = _bytes(key, value)
            elif key == "compact_chunk_rows":
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise MaintenanceConfigError(f"storage.compact_chunk_rows must be a positive integer, not {value!r}")
                kwargs[key] = value
            elif key == "guard_hysteresis":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 0.5:
                    raise MaintenanceConfigError(f"storage.guard_hysteresis must be a fraction from 0 to 0.5, "
                                                 f"not {value!r}")
                kwargs[key] = float(value)
            elif key == "compact_duty":
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.01 <= value <= 1:
                    raise MaintenanceConfigError(f"storage.compact_duty must be a number from 0.01 to 1, not {value!r}")
                kwargs[key] = float(value)
            elif key == "compaction":
                if not isinstance(value, bool):
                    raise MaintenanceConfigError(f"storage.compaction must be true or false, not {value!r}")
                kwargs[key] = value
            else:
                raise MaintenanceConfigError(f"unknown setting storage.{key}")
        span = kwargs.get("compact_span_s", cls.compact_span_s)
        if span % 3600 or DAY_S % span:
            raise MaintenanceConfigError(f"storage.compact_span must be a whole number of hours that divides a day "
                                         f"(1h, 2h, 3h, 4h, 6h, 8h, 12h, 24h), not {st.get('compact_span')!r}")
        lake = doc.get("lake") or {}
        if lake:
            kwargs["lake_enabled"] = bool(lake.get("enabled", False))
            kwargs["lake_path"] = lake.get("path")
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> "MaintenanceConfig":
        """[storage] and [lake] of a collector config file (collector/config.py reads every section)."""
        return cls.from_mapping(read_toml(path))
