"""Agent configuration: frozen dataclasses built from flag > environment (``GPUAGENT_*``) > TOML > default.

One function, :func:`load_config`, resolves everything so the daemon, the CLI and the tests agree on
precedence. Any bad value raises :class:`ConfigError` with one sentence naming the key and its source,
which the CLI turns into a ``click.ClickException``.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from gpuagent.common.parse import parse_bool

DEFAULT_CONFIG_PATH = "/etc/gpuagent/agent.toml"
DEFAULT_STATE_DIR = "/var/lib/gpuagent"
DEFAULT_COLLECTOR = "127.0.0.1:7443"
DEFAULT_SPOOL_MAX_BYTES = 512 * 1024 * 1024

# Labels that the collector stores in their own `nodes` columns (see collector/store/migrations/001_initial.sql).
KNOWN_LABELS = ("pool", "provider", "region", "price_per_gpu_hour")


class ConfigError(ValueError):
    """A configuration value is wrong; the message is one sentence naming the key and where it came from."""


def thaw(value: Any) -> Any:
    """Plain dicts/lists again (for JSON output and for consumers that want to copy a section)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


@dataclass(frozen=True)
class CollectorConfig:
    address: str = DEFAULT_COLLECTOR   # host:port of the collector's gRPC endpoint
    token: str = ""                    # bearer token; empty = none sent
    token_file: str = ""               # read the token from this file (wins over an empty `token`)
    tls_ca: str = ""                   # PEM file of the CA that signed the collector's certificate; empty = plaintext
    tls_client_cert: str = ""          # PEM client certificate (CN = this node) for a collector with --tls-client-ca
    tls_client_key: str = ""           # its private key
    rpc_timeout_s: float = 10.0        # deadline of Register and of each batch's ack
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    max_in_flight: int = 8             # batches sent but not yet acked


# ------------------------------------------------------------------ [exporter]

DEFAULT_EXPORTER_PORT = 9402   # dcgm-exporter uses 9400, node_exporter 9100


# dcgm-exporter's naming generations (docs/EXPORTER.md): before 4.8.3 label Hostname; 4.8.3 renamed it
# hostname; 4.9.0 renamed fields to DCGM 4.7's names and base units; 4.10.0 renamed the PCIe/NVLink rates.
DCGM_NAME_GENERATIONS = ("pre-4.8.3", "4.8.3", "4.9", "4.10")
# How jobs reach Prometheus: separate info series per (GPU, job) and (GPU, pod) to join on, dcgm-exporter's
# hpc_job label on every GPU series (one series per job on the GPU, as its HPC job mapping does), or its
# Kubernetes pod, namespace and container labels (one series per container holding the GPU).
JOB_LABEL_MODES = ("info", "hpc_job", "pod")


@dataclass(frozen=True)
class ExporterConfig:
    """The ``[exporter]`` table: the Prometheus /metrics endpoint (gpuagent.agent.surface.exporter)."""
    listen: str = ""                   # HOST:PORT, e.g. "0.0.0.0:9402"; "" = off
    dcgm_names: str = "pre-4.8.3"      # one of DCGM_NAME_GENERATIONS
    job_labels: str = "info"           # one of JOB_LABEL_MODES
    xid_labels: bool = True            # err_code / err_msg on the XID series, as dcgm-exporter sets them


# ------------------------------------------------------------------ [hardware]

@dataclass(frozen=True)
class HardwareConfig:
    """The ``[hardware]`` table: the host's hardware-health sources (gpuagent.agent.samplers.hw_host)."""
    kmsg: bool = True                  # NVIDIA XID/SXID/driver-init records from the kernel log (skipped if unreadable)
    kmsg_path: str = "/dev/kmsg"
    infiniband: bool = True            # /sys/class/infiniband port state and counters
    ethernet: bool = True              # /sys/class/net carrier changes and link speed
    sys_root: str = "/sys"
    sysfs_interval_s: float = 10.0     # sysfs is read this often; the kernel log every tick
    # (device name or fnmatch pattern, the Mb/s its link should run at), in file order: a manifest for
    # eth_speed_below_max
    ethernet_speed_mbps: tuple[tuple[str, int], ...] = ()


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


