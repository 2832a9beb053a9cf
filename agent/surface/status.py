"""``gpuagent status`` as text: the daemon's last :class:`~gpuagent.agent.snapshot.StatusSnapshot`, rendered.

The snapshot itself (its fields, the file, staleness) lives in agent/snapshot.py; this module only formats.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from gpuagent.agent.snapshot import (FabricStatus, GpuStatus, HealthStatus, JobStatus, KubeletStatus,
                                     StatusSnapshot)


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _fmt(v: Any, spec: str = ".0f", suffix: str = "") -> str:
    if v is None:
        return "-"
    try:
        return f"{float(v):{spec}}{suffix}"
    except (TypeError, ValueError):
        return str(v)


def _ago(ns: int, now_ns: int) -> str:
    if not ns:
        return "never"
    s = (now_ns - ns) / 1e9
    return f"{s:.1f} s ago" if s < 120 else f"{s / 60:.0f} min ago"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join("  " + x for x in out)


def render(snap: StatusSnapshot, now_ns: int | None = None) -> str:
    now_ns = now_ns if now_ns is not None else time.time_ns()
    node = snap.node
    fp = snap.fingerprint
    out = []
    out.append(f"gpuagent {snap.agent_version}  pid {snap.pid}  "
               f"up {(now_ns - snap.started_ns) / 1e9:.0f} s  "
               f"updated {_ago(snap.updated_ns, now_ns)}  interval {snap.interval_s} s")
    out.append(f"node      {node.hostname}  id {node.node_id or '(not registered yet)'}  "
               f"machine {node.machine_id[:12]}")
    if node.labels:
        out.append("labels    " + "  ".join(f"{k}={v}" for k, v in sorted(node.labels.items())))
    virt = fp.get("virt_type") or "?"
    cont = fp.get("container_runtime") or ("yes" if fp.get("in_container") else "none")
    out.append(f"virt      {virt} (virtualized: {str(bool(fp.get('virtualized'))).lower()})  container: {cont}  "
               f"hypervisor vendor: {fp.get('cpuid_hypervisor_vendor') or '-'}  "
               f"DMI: {fp.get('dmi_sys_vendor') or '-'} / {fp.get('dmi_product_name') or '-'}  "
               f"clocksource: {fp.get('clocksource') or '-'}")
    if fp.get("container_markers"):
        out.append("          container markers: " + ", ".join(fp["container_markers"]))
    host = snap.host
    if host.seen():
        out.append(f"host      cpu busy {_fmt(host.cpu_busy_percent, '.1f', '%')}  steal "
                   f"{_fmt(host.cpu_steal_percent, '.1f', '%')}  iowait {_fmt(host.cpu_iowait_percent, '.1f', '%')}  "
                   f"load1 {_fmt(host.load1, '.2f')}  mem {_fmt_bytes(host.mem_used_bytes)} / "
                   f"{_fmt_bytes(host.mem_total_bytes)}")

    out.append("")
    if snap.gpus:
        out.append(f"GPUs ({len(snap.gpus)})")
        rows = [[str(g.index), (g.name or "?")[:28], _fmt(g.util_percent, ".0f", "%"),
                 _fmt(g.sm_active_percent, ".0f", "%"), _fmt(g.tensor_active_percent, ".0f", "%"),
                 f"{_fmt_bytes(g.memory_used_bytes)} / {_fmt_bytes(g.memory_total_bytes)}",
                 _fmt(g.temperature_celsius, ".0f", " C"),
                 f"{_fmt(g.power_watts, '.0f')} / {_fmt(g.power_limit_watts, '.0f')} W",
                 ",".join(g.throttle_reasons) or "-"] for g in snap.gpus]
        # util: time any kernel ran (NVML counter); SM active / tensor: GPM, "-" where the GPU has none
        out.append(_table(["gpu", "name", "util", "SM active", "tensor", "memory", "temp", "power", "throttle"],
                          rows))
    else:
        out.append("GPUs      none visible")
    out.append("")
    out += _render_health(snap.health)

    out.append("")
    if snap.jobs:
        out.append(f"Jobs ({len(snap.jobs)})")
        heads, cols = _job_scheduler_columns(snap.jobs)
        rows = [[j.job_id, j.job_name or "-", *(col(j) for col in cols), _text(j.pid), _text(j.rank), _text(j.gpu),
                 _fmt(j.gpu_util_percent, ".0f", "%"), _fmt(j.cpu_percent, ".0f", "%"),
                 _fmt_bytes(j.rss_bytes), _fmt(j.steps_per_s, ".2f")] for j in snap.jobs]
        out.append(_table(["job", "name", *heads, "pid", "rank", "gpu", "gpu util", "cpu", "rss", "steps/s"], rows))
    else:
        out.append("Jobs      none active")
    if snap.job_throughput:
        out.append("")
        out.append("Training throughput (gpuagent.jobs tracker, last window)")
        rows = [[t.job_id, (t.job_name or "-")[:24], ",".join(str(r) for r in t.ranks) or "-",
                 _fmt(t.steps_per_s, ".2f"), _fmt(t.samples_per_s, ".1f"),
                 _fmt(t.tokens_per_s, ".0f") if t.tokens_per_s else "-",
                 _fmt(t.step_time_p50_s * 1000, ".1f", " ms"),
                 _fmt(t.data_wait_fraction * 100, ".0f", "%") if t.data_wait_fraction >= 0 else "-",
                 _fmt(t.model_flops_per_s / 1e12, ".1f") if t.model_flops_per_s is not None else "-",
                 _fmt(t.mfu * 100, ".1f", "%") if t.mfu is not None else "-"]
                for t in snap.job_throughput]
        out.append(_table(["job", "name", "ranks", "steps/s", "samples/s", "tokens/s", "step p50", "data wait",
                           "model TFLOP/s", "MFU"], rows))

    out.append("")
    if snap.probes:
        out.append("Probes (last result)")
        rows = []
        for name, p in sorted(snap.probes.items()):
            metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(p.metrics.items())[:4])
            rows.append([name, p.status, _ago(p.ended_ns, now_ns), (p.reason or metrics)[:70]])
        out.append(_table(["probe", "status", "when", "metrics / reason"], rows))
    else:
        out.append("Probes    no results yet")

    if snap.fabric is not None:
        out.append("")
        out += _render_fabric(snap.fabric, now_ns)

    if snap.kubelet is not None:
        out.append("")
        out += _render_kubelet(snap.kubelet, snap.gpus)

    link = snap.collector
    sp = snap.spool
    out.append("")
    state = "connected" if link.connected else "NOT connected"
    out.append(f"collector {link.collector}  {state} (since {_ago(link.since_ns, now_ns)})  "
               f"last ack seq {link.last_ack_seq} {_ago(link.last_ack_ns, now_ns)}")
    if link.last_error and not link.connected:
        out.append(f"          last error: {link.last_error}")
    out.append(f"spool     backlog {sp.backlog_batches} batches / {_fmt_bytes(sp.backlog_bytes)} "
               f"(max {_fmt_bytes(sp.max_bytes)})  dropped {sp.dropped_batches} batches / "
               f"{sp.dropped_samples} samples  corrupt files {sp.corrupt_files}  "
               f"rejected {sp.rejected_batches}")
    if snap.unavailable:
        out.append("")
        out.append("Unavailable")
        for u in snap.unavailable[:20]:
            out.append(f"  - {u}")
    return "\n".join(out)


def _render_paths(p: dict[str, Any]) -> list[str]:
    """The path probes' line (agent/probing/paths.py): pinglist, counters, responder; the last summary."""
    epoch = "-" if p.get("epoch") is None else p["epoch"]
    out = [f"          path probes: epoch {epoch}, {p.get('peers', 0)} peers; "
           f"{p.get('paths_probed', 0)} paths probed, {p.get('suspects', 0)} suspects, datagrams "
           f"{p.get('datagrams_sent', 0)} sent / {p.get('datagrams_lost', 0)} lost; responder port "
           f"{p.get('responder_port', 'none')} ({p.get('echoed', 0)} echoed, {p.get('dropped', 0)} dropped)"]
    last = p.get("last_summary") or {}
    if last:
        out.append(f"          last epoch {last.get('epoch')}: {last.get('status')}  "
                   f"{_fmt(last.get('paths'), '.0f')} paths  rtt p50 {_fmt(last.get('rtt_p50_us'), '.0f', ' us')}  "
                   f"train {_fmt(last.get('train_gbits_per_s'), '.2f', ' Gbit/s')}  "
                   f"loss {_fmt(last.get('loss_ratio'), '.4f')}  {last.get('reason') or ''}".rstrip())
    return out


