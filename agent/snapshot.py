"""What the daemon publishes: the status file, written every tick, read by ``gpuagent status``.

:class:`StatusSnapshot` is the one description of what the agent's latest tick saw (spool, collector
link, last samples per GPU and host, probe results, jobs, hardware health from agent/surface/health.py); the
daemon fills it, :func:`write_status`
stores it as ``<state_dir>/status.json`` atomically (temp + rename, mode 0644, no fsync: it is
rewritten every tick and only describes the present), and :func:`read_status` reads it back, so
``gpuagent status`` works for any user who can read the state dir, without talking to the daemon.
A value the tick did not see (a metric NVML does not report) is left out of the file, not written
as null.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Mapping

from gpuagent.common.atomic_file import atomic_write
from gpuagent.common.typed_json import Damaged, load_typed

STATUS_FILE = "status.json"
STATUS_VERSION = 1
STALE_MIN_S = 10.0     # a status older than max(3 x interval + 5 s, this) is stale


class StatusError(Exception):
    """`gpuagent status` cannot show a live status; the message is one sentence."""


# -------------------------------------------------------------------- the snapshot

# Batcher metric name -> GpuStatus field.
GPU_METRICS = {"gpu_util_percent": "util_percent", "gpu_mem_util_percent": "mem_util_percent",
               "gpu_memory_used_bytes": "memory_used_bytes", "gpu_memory_total_bytes": "memory_total_bytes",
               "gpu_temperature_celsius": "temperature_celsius", "gpu_power_watts": "power_watts",
               "gpu_power_limit_watts": "power_limit_watts", "gpu_sm_clock_mhz": "sm_clock_mhz",
               "gpu_mem_clock_mhz": "mem_clock_mhz", "gpu_energy_consumed_mj": "energy_consumed_mj",
               "gpu_pcie_replay_count": "pcie_replay_count", "gpu_pcie_tx_bytes_per_s": "pcie_tx_bytes_per_s",
               "gpu_pcie_rx_bytes_per_s": "pcie_rx_bytes_per_s", "gpu_nvlink_tx_bytes_per_s": "nvlink_tx_bytes_per_s",
               "gpu_nvlink_rx_bytes_per_s": "nvlink_rx_bytes_per_s",
               "gpu_ecc_corrected_total": "ecc_corrected_total", "gpu_ecc_uncorrected_total": "ecc_uncorrected_total",
               "gpu_sm_active_percent": "sm_active_percent", "gpu_sm_occupancy_percent": "sm_occupancy_percent",
               "gpu_tensor_active_percent": "tensor_active_percent", "gpu_dram_active_percent": "dram_active_percent"}
# The values behind dcgm-exporter's other default metrics (GpuSampler._dcgm_values; docs/EXPORTER.md).
GPU_METRICS.update({
    "gpu_memory_temperature_celsius": "memory_temperature_celsius",
    "gpu_encoder_util_percent": "encoder_util_percent", "gpu_decoder_util_percent": "decoder_util_percent",
    "gpu_memory_reserved_bytes": "memory_reserved_bytes", "gpu_memory_free_bytes": "memory_free_bytes",
    "gpu_remapped_rows_correctable_total": "remapped_rows_correctable_total",
    "gpu_remapped_rows_uncorrectable_total": "remapped_rows_uncorrectable_total",
    "gpu_remapped_rows_pending": "remapped_rows_pending", "gpu_row_remap_failure": "row_remap_failure",
    "gpu_vgpu_license_status": "vgpu_license_status",
    "gpu_nvlink_raw_tx_bytes_per_s": "nvlink_raw_tx_bytes_per_s",
    "gpu_nvlink_raw_rx_bytes_per_s": "nvlink_raw_rx_bytes_per_s",
    "gpu_gr_engine_active_percent": "gr_engine_active_percent"})
# The unlabelled hardware-health readings (issue 23; docs/HEALTH.md). The labelled ones (retired pages by
# cause, NVLink errors per link, clock-event durations per reason) are set by agent/surface/health.py.
GPU_METRICS.update({
    "gpu_ecc_aggregate_corrected_total": "ecc_aggregate_corrected_total",
    "gpu_ecc_aggregate_uncorrected_total": "ecc_aggregate_uncorrected_total",
    "gpu_retired_pages_pending": "retired_pages_pending",
    "gpu_pcie_link_gen": "pcie_link_gen", "gpu_pcie_link_width": "pcie_link_width",
    "gpu_pcie_link_gen_max": "pcie_link_gen_max", "gpu_pcie_link_width_max": "pcie_link_width_max"})
# Host metrics (unlabelled batcher series) shown by status; HostStatus has one field each.
HOST_METRICS = ("cpu_idle_percent", "cpu_steal_percent", "cpu_iowait_percent", "load1", "mem_used_bytes",
                "mem_total_bytes", "mem_available_bytes", "cpu_user_percent", "cpu_system_percent", "load5",
                "load15", "swap_used_bytes", "context_switches_per_s", "interrupts_per_s",
                "psi_cpu_some_avg10_percent", "psi_io_some_avg10_percent", "psi_io_full_avg10_percent",
                "psi_memory_some_avg10_percent", "psi_memory_full_avg10_percent", "psi_cpu_some_stall_percent",
                "psi_io_some_stall_percent", "psi_memory_some_stall_percent")
# Labelled host series kept per device: batcher metric -> (HostStatus dict field, label key).
HOST_DEVICE_METRICS = {m: ("disks", "device") for m in (
    "disk_read_bytes_per_s", "disk_write_bytes_per_s", "disk_read_iops", "disk_write_iops",
    "disk_read_latency_ms", "disk_write_latency_ms", "disk_busy_percent")}
HOST_DEVICE_METRICS.update({m: ("nics", "nic") for m in (
    "net_rx_bytes_per_s", "net_tx_bytes_per_s", "net_rx_errors_per_s", "net_tx_errors_per_s",
    "net_rx_drops_per_s")})


@dataclass
class NodeStatus:
    hostname: str = ""
    machine_id: str = ""
    node_id: str = ""                   # "" until the collector registered the node
    labels: dict[str, str] = field(default_factory=dict)
    cpu_model: str = ""
    kernel: str = ""
    driver_version: str = ""
    gpu_count: int = 0


@dataclass
class HostStatus:
    cpu_idle_percent: float | None = None
    cpu_steal_percent: float | None = None
    cpu_iowait_percent: float | None = None
    load1: float | None = None
    mem_used_bytes: float | None = None
    mem_total_bytes: float | None = None
    mem_available_bytes: float | None = None
    cpu_busy_percent: float | None = None    # 100 - idle
    cpu_user_percent: float | None = None
    cpu_system_percent: float | None = None
    load5: float | None = None
    load15: float | None = None
    swap_used_bytes: float | None = None
    context_switches_per_s: float | None = None
    interrupts_per_s: float | None = None
    psi_cpu_some_avg10_percent: float | None = None
    psi_io_some_avg10_percent: float | None = None
    psi_io_full_avg10_percent: float | None = None
    psi_memory_some_avg10_percent: float | None = None
    psi_memory_full_avg10_percent: float | None = None
    psi_cpu_some_stall_percent: float | None = None
    psi_io_some_stall_percent: float | None = None
    psi_memory_some_stall_percent: float | None = None
    disks: dict[str, dict[str, float]] | None = None   # device -> batcher metric -> value
    nics: dict[str, dict[str, float]] | None = None    # interface -> batcher metric -> value

    def seen(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self))


@dataclass
class GpuInstanceStatus:
    """One MIG GPU instance: NVML's instance id, DCGM's profile name, its framebuffer and its GPM values."""
    gpu_instance_id: int
    profile: str = ""                   # e.g. "3g.40gb" ("" when NVML gave no profile info)
    memory_used_bytes: float | None = None
    memory_free_bytes: float | None = None
    memory_total_bytes: float | None = None
    memory_reserved_bytes: float | None = None
    gr_engine_active_percent: float | None = None   # GPM, only for instances that ran work this tick
    sm_active_percent: float | None = None
    sm_occupancy_percent: float | None = None
    tensor_active_percent: float | None = None
    dram_active_percent: float | None = None


@dataclass
class GpuPodStatus:
    """A container the kubelet says holds this GPU, or one of its MIG GPU instances (agent/schedulers/kubelet.py)."""
    namespace: str
    pod: str
    container: str
    gpu_instance: int | None = None     # the MIG GPU instance it holds (None: the whole GPU)


def gpu_pods_status(cur: Mapping[str, Any]) -> list[GpuPodStatus] | None:
    """GpuSampler.last[gpu]'s ``pods`` as status rows (None: no pod attribution on this node)."""
    rows = cur.get("pods")
    return None if rows is None else [GpuPodStatus(**r) for r in rows]