# ------------------------------------------------------------------ [jobs]

DEFAULT_CMDLINE = (r"(^|/)torchrun(\s|$)", r"torch\.distributed\.(run|launch)(\s|$)",
                   r"torch/distributed/(run|launch)\.py")
DEFAULT_ENV_KEYS = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "SLURM_JOB_ID")


@dataclass(frozen=True)
class JobRules:
    """Which processes count as job processes on a GPU-less node (gpuagent.agent.samplers.job_discovery)."""

    cmdline_regex: tuple[str, ...] = DEFAULT_CMDLINE
    env_keys: tuple[str, ...] = DEFAULT_ENV_KEYS
    env_argv0_regex: str = r"^python"   # env keys only count for these executables ('' = any)

    def __post_init__(self) -> None:
        for what, pats in (("cmdline_regex", self.cmdline_regex), ("env_argv0_regex", (self.env_argv0_regex,))):
            for pat in pats:
                try:
                    re.compile(pat)
                except re.error as exc:
                    raise ValueError(f"job rule {what} {pat!r} is not a valid regular expression ({exc})") from None


@dataclass(frozen=True)
class JobsConfig:
    """The ``[jobs]`` table: job discovery and the training-step listener (gpuagent.agent.samplers.job_steps)."""

    rules: JobRules = field(default_factory=JobRules)
    scan_interval_s: float = 5.0        # /proc scan for rule-matched processes
    end_grace_s: float = 3.0            # a job unseen this long has ended
    orphan_grace_s: float = 30.0        # a rule-matched process naming no job waits this long
    # TCP connections (network neighbours, agent/samplers/tcp_sockets.py) are read this often; ticks between reuse the
    # last rates: each sock_diag dump walks the kernel's whole connection table (~1 ms here, even when empty)
    net_interval_s: float = 5.0
    step_listener: bool = True
    step_socket: str = ""               # "" = $GPUAGENT_JOBS_SOCKET or /run/gpuagent/jobs.sock
    step_window_s: float | None = None  # None = the batch interval
    slurm: str = "auto"                 # Slurm attribution (agent/schedulers/slurm.py): auto (where scontrol and slurm.conf are), on, off
    slurm_refresh_s: float = 2.0        # how often scontrol listpids runs (in the background)
    # Kubernetes attribution (agent/schedulers/kubelet.py): the kubelet's pod-resources socket names the pod holding
    # each GPU. auto: where the socket exists; on: keep asking (and say why) even while it is absent; off.
    kubernetes: str = "auto"
    kubernetes_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    kubernetes_refresh_s: float = 10.0  # how often List is called (in the background, 2 s timeout each)


# ------------------------------------------------------------------ [probes]

# Probes that run on their schedule unless their [probes.<name>] table says enabled = false.
DEFAULT_PROBES_ENABLED = ("host", "storage", "pcie", "gpu_compute", "collective")


@dataclass(frozen=True)
class ProbeSchedule:
    name: str
    enabled: bool = True
    interval_s: float = 3600.0
    timeout_s: float = 120.0
    params: Mapping[str, Any] = field(default_factory=dict)
    force: bool = False


_PROBE_SCALARS = ("enabled", "budget_fraction", "budget_window_s", "jitter_fraction", "initial_delay_s", "force",
                  "disk_busy_percent_max", "disk_iops_max", "disk_quiet_window_s", "lock_wait_s", "lock_path")
_PER_PROBE = ("enabled", "interval_s", "timeout_s", "params", "force")


