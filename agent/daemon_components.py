"""What the daemon wires together: its samplers, the node info it registers with, and its optional parts.

Apart from the Agent (daemon.py), which runs them: this is the one place that knows which sampler, scheduler
integration, listener, probe scheduler, exporter, fabric client and path-probe responder a node gets from its config, each built
lazily so a part that is off costs no import. The Agent calls them through gpuagent.agent.daemon, which
re-exports every name here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from gpuagent.agent.config import AgentConfig
from gpuagent.agent.samplers.sampling import Sampler
from gpuagent.proto import pb

if TYPE_CHECKING:
    from gpuagent.agent.daemon import Agent

log = logging.getLogger("gpuagent.daemon")


def default_samplers(cfg: AgentConfig) -> list[Sampler]:
    """The node's data sources: host (psutil + /proc), GPU (NVML, one choke point), job discovery."""
    from gpuagent.agent.samplers.gpu import GpuSampler
    from gpuagent.agent.samplers.host import HostSampler
    from gpuagent.agent.samplers.job_discovery import JobDiscovery
    from gpuagent.agent.schedulers.kubelet import PodResources, socket_present
    from gpuagent.agent.schedulers.slurm import SlurmAttribution, slurm_present

    gpu = GpuSampler()
    jobs = cfg.jobs
    discovery = JobDiscovery(gpu_sampler=gpu, rules=jobs.rules, scan_interval_s=jobs.scan_interval_s,
                             end_grace_s=jobs.end_grace_s, orphan_grace_s=jobs.orphan_grace_s,
                             net_interval_s=jobs.net_interval_s)
    if jobs.slurm == "on" or (jobs.slurm == "auto" and slurm_present()):
        discovery.slurm = SlurmAttribution(jobs.slurm_refresh_s).start()
    if jobs.kubernetes == "on" or (jobs.kubernetes == "auto" and socket_present(jobs.kubernetes_socket)):
        gpu.pods = discovery.pods = PodResources(jobs.kubernetes_socket, jobs.kubernetes_refresh_s).start()
    samplers: list[Sampler] = [HostSampler(), gpu, discovery]
    hw = hardware_sampler(cfg, gpu)
    if hw is not None:
        samplers.append(hw)
    return samplers


def hardware_sampler(cfg: AgentConfig, gpu: Any = None) -> Sampler | None:
    """The host's hardware-health sources (agent/samplers/hw_host.py: kernel log, InfiniBand, Ethernet) as one sampler
    whose sources each fail alone; NVML's XIDs (from ``gpu``, through an XidLedger the Agent taps onto the GPU
    sampler's sink) deduplicate the kernel log's copies. None when ``[hardware]`` turns every source off."""
    from gpuagent.agent.samplers.hw_host import HwHostSampler, XidLedger, bus_key

    hw = cfg.hardware
    if not (hw.kmsg or hw.infiniband or hw.ethernet):
        return None
    buses: dict[str, int] = {}
    asked: list[bool] = []

    def gpu_buses() -> dict[str, int]:
        """bus key -> NVML index, asked of NVML once (when the first kernel-log record needs it)."""
        if not asked and gpu is not None:
            asked.append(True)
            try:
                buses.update({bus_key(g.get("pci_bus_id")): int(g["index"]) for g in gpu.gpu_inventory()})
            except Exception as exc:  # noqa: BLE001 - no NVML: kernel-log events keep gpu -1
                log.info("GPU bus ids unknown for kernel-log events (%s: %s)", type(exc).__name__, exc)
            buses.pop("", None)
        return buses

    def bus_for_gpu(index: int) -> str | None:
        return next((b for b, i in gpu_buses().items() if i == index and b), None)

    ledger = XidLedger(bus_for_gpu)
    sampler = HwHostSampler(sys_root=hw.sys_root, kmsg_path=hw.kmsg_path, state_dir=cfg.state_dir, kmsg=hw.kmsg,
                            infiniband=hw.infiniband, ethernet=hw.ethernet, sysfs_every_s=hw.sysfs_interval_s,
                            nvml_seen=ledger.seen, gpu_for_bus=lambda b: gpu_buses().get(bus_key(b)),
                            ethernet_speed_mbps=dict(hw.ethernet_speed_mbps))
    sampler.xid_ledger = ledger
    return sampler


def build_node_info(cfg: AgentConfig, samplers: list[Sampler]) -> pb.NodeInfo:
    """Who this node is, sent with Register: inventory, GPUs and the virtualization fingerprint,
    taken once at start."""
    from gpuagent.agent.samplers.nodeinfo import build_node_info as build
    gpu = next((s for s in samplers if getattr(s, "name", "") == "gpu"), None)
    info = build(labels=dict(cfg.labels), gpu_sampler=gpu)
    if cfg.fabric.enabled:
        from gpuagent.agent.config import fabric_address
        info.fabric_address = fabric_address(cfg.fabric)
    return info


