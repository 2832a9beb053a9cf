"""The agent config's value parsers and its one error type, apart from the tables that use them.

Every table check (config_tables.py), the dataclasses (config_sections.py) and the loader (config.py) turn a
raw TOML, environment or flag value into a typed one here, so they all word a bad value the same way: one
:class:`ConfigError` sentence naming the key and where it came from. Re-exported by gpuagent.agent.config.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from gpuagent.common.parse import parse_bool


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one sentence naming the key and where it came from."""


def thaw(value: Any) -> Any:
    """Plain dicts/lists again (for JSON output and for consumers that want to copy a section)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


_HOSTPORT = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


def _where(src: str, key: str) -> str:
    return f"{key} (from {src})"


def _as_float(v: Any, key: str, src: str, minimum: float | None = None, maximum: float | None = None) -> float:
    if isinstance(v, bool):
        raise ConfigError(f"{_where(src, key)} must be a number, not {v!r}.")
    try:
        out = float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{_where(src, key)} must be a number, not {v!r}.") from None
    if out != out or (minimum is not None and out < minimum) or (maximum is not None and out > maximum):
        lo = "" if minimum is None else f" >= {minimum:g}"
        hi = "" if maximum is None else f" <= {maximum:g}"
        raise ConfigError(f"{_where(src, key)} must be{lo}{' and' if lo and hi else ''}{hi}, not {v!r}.")
    return out


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def _as_bytes(v: Any, key: str, src: str) -> int:
    """An integer byte count, or a string like "512MiB" / "2G" (binary units)."""
    if isinstance(v, bool):
        raise ConfigError(f"{_where(src, key)} must be a byte count like 536870912 or \"512MiB\", not {v!r}.")
    if isinstance(v, (int, float)):
        n = int(v)
    else:
        m = _SIZE.match(str(v))
        if not m:
            raise ConfigError(f"{_where(src, key)} must be a byte count like 536870912 or \"512MiB\", not {v!r}.")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "")[:1].lower()])
    if n < 64 * 1024:
        raise ConfigError(f"{_where(src, key)} must be at least 64KiB, not {v!r}.")
    return n


def _as_str(v: Any, key: str, src: str) -> str:
    if not isinstance(v, (str, int, float)) or isinstance(v, bool):
        raise ConfigError(f"{_where(src, key)} must be a string, not {v!r}.")
    return str(v)


def _as_address(v: Any, key: str, src: str) -> str:
    s = _as_str(v, key, src).strip()
    m = _HOSTPORT.match(s)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ConfigError(f"{_where(src, key)} must be HOST:PORT (e.g. collector.example:7443), not {v!r}.")
    return s


def _as_bool(v: Any, key: str, src: str) -> bool:
    out = parse_bool(v)
    if out is None:
        raise ConfigError(f"{_where(src, key)} must be true or false, not {v!r}.")
    return out


def _parse_labels(text: str, key: str, src: str) -> dict[str, str]:
    """``pool=a100,region=eu-west`` (env form)."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise ConfigError(f"{_where(src, key)} must be comma-separated key=value pairs, not {text!r}.")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _check_labels(labels: Mapping[str, Any], src: str) -> dict[str, str]:
    out = {}
    for k, v in labels.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", str(k)):
            raise ConfigError(f"labels key {k!r} (from {src}) must be letters, digits, '_', '.', or '-'.")
        if isinstance(v, (Mapping, list)):
            raise ConfigError(f"labels.{k} (from {src}) must be a plain value, not a table or list.")
        out[str(k)] = str(v).lower() if isinstance(v, bool) else str(v)
    if "price_per_gpu_hour" in out:
        _as_float(out["price_per_gpu_hour"], "labels.price_per_gpu_hour", src, minimum=0)
    return out
