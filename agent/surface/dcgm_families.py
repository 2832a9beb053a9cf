"""What one tick's snapshot becomes under dcgm-exporter's names (dcgm_names.py): the DCGM families, one series
per GPU (per GPU instance under MIG) with dcgm-exporter's labels and the job or pod attribution, and
gpuagent_gpu_job_info / gpuagent_gpu_pod_info, the series to join them with; plus the Prometheus text writer.

Why a text writer of its own: dcgm-exporter types TOTAL_ENERGY_CONSUMPTION and four other defaults
``counter`` without a ``_total`` suffix, which prometheus_client cannot say (exporter.py's docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

from gpuagent.agent.config import ExporterConfig
from gpuagent.agent.snapshot import GpuInstanceStatus, GpuStatus, StatusSnapshot
from gpuagent.agent.surface.dcgm_names import DCGM_METRICS, XID, Naming, in_unit, xid_message

JOB_INFO = "gpuagent_gpu_job_info"
POD_INFO = "gpuagent_gpu_pod_info"


@dataclass
class Family:
    """One metric family as the text writer emits it."""
    name: str
    kind: str                       # gauge | counter | untyped
    help: str
    samples: list[tuple[list[tuple[str, str]], float]]


def _gpu_labels(g: GpuStatus, naming: Naming, host: str, driver: str,
                inst: GpuInstanceStatus | None = None) -> list[tuple[str, str]]:
    """dcgm-exporter's labels, in its order (internal/pkg/rendermetrics): gpu, UUID, pci_bus_id, device,
    modelName, GPU_I_PROFILE and GPU_I_ID for a MIG GPU instance, the hostname, the driver-version label."""
    out = [("gpu", str(g.index)), ("UUID", g.uuid or ""), ("pci_bus_id", g.pci_bus_id or ""),
           ("device", f"nvidia{g.index}"), ("modelName", g.name or "")]
    if inst is not None:
        out += [("GPU_I_PROFILE", inst.profile), ("GPU_I_ID", str(inst.gpu_instance_id))]
    out.append((naming.hostname, host))
    if driver:
        out.append((naming.driver, driver))
    return out


def _gpu_jobs(snap: StatusSnapshot) -> dict[tuple[int, int | None], list[tuple[str, str]]]:
    """(GPU, MIG GPU instance or None) -> [(job_id, job_name)], each job once, in job-id order."""
    out: dict[tuple[int, int | None], dict[str, str]] = {}
    for j in snap.jobs:
        if j.gpu is not None and j.gpu >= 0:
            out.setdefault((j.gpu, j.gpu_instance), {}).setdefault(j.job_id, j.job_name or "")
    return {key: sorted(jobs.items()) for key, jobs in out.items()}


def _gpu_pods(snap: StatusSnapshot) -> dict[tuple[int, int | None], list[tuple[str, str, str]]]:
    """(GPU, MIG GPU instance or None) -> [(pod, namespace, container)] the kubelet says hold it, each once."""
    out: dict[tuple[int, int | None], set[tuple[str, str, str]]] = {}
    for g in snap.gpus:
        for p in g.pods or []:
            out.setdefault((g.index, p.gpu_instance), set()).add((p.pod, p.namespace, p.container))
    return {key: sorted(v) for key, v in out.items()}


def _attribution(snap: StatusSnapshot, mode: str) -> dict[tuple[int, int | None], list[list[tuple[str, str]]]]:
    """The extra labels each GPU series is repeated with: one hpc_job per job (``hpc_job``), or pod,
    namespace and container per holding container as dcgm-exporter's Kubernetes mapping names them (``pod``)."""
    if mode == "hpc_job":
        return {key: [[("hpc_job", job)] for job, _ in jobs] for key, jobs in _gpu_jobs(snap).items()}
    if mode == "pod":
        return {key: [[("pod", p), ("namespace", ns), ("container", c)] for p, ns, c in rows]
                for key, rows in _gpu_pods(snap).items()}
    return {}


def _extra_for(attr: dict[tuple[int, int | None], list[list[tuple[str, str]]]], gpu: int,
               inst: GpuInstanceStatus | None) -> list[list[tuple[str, str]]]:
    """The extra label sets of one series: those of its GPU instance, or of the whole GPU for a GPU-level
    series (dcgm-exporter's mapping files are keyed <gpu> and <gpu>.<GPU instance> the same way)."""
    if inst is not None:
        return attr.get((gpu, inst.gpu_instance_id), [])
    return sorted({tuple(x) for (g, _gi), rows in attr.items() if g == gpu for x in rows})