@dataclass(frozen=True)
class ProbesConfig:
    """The ``[probes]`` table, as the probe scheduler uses it (gpuagent.agent.probing.scheduler)."""

    enabled: bool = True
    schedules: tuple[ProbeSchedule, ...] = ()
    budget_fraction: float = 0.02
    budget_window_s: float = 3600.0
    jitter_fraction: float = 0.1
    initial_delay_s: float = 60.0
    force: bool = False
    disk_busy_percent_max: float = 20.0
    disk_iops_max: float = 200.0
    disk_quiet_window_s: float = 1.0
    lock_wait_s: float = 0.0
    lock_path: str = ""                 # "" = probe.lock in the agent's state dir

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any] | None = None) -> "ProbesConfig":
        """Build from the ``[probes]`` TOML table. Scalars sit at the top; ``[probes.<name>]`` sub-tables
        hold enabled/interval_s/timeout_s/force and a ``params`` table. Raises ConfigError with one
        sentence naming the key (:func:`load_config` adds the file)."""
        from gpuagent.probes import registry   # the probe modules import no torch at this point

        table = dict(table or {})
        kwargs: dict[str, Any] = {}
        per_probe: dict[str, Mapping[str, Any]] = {}
        known = set(registry.names())
        for key, value in table.items():
            if key in known:
                if not isinstance(value, Mapping):
                    raise ConfigError(f"[probes.{key}] must be a table")
                per_probe[key] = value
            elif key in _PROBE_SCALARS:
                default = getattr(cls, key)
                if isinstance(default, bool):
                    value = parse_bool(value)
                    if value is None:
                        raise ConfigError(f"probes.{key} must be true or false")
                elif isinstance(default, float):
                    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                        raise ConfigError(f"probes.{key} must be a non-negative number")
                    value = float(value)
                elif not isinstance(value, str):
                    raise ConfigError(f"probes.{key} must be a string")
                kwargs[key] = value
            else:
                raise ConfigError(f"unknown key probes.{key} (known: {', '.join(sorted(_PROBE_SCALARS))}, "
                                  f"or a probe name: {', '.join(sorted(known))})")
        if kwargs.get("budget_fraction", 0.02) > 1:
            raise ConfigError("probes.budget_fraction is a fraction of wall time and must be <= 1")
        schedules = []
        for name in registry.names():
            spec = registry.get(name)
            sub = dict(per_probe.get(name, {}))
            bad = set(sub) - set(_PER_PROBE)
            if bad:
                raise ConfigError(f"unknown key(s) {', '.join(sorted(bad))} in [probes.{name}] "
                                  f"(known: {', '.join(_PER_PROBE)})")
            try:
                params = registry.parse_params(name, sub.get("params") or {})
            except registry.ParamError as exc:
                raise ConfigError(f"[probes.{name}.params]: {exc}") from None
            params = {k: v for k, v in params.items() if k in (sub.get("params") or {})}
            flags = {}
            for key, default in (("enabled", name in DEFAULT_PROBES_ENABLED), ("force", False)):
                flags[key] = parse_bool(sub.get(key, default))
                if flags[key] is None:
                    raise ConfigError(f"[probes.{name}] {key} must be true or false")
            schedules.append(ProbeSchedule(
                name, interval_s=float(sub.get("interval_s", spec.interval_s)),
                timeout_s=float(sub.get("timeout_s", spec.timeout_s)), params=params, **flags))
        for s in schedules:
            if s.interval_s <= 0 or s.timeout_s <= 0:
                raise ConfigError(f"[probes.{s.name}] interval_s and timeout_s must be positive")
        return cls(schedules=tuple(schedules), **kwargs)

    def schedule(self, name: str) -> ProbeSchedule:
        for s in self.schedules:
            if s.name == name:
                return s
        from gpuagent.probes import registry
        spec = registry.get(name)
        return ProbeSchedule(name, interval_s=spec.interval_s, timeout_s=spec.timeout_s)


# ------------------------------------------------------------------ [fabric]

@dataclass(frozen=True)
class FabricConfig:
    """The ``[fabric]`` table: whether this node takes part in fleet pair probes (agent/probing/fabric.py), and
    where peers reach it. ``address`` wins over ``interface`` (whose first IPv4 address is used). The
    port range is this node's firewall opening, so it wins over the range the collector offers."""

    enabled: bool = False
    address: str = ""                   # the address peers connect to
    interface: str = ""                 # or: the NIC whose IPv4 address peers connect to
    port_lo: int = 0                    # the listening end binds in [port_lo, port_hi] when the
    port_hi: int = 0                    # collector's offered range (0, 0: the offer's range)


