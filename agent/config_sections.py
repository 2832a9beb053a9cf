"""The agent config's dataclasses, one per TOML table, and the defaults they start from.

What the stages import (samplers take JobRules and HardwareConfig, the sender CollectorConfig, the
exporter ExporterConfig, the probe scheduler ProbesConfig): the types alone, apart from how a file, the
environment and flags are read into them (config.py, config_tables.py). Re-exported by gpuagent.agent.config.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from gpuagent.agent.config_values import ConfigError, thaw
from gpuagent.common.parse import parse_bool

DEFAULT_STATE_DIR = "/var/lib/gpuagent"
DEFAULT_COLLECTOR = "127.0.0.1:7443"
DEFAULT_SPOOL_MAX_BYTES = 512 * 1024 * 1024

# Labels that the collector stores in their own `nodes` columns (see collector/store/migrations/001_initial.sql).
KNOWN_LABELS = ("pool", "provider", "region", "price_per_gpu_hour")


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
    """The ``[fabric]`` table: whether this node takes part in fleet pair probes (agent/probing/fabric.py) and
    path probes (agent/probing/paths.py), and where peers reach it. ``address`` wins over ``interface``
    (whose first IPv4 address is used). The port range is this node's firewall opening, so it wins over the
    range the collector offers."""

    enabled: bool = False
    address: str = ""                   # the address peers connect to
    interface: str = ""                 # or: the NIC whose IPv4 address peers connect to
    port_lo: int = 0                    # the listening end binds in [port_lo, port_hi] when the
    port_hi: int = 0                    # collector's offered range (0, 0: the offer's range)
    paths: bool = True                  # path probes (agent/probing/paths.py): a UDP echo responder and the
    #                                     probes of the collector's pinglists, when enabled
    path_port: int = 0                  # the responder's UDP port; 0: the first free one in [port_lo, port_hi],
    #                                     or any free port when there is no range


FABRIC_KEYS = {f.name for f in fields(FabricConfig)}


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
    # Resolution (docs/RESOLUTION.md): series no rule reads per sample travel as summaries of this many
    # seconds (0: every sample raw); their samples stay raw_keep_s in memory for the collector to ask for.
    summary_interval_s: float = 60.0
    raw_keep_s: float = 900.0
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
