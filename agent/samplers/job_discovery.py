"""Job discovery: which processes belong to which training job, and what each one uses.

Where processes come from:
- on a GPU node, NVML's per-GPU process lists (GpuSampler.processes(): pid, GPU memory, SM util);
- on a node without GPUs (or without NVML), a /proc scan every ``scan_interval_s`` for processes that
  match :class:`JobRules`: a command-line regex (default: torchrun / torch.distributed.run / launch) or,
  for python processes, one of the env keys (default TORCHELASTIC_RUN_ID, RANK, LOCAL_RANK, SLURM_JOB_ID).

Identity: the shared rule in :mod:`gpuagent.common.job_identity` (the step tracker uses the same one, so
``job_samples`` and ``job_steps`` join on ``job_id``): GPUAGENT_JOB_ID, Slurm, torchelastic run id, k8s
pod uid, container id (not the agent's own container), torchelastic ``none-<ppid>``, else ``pid:<pid>``
(source ``rule`` when a rule matched it, ``process`` for a GPU process). Cached per (pid, start time);
attrs carry ``container_id`` / ``pod_uid`` when the cgroup shows them.

Which processes of a job are sampled: on a GPU node, the NVML processes plus the rule-matched
processes of the jobs that hold a GPU (launcher, data-loader workers); on a GPU-less node, every
rule-matched process; on both, every process that sends steps through ``gpuagent.jobs`` (the daemon
sets :attr:`JobDiscovery.tracked_pids`; such a pid gets the step receiver's job id). A launcher that has
no job env of its own (torchrun's elastic agent) takes the job id of the workers it started, and keeps
it after they exit; a rule-matched process that names no job waits ``orphan_grace_s`` before it counts
as a ``pid:<pid>`` job of its own.

Each tick emits one ``sink.job_sample(...)`` per (process, GPU) with the JobSample proto field names;
CPU % (of one core) and I/O rates are deltas of /proc/<pid>/stat and /proc/<pid>/io. When NVML has
no per-process utilization (MIG) the sample carries 0 with attrs ``gpu_util_known=false`` and the tick
does not count toward the job's mean; a MIG process carries ``mig_gpu_instance``.

Lifecycle events (the ``gpuagent.jobs`` tracker and the analyzer rely on these):
- ``job_start``: a job id seen for the first time; attrs {job_id, job_name, source, started_ns}.
- ``job_end``: a job id unseen for ``end_grace_s``; **value = mean GPU utilization over its life**
  (per tick, the mean over the GPUs it used of its processes' SM util; NaN when no GPU utilization was
  ever sampled, i.e. a CPU-only job, stored as NULL);
  attrs {job_id, job_name, source, duration_s, started_ns, first_seen_ns, last_seen_ns, gpus,
  gpu_util_samples}.

When a job ran (all wall-clock ns): ``started_ns`` is the earliest start time of any process seen in the
job (/proc/<pid>/stat starttime on the boot clock, 10 ms resolution), so a job found by a scan up to
``scan_interval_s`` after it began still starts when it began; the first tick that saw it when no
start time could be read (a GPU process whose /proc entry is not readable). ``last_seen_ns`` is the
last tick at which any of its processes was alive: once found, a process is checked every tick, so the
job really ended between ``last_seen_ns`` and the next tick (one sampling interval later).
``duration_s`` = last_seen_ns - started_ns. ``first_seen_ns`` is the first tick that saw the job.

Passive progress and contention, per job and tick, for jobs that never use the tracker (samples with
label ``job_id``; the analyzer's noisy_neighbor_variance co_tenant/hypervisor components read them):
- ``job_progress_percent`` (label ``source``): the mean GPU utilization of the job's GPUs where NVML
  knows it (``gpu_util``), else the CPU share of the job's processes and their descendants in % of
  one core (``cpu_share``), so a CPU job that loses CPU to someone else shows a drop;
- ``job_neighbour_cpu_percent``: CPU (% of one core) used by every process that is not the job's (not
  in its process trees, not in its container or pod cgroup) and not this agent's;
- ``job_neighbour_process_cpu_percent`` (labels ``comm``, ``pid``): the top five of those processes
  that used at least ``NEIGHBOUR_NAMED_MIN`` %, so the flag can name them;
- ``job_neighbour_process_io_bytes_per_s`` (labels ``comm``, ``pid``): the top five commands outside the
  job by storage I/O (``read_bytes`` + ``write_bytes`` of /proc/<pid>/io: what reached the block layer, not
  page-cache hits) that moved at least ``NEIGHBOUR_IO_NAMED_MIN`` bytes/s, so a disk neighbour that takes
  little CPU (a backup, a checkpoint copy, fio) is seen too. /proc/<pid>/io is read only for processes that
  ran in the tick (a process that used no CPU issued no I/O) and needs root or the same user.
- ``job_neighbour_process_net_bytes_per_s`` (labels ``comm``, ``pid``): the top five commands outside the
  job by TCP bytes sent (acked) and received on connections that leave the node (agent/samplers/tcp_sockets.py:
  sock_diag every ``net_interval_s``; a socket's owner, the oldest process holding it, from /proc/<pid>/fd,
  looked up only for sockets that moved bytes and have no live owner known), at least
  ``NEIGHBOUR_NET_NAMED_MIN`` bytes/s, so a network neighbour (a backup upload, a dataset sync, another
  job's traffic) is seen;
- the job's own connections off the node: ``job_tcp_bytes_per_s`` (sent and received), ``job_tcp_srtt_ms``
  (the mean smoothed RTT of those that sent in the interval) and ``job_tcp_busy_send_rate_bytes_per_s`` (the
  bytes they sent per second of having data to send held up by the network, tcp_info busy time less the
  receive-window-limited time, summed over the connections). The job's "network pressure": a neighbour that
  fills a link the job uses makes its packets queue (RTT up) and, where the job itself filled the link so
  that its queue was full already, cuts what it gets while it has data to send (busy rate down), while the
  job moves no more bytes than before; the job's own heavier traffic raises its RTT too, but its bytes with
  it. Connections inside the node (loopback) count for none of these series.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gpuagent.agent.config import JobRules
from gpuagent.agent.samplers.job_contention import (NEIGHBOUR_IO_NAMED_MIN, NEIGHBOUR_NET_NAMED_MIN,  # noqa: F401
                                                     JobContentionMixin, _NetRead)
from gpuagent.agent.samplers.job_naming import _POD_KEYS, JobNamingMixin, identify, slurm_identity
from gpuagent.agent.samplers.job_procfs import JobProcfsMixin, _Proc
from gpuagent.agent.schedulers.slurm import PENDING, SlurmAttribution
from gpuagent.common.job_identity import own_container_id


RECHECK_S = 2.0

__all__ = ["JobDiscovery", "JobRules", "identify", "slurm_identity", "NEIGHBOUR_IO_NAMED_MIN",
           "NEIGHBOUR_NET_NAMED_MIN"]


@dataclass
class _Job:
    job_id: str
    job_name: str
    source: str
    first_ns: int       # first tick that saw the job
    last_ns: int        # last tick at which one of its processes was alive
    start_ns: int       # earliest process start time (first_ns when none could be read)
    util_sum: float = 0.0
    util_n: int = 0
    pids: set[int] = field(default_factory=set)
    gpus: set[int] = field(default_factory=set)


class JobDiscovery(JobProcfsMixin, JobNamingMixin, JobContentionMixin):
    """Sampler (agent/samplers/sampling.py) that emits JobSamples and job_start/job_end events."""

    name = "jobs"

    def __init__(self, gpu_sampler: Any = None, rules: JobRules | None = None, proc_root: str = "/proc",
                 scan_interval_s: float = 5.0, end_grace_s: float = 3.0, orphan_grace_s: float = 30.0,
                 net_interval_s: float = 5.0) -> None:
        self.gpu = gpu_sampler
        self.rules = rules or JobRules()
        self._cmd_res = [re.compile(p) for p in self.rules.cmdline_regex]
        self._argv0_re = re.compile(self.rules.env_argv0_regex) if self.rules.env_argv0_regex else None
        self.proc = proc_root.rstrip("/")
        self.scan_interval_ns = int(scan_interval_s * 1e9)
        self.end_grace_ns = int(end_grace_s * 1e9)
        self.orphan_grace_ns = int(orphan_grace_s * 1e9)
        self.net_interval_s = net_interval_s
        self._first_seen: dict[int, int] = {}
        self._procs: dict[int, _Proc] = {}
        self._rule_pids: set[int] = set()
        self._last_scan_ns: int | None = None
        self._jobs: dict[str, _Job] = {}
        self._self_pid = os.getpid()
        self._boot_wall_ns = self._boot_wall_clock()
        self._own_container = own_container_id()   # the agent's own container is not a job boundary
        # Set by the daemon to JobStepReceiver.tracked_pids (pid -> job_id of processes sending steps).
        self.tracked_pids: Callable[[], dict[int, str]] | None = None
        # Every process's last (start, cpu ticks, time) for the neighbour CPU shares.
        self._all_cpu: dict[int, tuple[int, int, float]] = {}
        # Its last (start, storage bytes read + written) for the neighbour I/O rates.
        self._all_io: dict[int, tuple[int, int]] = {}
        # TCP connections: (bytes, bytes acked, busy us) at the last read by socket cookie; owner pid by
        # inode; inodes whose owner was not found, with when to look again; when sock_diag may be asked
        # again after it failed.
        self._sock_bytes: dict[int, tuple[int, int, int]] = {}
        self._sock_owner: dict[int, tuple[int, int]] = {}         # inode -> (pid, start time ticks)
        self._sock_unowned: dict[int, tuple[float, float]] = {}   # inode -> (look again at, delay)
        self._walk_from: tuple[int, int] | None = None           # (start, pid) an owner walk goes on from
        self._walk_left = 0                                      # processes left in the owner walk's round
        self._net_retry_t = 0.0
        self._net_failed = False
        self._net_last: tuple[float, _NetRead] | None = None
        self._last_contention_t: float | None = None
        # Set by the daemon where Slurm runs: names a Slurm job's processes without their environment.
        self.slurm: SlurmAttribution | None = None
        self.pods: Any = None        # agent/kubelet.PodResources (also read by the GPU sampler), or None

    def _proc_for(self, pid: int, rule_check: bool, force: bool = False) -> _Proc | None:
        st = self._stat(pid)
        if st is None:
            self._procs.pop(pid, None)
            return None
        cached = self._procs.get(pid)
        if force:
            rule_check = False
        now = time.monotonic_ns()
        same = cached is not None and cached.start == st[1]
        # a cached "not a job" verdict only holds for the rule check: a GPU or tracked process is one.
        # A process first seen between fork and exec showed its parent's command line and environment
        # (torchrun's workers look like the launcher then), so every verdict is taken once more after
        # RECHECK_S; the start time alone does not change at exec.
        if same and (cached.ident is not None or rule_check) and not (cached.recheck_ns and now >= cached.recheck_ns):
            cached.stat = st
            return cached
        ident = None
        matched = False
        cg: str | None = None
        slurm = None
        if self.slurm is not None:
            cg = (self._read_bytes(pid, "cgroup") or b"").decode("utf-8", "replace")
            slurm = self.slurm.lookup(pid, cg, self._start_ticks_wall_ns(st[1]))
            if slurm == PENDING:   # Slurm's details come on a later tick: no id yet rather than a wrong one
                p = _Proc(start=st[1], ident=None, stat=st, recheck_ns=now)
                if same:
                    p.prev_t, p.prev_cpu, p.prev_io, p.adopted = (cached.prev_t, cached.prev_cpu, cached.prev_io,
                                                                  cached.adopted)
                self._procs[pid] = p
                return p
        if rule_check:
            cmd = (self._read_bytes(pid, "cmdline") or b"").replace(b"\0", b" ").decode("utf-8", "replace").strip()
            if slurm is not None or any(r.search(cmd) for r in self._cmd_res):
                matched = True      # a Slurm job's processes are job processes whatever they run
            argv0 = os.path.basename(cmd.split(" ", 1)[0]) if cmd else ""
            env = None
            if not matched and cmd and (self._argv0_re is None or self._argv0_re.search(argv0)):
                env = self._environ(pid)
                matched = any(k in env for k in self.rules.env_keys)
            if matched:
                env = env if env is not None else self._environ(pid)
                if cg is None:
                    cg = (self._read_bytes(pid, "cgroup") or b"").decode("utf-8", "replace")
                ident = identify(pid, env, cg, st[2], True, self._own_container)
        else:
            env = self._environ(pid)
            if cg is None:
                cg = (self._read_bytes(pid, "cgroup") or b"").decode("utf-8", "replace")
            ident = identify(pid, env, cg, st[2], False, self._own_container)
        if ident is not None and slurm is not None and ident["source"] != "explicit":
            ident = slurm_identity(ident, *slurm)
        p = _Proc(start=st[1], ident=ident, stat=st, recheck_ns=0 if same else now + int(RECHECK_S * 1e9))
        if same:   # keep the CPU/IO baselines and a launcher's adopted identity
            p.prev_t, p.prev_cpu, p.prev_io, p.adopted = cached.prev_t, cached.prev_cpu, cached.prev_io, cached.adopted
        self._procs[pid] = p
        return p

    def _scan(self) -> None:
        try:
            names = os.listdir(self.proc)
        except OSError:
            return
        live = set()
        now = time.monotonic_ns()
        for n in names:
            if not n.isdigit():
                continue
            pid = int(n)
            if pid == self._self_pid:
                continue
            live.add(pid)
            p = self._procs.get(pid)
            if p is None or (p.recheck_ns and now >= p.recheck_ns):
                p = self._proc_for(pid, rule_check=True)
            if p is not None and p.ident is not None:
                self._rule_pids.add(pid)
            else:
                self._rule_pids.discard(pid)
        for pid in [p for p in self._procs if p not in live]:
            del self._procs[pid]
        self._rule_pids &= live

    # ------------------------------------------------------------------ the tick
    def _gpu_mode(self) -> bool:
        return self.gpu is not None and self.gpu.nvml.available and self.gpu.nvml.device_count > 0

    def sample(self, ts_ns: int, sink) -> None:
        t = ts_ns / 1e9
        rows: list[tuple[int, int, float, float, int]] = []   # (pid, gpu, gpu_util, gpu_mem, mig gi)
        gpu_mode = self._gpu_mode()
        if gpu_mode:
            for p in self.gpu.processes():
                rows.append((p["pid"], p["gpu"], p["gpu_util_percent"], p["gpu_memory_bytes"],
                             p.get("gpu_instance_id", -1)))
        if self._last_scan_ns is None or ts_ns - self._last_scan_ns >= self.scan_interval_ns:
            self._last_scan_ns = ts_ns
            self._scan()
        # Processes that report steps through gpuagent.jobs are jobs even when no rule matches them,
        # under the job id the step receiver uses (so job_samples and job_steps join).
        tracked = self.tracked_pids() if self.tracked_pids is not None else {}
        listed = {r[0] for r in rows}
        slurm_pids = self.slurm.pids() if self.slurm is not None else set()   # slurmd's list, no /proc scan wait
        rows += [(pid, -1, -1.0, 0.0, -1) for pid in sorted(self._rule_pids | set(tracked) | slurm_pids)
                 if pid not in listed]

        # Identity of every candidate first, so that a launcher (torchrun's elastic agent has no job
        # env of its own) can take the job id of the workers it started.
        resolved: list[tuple[int, int, float, float, int, _Proc | None, dict[str, Any]]] = []
        for pid, gpu, gutil, gmem, gi in rows:
            p = self._proc_for(pid, rule_check=gpu < 0, force=pid in tracked)
            if p is None and gpu < 0:
                self._rule_pids.discard(pid)
                continue
            if p is not None and p.ident is None:
                continue
            ident = p.ident if p is not None else identify(pid, {}, "", 0, False)
            # A tracker's own id wins (its environment may have been set at run time), except its bare pid:
            # Slurm's name for the process is better than that, and the receiver takes it up too.
            if pid in tracked and tracked[pid] != ident["job_id"] and not (
                    ident["source"] == "slurm" and tracked[pid] == f"pid:{pid}"):
                ident = dict(ident, job_id=tracked[pid], source="tracker")
            resolved.append((pid, gpu, gutil, gmem, gi, p, ident))
        child_job = {}
        for pid, _g, _u, _m, _gi, p, ident in resolved:
            if p is not None and p.stat is not None and not ident["job_id"].startswith("pid:"):
                child_job.setdefault(p.stat[2], ident)
        for i, (pid, gpu, gutil, gmem, gi, p, ident) in enumerate(resolved):
            if not ident["job_id"].startswith("pid:"):
                continue
            if pid in child_job:
                parent_of = child_job[pid]
                adopted = dict(ident, job_id=parent_of["job_id"], source=parent_of["source"],
                               job_name=ident["job_name"] or parent_of["job_name"],
                               world_size=parent_of["world_size"])
                if p is not None:
                    p.adopted = adopted     # stays with the job after its workers exit
                resolved[i] = (pid, gpu, gutil, gmem, gi, p, adopted)
            elif p is not None and p.adopted is not None:
                resolved[i] = (pid, gpu, gutil, gmem, gi, p, p.adopted)
        # A process that matched a rule but names no job (typically a launcher whose workers have not
        # started yet) waits ``orphan_grace_s`` before it counts as a job of its own, so a torchrun
        # launch does not leave a one-second "pid:<launcher>" job behind.
        for pid in [pid for pid in self._first_seen if pid not in self._procs]:
            del self._first_seen[pid]
        kept = []
        for r in resolved:
            if r[6]["job_id"].startswith("pid:") and r[6]["source"] == "rule" and r[1] < 0:
                first = self._first_seen.setdefault(r[0], ts_ns)
                if ts_ns - first < self.orphan_grace_ns:
                    continue
            kept.append(r)
        resolved = kept
        if gpu_mode:
            # A GPU job's launcher and data-loader workers use no GPU, but their CPU, memory and I/O
            # are part of the job (an input-bound job shows there): keep the non-GPU processes of jobs
            # that hold a GPU now, and no others.
            gpu_jobs = {r[6]["job_id"] for r in resolved if r[1] >= 0}
            resolved = [r for r in resolved if r[1] >= 0 or r[6]["job_id"] in gpu_jobs]

        if self.pods is not None:
            resolved = self._with_pods(resolved)

        seen_jobs: dict[str, list[tuple[int, float]]] = {}
        seen_pids: dict[str, set[int]] = {}
        per_pid_done: dict[int, tuple[float, float, float, float]] = {}
        for pid, gpu, gutil, gmem, gi, p, ident in resolved:
            if pid not in per_pid_done:
                per_pid_done[pid] = self._usage(pid, p, t)
            cpu, rss, rd, wr = per_pid_done[pid]
            attrs = dict(ident["attrs"])
            if gpu >= 0 and gutil < 0:
                attrs["gpu_util_known"] = "false"   # sent as 0; NVML had no per-process figure
            if gpu >= 0 and gmem < 0:
                attrs["gpu_memory_known"] = "false"   # sent as 0; NVML_VALUE_NOT_AVAILABLE for this process
            if gi >= 0:
                attrs["mig_gpu_instance"] = str(gi)
            sink.job_sample(ts_ns=ts_ns, job_id=ident["job_id"], job_name=ident["job_name"],
                            source=ident["source"], pid=pid, rank=ident["rank"],
                            local_rank=ident["local_rank"], world_size=ident["world_size"], gpu=gpu,
                            gpu_util_percent=max(0.0, gutil), gpu_memory_bytes=max(0.0, gmem), cpu_percent=cpu,
                            rss_bytes=rss, read_bytes_per_s=rd, write_bytes_per_s=wr,
                            attrs=attrs)
            seen_jobs.setdefault(ident["job_id"], []).append((gpu, gutil))
            job = self._jobs.get(ident["job_id"])
            proc_start = self._start_wall_ns(p)
            if proc_start is not None:
                proc_start = min(proc_start, ts_ns)   # a clock step must not start a job in the future
            if job is None:
                job = self._jobs[ident["job_id"]] = _Job(ident["job_id"], ident["job_name"], ident["source"],
                                                         ts_ns, ts_ns, ts_ns if proc_start is None else proc_start)
                sink.event("job_start", f"job {job.job_id} started ({job.source})", ts_ns=ts_ns,
                           attrs={"job_id": job.job_id, "job_name": job.job_name, "source": job.source,
                                  "started_ns": str(job.start_ns),
                                  **{k: v for k, v in ident["attrs"].items()
                                     if k.startswith("slurm_") or k in _POD_KEYS}})
            elif proc_start is not None and proc_start < job.start_ns:
                job.start_ns = proc_start   # e.g. the launcher, adopted after its workers were found
            job.last_ns = ts_ns
            seen_pids.setdefault(job.job_id, set()).add(pid)
            if gpu >= 0:
                job.gpus.add(gpu)
        for job_id, pids in seen_pids.items():
            self._jobs[job_id].pids = pids
        gpu_progress: dict[str, float] = {}
        for job_id, pairs in seen_jobs.items():
            per_gpu: dict[int, float] = {}
            for gpu, util in pairs:
                if gpu >= 0 and util >= 0:
                    per_gpu[gpu] = per_gpu.get(gpu, 0.0) + util
            if per_gpu:
                job = self._jobs[job_id]
                gpu_progress[job_id] = sum(min(100.0, u) for u in per_gpu.values()) / len(per_gpu)
                job.util_sum += gpu_progress[job_id]
                job.util_n += 1
        self._contention(ts_ns, t, sink, seen_pids, gpu_progress,
                         {r[6]["job_id"]: r[6]["attrs"] for r in resolved})
        self._end_jobs(ts_ns, sink)

    def _end_jobs(self, ts_ns: int, sink) -> None:
        for job_id in [j for j, job in self._jobs.items() if ts_ns - job.last_ns >= self.end_grace_ns]:
            job = self._jobs.pop(job_id)
            # No GPU utilization was ever sampled (a CPU-only job): the mean is unknown, not 0 %. NaN
            # travels in the proto double and the collector stores it as NULL.
            mean = job.util_sum / job.util_n if job.util_n else float("nan")
            dur = (job.last_ns - job.start_ns) / 1e9
            util_text = f"mean GPU util {mean:.1f} %" if job.util_n else "no GPU utilization sampled"
            sink.event("job_end", f"job {job_id} ended after {dur:.0f} s, {util_text}",
                       value=mean, ts_ns=ts_ns,
                       attrs={"job_id": job_id, "job_name": job.job_name, "source": job.source,
                              "duration_s": f"{dur:.3f}", "started_ns": str(job.start_ns),
                              "first_seen_ns": str(job.first_ns), "last_seen_ns": str(job.last_ns), "gpus": ",".join(map(str, sorted(job.gpus))),
                              "gpu_util_samples": str(job.util_n)})

    def is_job_process(self, pid: int) -> bool | None:
        """Whether discovery's current verdict on ``pid`` is "a job process"; None when it has not seen it."""
        p = self._procs.get(pid)
        return None if p is None else p.ident is not None

    def active_jobs(self) -> list[dict[str, Any]]:
        """Jobs currently seen (for `gpuagent status`)."""
        return [{"job_id": j.job_id, "job_name": j.job_name, "source": j.source, "pids": sorted(j.pids),
                 "gpus": sorted(j.gpus), "started_ns": j.start_ns,
                 "first_seen_ns": j.first_ns, "last_seen_ns": j.last_ns,
                 "mean_gpu_util_percent": (j.util_sum / j.util_n) if j.util_n else None}
                for j in self._jobs.values()]

    def close(self) -> None:
        if self.slurm is not None:
            self.slurm.stop()
        if self.pods is not None:
            self.pods.stop()
