"""Agent configuration: frozen dataclasses built from flag > environment (``GPUAGENT_*``) > TOML > default.

One function, :func:`load_config`, resolves everything so the daemon, the CLI and the tests agree on
precedence. Any bad value raises :class:`ConfigError` with one sentence naming the key and its source,
which the CLI turns into a ``click.ClickException``.

This module reads the sources (the file, the environment, the flags) and merges them; the pieces it builds
from live beside it, and every name of theirs is importable from here as before:
config_sections.py (the dataclass of each table and its defaults), config_tables.py (one TOML table checked
into its dataclass), config_values.py (ConfigError and the value parsers).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from gpuagent.agent.config_sections import (DCGM_NAME_GENERATIONS, DEFAULT_CMDLINE, DEFAULT_COLLECTOR,
                                            DEFAULT_ENV_KEYS, DEFAULT_EXPORTER_PORT, DEFAULT_PROBES_ENABLED,
                                            DEFAULT_SPOOL_MAX_BYTES, DEFAULT_STATE_DIR, FABRIC_KEYS,
                                            JOB_LABEL_MODES, KNOWN_LABELS, AgentConfig, CollectorConfig,
                                            ExporterConfig, FabricConfig, HardwareConfig, JobRules, JobsConfig,
                                            ProbeSchedule, ProbesConfig, fabric_address)
from gpuagent.agent.config_tables import JOBS_KEYS, _check_fabric, _check_hardware, _check_jobs, _exporter_value
from gpuagent.common.resolution import valid_summary_interval
from gpuagent.agent.config_values import (ConfigError, _as_address, _as_bool, _as_bytes, _as_float, _as_str,
                                          _check_labels, _parse_labels, _where, thaw)

__all__ = [
    "DCGM_NAME_GENERATIONS", "DEFAULT_CMDLINE", "DEFAULT_COLLECTOR", "DEFAULT_CONFIG_PATH", "DEFAULT_ENV_KEYS",
    "DEFAULT_EXPORTER_PORT", "DEFAULT_PROBES_ENABLED", "DEFAULT_SPOOL_MAX_BYTES", "DEFAULT_STATE_DIR", "ENV_VARS",
    "FABRIC_KEYS", "JOBS_KEYS", "JOB_LABEL_MODES", "KNOWN_LABELS", "AgentConfig", "CollectorConfig", "ConfigError",
    "ExporterConfig", "FabricConfig", "HardwareConfig", "JobRules", "JobsConfig", "ProbeSchedule", "ProbesConfig",
    "fabric_address", "load_config", "read_toml", "thaw", "with_overrides",
]

DEFAULT_CONFIG_PATH = "/etc/gpuagent/agent.toml"


# ------------------------------------------------------------------ sources

_AGENT_KEYS = {"interval_s", "batch_interval_s", "batch_max_samples", "state_dir", "spool_max_bytes", "log_level",
               "summary_interval_s", "raw_keep_s"}
_COLLECTOR_KEYS = {f.name for f in fields(CollectorConfig)}
_TOP_TABLES = {"agent", "collector", "labels", "probes", "jobs", "exporter", "fabric", "hardware"}

# Environment variable -> (section, key). GPUAGENT_LABELS and GPUAGENT_CONFIG are handled apart.
ENV_VARS = {
    "GPUAGENT_COLLECTOR": ("collector", "address"),
    "GPUAGENT_TOKEN": ("collector", "token"),
    "GPUAGENT_TOKEN_FILE": ("collector", "token_file"),
    "GPUAGENT_TLS_CA": ("collector", "tls_ca"),
    "GPUAGENT_TLS_CLIENT_CERT": ("collector", "tls_client_cert"),
    "GPUAGENT_TLS_CLIENT_KEY": ("collector", "tls_client_key"),
    "GPUAGENT_RPC_TIMEOUT": ("collector", "rpc_timeout_s"),
    "GPUAGENT_INTERVAL": ("agent", "interval_s"),
    "GPUAGENT_BATCH_INTERVAL": ("agent", "batch_interval_s"),
    "GPUAGENT_SUMMARY_INTERVAL": ("agent", "summary_interval_s"),
    "GPUAGENT_STATE_DIR": ("agent", "state_dir"),
    "GPUAGENT_SPOOL_MAX_BYTES": ("agent", "spool_max_bytes"),
    "GPUAGENT_LOG_LEVEL": ("agent", "log_level"),
    "GPUAGENT_EXPORTER_LISTEN": ("exporter", "listen"),
    "GPUAGENT_EXPORTER_DCGM_NAMES": ("exporter", "dcgm_names"),
    "GPUAGENT_EXPORTER_JOB_LABELS": ("exporter", "job_labels"),
    "GPUAGENT_EXPORTER_XID_LABELS": ("exporter", "xid_labels"),
}


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r} does not exist.") from None
    except PermissionError:
        raise ConfigError(f"config file {str(p)!r} is not readable by this user.") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}.") from None
    unknown = set(data) - _TOP_TABLES
    if unknown:
        raise ConfigError(f"config file {str(p)!r} has unknown table or key {sorted(unknown)[0]!r} "
                          f"(expected {', '.join(sorted(_TOP_TABLES))}).")
    for table in _TOP_TABLES:
        if table in data and not isinstance(data[table], dict):
            raise ConfigError(f"config file {str(p)!r}: {table!r} must be a table ([{table}]).")
    for table, allowed in (("agent", _AGENT_KEYS), ("collector", _COLLECTOR_KEYS),
                           ("exporter", {f.name for f in fields(ExporterConfig)})):
        extra = set(data.get(table, {})) - allowed
        if extra:
            raise ConfigError(f"config file {str(p)!r}: unknown key {table}.{sorted(extra)[0]} "
                              f"(expected one of {', '.join(sorted(allowed))}).")
    return data


def load_config(
    config_file: str | None = None,
    *,
    collector: str | None = None,
    state_dir: str | None = None,
    interval_s: float | None = None,
    batch_interval_s: float | None = None,
    summary_interval_s: float | None = None,
    token: str | None = None,
    labels: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
) -> AgentConfig:
    """Resolve the configuration. Flags are the keyword arguments (None = not given).

    The file is ``config_file``, else ``$GPUAGENT_CONFIG``, else /etc/gpuagent/agent.toml when it
    exists. An explicitly named file that does not exist is an error; the default path is optional.
    """
    env = os.environ if env is None else env
    explicit = config_file or env.get("GPUAGENT_CONFIG")
    path = explicit or (DEFAULT_CONFIG_PATH if Path(DEFAULT_CONFIG_PATH).exists() else "")
    data = read_toml(path) if path else {}
    fsrc = f"config file {path}" if path else "defaults"

    # (value, source) per key, lowest precedence first.
    merged: dict[tuple[str, str], tuple[Any, str]] = {}
    for section in ("agent", "collector", "exporter"):
        for k, v in data.get(section, {}).items():
            merged[(section, k)] = (v, f"{fsrc} [{section}]")
    for var, key in ENV_VARS.items():
        if env.get(var, "") != "":
            merged[key] = (env[var], f"environment {var}")
    flags = {("collector", "address"): collector, ("agent", "state_dir"): state_dir,
             ("agent", "interval_s"): interval_s, ("agent", "batch_interval_s"): batch_interval_s,
             ("agent", "summary_interval_s"): summary_interval_s, ("collector", "token"): token}
    flag_names = {("collector", "address"): "--collector", ("agent", "state_dir"): "--state-dir",
                  ("agent", "interval_s"): "--interval", ("agent", "batch_interval_s"): "--batch-interval",
                  ("agent", "summary_interval_s"): "--summary-interval", ("collector", "token"): "--token"}
    for key, v in flags.items():
        if v is not None:
            merged[key] = (v, f"flag {flag_names[key]}")

    coll_kw: dict[str, Any] = {}
    agent_kw: dict[str, Any] = {}
    exporter_kw: dict[str, Any] = {}
    for (section, k), (v, src) in merged.items():
        name = f"{section}.{k}"
        if section == "exporter":
            exporter_kw[k] = _exporter_value(k, v, name, src)
        elif section == "collector":
            if k == "address":
                coll_kw[k] = _as_address(v, name, src)
            elif k in ("token", "token_file", "tls_ca", "tls_client_cert", "tls_client_key"):
                coll_kw[k] = _as_str(v, name, src)
            elif k == "max_in_flight":
                coll_kw[k] = int(_as_float(v, name, src, minimum=1, maximum=1024))
            else:
                coll_kw[k] = _as_float(v, name, src, minimum=0.01)
        else:
            if k == "interval_s":
                agent_kw[k] = _as_float(v, name, src, minimum=0.05, maximum=3600)
            elif k == "batch_interval_s":
                agent_kw[k] = _as_float(v, name, src, minimum=0.05, maximum=3600)
            elif k == "summary_interval_s":
                x = _as_float(v, name, src, minimum=0, maximum=60)
                if not valid_summary_interval(x):
                    raise ConfigError(f"{_where(src, name)} must be 0 (every sample raw) or a whole number of "
                                      f"seconds that divides a minute (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30 or 60), "
                                      f"not {v!r}.")
                agent_kw[k] = x
            elif k == "raw_keep_s":
                agent_kw[k] = _as_float(v, name, src, minimum=0, maximum=86400)
            elif k == "batch_max_samples":
                agent_kw[k] = int(_as_float(v, name, src, minimum=1))
            elif k == "spool_max_bytes":
                agent_kw[k] = _as_bytes(v, name, src)
            elif k == "state_dir":
                s = _as_str(v, name, src)
                if not s:
                    raise ConfigError(f"{_where(src, name)} must not be empty.")
                agent_kw[k] = s
            elif k == "log_level":
                s = _as_str(v, name, src).lower()
                if s not in ("debug", "info", "warning", "error"):
                    raise ConfigError(f"{_where(src, name)} must be debug, info, warning or error, not {v!r}.")
                agent_kw[k] = s

    lab = _check_labels(data.get("labels", {}), f"{fsrc} [labels]")
    if env.get("GPUAGENT_LABELS"):
        lab.update(_check_labels(_parse_labels(env["GPUAGENT_LABELS"], "labels", "environment GPUAGENT_LABELS"),
                                 "environment GPUAGENT_LABELS"))
    if labels:
        lab.update(_check_labels(labels, "flag --label"))

    jobs = _check_jobs(dict(data.get("jobs", {})), f"{fsrc} [jobs]")
    fabric = _check_fabric(dict(data.get("fabric", {})), f"{fsrc} [fabric]")
    hardware = _check_hardware(dict(data.get("hardware", {})), f"{fsrc} [hardware]")

    probes_table = data.get("probes", {})
    if "enabled" in probes_table:
        _as_bool(probes_table["enabled"], "probes.enabled", f"{fsrc} [probes]")
    if env.get("GPUAGENT_PROBES_ENABLED"):
        probes_table = {**probes_table,
                        "enabled": _as_bool(env["GPUAGENT_PROBES_ENABLED"], "probes.enabled",
                                            "environment GPUAGENT_PROBES_ENABLED")}
    try:
        probes = ProbesConfig.from_mapping(probes_table)
    except (ValueError, TypeError) as exc:
        text = str(exc).rstrip(".")
        raise ConfigError(f"[probes] (from {fsrc}): {text}.") from None

    cfg = AgentConfig(
        collector=CollectorConfig(**coll_kw),
        labels=MappingProxyType(lab),
        probes=probes,
        jobs=jobs,
        exporter=ExporterConfig(**exporter_kw),
        fabric=fabric,
        hardware=hardware,
        config_file=str(path) if path else "",
        **agent_kw,
    )
    for key in ("tls_ca", "tls_client_cert", "tls_client_key"):
        value = getattr(cfg.collector, key)
        if value and not Path(value).is_file():
            raise ConfigError(f"collector.{key} {value!r} is not a readable file.")
    if bool(cfg.collector.tls_client_cert) != bool(cfg.collector.tls_client_key):
        raise ConfigError("collector.tls_client_cert and collector.tls_client_key go together: set both or neither.")
    if cfg.collector.tls_client_cert and not cfg.collector.tls_ca:
        raise ConfigError("collector.tls_client_cert needs collector.tls_ca (a client certificate is sent over TLS).")
    return cfg


def with_overrides(cfg: AgentConfig, **kw: Any) -> AgentConfig:
    """A copy with some top-level fields replaced (tests, local_run)."""
    return replace(cfg, **kw)