FABRIC_KEYS = {f.name for f in fields(FabricConfig)}


def _check_fabric(table: dict[str, Any], src: str) -> FabricConfig:
    out: dict[str, Any] = {}
    for k, v in table.items():
        name = f"fabric.{k}"
        if k not in FABRIC_KEYS:
            raise ConfigError(f"unknown key {name!r} (from {src}); expected one of {', '.join(sorted(FABRIC_KEYS))}.")
        if k == "enabled":
            out[k] = _as_bool(v, name, src)
        elif k in ("address", "interface"):
            out[k] = _as_str(v, name, src).strip()
        else:
            out[k] = int(_as_float(v, name, src, minimum=0, maximum=65535))
    cfg = FabricConfig(**out)
    if (cfg.port_lo == 0) != (cfg.port_hi == 0) or cfg.port_lo > cfg.port_hi:
        raise ConfigError(f"fabric.port_lo and fabric.port_hi (from {src}) must both be 0 or a range lo <= hi, "
                          f"not {cfg.port_lo}-{cfg.port_hi}.")
    if cfg.enabled and not (cfg.address or cfg.interface):
        raise ConfigError(f"[fabric] (from {src}) is enabled but names neither address nor interface; set the "
                          "address (or NIC) peers reach this node on.")
    return cfg


def fabric_address(cfg: FabricConfig) -> str:
    """The address this node declares for fabric probes: ``address``, else the first IPv4 address of
    ``interface``. Raises ConfigError when the interface does not exist or has no IPv4 address."""
    if cfg.address:
        return cfg.address
    import socket

    import psutil

    addrs = psutil.net_if_addrs().get(cfg.interface)
    if addrs is None:
        raise ConfigError(f"fabric.interface {cfg.interface!r} does not exist on this host.")
    for a in addrs:
        if a.family == socket.AF_INET:
            return a.address
    raise ConfigError(f"fabric.interface {cfg.interface!r} has no IPv4 address.")


@dataclass(frozen=True)
class AgentConfig:
    collector: CollectorConfig = field(default_factory=CollectorConfig)
    interval_s: float = 1.0             # sampling interval
    batch_interval_s: float = 5.0       # a batch is cut at least this often
    batch_max_samples: int = 50_000     # ...or when it holds this many samples
    state_dir: str = DEFAULT_STATE_DIR
    spool_max_bytes: int = DEFAULT_SPOOL_MAX_BYTES
    log_level: str = "info"
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    probes: ProbesConfig = field(default_factory=ProbesConfig.from_mapping)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    fabric: FabricConfig = field(default_factory=FabricConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    config_file: str = ""               # the file that was read ("" when none)

    @property
    def spool_dir(self) -> Path:
        return Path(self.state_dir) / "spool"

    @property
    def status_path(self) -> Path:
        return Path(self.state_dir) / "status.json"

    def resolved_token(self) -> str:
        """The bearer token, read from `token_file` when `token` is empty."""
        if self.collector.token:
            return self.collector.token
        if self.collector.token_file:
            try:
                return Path(self.collector.token_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"collector.token_file {self.collector.token_file!r} cannot be read: "
                                  f"{exc.strerror or exc}.") from None
        return ""

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: thaw(getattr(self, f.name)) for f in fields(self)
               if f.name not in ("collector", "probes", "jobs", "exporter", "fabric", "hardware")}
        for name in ("collector", "probes", "jobs", "exporter", "fabric", "hardware"):
            out[name] = thaw(asdict(getattr(self, name)))
        if out["collector"]["token"]:
            out["collector"]["token"] = "***"
        return out


# ------------------------------------------------------------------ value parsing

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


# ------------------------------------------------------------------ sources

_AGENT_KEYS = {"interval_s", "batch_interval_s", "batch_max_samples", "state_dir", "spool_max_bytes", "log_level"}
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
             ("collector", "token"): token}
    flag_names = {("collector", "address"): "--collector", ("agent", "state_dir"): "--state-dir",
                  ("agent", "interval_s"): "--interval", ("agent", "batch_interval_s"): "--batch-interval",
                  ("collector", "token"): "--token"}
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