def gpu_instances_status(cur: Mapping[str, Any]) -> list[GpuInstanceStatus] | None:
    """GpuSampler.last[gpu]'s ``mig_instances`` as status rows (None: not a MIG GPU)."""
    rows = cur.get("mig_instances")
    if not rows:
        return None
    names = {f.name for f in fields(GpuInstanceStatus)}
    return [GpuInstanceStatus(**{k: v for k, v in r.items() if k in names}) for r in rows]


@dataclass
class GpuStatus:
    index: int
    name: str | None = None             # None: the GPU was sampled but is not in the start-up inventory
    uuid: str | None = None
    memory_total_bytes: float | None = None
    throttle_reasons: list[str] = field(default_factory=list)
    util_percent: float | None = None
    mem_util_percent: float | None = None
    memory_used_bytes: float | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    sm_clock_mhz: float | None = None
    pci_bus_id: str | None = None
    mem_clock_mhz: float | None = None
    energy_consumed_mj: float | None = None   # since the driver was loaded
    pcie_replay_count: float | None = None
    pcie_tx_bytes_per_s: float | None = None
    pcie_rx_bytes_per_s: float | None = None
    nvlink_tx_bytes_per_s: float | None = None
    nvlink_rx_bytes_per_s: float | None = None
    ecc_corrected_total: float | None = None
    ecc_uncorrected_total: float | None = None
    last_xid: int | None = None               # the latest XID event this agent saw on the GPU
    sm_active_percent: float | None = None    # GPM: share of SMs busy (None: no GPM on this GPU)
    sm_occupancy_percent: float | None = None
    tensor_active_percent: float | None = None
    dram_active_percent: float | None = None
    activity_source: str | None = None        # "gpm", "gpm per GPU instance" or "utilization counter"
    # for dcgm-exporter's default metrics (docs/EXPORTER.md)
    memory_temperature_celsius: float | None = None
    encoder_util_percent: float | None = None
    decoder_util_percent: float | None = None
    memory_reserved_bytes: float | None = None      # nvmlMemory_v2 .reserved
    memory_free_bytes: float | None = None          # nvmlMemory_v2 .free
    remapped_rows_correctable_total: float | None = None
    remapped_rows_uncorrectable_total: float | None = None
    remapped_rows_pending: float | None = None
    row_remap_failure: float | None = None
    vgpu_license_status: float | None = None        # 1 licensed, 0 not (DCGM's rule)
    nvlink_raw_tx_bytes_per_s: float | None = None  # NVLink data + protocol headers, all links
    nvlink_raw_rx_bytes_per_s: float | None = None
    gr_engine_active_percent: float | None = None   # GPM GRAPHICS_UTIL
    instances: list[GpuInstanceStatus] | None = None   # MIG GPU instances (None: MIG off)
    # hardware health (issue 23; docs/HEALTH.md, docs/EXPORTER.md)
    ecc_aggregate_corrected_total: float | None = None     # since the GPU was made (InfoROM)
    ecc_aggregate_uncorrected_total: float | None = None
    retired_pages_sbe_total: float | None = None           # gpu_retired_pages_total{cause=single_bit_ecc}
    retired_pages_dbe_total: float | None = None           # {cause=double_bit_ecc}
    retired_pages_pending: float | None = None             # 1 / 0
    pcie_link_gen: float | None = None
    pcie_link_width: float | None = None
    pcie_link_gen_max: float | None = None
    pcie_link_width_max: float | None = None
    nvlink_errors: dict[str, dict[str, float]] | None = None   # link -> counter (crc_flit, ...) -> total
    nvlink_link_up: dict[str, float] | None = None             # link -> 1 up / 0 down (links that exist)
    clock_event_seconds: dict[str, float] | None = None        # reason (hw_slowdown, ...) -> seconds total
    pods: list[GpuPodStatus] | None = None    # Kubernetes: the containers holding it (None: not attributed)


