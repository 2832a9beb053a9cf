"""Slurm attribution: which Slurm job (and step) a process belongs to, without reading its environment.

A process's environment can be empty of ``SLURM_*`` (a job that cleans it, a container, ``env -i``), and
reading ``/proc/<pid>/environ`` needs the job's uid or CAP_SYS_PTRACE. Slurm itself knows: where it tracks
jobs with cgroups (proctrack/cgroup) the process's cgroup path names the job and step; everywhere,
``scontrol listpids`` asks the node's slurmd which pids belong to which job and step. The job's details
(name, user, partition, account, array job and task) come from ``scontrol show job -o``.

A tick never waits on Slurm: a background thread runs ``scontrol`` every ``refresh_s`` (each call with a
timeout), looks up each job it has not seen (details cached, at most ``MAX_JOBS``), and only then publishes
the pid map; :meth:`SlurmAttribution.lookup` reads the published map and cache. A job whose details are not
known yet is "pending": the caller asks again on a later tick, so a process never gets a wrong id first. So is
a process that started after the published listing was asked for (or before any listing, at the agent's
start): slurmd has not been asked about it yet, and it may be a job's. This holds while listpids answers;
when it fails, an unlisted process is nobody's job, as without Slurm.

Job ids follow :mod:`gpuagent.common.job_identity`: ``slurm:<job id>``, array tasks
``slurm:<array job id>_<task id>``, so the tracker (which reads the environment) and discovery agree.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

from gpuagent.common.background import BackgroundThread

log = logging.getLogger("gpuagent.slurm")

MAX_JOBS = 4096            # job details cached at most (the oldest looked-up go first)
CALL_TIMEOUT_S = 5.0       # each scontrol call
START_SLACK_NS = 50_000_000  # /proc starttime has clock-tick (10 ms) resolution: a process started just after
                             # a listing began can read as up to a tick before it
PENDING = "pending"        # lookup(): the pid is in a Slurm job whose details are not known yet

# cgroup v1: .../slurm/uid_<uid>/job_<id>/step_<step>/...; cgroup v2: .../slurmstepd.scope/job_<id>/step_<step>/...
# (Slurm's cgroup plugins; the step is batch, extern, interactive or a number).
_CGROUP_RE = re.compile(r"/(?:slurm[^/]*|uid_\d+)/(?:uid_\d+/)?job_(\d+)(?:/step_([A-Za-z0-9_.]+))?")


@dataclass(frozen=True)
class SlurmJob:
    """What ``scontrol show job`` says about one job."""

    job_id: str            # Slurm's JobId (an array task has its own)
    array_job_id: str      # "" when not an array task
    array_task_id: str
    name: str
    user: str
    partition: str
    account: str

    @property
    def gpuagent_job_id(self) -> str:
        if self.array_job_id and self.array_task_id:
            return f"slurm:{self.array_job_id}_{self.array_task_id}"
        return f"slurm:{self.job_id}"


def job_from_cgroup(cgroup_text: str) -> tuple[str, str] | None:
    """(Slurm job id, step) from a ``/proc/<pid>/cgroup`` text, or None where Slurm's cgroups are not used."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        if "slurm" not in path:
            continue
        m = _CGROUP_RE.search(path)
        if m:
            return m.group(1), m.group(2) or ""
    return None


