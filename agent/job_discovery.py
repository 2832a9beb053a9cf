"""Job discovery: which processes belong to which training job, and what each one uses.

Where processes come from:
- on a GPU node, NVML's per-GPU process lists (GpuSampler.processes(): pid, GPU memory, SM util);
- on a node without GPUs (or without NVML), a /proc scan every ``scan_interval_s`` for processes that
  match :class:`JobRules`: a command-line regex (default: torchrun / torch.distributed.run / launch) or,
  for python processes, one of the env keys (default TORCHELASTIC_RUN_ID, RANK, LOCAL_RANK, SLURM_JOB_ID).

Identity, from /proc/<pid>/environ and /proc/<pid>/cgroup, cached per (pid, start time):
``slurm:<SLURM_JOB_ID>`` > ``torchelastic:<TORCHELASTIC_RUN_ID>`` (a run id of ``none`` gets
``@MASTER_ADDR:MASTER_PORT`` appended so concurrent jobs stay apart) > ``k8s:<pod uid>`` >
``container:<id 12>`` > ``pid:<session id>`` (rule match) or ``pid:<pid>`` (a GPU process). Ranks come
from RANK/LOCAL_RANK/WORLD_SIZE, else SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS.

Each tick emits one ``sink.job_sample(...)`` per (process, GPU) with the JobSample proto field names;
CPU % (of one core) and I/O rates are deltas of /proc/<pid>/stat and /proc/<pid>/io.

Lifecycle events (the ``gpuagent.jobs`` tracker and the analyzer rely on these):
- ``job_start``: a job id seen for the first time; attrs {job_id, job_name, source}.
- ``job_end``: a job id unseen for ``end_grace_s``; **value = mean GPU utilization over its life**
  (per tick, the mean over the GPUs it used of its processes' SM util; 0 when it used no GPU);
  attrs {job_id, job_name, source, duration_s, gpus, gpu_util_samples}.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

DEFAULT_CMDLINE = (r"(^|/)torchrun(\s|$)", r"torch\.distributed\.(run|launch)(\s|$)",
                   r"torch/distributed/(run|launch)\.py")
DEFAULT_ENV_KEYS = ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "SLURM_JOB_ID")
_ENV_WANTED = ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
               "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "HOSTNAME", "GPUAGENT_JOB_NAME")

_POD_RE = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CID_RE = re.compile(r"(?:docker|cri-containerd|crio|libpod|containerd)?[-/:]?([0-9a-f]{64})")
_RUNTIME_RE = ((re.compile(r"libpod"), "podman"), (re.compile(r"cri-containerd|containerd"), "containerd"),
               (re.compile(r"crio"), "cri-o"), (re.compile(r"docker"), "docker"))


@dataclass(frozen=True)
class JobRules:
    """Which processes count as job processes on a GPU-less node."""

    cmdline_regex: tuple[str, ...] = DEFAULT_CMDLINE
    env_keys: tuple[str, ...] = DEFAULT_ENV_KEYS
    env_argv0_regex: str = r"^python"   # env keys only count for these executables ('' = any)


def parse_cgroup(text: str) -> dict[str, str]:
    """{pod_uid?, container_id?, container_runtime?} from /proc/<pid>/cgroup content."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        m = _POD_RE.search(path)
        if m and "pod_uid" not in out:
            out["pod_uid"] = m.group(1).replace("_", "-")
        ids = _CID_RE.findall(path)
        if ids and "container_id" not in out:
            out["container_id"] = ids[-1]
            for pat, name in _RUNTIME_RE:
                if pat.search(path):
                    out["container_runtime"] = name
                    break
    return out


def _int(v: str | None, default: int) -> int:
    try:
        return int(v) if v not in (None, "") else default
    except ValueError:
        return default