@dataclass
class JobStatus:
    """One job process (from job discovery) or a job known only from its step tracker."""
    job_id: str
    job_name: str | None = None
    source: str | None = None
    pid: int | None = None
    rank: int | None = None
    gpu: int | None = None
    gpu_util_percent: float | None = None
    cpu_percent: float | None = None
    rss_bytes: float | None = None
    steps_per_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time_p50_s: float | None = None
    data_wait_fraction: float | None = None
    ranks: list[int] | None = None
    model_flops_per_s: float | None = None    # declared model FLOPs x step (or token) rate
    mfu: float | None = None                  # model FLOPs utilization, a fraction of the GPU's dense BF16 peak
    gpu_instance: int | None = None           # the MIG GPU instance the process runs in (None: MIG off)
    # Who and where, as the scheduler names it (None: not known here). Slurm: from scontrol show job, as
    # squeue shows them; Kubernetes: the container the kubelet says holds the job's GPU.
    user: str | None = None
    partition: str | None = None
    account: str | None = None
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None


# JobStatus field <- job sample attr (job discovery's names: agent/samplers/job_naming.py).
JOB_SCHEDULER_ATTRS = {"user": "slurm_user", "partition": "slurm_partition", "account": "slurm_account",
                       "namespace": "namespace", "pod": "pod", "container": "container"}


