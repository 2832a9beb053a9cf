"""The resident daemon: a ticker that calls the samplers, cuts batches into the spool, and keeps the
sender thread and the local status file going.

The ticker runs on ``time.monotonic``: tick k is due at ``t0 + k * interval`` so the period does not
drift with the work done inside a tick; when it falls more than a whole interval behind (a stalled
host), it skips to the next due tick instead of bursting. SIGTERM/SIGINT: the current batch is cut into
the spool, the stream is half-closed, in-flight acks get a short grace, and the process exits well
within 5 s. This module never imports torch (tests check ``sys.modules`` of a running daemon).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from gpuagent import __version__
from gpuagent.agent.pipeline.batcher import Batcher, SeqAllocator
from gpuagent.agent.config import AgentConfig
from gpuagent.agent.surface.health import health_status
from gpuagent.agent.samplers.sampling import Sampler, now_ns
from gpuagent.common.sdnotify import Notifier, WatchdogPinger
from gpuagent.agent.pipeline.sender import Sender
from gpuagent.agent.pipeline.spool import Spool
from gpuagent.agent.snapshot import (GPU_METRICS, HOST_DEVICE_METRICS, HOST_METRICS, GpuStatus, HostStatus,
                                     JobStatus, JobThroughput, KubeletStatus, NodeStatus, ProbeStatus,
                                     RecentEvent, SpoolStatus, StatusSnapshot, TickCounters,
                                     gpu_instances_status, gpu_pods_status, job_gpu_instance, write_status)
from gpuagent.proto import pb

log = logging.getLogger("gpuagent.daemon")

SHUTDOWN_SEND_GRACE_S = 1.0   # in-flight acks may arrive this long after SIGTERM


class StartupError(Exception):
    """The daemon cannot start; one sentence (e.g. the state dir is not writable)."""


class Agent:
    """Everything the daemon runs, wired together. ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(self, cfg: AgentConfig, samplers: list[Sampler] | None = None,
                 node_info: pb.NodeInfo | None = None, notifier: Notifier | None = None):
        self.cfg = cfg
        self.state_dir = Path(cfg.state_dir)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.state_dir, 0o755)   # `gpuagent status` works for users who can read it
            probe = self.state_dir / ".writable"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StartupError(_state_dir_problem(self.state_dir, exc)) from None
        self._lock_fd: int | None = lock_state_dir(self.state_dir)
        self.token = cfg.resolved_token()
        self.stop_event = threading.Event()
        self.notifier = notifier or Notifier()
        self._pinger = WatchdogPinger(self.notifier)
        self.started_ns = time.time_ns()

        self.seq = SeqAllocator(self.state_dir)
        self._cut_lock = threading.Lock()    # a seq is handed out and its batch spooled as one step
        self.batcher = Batcher(self.seq, cfg.batch_interval_s, cfg.batch_max_samples)
        self.spool = Spool(cfg.spool_dir, cfg.spool_max_bytes, on_event=self._spool_event)
        self.seq.raise_floor(max(self.spool.seqs(), default=0))
        self._fresh_state = self.seq.fresh and not self.spool.seqs()

        self.samplers: list[Sampler] = list(samplers) if samplers is not None else default_samplers(cfg)
        self.node_info = node_info if node_info is not None else build_node_info(cfg, self.samplers)
        self.sender = Sender(cfg.collector, self.spool, lambda: self.node_info, token=self.token,
                             on_registered=self._on_registered, batch_interval_s=cfg.batch_interval_s)
        self.extras: list[Any] = []          # probe scheduler and other parts with stop()
        self.job_steps: Any = None           # the JobStepReceiver when listening
        self.unavailable: list[str] = []     # optional parts that could not start (for status)
        self.exporter: Any = None            # the /metrics endpoint when [exporter] listen is set
        self._sampler_errors: set[tuple[str, str]] = set()
        # The GPU sampler's events pass through the hardware sampler's XID ledger (kernel-log dedup).
        self._sinks: dict[int, Any] = {}
        ledger = next((s.xid_ledger for s in self.samplers if getattr(s, "xid_ledger", None) is not None), None)
        if ledger is not None:
            for s in self.samplers:
                if getattr(s, "name", "") == "gpu":
                    self._sinks[id(s)] = ledger.tap(self.batcher)
        self.ticks = 0
        self.late_ticks = 0
        self.skipped_ticks = 0
        self._stopped = threading.Event()

    # ---------------------------------------------------------------- wiring callbacks
    def _spool_event(self, kind: str, message: str, attrs: dict) -> None:
        self.batcher.event(kind, message, attrs=attrs)

    def _on_registered(self, resp: pb.RegisterResponse) -> None:
        """Guard against seqs the collector already holds from an earlier life of this node.

        When this state dir started empty (first install, or wiped) but the collector knows seqs up to
        N for this machine, or when the collector is ahead of our seq file, the batches spooled with a
        seq <= N are new data, not resends: move the allocator past N and renumber them before the
        sender drops everything <= N as already stored."""
        lc = resp.last_committed_seq
        fresh, self._fresh_state = self._fresh_state, False
        if lc == 0 or not (fresh or lc > self.seq.last):
            return
        with self._cut_lock:
            # After this, every batch with a seq <= lc is in the spool (a cut in progress has finished its
            # put) and every later cut gets a seq above lc, so the loop below misses none.
            self.seq.raise_floor(lc)
        moved = 0
        for old in self.spool.seqs():
            if old > lc:
                continue
            payload = self.spool.read(old)
            if payload is None:
                continue
            batch = pb.Batch.FromString(payload)
            batch.seq = self.seq.next()
            self.spool.put(batch.seq, batch.SerializeToString(), len(batch.samples.ts_ns), _n_items(batch))
            self.spool.ack(old)
            moved += 1
        log.warning("collector already holds seqs up to %d for this machine but %s started empty or behind "
                    "(reset or reinstalled?); new seqs start above %d, %d spooled batches renumbered",
                    lc, self.state_dir, lc, moved)

    # ---------------------------------------------------------------- main loop
    def install_signal_handlers(self) -> None:
        def _term(signum, frame):
            log.info("received %s: flushing and stopping", signal.Signals(signum).name)
            self.stop_event.set()

        def _hup(signum, frame):
            log.info("SIGHUP: configuration reload is not supported; restart the service to apply changes")

        signal.signal(signal.SIGTERM, _term)
        signal.signal(signal.SIGINT, _term)
        signal.signal(signal.SIGHUP, _hup)

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        cfg = self.cfg
        fp = self.node_info.fingerprint
        self.batcher.event("agent_start", f"gpuagent {__version__} started (pid {os.getpid()}, "
                           f"interval {cfg.interval_s:g} s)",
                           attrs={"version": __version__, "pid": str(os.getpid()),
                                  "interval_s": f"{cfg.interval_s:g}", "virt_type": fp.virt_type,
                                  "in_container": str(fp.in_container).lower(),
                                  # when the node booted: the hardware rules tell a reboot from an agent restart
                                  "boot_ns": str(time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME))})
        self.sender.start()
        self._start_extras()
        self.notifier.ready(f"sampling every {cfg.interval_s:g} s, collector {cfg.collector.address}")
        log.info("gpuagent %s running: %d samplers, interval %g s, batch %g s, collector %s, state %s",
                 __version__, len(self.samplers), cfg.interval_s, cfg.batch_interval_s,
                 cfg.collector.address, self.state_dir)
        interval = cfg.interval_s
        t0 = time.monotonic()
        self.batcher.start_clock(t0)     # batches are cut on the tick schedule
        k = 0
        try:
            while not self.stop_event.is_set():
                self.tick(t0 + k * interval)
                k += 1
                now = time.monotonic()
                due = t0 + k * interval
                if now - due > interval:
                    # More than a whole tick late: skip ahead instead of bursting to catch up.
                    missed = int((now - due) // interval)
                    self.skipped_ticks += missed
                    k += missed
                    due = t0 + k * interval
                elif now > due:
                    self.late_ticks += 1
                self.stop_event.wait(max(0.0, due - now))
        finally:
            self.shutdown()

    def tick(self, scheduled: float | None = None) -> None:
        """One sampling round; ``scheduled`` is the tick's planned monotonic time (batch clock)."""
        ts = now_ns()
        sinks = self._sinks
        for s in self.samplers:
            try:
                s.sample(ts, sinks.get(id(s), self.batcher))
            except Exception as exc:  # noqa: BLE001 - one broken source must not stop the others
                key = (getattr(s, "name", type(s).__name__), type(exc).__name__)
                if key not in self._sampler_errors:
                    self._sampler_errors.add(key)
                    log.exception("sampler %s failed (reported once per error type)", key[0])
                    self.batcher.event("sampler_error", f"sampler {key[0]} failed: {type(exc).__name__}: {exc}")
        self.ticks += 1
        if self.batcher.due(scheduled):
            self.flush(scheduled)
        self.write_status()
        self._pinger.maybe_ping()

    def flush(self, scheduled: float | None = None) -> None:
        with self._cut_lock:
            self._flush_locked(scheduled)

    def _flush_locked(self, scheduled: float | None) -> None:
        try:
            batch = self.batcher.cut(scheduled)
        except OSError as exc:
            # The seq could not be persisted (disk full, read-only): keep sampling into memory and retry
            # at the next cut; past 4 batches' worth, drop what is pending and count it.
            self._report_once(("seq", "write"), f"cannot persist the batch seq in {self.state_dir}: "
                              f"{exc.strerror or exc}; samples stay in memory until it can be written")
            if self.batcher.pending_samples > 4 * self.cfg.batch_max_samples:
                n = self.batcher.discard_pending()
                self.spool.count_dropped(0, n, f"dropped {n} samples held in memory: the seq cannot be persisted")
            return
        if batch is not None:
            self.spool.put(batch.seq, batch.SerializeToString(), len(batch.samples.ts_ns), _n_items(batch))

    def shutdown(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        t = time.monotonic()
        self.notifier.stopping()
        for x in self.extras:
            try:
                x.stop()
            except Exception:  # noqa: BLE001
                log.exception("stopping %r failed", x)
        if self.job_steps is not None:
            try:   # the training steps of the open window would otherwise be lost
                self.job_steps.flush_window(time.time_ns(), self.batcher)
            except Exception:  # noqa: BLE001
                log.exception("closing the job-step window failed")
        try:
            self.flush()
            self.flush()     # events the first flush raised (e.g. spool_dropped) go into one more batch
        except Exception:  # noqa: BLE001
            log.exception("final flush to the spool failed")
        self.sender.stop(grace_s=SHUTDOWN_SEND_GRACE_S)
        for s in self.samplers:
            try:
                s.close()
            except Exception:  # noqa: BLE001
                log.exception("closing sampler %s failed", getattr(s, "name", s))
        self.write_status(state="stopped")
        self.notifier.close()
        sp = self.spool.stats()
        log.info("stopped in %.2f s; %d batches (%d bytes) remain spooled for the next start",
                 time.monotonic() - t, sp["backlog_batches"], sp["backlog_bytes"])
        if self._lock_fd is not None:
            os.close(self._lock_fd)     # releases the state dir for the next agent
            self._lock_fd = None

    # ---------------------------------------------------------------- extras (probe scheduler, job listener)
    def _start_extras(self) -> None:
        """Start the optional parts (EXTRA_FACTORIES: the jobs step listener, the probe scheduler); one
        that fails is reported and the rest of the agent keeps running."""
        for factory in EXTRA_FACTORIES:
            try:
                x = factory(self)
            except Exception as exc:  # noqa: BLE001 - an optional part failing leaves the rest running
                log.exception("optional component %s failed to start", getattr(factory, "__name__", factory))
                self.batcher.event("component_error", f"{getattr(factory, '__name__', factory)}: {exc}")
                continue
            if x is not None:
                self.extras.append(x)

    # ---------------------------------------------------------------- status
    def _fingerprint_dict(self, fp) -> dict:
        """The fingerprint as JSON, converted once per fingerprint message (it is fixed at start-up, and
        converting it every tick cost more than the rest of the snapshot)."""
        from google.protobuf.json_format import MessageToDict
        cached = getattr(self, "_fp_cache", None)
        if cached is None or cached[0] is not fp:
            cached = self._fp_cache = (fp, MessageToDict(fp, preserving_proto_field_name=True,
                                                         always_print_fields_with_no_presence=True))
        return cached[1]

    def _kubelet_status(self) -> KubeletStatus | None:
        pods = next((s.pods for s in self.samplers if getattr(s, "name", "") == "gpu"
                     and getattr(s, "pods", None) is not None), None)
        return None if pods is None else KubeletStatus(**pods.state())

    def status_snapshot(self, state: str = "running") -> StatusSnapshot:
        """What this tick saw, for the status file (and anything else that reports it)."""
        b = self.batcher
        now = time.time_ns()
        node = self.node_info
        gpus = {g.index: GpuStatus(index=g.index, name=g.name, uuid=g.uuid, pci_bus_id=g.pci_bus_id or None,
                                   memory_total_bytes=g.memory_total_bytes or None) for g in node.gpus}
        host = HostStatus()
        for s in self.samplers:
            for gpu, xid in (getattr(s, "last_xid", None) or {}).items():
                gpus.setdefault(gpu, GpuStatus(index=gpu)).last_xid = xid
            if getattr(s, "name", "") == "gpu":
                for gpu, cur in list(getattr(s, "last", {}).items()):
                    g = gpus.setdefault(gpu, GpuStatus(index=gpu))
                    g.activity_source, g.instances = cur.get("activity_source"), gpu_instances_status(cur)
                    g.pods = gpu_pods_status(cur)
        latest = b.latest_values()      # one copy of every series' latest value, for the status and health
        for (metric, gpu, labels), (_ts, v) in latest.items():
            if gpu >= 0:
                # not setdefault(gpu, GpuStatus(...)): that built a GpuStatus for every GPU series of every tick
                # (thousands on an 8-GPU node with NVLink), a quarter of the agent's tick (py-spy, 2026-12-05)
                g = gpus.get(gpu)
                if g is None:
                    g = gpus[gpu] = GpuStatus(index=gpu)
                if metric in GPU_METRICS and not labels:    # per-MIG-instance GPM series stay out
                    setattr(g, GPU_METRICS[metric], v)
                elif metric == "gpu_throttle_active" and v >= 1 and labels:
                    g.throttle_reasons.append(dict(labels).get("reason", "?"))
            elif not labels and metric in HOST_METRICS:
                setattr(host, metric, v)
            elif labels and metric in HOST_DEVICE_METRICS:
                table, key = HOST_DEVICE_METRICS[metric]
                dev = dict(labels).get(key)
                if dev is not None:
                    if getattr(host, table) is None:
                        setattr(host, table, {})
                    getattr(host, table).setdefault(dev, {})[metric] = v
        if host.cpu_idle_percent is not None:
            host.cpu_busy_percent = max(0.0, 100.0 - host.cpu_idle_percent)

        # Job processes sampled in the last few ticks; forgotten a minute after that.
        horizon = now - int(3 * self.cfg.interval_s * 1e9) - 2_000_000_000
        jobs: list[JobStatus] = []
        for j, step in b.recent_jobs(horizon, horizon - 60_000_000_000):
            row = JobStatus(**{k: j.get(k) for k in _JOB_SAMPLE_KEYS}, gpu_instance=job_gpu_instance(j))
            if step:
                for k in _STEP_KEYS:
                    setattr(row, k, step.get(k))
            jobs.append(row)
        throughput = self.job_steps.live() if self.job_steps is not None else []
        for live in throughput:
            row = next((j for j in jobs if j.job_id == live["job_id"]), None)
            if row is None:
                row = JobStatus(job_id=live["job_id"], job_name=live.get("job_name"))
                jobs.append(row)
            for k in (*_STEP_KEYS, "ranks"):
                setattr(row, k, live.get(k))

        unavailable = list(self.unavailable)
        for s in self.samplers:
            unavailable.extend(getattr(s, "unavailable", None) or [])
            nv = getattr(s, "nvml", None)
            unavailable.extend(getattr(nv, "unavailable", None) or [])
        return StatusSnapshot(
            state=state, pid=os.getpid(), agent_version=__version__, started_ns=self.started_ns, updated_ns=now,
            interval_s=self.cfg.interval_s, batch_interval_s=self.cfg.batch_interval_s,
            state_dir=str(self.state_dir), config_file=self.cfg.config_file,
            node=NodeStatus(hostname=node.hostname, machine_id=node.machine_id, node_id=self.sender.state.node_id,
                            labels=dict(node.labels), cpu_model=node.cpu_model, kernel=node.kernel,
                            driver_version=node.driver_version, gpu_count=len(node.gpus)),
            fingerprint=self._fingerprint_dict(node.fingerprint),
            host=host,
            gpus=[gpus[i] for i in sorted(gpus)],
            jobs=jobs,
            job_throughput=[JobThroughput(**t) for t in throughput],
            probes={name: ProbeStatus(**p) for name, p in b.last_probes().items()},
            collector=self.sender.link(),
            spool=SpoolStatus(**self.spool.stats()),
            unavailable=sorted(set(map(str, unavailable))),
            recent_events=[RecentEvent(**e) for e in b.last_events(10)],
            counters=TickCounters(ticks=self.ticks, late_ticks=self.late_ticks, skipped_ticks=self.skipped_ticks,
                                  batches=b.total_batches, samples=b.total_samples),
            torch_loaded="torch" in sys.modules,
            fabric=next((x.fabric_status() for x in self.extras if hasattr(x, "fabric_status")), None),
            kubelet=self._kubelet_status(),
            health=health_status(b, gpus, jobs, now, latest_values=latest),
        )

    def _report_once(self, key: tuple[str, str], message: str) -> None:
        if key not in self._sampler_errors:
            self._sampler_errors.add(key)
            log.error(message + " (reported once)")
            self.batcher.event("agent_error", message)

    def write_status(self, state: str = "running") -> None:
        try:
            snap = self.status_snapshot(state)
            if self.exporter is not None:
                self.exporter.update(snap)   # scrapes see this tick from now on, the same one as the file
            write_status(self.state_dir, snap)
        except Exception:  # noqa: BLE001 - status is best effort; the data path matters more
            if ("status", "write") not in self._sampler_errors:
                self._sampler_errors.add(("status", "write"))
                log.exception("writing the status file failed (reported once)")


def _state_dir_problem(state_dir: Path, exc: OSError) -> str:
    """One sentence for a state dir the agent cannot write."""
    if exc.errno == errno.EROFS:
        return f"state dir {state_dir} is on a read-only file system (pass --state-dir or GPUAGENT_STATE_DIR)."
    if exc.errno in (errno.ENOTDIR, errno.EEXIST) and not state_dir.is_dir():
        return f"state dir {state_dir} is not a directory (pass --state-dir or GPUAGENT_STATE_DIR)."
    if isinstance(exc, PermissionError):
        if os.geteuid() != 0:
            return (f"state dir {state_dir} is not writable by this user (run as root, or pass --state-dir or "
                    "GPUAGENT_STATE_DIR).")
        return f"state dir {state_dir} is not writable, even for root (pass --state-dir or GPUAGENT_STATE_DIR)."
    return f"state dir {state_dir} cannot be used: {exc.strerror or exc}."


LOCK_FILE = "agent.lock"


def lock_state_dir(state_dir: Path) -> int:
    """Hold ``<state_dir>/agent.lock`` (flock) for the agent's life; returns the open fd.

    Two agents on one state dir would hand out the same seq numbers from one seq file, and the collector
    would then drop the second batch of each pair as a resend: the second agent must not start."""
    path = state_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise StartupError(_state_dir_problem(state_dir, exc)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StartupError(f"another gpuagent (pid {holder}) already runs with state dir {state_dir}; stop it "
                           "first or give this one another --state-dir.") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


_JOB_SAMPLE_KEYS = ("job_id", "job_name", "source", "pid", "rank", "gpu", "gpu_util_percent", "cpu_percent",
                    "rss_bytes")
_STEP_KEYS = ("steps_per_s", "samples_per_s", "tokens_per_s", "step_time_p50_s", "data_wait_fraction",
              "model_flops_per_s", "mfu")


def _n_items(batch: pb.Batch) -> int:
    return len(batch.probe_results) + len(batch.job_samples) + len(batch.job_steps) + len(batch.events)


# -------------------------------------------------------------------- data sources and node info

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
        msg = f"{exc}; training-step tracking is off (set [jobs] step_socket or GPUAGENT_JOBS_SOCKET)"
        log.warning(msg)
        agent.batcher.event("component_unavailable", msg, attrs={"component": "job_steps"})
        agent.unavailable.append(msg)
        return None
    agent.samplers.append(receiver)
    agent.job_steps = receiver
    for s in agent.samplers:   # tracked processes are jobs too, under the id the receiver uses
        if hasattr(s, "tracked_pids"):
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


def setup_logging(level: str = "info") -> None:
    # Under systemd, journald adds timestamps; in a terminal they help.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt, stream=sys.stderr)


def run_agent(cfg: AgentConfig) -> None:
    """Entry point of `gpuagent run`: build the agent, install signal handlers, run until stopped."""
    setup_logging(cfg.log_level)
    agent = Agent(cfg)
    agent.install_signal_handlers()
    agent.run()