def parse_listpids(text: str) -> dict[int, tuple[str, str]]:
    """``scontrol listpids`` output -> {pid: (job id, step)}. Lines that do not parse are skipped."""
    out: dict[int, tuple[str, str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 3 or not parts[0].isdigit() or not parts[1].isdigit():
            continue    # the header (PID JOBID STEPID ...) and anything unexpected
        out[int(parts[0])] = (parts[1], parts[2])
    return out


def parse_show_job(text: str) -> SlurmJob | None:
    """One ``scontrol show job -o`` line (Key=Value pairs) -> SlurmJob; None when it names no job."""
    fields: dict[str, str] = {}
    for tok in text.split():
        k, sep, v = tok.partition("=")
        if sep and k not in fields:
            fields[k] = v
    if not fields.get("JobId", "").isdigit():
        return None

    def clean(v: str) -> str:
        return "" if v in ("(null)", "N/A") else v

    user = fields.get("UserId", "")
    user = user.split("(", 1)[0]      # UserId=alice(1000)
    return SlurmJob(job_id=fields["JobId"], array_job_id=clean(fields.get("ArrayJobId", "")),
                    array_task_id=clean(fields.get("ArrayTaskId", "")), name=clean(fields.get("JobName", "")),
                    user=clean(user), partition=clean(fields.get("Partition", "")),
                    account=clean(fields.get("Account", "")))


def slurm_present(conf_env: str | None = None) -> bool:
    """scontrol is on PATH and a slurm.conf is there to tell it where slurmctld is."""
    if shutil.which("scontrol") is None:
        return False
    conf = conf_env if conf_env is not None else os.environ.get("SLURM_CONF", "")
    return bool(conf and os.path.exists(conf)) or os.path.exists("/etc/slurm/slurm.conf") \
        or os.path.exists("/etc/slurm-llnl/slurm.conf")


Runner = Callable[[list[str]], str]


def _scontrol(args: list[str]) -> str:
    proc = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=CALL_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0 and args[:1] == ["listpids"] and "No job steps exist" in proc.stderr + proc.stdout:
        return ""          # slurmd answered: nothing runs here
    if proc.returncode != 0:
        raise RuntimeError((proc.stderr or proc.stdout).strip().splitlines()[0] if (proc.stderr or proc.stdout)
                           else f"scontrol exited {proc.returncode}")
    return proc.stdout


class SlurmAttribution:
    """The node's Slurm jobs by pid, refreshed in the background; ``lookup`` never blocks on Slurm."""

    def __init__(self, refresh_s: float = 2.0, run: Runner | None = None) -> None:
        self.refresh_s = refresh_s
        self._run = run or _scontrol
        self._mu = threading.Lock()
        self._pids: dict[int, tuple[str, str]] = {}
        self._jobs: dict[str, SlurmJob] = {}
        self._worker = BackgroundThread("slurm-attribution", self._loop)
        self._stop = self._worker.stopping
        self.refreshes = 0
        self.calls = 0
        self.errors = 0
        self.last_error = ""
        self._logged_error = ""
        self._listed_ns: int | None = None   # wall clock when the published listpids call began
        self._listing_ok = True              # the latest listpids call answered (or none has failed yet)

    # -- background
    def start(self) -> SlurmAttribution:
        self._worker.start()
        return self

    def stop(self) -> None:
        self._worker.stop(CALL_TIMEOUT_S * 2)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.refresh_s)

    def _call(self, args: list[str]) -> str | None:
        self.calls += 1
        try:
            return self._run(args)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
            self.errors += 1
            why = f"scontrol {' '.join(args)}: {exc}" if not isinstance(exc, subprocess.TimeoutExpired) \
                else f"scontrol {' '.join(args)} did not answer within {CALL_TIMEOUT_S:g} s"
            self.last_error = why
            if why != self._logged_error:     # once per distinct error, not every refresh
                log.warning("Slurm attribution: %s", why)
                self._logged_error = why
            return None

    def refresh(self) -> None:
        """One pass: the node's pids by job, then the details of jobs not seen before; then publish."""
        asked_ns = time.time_ns()
        text = self._call(["listpids"])
        if text is None:
            self._listing_ok = False
            return
        pids = parse_listpids(text)
        with self._mu:
            known = set(self._jobs)
        for job_id in sorted({j for j, _ in pids.values()} - known):
            self.details(job_id)
        with self._mu:
            self._pids = pids
            self._listed_ns = asked_ns
            self._listing_ok = True
        self.refreshes += 1

    def details(self, job_id: str) -> SlurmJob | None:
        """Look one job up in slurmctld (from the background thread) and cache it."""
        text = self._call(["show", "job", "-o", job_id])
        job = parse_show_job(text.strip().splitlines()[0]) if text and text.strip() else None
        if job is not None:
            with self._mu:
                if len(self._jobs) >= MAX_JOBS:
                    self._jobs.pop(next(iter(self._jobs)))
                self._jobs[job_id] = job
        return job

    # -- the tick
    def lookup(self, pid: int, cgroup_text: str = "", started_ns: int | None = None) -> tuple[SlurmJob, str] | str | None:
        """(job, step) for a pid in a Slurm job; PENDING when it is in one whose details are not known yet
        (cgroup or listpids says so), or when it started (``started_ns``, wall clock) after the published
        listing was asked for; None when Slurm does not know the pid."""
        hit = job_from_cgroup(cgroup_text) if cgroup_text else None
        with self._mu:
            if hit is None:
                hit = self._pids.get(pid)
            if hit is None:
                return PENDING if self._not_asked_yet(started_ns) else None
            job = self._jobs.get(hit[0])
        return (job, hit[1]) if job is not None else PENDING

    def _not_asked_yet(self, started_ns: int | None) -> bool:
        """slurmd has not been asked about a process that started then, and is answering (caller holds _mu).
        Before the first listing: only while the background thread runs (its first call is under way)."""
        if started_ns is None or not self._listing_ok or started_ns > time.time_ns() + START_SLACK_NS:
            return False     # unknown or impossible start (a start in the future is not to be trusted)
        if self._listed_ns is None:
            return self._worker.alive
        return started_ns >= self._listed_ns - START_SLACK_NS

    def pids(self) -> set[int]:
        """Every pid slurmd lists in a job on this node (the latest refresh)."""
        with self._mu:
            return set(self._pids)

    def wait_refreshed(self, n: int = 1, timeout: float = 10.0) -> bool:
        """For tests and start-up: wait until ``n`` refreshes have completed."""
        end = time.monotonic() + timeout
        while self.refreshes < n and time.monotonic() < end:
            time.sleep(0.05)
        return self.refreshes >= n