def _render_kubelet(k: KubeletStatus, gpus: list[GpuStatus]) -> list[str]:
    """Which containers hold which GPU, as the kubelet said (agent/schedulers/kubelet.py), or why it did not say."""
    age = "never" if k.last_answer_age_s is None else f"{k.last_answer_age_s:.0f} s ago"
    out = [f"Pods      kubelet {k.socket}  last answer {age}"]
    if k.error:
        out.append(f"          {k.error}")
    rows = [[str(g.index) + ("" if p.gpu_instance is None else f" GI {p.gpu_instance}"), p.namespace, p.pod,
             p.container] for g in gpus for p in (g.pods or [])]
    out.append(_table(["gpu", "namespace", "pod", "container"], rows) if rows else "          no GPU is held by a pod")
    return out


def _render_health(h: HealthStatus | None) -> list[str]:
    """The health section: OK, or one line per fault with its action (agent/surface/health.py; docs/HEALTH.md)."""
    if h is None:
        return ["Health    not reported (this agent predates hardware health)"]
    if h.error:
        return [f"Health    UNKNOWN: {h.error}"]
    what = ", ".join(h.checked) or "nothing read"
    if not h.faults:
        return [f"Health    OK: no hardware faults on {what}"]
    n = len(h.faults)
    out = [f"Health    {n} hardware fault{'s' if n != 1 else ''} on {what}"]
    out += [f"  - {f.severity.upper()} {f.component}: {f.sentence}" for f in h.faults[:20]]
    if n > 20:
        out.append(f"  ... and {n - 20} more (`gpuagent health` lists them all)")
    return out


