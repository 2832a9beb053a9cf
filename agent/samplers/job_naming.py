"""Which job a process belongs to, by name: the JobSample identity fields from the shared identity rule
(gpuagent.common.job_identity), Slurm's name for a process (agent/schedulers/slurm.py) and the pod the kubelet
says holds its GPU (agent/schedulers/kubelet.py). The one place that turns environment, cgroup and scheduler
answers into job_id / job_name / source for job discovery (agent/samplers/job_discovery.py), so the scan
(JobDiscovery._proc_for), the tick and the step receiver name a job alike."""

from __future__ import annotations

from typing import Any, Callable

from gpuagent.agent.schedulers.slurm import PENDING, SlurmAttribution
from gpuagent.common.job_identity import cgroup_ids, job_identity

_POD_KEYS = ("pod", "namespace", "container")     # job sample attrs from the kubelet (agent/schedulers/kubelet.py)


def identify(pid: int, env: dict[str, str], cgroup_text: str, ppid: int, matched_by_rule: bool,
             own_container: str = "") -> dict[str, Any]:
    """JobSample identity fields + attrs for a process, via the shared job identity rule."""
    ji = job_identity(env, pid, ppid, cgroup_text, own_container)
    pod, container = cgroup_ids(cgroup_text) if cgroup_text else ("", "")
    attrs: dict[str, str] = {}
    if container and container != own_container[:12]:
        attrs["container_id"] = container
    if pod:
        attrs["pod_uid"] = pod
    source = "rule" if (ji.source == "process" and matched_by_rule) else ji.source
    name = ji.job_name or (env.get("HOSTNAME", "") if ji.source == "kubernetes" else "")
    return {"job_id": ji.job_id, "job_name": name, "source": source, "rank": ji.rank,
            "local_rank": ji.local_rank, "world_size": ji.world_size, "attrs": attrs}


def slurm_identity(ident: dict[str, Any], job: Any, step: str) -> dict[str, Any]:
    """A process's identity as Slurm names it (agent/schedulers/slurm.py): the job id, name, user, partition and
    account from slurmctld, the step from slurmd; ranks stay whatever the environment said (-1 without it)."""
    attrs = dict(ident["attrs"])
    attrs.update({k: v for k, v in (("slurm_job_id", job.job_id), ("slurm_step", step), ("slurm_user", job.user),
                                    ("slurm_partition", job.partition), ("slurm_account", job.account),
                                    ("slurm_array_job_id", job.array_job_id),
                                    ("slurm_array_task_id", job.array_task_id)) if v})
    return dict(ident, job_id=job.gpuagent_job_id, job_name=job.name or ident["job_name"], source="slurm",
                attrs=attrs)


class JobNamingMixin:
    """JobDiscovery's scheduler lookups (agent/samplers/job_discovery.py): Slurm's job of a process, the kubelet's
    pod of a job. ``slurm`` and ``pods`` are set by the daemon; the /proc readers are job_procfs.py's."""

    gpu: Any
    slurm: SlurmAttribution | None
    _stat: Callable[[int], tuple[int, int, int] | None]
    _read_bytes: Callable[[int, str], bytes | None]
    _start_ticks_wall_ns: Callable[[int], int | None]

    def slurm_job_of(self, pid: int) -> tuple[str, str] | str | None:
        """(job id, job name) of a process as Slurm names it; PENDING while Slurm has not been asked about it
        yet (agent/schedulers/slurm.py); None when there is no Slurm here or the process is in no Slurm job. For the step
        receiver: a tracker whose environment names no job gets the id its process's job_samples carry. Safe
        from another thread (reads /proc; the Slurm cache has its own lock)."""
        if self.slurm is None:
            return None
        st = self._stat(pid)
        if st is None:
            return None
        cg = (self._read_bytes(pid, "cgroup") or b"").decode("utf-8", "replace")
        hit = self.slurm.lookup(pid, cg, self._start_ticks_wall_ns(st[1]))
        if hit is None or hit == PENDING:
            return hit
        job, _step = hit
        return job.gpuagent_job_id, job.name

    def _pod_of(self, gpu: int, gi: int, ident: dict[str, Any]) -> dict[str, Any] | None:
        """The container the kubelet says holds this process's GPU (or its MIG GPU instance), when that is
        one container; among several (time-sliced GPUs) the one whose pod has the process's hostname."""
        if gpu < 0 or self.gpu is None:
            return None
        held = (getattr(self.gpu, "last", {}).get(gpu) or {}).get("pods") or []
        cands = [h for h in held if h["gpu_instance"] == (gi if gi >= 0 else None)]
        if len(cands) > 1:
            cands = [h for h in cands if h["pod"] == ident["job_name"]]
        return cands[0] if len(cands) == 1 else None

    def _with_pods(self, resolved: list) -> list:
        """Name each job's pod on all its processes (launcher and loaders too), from its GPU processes. A
        process with no better identity than its pid becomes the pod's job, ``k8s:<namespace>/<pod>``."""
        job_pod: dict[str, dict[str, Any]] = {}
        for _pid, gpu, _u, _m, gi, _p, ident in resolved:
            pod = self._pod_of(gpu, gi, ident)
            if pod is not None:
                job_pod.setdefault(ident["job_id"], pod)
        out = []
        for pid, gpu, gutil, gmem, gi, p, ident in resolved:
            pod = job_pod.get(ident["job_id"])
            if pod is not None:
                attrs = dict(ident["attrs"], **{k: pod[k] for k in _POD_KEYS})
                ident = dict(ident, attrs=attrs, job_name=ident["job_name"] or pod["pod"])
                if ident["job_id"].startswith("pid:"):
                    ident.update(job_id=f"k8s:{pod['namespace']}/{pod['pod']}", job_name=pod["pod"],
                                 source="kubernetes")
            out.append((pid, gpu, gutil, gmem, gi, p, ident))
        return out
