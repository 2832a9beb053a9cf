"""One rule for naming a training job, shared by the agent's job discovery and the in-process tracker.

Both sides must derive the same ``job_id`` for the same process, or the collector's ``job_samples``
(passive, from discovery) and ``job_steps`` (from the tracker) would not join. Discovery reads a
process's environment from ``/proc/<pid>/environ`` and its cgroup from ``/proc/<pid>/cgroup``; the
tracker reads its own ``os.environ`` and ``/proc/self/cgroup``; both call :func:`job_identity`.

Stdlib only, on purpose: training processes import this through ``gpuagent.jobs``.

Precedence (first that applies wins):

1. ``GPUAGENT_JOB_ID`` — set by the operator/launcher to force an id (``source="explicit"``);
2. Slurm: ``slurm:<SLURM_JOB_ID>`` (array tasks: ``slurm:<ARRAY_JOB_ID>_<ARRAY_TASK_ID>``);
3. torchelastic/torchrun: ``torchelastic:<TORCHELASTIC_RUN_ID>`` (torchrun --standalone sets a fresh
   uuid; the default id ``none`` is not unique, so it falls through);
4. Kubernetes pod from the cgroup path: ``k8s:<pod uid>``;
5. other containers from the cgroup path: ``container:<first 12 hex of the id>``;
6. torchelastic with run id ``none``: ``torchelastic:none-<ppid>`` (all local workers share the
   elastic agent as parent);
7. otherwise the process itself: ``pid:<pid>``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

_POD_RE = re.compile(r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}"
                     r"[-_][0-9a-fA-F]{12})")
_CONTAINER_RE = re.compile(r"(?:docker|cri-containerd|crio|libpod|containerd|lxc)[-/:]([0-9a-f]{12,64})"
                           r"|/([0-9a-f]{64})(?:\.scope)?(?:/|$)")


@dataclass(frozen=True)
class JobIdentity:
    job_id: str
    source: str          # explicit, slurm, torchelastic, kubernetes, container, process
    job_name: str        # "" when the environment does not name the job
    rank: int            # -1 when unknown
    local_rank: int      # -1 when unknown
    world_size: int      # 0 when unknown


def _int(environ: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            continue
    return default


def cgroup_ids(cgroup_text: str) -> tuple[str, str]:
    """(k8s pod uid, container id) found in a ``/proc/<pid>/cgroup`` text; "" where absent."""
    pod = ""
    container = ""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        if not pod:
            m = _POD_RE.search(path)
            if m:
                pod = m.group(1).replace("_", "-").lower()
        if not container:
            m = _CONTAINER_RE.search(path)
            if m:
                container = (m.group(1) or m.group(2))[:12]
    return pod, container


def job_identity(environ: Mapping[str, str], pid: int, ppid: int = 0,
                 cgroup_text: str = "", ignore_container: str = "") -> JobIdentity:
    """The job a process belongs to, from its environment, cgroup and parent (see module doc).

    ``ignore_container``: a container id (12 hex) that is not a job boundary — the agent passes its
    own, so that when the agent shares a container with the jobs, that container is not "one job".
    """
    rank = _int(environ, "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", default=-1)
    local_rank = _int(environ, "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", default=-1)
    world_size = _int(environ, "WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                      default=0)
    name = environ.get("GPUAGENT_JOB_NAME") or environ.get("SLURM_JOB_NAME") or ""

    def ident(job_id: str, source: str) -> JobIdentity:
        return JobIdentity(job_id, source, name, rank, local_rank, world_size)

    explicit = environ.get("GPUAGENT_JOB_ID", "").strip()
    if explicit:
        return ident(explicit, "explicit")
    slurm = environ.get("SLURM_JOB_ID", "").strip()
    if slurm:
        array_job = environ.get("SLURM_ARRAY_JOB_ID", "").strip()
        array_task = environ.get("SLURM_ARRAY_TASK_ID", "").strip()
        if array_job and array_task:
            return ident(f"slurm:{array_job}_{array_task}", "slurm")
        return ident(f"slurm:{slurm}", "slurm")
    run_id = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id.lower() != "none":
        return ident(f"torchelastic:{run_id}", "torchelastic")
    if cgroup_text:
        pod, container = cgroup_ids(cgroup_text)
        if pod:
            return ident(f"k8s:{pod}", "kubernetes")
        if container and container != ignore_container[:12]:
            return ident(f"container:{container}", "container")
    if run_id and ppid > 0:
        return ident(f"torchelastic:none-{ppid}", "torchelastic")
    return ident(f"pid:{pid}", "process")


def read_own_identity() -> JobIdentity:
    """This process's identity (used by the tracker)."""
    import os  # noqa: PLC0415

    try:
        with open("/proc/self/cgroup", encoding="utf-8", errors="replace") as f:
            cgroup_text = f.read()
    except OSError:
        cgroup_text = ""
    return job_identity(os.environ, os.getpid(), os.getppid(), cgroup_text)


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def parse_environ(raw: str) -> dict[str, str]:
    """``/proc/<pid>/environ`` (NUL-separated KEY=VALUE) as a dict."""
    env: dict[str, str] = {}
    for item in raw.split("\0"):
        key, sep, value = item.partition("=")
        if sep and key:
            env[key] = value
    return env


def parent_pid(stat_text: str) -> int:
    """The ppid field of ``/proc/<pid>/stat`` (after the parenthesised command name)."""
    try:
        return int(stat_text[stat_text.rindex(")") + 2:].split()[1])
    except (ValueError, IndexError):
        return 0


def own_container_id(proc_root: str = "/proc") -> str:
    """The container id of the calling process ("" when not in a recognised container)."""
    return cgroup_ids(_read(f"{proc_root}/self/cgroup") or "")[1]


def identity_for_pid(pid: int, proc_root: str = "/proc", ignore_container: str = "") -> JobIdentity | None:
    """A running process's identity read from ``/proc``; None when its environment is unreadable
    (the process is gone, or belongs to another user and the agent is not root)."""
    raw_env = _read(f"{proc_root}/{pid}/environ")
    if raw_env is None:
        return None
    stat = _read(f"{proc_root}/{pid}/stat") or ""
    cgroup = _read(f"{proc_root}/{pid}/cgroup") or ""
    return job_identity(parse_environ(raw_env), pid, parent_pid(stat), cgroup, ignore_container)