def identify(pid: int, env: dict[str, str], cgroup: dict[str, str], sid: int, matched_by_rule: bool) -> dict[str, Any]:
    """The job a process belongs to (JobSample identity fields + attrs)."""
    attrs: dict[str, str] = {}
    if "container_id" in cgroup:
        attrs["container_id"] = cgroup["container_id"][:12]
    if "pod_uid" in cgroup:
        attrs["pod_uid"] = cgroup["pod_uid"]
    rank = _int(env.get("RANK"), _int(env.get("SLURM_PROCID"), -1))
    local_rank = _int(env.get("LOCAL_RANK"), _int(env.get("SLURM_LOCALID"), -1))
    world = _int(env.get("WORLD_SIZE"), _int(env.get("SLURM_NTASKS"), 0))
    name = env.get("GPUAGENT_JOB_NAME", "")
    if env.get("SLURM_JOB_ID"):
        job_id, source = f"slurm:{env['SLURM_JOB_ID']}", "slurm"
        name = name or env.get("SLURM_JOB_NAME", "")
    elif env.get("TORCHELASTIC_RUN_ID"):
        run = env["TORCHELASTIC_RUN_ID"]
        if run == "none":
            run += f"@{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
        job_id, source = f"torchelastic:{run}", "torchelastic"
    elif "pod_uid" in cgroup:
        job_id, source = f"k8s:{cgroup['pod_uid']}", "kubernetes"
        name = name or env.get("HOSTNAME", "")
    elif "container_id" in cgroup:
        job_id, source = f"container:{cgroup['container_id'][:12]}", "container"
    elif matched_by_rule:
        job_id, source = f"pid:{sid}", "rule"
    else:
        job_id, source = f"pid:{pid}", "process"
    return {"job_id": job_id, "job_name": name, "source": source, "rank": rank,
            "local_rank": local_rank, "world_size": world, "attrs": attrs}


@dataclass
class _Proc:
    start: int
    ident: dict[str, Any] | None            # None: not a job process
    prev_t: float | None = None
    prev_cpu: int = 0
    prev_io: tuple[int, int] | None = None


@dataclass
class _Job:
    job_id: str
    job_name: str
    source: str
    first_ns: int
    last_ns: int
    util_sum: float = 0.0
    util_n: int = 0
    pids: set[int] = field(default_factory=set)
    gpus: set[int] = field(default_factory=set)


