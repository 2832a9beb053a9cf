"""The checks that turn one TOML table ([hardware], [fabric], [jobs], an [exporter] value) into its dataclass.

Apart from the dataclasses (config_sections.py) so the types stay short to read, and apart from the loader
(config.py), which calls these once per table with the table's source for the error message.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

from gpuagent.agent.config_sections import (DCGM_NAME_GENERATIONS, DEFAULT_EXPORTER_PORT, FABRIC_KEYS,
                                            JOB_LABEL_MODES, FabricConfig, HardwareConfig, JobRules, JobsConfig)
from gpuagent.agent.config_values import _HOSTPORT, ConfigError, _as_bool, _as_float, _as_str, _where


def _check_hardware(table: dict[str, Any], src: str) -> HardwareConfig:
    allowed = {f.name for f in fields(HardwareConfig)}
    extra = set(table) - allowed
    if extra:
        raise ConfigError(f"{src}: unknown key hardware.{sorted(extra)[0]} (expected one of {', '.join(sorted(allowed))}).")
    kw: dict[str, Any] = {}
    for k, v in table.items():
        name = f"hardware.{k}"
        if k in ("kmsg", "infiniband", "ethernet"):
            kw[k] = _as_bool(v, name, src)
        elif k == "sysfs_interval_s":
            kw[k] = _as_float(v, name, src, minimum=1, maximum=3600)
        elif k == "ethernet_speed_mbps":
            if not isinstance(v, dict):
                raise ConfigError(f"{_where(src, name)} must be a table of device name or pattern = Mb/s, "
                                  f"such as {{ \"ens*\" = 200000 }}.")
            speeds = {}
            for dev, mbps in v.items():
                if not str(dev).strip() or isinstance(mbps, bool) or not isinstance(mbps, int) or mbps <= 0:
                    raise ConfigError(f"{_where(src, name)}: {dev!r} = {mbps!r} must name a device or pattern and "
                                      f"a speed in whole Mb/s above 0, such as \"ens*\" = 200000.")
                speeds[str(dev)] = mbps
            kw[k] = tuple(speeds.items())
        else:
            s = _as_str(v, name, src).strip()
            if not s:
                raise ConfigError(f"{_where(src, name)} must not be empty.")
            kw[k] = s
    return HardwareConfig(**kw)


def _check_fabric(table: dict[str, Any], src: str) -> FabricConfig:
    out: dict[str, Any] = {}
    for k, v in table.items():
        name = f"fabric.{k}"
        if k not in FABRIC_KEYS:
            raise ConfigError(f"unknown key {name!r} (from {src}); expected one of {', '.join(sorted(FABRIC_KEYS))}.")
        if k in ("enabled", "paths"):
            out[k] = _as_bool(v, name, src)
        elif k in ("address", "interface"):
            out[k] = _as_str(v, name, src).strip()
        else:
            port = _as_float(v, name, src, minimum=0, maximum=65535)
            if k == "path_port" and port != int(port):
                raise ConfigError(f"{_where(src, name)} must be a whole UDP port number (0: a free one), not {v!r}.")
            out[k] = int(port)
    cfg = FabricConfig(**out)
    if (cfg.port_lo == 0) != (cfg.port_hi == 0) or cfg.port_lo > cfg.port_hi:
        raise ConfigError(f"fabric.port_lo and fabric.port_hi (from {src}) must both be 0 or a range lo <= hi, "
                          f"not {cfg.port_lo}-{cfg.port_hi}.")
    if cfg.enabled and not (cfg.address or cfg.interface):
        raise ConfigError(f"[fabric] (from {src}) is enabled but names neither address nor interface; set the "
                          "address (or NIC) peers reach this node on.")
    return cfg


def _exporter_value(k: str, v: Any, name: str, src: str) -> Any:
    if k == "xid_labels":
        return _as_bool(v, name, src)
    s = _as_str(v, name, src).strip()
    choices = {"dcgm_names": DCGM_NAME_GENERATIONS, "job_labels": JOB_LABEL_MODES}.get(k)
    if choices is not None:
        if s not in choices:
            raise ConfigError(f"{_where(src, name)} must be one of {', '.join(repr(c) for c in choices)}, not {v!r}.")
        return s
    if s:   # listen
        m = _HOSTPORT.match(s)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise ConfigError(f"{_where(src, name)} must be HOST:PORT (e.g. 0.0.0.0:"
                              f"{DEFAULT_EXPORTER_PORT}) or empty for off, not {v!r}.")
    return s


# [jobs] keys and the kind of value each takes; the rule keys go into JobRules, the others into JobsConfig.
JOBS_KEYS = {"cmdline_regex": list, "env_keys": list, "env_argv0_regex": str, "scan_interval_s": float,
             "end_grace_s": float, "orphan_grace_s": float, "net_interval_s": float, "step_listener": bool, "step_socket": str, "step_window_s": float,
             "slurm": str, "slurm_refresh_s": float, "kubernetes": str, "kubernetes_socket": str,
             "kubernetes_refresh_s": float}
_RULE_KEYS = {f.name for f in fields(JobRules)}


def _check_jobs(table: dict[str, Any], src: str) -> JobsConfig:
    out: dict[str, Any] = {}
    for k, v in table.items():
        kind = JOBS_KEYS.get(k)
        name = f"jobs.{k}"
        if kind is None:
            raise ConfigError(f"unknown key {name!r} (from {src}); expected one of {', '.join(sorted(JOBS_KEYS))}.")
        if kind is list:
            if isinstance(v, str):
                v = [v]
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ConfigError(f"{name} (from {src}) must be a list of strings.")
            if k == "cmdline_regex":
                for x in v:
                    try:
                        re.compile(x)
                    except re.error as exc:
                        raise ConfigError(f"{name} (from {src}): {x!r} is not a valid regular expression "
                                          f"({exc}).") from None
            out[k] = tuple(v)
        elif kind is float:
            out[k] = _as_float(v, name, src, minimum=0.1)
        elif kind is bool:
            out[k] = _as_bool(v, name, src)
        else:
            s = _as_str(v, name, src)
            if k in ("slurm", "kubernetes") and s not in ("auto", "on", "off"):
                raise ConfigError(f"{name} (from {src}) must be auto, on or off, not {s!r}.")
            if k == "env_argv0_regex":
                try:
                    re.compile(s)
                except re.error as exc:
                    raise ConfigError(f"{name} (from {src}) is not a valid regular expression ({exc}).") from None
            out[k] = s
    rules = JobRules(**{k: v for k, v in out.items() if k in _RULE_KEYS})
    return JobsConfig(rules=rules, **{k: v for k, v in out.items() if k not in _RULE_KEYS})