def job_scheduler_fields(sample: Mapping[str, Any]) -> dict[str, str]:
    """The JobStatus scheduler fields a job sample's attrs carry (the ones it does not carry are left out)."""
    attrs = sample.get("attrs") or {}
    return {field: attrs[attr] for field, attr in JOB_SCHEDULER_ATTRS.items() if attrs.get(attr)}


def job_gpu_instance(sample: Mapping[str, Any]) -> int | None:
    """The MIG GPU instance of a job sample (job discovery's ``mig_gpu_instance`` attr), for the exporter."""
    gi = (sample.get("attrs") or {}).get("mig_gpu_instance")
    return int(gi) if gi not in (None, "") else None


@dataclass
class JobThroughput:
    """A tracked job's last closed step window, over all its ranks on this node."""
    job_id: str
    job_name: str
    ranks: list[int]
    steps_per_s: float
    samples_per_s: float
    tokens_per_s: float
    step_time_p50_s: float
    data_wait_fraction: float           # -1: not measured
    ts_ns: int
    model_flops_per_s: float | None = None    # None: the job declared no FLOPs
    mfu: float | None = None                  # None: no FLOPs declared, or the GPU's peak is not known


@dataclass
class ProbeStatus:
    probe: str
    gpu: int
    status: str
    reason: str
    metrics: dict[str, float]
    ended_ns: int


@dataclass
class LinkState:
    """The collector link, as the sender keeps it."""
    collector: str = ""
    connected: bool = False
    node_id: str = ""
    since_ns: int = 0                 # when the current state (connected or not) began
    last_ack_ns: int = 0
    last_ack_seq: int = 0
    highest_committed_seq: int = 0
    sent_batches: int = 0
    acked_batches: int = 0
    duplicate_acks: int = 0
    reconnects: int = 0
    consecutive_failures: int = 0
    last_error: str = ""
    last_error_ns: int = 0
    next_retry_ns: int = 0
    in_flight: int = 0                # batches sent and not yet acked


@dataclass
class SpoolStatus:
    backlog_batches: int = 0
    backlog_bytes: int = 0
    backlog_samples: int = 0
    oldest_seq: int = 0
    newest_seq: int = 0
    max_bytes: int = 0
    dropped_batches: int = 0
    dropped_samples: int = 0
    corrupt_files: int = 0
    rejected_batches: int = 0
    rejected_samples: int = 0
    write_errors: int = 0


@dataclass
class RecentEvent:
    ts_ns: int
    kind: str
    gpu: int
    message: str
    value: float | None = None
    attrs: dict[str, str] | None = None


@dataclass
class HealthReading:
    """One health-relevant series' latest value (the batcher's metric name, docs/METRICS.md)."""
    metric: str
    gpu: int                                 # -1: a host series (InfiniBand port, Ethernet interface)
    value: float
    labels: dict[str, str] | None = None


@dataclass
class HealthEvent:
    """A hardware event (xid, sxid, nvidia_driver_error, gpu_lost) or an agent_start within the window."""
    ts_ns: int
    kind: str
    gpu: int
    value: float
    message: str
    attrs: dict[str, str] | None = None


