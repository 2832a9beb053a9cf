"""The floor under collector.toml: its one error type, the one way the file is read, and its tables.

``collector/config.py`` reads the file once and hands each section to the code that owns it
(``analysis/settings.py``, ``store/maintenance_config.py``, ``lake/export.py``, ``actions/config.py``, the
fabric coordinator); a bad value there is a ``CollectorConfigError`` (or a subclass of it) with one sentence
naming the section and key. This module imports nothing of the collector, so every owner may import it,
and config.py, on top of them all, imports the owners.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Mapping

from gpuagent.common.durations import DurationError, parse_duration

# Every table collector.toml may have; anything else is a typo and refused, not ignored.
TABLES = ("analyzer", "baselines", "pricing", "metrics", "fabric", "auth", "storage", "lake", "actions", "console")


class CollectorConfigError(ValueError):
    """collector.toml cannot be read, or a value in it is not usable; the message is one sentence."""


def read_toml(path: str | Path) -> dict[str, Any]:
    """The parsed file, or one sentence saying why it cannot be had."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise CollectorConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise CollectorConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CollectorConfigError(f"config file {path} is not valid TOML: {exc}") from None


def check_tables(doc: Mapping[str, Any], error: type[CollectorConfigError] = CollectorConfigError) -> None:
    """Refuse a table (or top-level key) the collector does not know, and a known one that is not a table."""
    unknown = sorted(set(doc) - set(TABLES))
    if unknown:
        raise error(f"unknown table or key {unknown[0]!r} in the collector config (expected [analyzer], "
                    "[[baselines.declared]], [pricing], [metrics], [fabric], [auth], [storage], [lake], "
                    "[actions] and [console])")
    for table in TABLES:
        if table in doc and not isinstance(doc[table], Mapping):
            raise error(f"[{table}] in the collector config must be a table")


def duration(section: str, key: str, value: Any, error: type[CollectorConfigError] = CollectorConfigError) -> float:
    """``value`` in seconds, or one sentence naming ``[section] key``."""
    try:
        return parse_duration(value)
    except DurationError as exc:
        raise error(f"[{section}] {key}: {exc}") from None