def dcgm_families(snap: StatusSnapshot, settings: ExporterConfig) -> list[Family]:
    """The dcgm-exporter families of one tick, named for ``settings.dcgm_names``.

    A GPU-level value is one series per GPU. Under MIG, the values DCGM keeps per GPU instance (the
    framebuffer and the profiling ratios) are one series per GPU instance with GPU_I_PROFILE and
    GPU_I_ID, and GPU_UTIL too (from GPM; see _gr_util_of_instance). With ``job_labels = "hpc_job"``
    each series is repeated once per job on its GPU with ``hpc_job`` (dcgm-exporter's HPC job
    mapping); otherwise no job label is set and gpuagent_gpu_job_info carries the jobs.
    """
    naming = Naming(settings.dcgm_names)
    host, driver = snap.node.hostname, snap.node.driver_version
    attr = _attribution(snap, settings.job_labels)
    fams: list[Family] = []
    for m in DCGM_METRICS:
        samples: list[tuple[list[tuple[str, str]], float]] = []
        for g in snap.gpus:
            rows: list[tuple[list[tuple[str, str]], float | None, GpuInstanceStatus | None]] = []
            if g.instances and m.per_instance is not None:
                rows = [(_gpu_labels(g, naming, host, driver, x), m.per_instance(x), x) for x in g.instances]
            else:
                base = _gpu_labels(g, naming, host, driver)
                if m.old == XID and settings.xid_labels:
                    code = int(g.last_xid or 0)
                    base += [("err_code", str(code)), ("err_msg", xid_message(code))]
                rows = [(base, (m.value_new or m.value)(g) if naming.new else m.value(g), None)]
            for labels, v, inst in rows:
                if v is None or (isinstance(v, float) and math.isnan(v)):
                    continue
                v = in_unit(m, v, naming)
                extra = _extra_for(attr, g.index, inst) if attr else []
                if extra:
                    samples += [(labels + list(x), v) for x in extra]
                else:
                    samples.append((labels, v))
        if samples:
            fams.append(Family(m.name(settings.dcgm_names), m.kind, m.help_new if naming.new else m.help_old,
                               samples))
    return fams


def job_info_family(snap: StatusSnapshot, settings: ExporterConfig) -> Family:
    """gpuagent_gpu_job_info: 1 per (GPU, job) the job discovery saw this tick, to join GPU series with
    (docs/EXPORTER.md): a job starting or stopping changes these series only, never a GPU series."""
    naming = Naming(settings.dcgm_names)
    uuid = {g.index: g.uuid or "" for g in snap.gpus}
    samples = []
    for (gpu, gi), jobs in sorted(_gpu_jobs(snap).items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None
                                                                          else kv[0][1])):
        for job_id, job_name in jobs:
            labels = [("gpu", str(gpu)), ("UUID", uuid.get(gpu, ""))]
            if gi is not None:
                labels.append(("GPU_I_ID", str(gi)))
            labels += [(naming.hostname, snap.node.hostname), ("job_id", job_id), ("job_name", job_name)]
            samples.append((labels, 1.0))
    return Family(JOB_INFO, "gauge", "1 for each job with a process on the GPU (GPU instance under MIG); "
                  "join on instance and gpu.", samples)


def pod_info_family(snap: StatusSnapshot, settings: ExporterConfig) -> Family:
    """gpuagent_gpu_pod_info: 1 per (GPU or MIG GPU instance, container) the kubelet says holds it, with a
    process on it or not (an idle pod's GPU is held all the same); join on instance and gpu like the job info."""
    naming = Naming(settings.dcgm_names)
    uuid = {g.index: g.uuid or "" for g in snap.gpus}
    samples = []
    for (gpu, gi), rows in sorted(_gpu_pods(snap).items(), key=lambda kv: (kv[0][0], -1 if kv[0][1] is None
                                                                          else kv[0][1])):
        for pod, ns, container in rows:
            labels = [("gpu", str(gpu)), ("UUID", uuid.get(gpu, ""))]
            if gi is not None:
                labels.append(("GPU_I_ID", str(gi)))
            labels += [(naming.hostname, snap.node.hostname), ("pod", pod), ("namespace", ns), ("container", container)]
            samples.append((labels, 1.0))
    return Family(POD_INFO, "gauge", "1 for each container the kubelet says holds the GPU (GPU instance under "
                  "MIG); join on instance and gpu.", samples)


def render_text(families: Iterable[Family]) -> bytes:
    """The Prometheus text format (0.0.4), with each family's own type, counters without _total."""
    out: list[str] = []
    for f in families:
        out.append(f"# HELP {f.name} {_escape_help(f.help)}")
        out.append(f"# TYPE {f.name} {f.kind}")
        for labels, v in f.samples:
            lab = ",".join(f'{k}="{_escape_label(val)}"' for k, val in labels)
            out.append(f"{f.name}{{{lab}}} {floatToGoString(v)}" if lab else f"{f.name} {floatToGoString(v)}")
    return ("\n".join(out) + "\n").encode() if out else b""


def _escape_help(s: str) -> str:
    return s.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(s: str) -> str:
    return s.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def as_client_metric(f: Family) -> Metric:
    """A Family for prometheus_client's OpenMetrics encoder: counters without _total go out ``unknown``."""
    m = Metric(f.name, f.help, f.kind if f.kind == "gauge" else "unknown")
    for labels, v in f.samples:
        m.add_sample(f.name, dict(labels), v)
    return m