@dataclass
class HardwareFault:
    """One fault the hardware-fault rules (common/hardware_faults.py) found on this node."""
    component: str                           # xid, ecc, row_remap, retired_pages, nvlink, pcie_link, clocks, ib_port, eth_link
    severity: str                            # critical | warning
    subject: str                             # "GPU 3", "mlx5_0 port 1", "eth0"
    gpu: int                                 # -1 when not a GPU
    sentence: str                            # what is wrong and the action, one line
    action: str
    source: str                              # the cited source of the rule
    evidence: dict[str, Any] | None = None
    rule: str = ""                           # the rule's name (xid_79, row_remap_pending, ...)


@dataclass
class HealthStatus:
    """The node's hardware health as of ``checked_ns`` (agent/surface/health.py; docs/HEALTH.md)."""
    checked_ns: int
    window_s: float                          # the span the counter rules looked back over
    faults: list[HardwareFault]
    readings: list[HealthReading]
    events: list[HealthEvent]
    checked: list[str]                       # what was read: "GPUs (NVML)", "InfiniBand", "Ethernet", "kernel log"
    not_checked: list[str]                   # one sentence each: what could not be read and why
    error: str | None = None                 # the rules themselves failed (one sentence); faults is then empty


@dataclass
class TickCounters:
    ticks: int = 0
    late_ticks: int = 0
    skipped_ticks: int = 0
    batches: int = 0
    samples: int = 0


@dataclass
class FabricRun:
    """One fabric run this node took part in, as its end measured it: a net_pair, or a collective group."""
    pair_id: str                        # the pair's id, or the group's
    peer: str                           # the other end's node id (a group: the other members, comma-separated)
    role: str                           # connect (node_a: sends first) | listen | "rank N" in a group
    status: str
    reason: str
    ended_ns: int
    send_gbits_per_s: float | None = None
    recv_gbits_per_s: float | None = None
    rtt_p50_us: float | None = None
    busbw_gbytes_per_s: float | None = None     # a collective group's all-reduce bus bandwidth


@dataclass
class FabricStatus:
    """The fabric client ([fabric] enabled): its assignments stream and its last runs, newest first."""
    address: str                        # where peers reach this node
    stream_open: bool                   # an Assignments call is in progress (the collector sends only offers)
    stream_error: str                   # why the last call ended ("" while none failed)
    last_message_ns: int                # when the collector last sent an assignment (0: never)
    counts: dict[str, int]              # accepted, busy, cancelled, result:<status>
    recent: list[FabricRun]
    paths: dict[str, Any] | None = None     # path probes' pinglist, counters, last summary (None: off)


@dataclass
class KubeletStatus:
    """The kubelet's pod-resources API as the agent last asked it (agent/schedulers/kubelet.py)."""
    socket: str
    error: str | None = None                 # why the last List call failed (None: it answered)
    last_answer_age_s: float | None = None   # seconds since the last answer (None: never answered)
    devices_held: int = 0                    # GPUs and MIG devices allocated to containers in that answer
    devices_allocatable: int | None = None   # GPUs and MIG devices the kubelet can hand out (None: not known)