class JobDiscovery:
    """Sampler (agent/sampling.py) that emits JobSamples and job_start/job_end events."""

    name = "jobs"

    def __init__(self, gpu_sampler: Any = None, rules: JobRules | None = None, proc_root: str = "/proc",
                 scan_interval_s: float = 5.0, end_grace_s: float = 3.0) -> None:
        self.gpu = gpu_sampler
        self.rules = rules or JobRules()
        self._cmd_res = [re.compile(p) for p in self.rules.cmdline_regex]
        self._argv0_re = re.compile(self.rules.env_argv0_regex) if self.rules.env_argv0_regex else None
        self.proc = proc_root.rstrip("/")
        self.scan_interval_ns = int(scan_interval_s * 1e9)
        self.end_grace_ns = int(end_grace_s * 1e9)
        self._procs: dict[int, _Proc] = {}
        self._rule_pids: set[int] = set()
        self._last_scan_ns: int | None = None
        self._jobs: dict[str, _Job] = {}
        self._self_pid = os.getpid()

    # ------------------------------------------------------------------ /proc readers
    def _stat(self, pid: int) -> tuple[int, int, int] | None:
        """(utime+stime ticks, start time ticks, session id) or None when the process is gone."""
        try:
            with open(f"{self.proc}/{pid}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            return None
        rest = raw[raw.rfind(b")") + 2:].split()
        if rest[:1] == [b"Z"]:   # a zombie has exited; only its parent has not reaped it yet
            return None
        try:
            return int(rest[11]) + int(rest[12]), int(rest[19]), int(rest[3])
        except (IndexError, ValueError):
            return None

    def _read_bytes(self, pid: int, name: str) -> bytes | None:
        try:
            with open(f"{self.proc}/{pid}/{name}", "rb") as f:
                return f.read()
        except OSError:
            return None

    def _environ(self, pid: int) -> dict[str, str]:
        raw = self._read_bytes(pid, "environ") or b""
        out = {}
        for item in raw.split(b"\0"):
            k, sep, v = item.partition(b"=")
            if sep:
                key = k.decode("utf-8", "replace")
                if key in _ENV_WANTED or key in self.rules.env_keys:
                    out[key] = v.decode("utf-8", "replace")
        return out

    def _rss(self, pid: int) -> float:
        raw = self._read_bytes(pid, "statm")
        try:
            return float(int(raw.split()[1]) * _PAGE) if raw else 0.0
        except (IndexError, ValueError):
            return 0.0

    def _io(self, pid: int) -> tuple[int, int] | None:
        raw = self._read_bytes(pid, "io")   # needs same uid or CAP_SYS_PTRACE; None otherwise
        if not raw:
            return None
        r = w = 0
        for line in raw.split(b"\n"):
            if line.startswith(b"read_bytes:"):
                r = int(line.split()[1])
            elif line.startswith(b"write_bytes:"):
                w = int(line.split()[1])
        return r, w

    # ------------------------------------------------------------------ identity
    def _proc_for(self, pid: int, rule_check: bool) -> _Proc | None:
        st = self._stat(pid)
        if st is None:
            self._procs.pop(pid, None)
            return None
        cached = self._procs.get(pid)
        if cached is not None and cached.start == st[1]:
            return cached
        ident = None
        matched = False
        if rule_check:
            cmd = (self._read_bytes(pid, "cmdline") or b"").replace(b"\0", b" ").decode("utf-8", "replace").strip()
            if any(r.search(cmd) for r in self._cmd_res):
                matched = True
            argv0 = os.path.basename(cmd.split(" ", 1)[0]) if cmd else ""
            env = None
            if not matched and cmd and (self._argv0_re is None or self._argv0_re.search(argv0)):
                env = self._environ(pid)
                matched = any(k in env for k in self.rules.env_keys)
            if matched:
                env = env if env is not None else self._environ(pid)
                cg = parse_cgroup((self._read_bytes(pid, "cgroup") or b"").decode("utf-8", "replace"))
                ident = identify(pid, env, cg, st[2], True)
        else:
            env = self._environ(pid)
            cg = parse_cgroup((self._read_bytes(pid, "cgroup") or b"").decode("utf-8", "replace"))
            ident = identify(pid, env, cg, st[2], False)
        p = _Proc(start=st[1], ident=ident)
        self._procs[pid] = p
        return p

    def _scan(self) -> None:
        try:
            names = os.listdir(self.proc)
        except OSError:
            return
        live = set()
        for n in names:
            if not n.isdigit():
                continue
            pid = int(n)
            if pid == self._self_pid:
                continue
            live.add(pid)
            p = self._procs.get(pid)
            if p is None:
                p = self._proc_for(pid, rule_check=True)
            if p is not None and p.ident is not None:
                self._rule_pids.add(pid)
        for pid in [p for p in self._procs if p not in live]:
            del self._procs[pid]
        self._rule_pids &= live

    # ------------------------------------------------------------------ the tick
    def _gpu_mode(self) -> bool:
        return self.gpu is not None and self.gpu.nvml.available and self.gpu.nvml.device_count > 0

    def sample(self, ts_ns: int, sink) -> None:
        t = ts_ns / 1e9
        rows: list[tuple[int, int, float, float]] = []   # (pid, gpu, gpu_util, gpu_mem)
        if self._gpu_mode():
            for p in self.gpu.processes():
                rows.append((p["pid"], p["gpu"], p["gpu_util_percent"], p["gpu_memory_bytes"]))
        else:
            if self._last_scan_ns is None or ts_ns - self._last_scan_ns >= self.scan_interval_ns:
                self._last_scan_ns = ts_ns
                self._scan()
            rows = [(pid, -1, -1.0, 0.0) for pid in sorted(self._rule_pids)]

        seen_jobs: dict[str, list[tuple[int, float]]] = {}
        seen_pids: dict[str, set[int]] = {}
        per_pid_done: dict[int, tuple[float, float, float, float]] = {}
        for pid, gpu, gutil, gmem in rows:
            p = self._proc_for(pid, rule_check=not self._gpu_mode())
            if p is None and not self._gpu_mode():
                self._rule_pids.discard(pid)
                continue
            if p is not None and p.ident is None:
                continue
            ident = p.ident if p is not None else identify(pid, {}, {}, pid, False)
            if pid not in per_pid_done:
                per_pid_done[pid] = self._usage(pid, p, t)
            cpu, rss, rd, wr = per_pid_done[pid]
            sink.job_sample(ts_ns=ts_ns, job_id=ident["job_id"], job_name=ident["job_name"],
                            source=ident["source"], pid=pid, rank=ident["rank"],
                            local_rank=ident["local_rank"], world_size=ident["world_size"], gpu=gpu,
                            gpu_util_percent=max(0.0, gutil), gpu_memory_bytes=gmem, cpu_percent=cpu,
                            rss_bytes=rss, read_bytes_per_s=rd, write_bytes_per_s=wr,
                            attrs=dict(ident["attrs"]))
            seen_jobs.setdefault(ident["job_id"], []).append((gpu, gutil))
            job = self._jobs.get(ident["job_id"])
            if job is None:
                job = self._jobs[ident["job_id"]] = _Job(ident["job_id"], ident["job_name"], ident["source"],
                                                         ts_ns, ts_ns)
                sink.event("job_start", f"job {job.job_id} started ({job.source})", ts_ns=ts_ns,
                           attrs={"job_id": job.job_id, "job_name": job.job_name, "source": job.source})
            job.last_ns = ts_ns
            seen_pids.setdefault(job.job_id, set()).add(pid)
            if gpu >= 0:
                job.gpus.add(gpu)
        for job_id, pids in seen_pids.items():
            self._jobs[job_id].pids = pids
        for job_id, pairs in seen_jobs.items():
            per_gpu: dict[int, float] = {}
            for gpu, util in pairs:
                if gpu >= 0 and util >= 0:
                    per_gpu[gpu] = per_gpu.get(gpu, 0.0) + util
            if per_gpu:
                job = self._jobs[job_id]
                job.util_sum += sum(min(100.0, u) for u in per_gpu.values()) / len(per_gpu)
                job.util_n += 1
        self._end_jobs(ts_ns, sink)

    def _usage(self, pid: int, p: _Proc | None, t: float) -> tuple[float, float, float, float]:
        if p is None:
            return 0.0, 0.0, 0.0, 0.0
        st = self._stat(pid)
        if st is None:
            return 0.0, 0.0, 0.0, 0.0
        io = self._io(pid)
        cpu = rd = wr = 0.0
        if p.prev_t is not None and t > p.prev_t:
            dt = t - p.prev_t
            cpu = max(0, st[0] - p.prev_cpu) / _CLK_TCK / dt * 100.0
            if io is not None and p.prev_io is not None:
                rd = max(0, io[0] - p.prev_io[0]) / dt
                wr = max(0, io[1] - p.prev_io[1]) / dt
        p.prev_t, p.prev_cpu, p.prev_io = t, st[0], io
        return cpu, self._rss(pid), rd, wr

    def _end_jobs(self, ts_ns: int, sink) -> None:
        for job_id in [j for j, job in self._jobs.items() if ts_ns - job.last_ns >= self.end_grace_ns]:
            job = self._jobs.pop(job_id)
            mean = job.util_sum / job.util_n if job.util_n else 0.0
            dur = (job.last_ns - job.first_ns) / 1e9
            sink.event("job_end", f"job {job_id} ended after {dur:.0f} s, mean GPU util {mean:.1f} %",
                       value=mean, ts_ns=ts_ns,
                       attrs={"job_id": job_id, "job_name": job.job_name, "source": job.source,
                              "duration_s": f"{dur:.3f}", "gpus": ",".join(map(str, sorted(job.gpus))),
                              "gpu_util_samples": str(job.util_n)})

    def active_jobs(self) -> list[dict[str, Any]]:
        """Jobs currently seen (for `gpuagent status`)."""
        return [{"job_id": j.job_id, "job_name": j.job_name, "source": j.source, "pids": sorted(j.pids),
                 "gpus": sorted(j.gpus), "started_ns": j.first_ns,
                 "mean_gpu_util_percent": (j.util_sum / j.util_n) if j.util_n else None}
                for j in self._jobs.values()]

    def close(self) -> None:
        pass