def _render_fabric(fab: FabricStatus, now_ns: int) -> list[str]:
    if fab.stream_open:
        stream = f"assignments stream open (last assignment {_ago(fab.last_message_ns, now_ns)})"
    else:
        stream = "assignments stream DOWN" + (f": {fab.stream_error}" if fab.stream_error else "")
    counts = "  ".join(f"{k} {v}" for k, v in sorted(fab.counts.items())) or "no assignments yet"
    out = [f"Fabric    peers reach this node at {fab.address or '?'}  {stream}  {counts}"]
    if fab.paths is not None:
        out += _render_paths(fab.paths)
    if not fab.recent:
        out.append("          no runs yet")
        return out
    rows = [[r.peer[:20], r.role, r.status, _ago(r.ended_ns, now_ns), _fmt(r.send_gbits_per_s, ".2f"),
             _fmt(r.recv_gbits_per_s, ".2f"), _fmt(r.rtt_p50_us, ".0f", " us"), _fmt(r.busbw_gbytes_per_s, ".3f"),
             r.reason[:60]] for r in fab.recent]
    out.append(_table(["peer", "role", "status", "when", "send Gbit/s", "recv Gbit/s", "rtt p50", "busbw GB/s",
                       "reason"], rows))
    return out


def _job_scheduler_columns(jobs: list[JobStatus]) -> tuple[list[str], list[Callable[[JobStatus], str]]]:
    """The Jobs table's scheduler columns, only where some job has them: Slurm's user, partition and account
    (as squeue names them), the Kubernetes namespace, pod and container."""
    heads: list[str] = []
    cols: list[Callable[[JobStatus], str]] = []
    for head, name in (("user", "user"), ("partition", "partition"), ("account", "account"),
                       ("namespace", "namespace"), ("pod", "pod"), ("container", "container")):
        if any(getattr(j, name) for j in jobs):
            heads.append(head)
            cols.append(lambda j, name=name: getattr(j, name) or "-")
    return heads, cols


def _text(v: int | None) -> str:
    return "" if v is None else str(v)