def bind_path_responder(agent: Agent) -> Any:
    """The path-probe echo responder (gpuagent.agent.probing.paths), bound on the fabric address before
    Register so that its port goes out as ``NodeInfo.path_port``; the daemon starts it with the sender and
    closes it at shutdown. None when ``[fabric]`` or its ``paths`` is off; a port that cannot be bound
    leaves path_port 0 (peers then do not probe this node) and is reported once."""
    fab, info = agent.cfg.fabric, agent.node_info
    if not (fab.enabled and fab.paths and info.fabric_address):
        return None
    from gpuagent.agent.probing.paths import PathError, PathResponder
    try:
        responder = PathResponder(info.fabric_address, fab.path_port, (fab.port_lo, fab.port_hi))
    except PathError as exc:
        return _unavailable(agent, "path_responder", f"{exc}; peers cannot probe paths to this node (change "
                            "[fabric] path_port or port_lo-port_hi)")
    info.path_port = responder.port
    return responder


def _unavailable(agent: Agent, component: str, msg: str) -> None:
    """A part that could not start: logged, sent as an event, listed under Unavailable; the rest runs on."""
    log.warning(msg)
    agent.batcher.event("component_unavailable", msg, attrs={"component": component})
    agent.unavailable.append(msg)
    return None


def _peak_flops_lookup(samplers: list[Any]):
    """(pid, local_rank) -> the dense BF16 peak in FLOP/s of the GPU the rank uses, for MFU.

    On a node whose GPUs are all one model that model's peak; on a mixed node the GPU whose index is
    the rank's local rank (the usual one-GPU-per-local-rank launch); None when the model is not in
    gpuagent.common.gpu_peaks or there is no GPU."""
    from gpuagent.common.gpu_peaks import dense_bf16_peak
    gpu = next((s for s in samplers if getattr(s, "name", "") == "gpu"), None)
    names = [g["name"] for g in gpu.gpu_inventory()] if gpu is not None else []
    peaks = [(p[1] * 1e12 if p else None) for p in map(dense_bf16_peak, names)]
    uniform = peaks[0] if peaks and all(p == peaks[0] for p in peaks) else None

    def lookup(_pid: int, local_rank: int) -> float | None:
        if uniform is not None:
            return uniform
        return peaks[local_rank] if 0 <= local_rank < len(peaks) else None
    return lookup


def start_job_step_receiver(agent: Agent) -> None:
    """The opt-in training-step tracker's listener (gpuagent.agent.samplers.job_steps); a sampler once started.

    ``[jobs] step_socket`` (or $GPUAGENT_JOBS_SOCKET, default /run/gpuagent/jobs.sock) is where it
    listens; ``[jobs] step_listener = false`` turns it off. A socket that cannot be created (e.g. not
    root and /run/gpuagent not writable) leaves the rest of the agent running and is reported once."""
    jobs = agent.cfg.jobs
    if not jobs.step_listener:
        return None
    from gpuagent.agent.samplers.job_steps import JobSocketError, JobStepReceiver
    window_s = jobs.step_window_s if jobs.step_window_s is not None else agent.cfg.batch_interval_s
    receiver = JobStepReceiver(socket_path=jobs.step_socket or None, window_s=window_s,
                               peak_flops=_peak_flops_lookup(agent.samplers))
    try:
        receiver.start()
    except JobSocketError as exc:
        return _unavailable(agent, "job_steps", f"{exc}; training-step tracking is off (set [jobs] step_socket "
                            "or GPUAGENT_JOBS_SOCKET)")
    agent.samplers.append(receiver)
    agent.job_steps = receiver
    for s in agent.samplers:   # tracked processes are jobs too, under the id the receiver uses
        if hasattr(s, "tracked_pids") and hasattr(s, "slurm_job_of"):   # job discovery, not the receiver
            s.tracked_pids = receiver.tracked_pids
            receiver.scheduler_job = s.slurm_job_of    # and a tracker without a job env takes Slurm's name
    log.info("listening for training-step trackers on %s", receiver.socket_path)
    return None       # closed with the samplers


# Callables taking the Agent and returning an object with stop() (or None when not applicable).
def start_probe_scheduler(agent: Agent) -> Any:
    """Active probes on their schedule (gpuagent.agent.probing.scheduler; [probes] config table)."""
    from gpuagent.agent.probing.scheduler import start_probe_scheduler as start
    return start(agent)


def start_exporter(agent: Agent) -> Any:
    """The Prometheus /metrics endpoint (gpuagent.agent.surface.exporter) when ``[exporter] listen`` is set; an
    address that cannot be bound leaves the rest of the agent running and is reported once."""
    listen = agent.cfg.exporter.listen
    if not listen:
        return None
    from gpuagent.agent.surface.exporter import Exporter
    try:
        exp = Exporter(listen, agent.cfg.exporter).start()
    except OSError as exc:
        msg = (f"the Prometheus exporter cannot listen on {listen}: {exc.strerror or exc}; /metrics is off "
               "(change [exporter] listen)")
        log.warning(msg)
        agent.batcher.event("component_unavailable", msg, attrs={"component": "exporter"})
        agent.unavailable.append(msg)
        return None
    agent.exporter = exp
    return exp


def start_fabric(agent: Agent) -> Any:
    """Fleet pair probes on the collector's assignments (gpuagent.agent.probing.fabric; [fabric] config table)."""
    from gpuagent.agent.probing.fabric import start_fabric_client
    return start_fabric_client(agent)


EXTRA_FACTORIES: list[Callable[[Agent], Any]] = [start_job_step_receiver, start_probe_scheduler, start_exporter,
                                                  start_fabric]