@dataclass
class StatusSnapshot:
    state: str                          # running | stopped
    pid: int
    agent_version: str
    started_ns: int
    updated_ns: int
    interval_s: float
    batch_interval_s: float
    state_dir: str
    config_file: str
    node: NodeStatus
    fingerprint: dict[str, Any]         # the Register fingerprint message as JSON (its proto field names)
    host: HostStatus
    gpus: list[GpuStatus]
    jobs: list[JobStatus]
    job_throughput: list[JobThroughput]
    probes: dict[str, ProbeStatus]      # "<probe>" or "<probe>[gpu<i>]" -> last result
    collector: LinkState
    spool: SpoolStatus
    unavailable: list[str]
    recent_events: list[RecentEvent]
    counters: TickCounters
    torch_loaded: bool
    version: int = STATUS_VERSION
    fabric: FabricStatus | None = None  # None: [fabric] is off
    health: HealthStatus | None = None  # None: written by a gpuagent without hardware health
    kubelet: KubeletStatus | None = None    # None: no Kubernetes attribution on this node

    def to_json(self) -> dict[str, Any]:
        """The status file's JSON object (``version`` first; unseen values left out)."""
        return _dump(self)

    @classmethod
    def from_json(cls, data: Any, path: str | os.PathLike = STATUS_FILE) -> "StatusSnapshot":
        """The snapshot in a decoded status file; StatusError (one sentence) for another version or a
        damaged file."""
        if not isinstance(data, Mapping):
            raise StatusError(f"{path} is not a gpuagent status file (no pid and updated_ns); is --state-dir right?")
        version = data.get("version")
        if version != STATUS_VERSION:
            raise StatusError(f"{path} has status format {version!r} and this gpuagent reads format {STATUS_VERSION} "
                              f"(the running agent is another gpuagent version; restart it after upgrading).")
        try:
            return load_typed(cls, data, "")
        except Damaged as exc:
            raise StatusError(f"{path} is damaged: {exc} (the agent rewrites it every tick; if this stays, "
                              f"restart the agent).") from None


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _dataclass_as_dict(value: Any) -> dict[str, Any]:
    """json.dumps' ``default``: one dataclass level at a time, so the C encoder walks everything else
    (the status file is written every tick; a recursive _dump was a fifth of the tick's CPU)."""
    names = _FIELD_NAMES.get(type(value))
    if names is None:
        if not is_dataclass(value):
            raise TypeError(f"{type(value).__name__} is not JSON serializable")
        names = tuple(f.name for f in fields(value))
        names = _FIELD_NAMES[type(value)] = tuple(sorted(names, key=lambda n: n != "version"))   # version first
    return {n: v for n in names if (v := getattr(value, n)) is not None}


def status_json_bytes(snapshot: "StatusSnapshot") -> bytes:
    """The status file's bytes: the same object as ``snapshot.to_json()``, compact."""
    return json.dumps(snapshot, default=_dataclass_as_dict, separators=(",", ":")).encode()


def _dump(value: Any) -> Any:
    if is_dataclass(value):
        return {k: _dump(v) for k, v in _dataclass_as_dict(value).items()}
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value


# -------------------------------------------------------------------- the file

def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True    # alive, owned by another user (e.g. the daemon runs as root)
    # A zombie still answers kill(0); it is not running.
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def stale_after_s(interval_s: float) -> float:
    return max(3 * interval_s + 5.0, STALE_MIN_S)


def read_status(state_dir: str | os.PathLike, now_ns: int | None = None, check_live: bool = True) -> StatusSnapshot:
    """The daemon's last status; raises StatusError (one sentence) when it is absent, dead, stale, damaged
    or from another gpuagent version."""
    path = Path(state_dir) / STATUS_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise StatusError(f"gpuagent is not running: no status file at {path} "
                          f"(start it with `gpuagent run --state-dir {state_dir}` or `systemctl start gpuagent`).") from None
    except PermissionError:
        raise StatusError(f"cannot read {path}: permission denied (run as a user who can read the state dir).") from None
    except (OSError, ValueError) as exc:
        raise StatusError(f"cannot read {path}: {exc}.") from None
    if not (isinstance(data, dict) and isinstance(data.get("pid"), int) and isinstance(data.get("updated_ns"), int)):
        raise StatusError(f"{path} is not a gpuagent status file (no pid and updated_ns); is --state-dir right?")
    if check_live:
        # Liveness first: a dead or hung agent is the news, whatever else its last file says.
        now_ns = now_ns if now_ns is not None else time.time_ns()
        pid = int(data["pid"])
        age = (now_ns - int(data["updated_ns"])) / 1e9
        if data.get("state") == "stopped" or not pid_alive(pid):
            raise StatusError(f"gpuagent is not running: pid {pid} from {path} is gone "
                              f"(last update {age:.0f} s ago).")
        interval = data.get("interval_s", 1.0)
        limit = stale_after_s(float(interval) if isinstance(interval, (int, float)) else 1.0)
        if age > limit:
            raise StatusError(f"gpuagent status is stale: {path} was last updated {age:.0f} s ago "
                              f"(more than {limit:.0f} s; pid {pid} may be hung).")
    return StatusSnapshot.from_json(data, path)


def write_status(state_dir: str | os.PathLike, snapshot: StatusSnapshot) -> None:
    atomic_write(Path(state_dir) / STATUS_FILE, status_json_bytes(snapshot),
                 fsync=False, mode=0o644)
