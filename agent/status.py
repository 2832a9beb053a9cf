"""The local status file: written by the daemon every tick, read by ``gpuagent status``.

The daemon writes ``<state_dir>/status.json`` atomically (temp + rename, mode 0644, no fsync: it is
rewritten every second and only describes the present), so ``gpuagent status`` works for any user who
can read the state dir, without talking to the daemon or needing root.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

STATUS_FILE = "status.json"
STATUS_VERSION = 1
STALE_MIN_S = 10.0     # a status older than max(3 x interval + 5 s, this) is stale


class StatusError(Exception):
    """`gpuagent status` cannot show a live status; the message is one sentence."""


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


def read_status(state_dir: str | os.PathLike, now_ns: int | None = None, check_live: bool = True) -> dict[str, Any]:
    """The daemon's last status; raises StatusError (one sentence) when it is absent, dead or stale."""
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
    if not check_live:
        return data
    now_ns = now_ns if now_ns is not None else time.time_ns()
    pid = int(data.get("pid", 0))
    age = (now_ns - int(data.get("updated_ns", 0))) / 1e9
    if data.get("state") == "stopped" or not pid_alive(pid):
        raise StatusError(f"gpuagent is not running: pid {pid} from {path} is gone "
                          f"(last update {age:.0f} s ago).")
    limit = stale_after_s(float(data.get("interval_s", 1.0)))
    if age > limit:
        raise StatusError(f"gpuagent status is stale: {path} was last updated {age:.0f} s ago "
                          f"(more than {limit:.0f} s; pid {pid} may be hung).")
    return data


def write_status(state_dir: str | os.PathLike, data: dict[str, Any]) -> None:
    from gpuagent.agent.batcher import atomic_write
    atomic_write(Path(state_dir) / STATUS_FILE, json.dumps(data, separators=(",", ":")).encode(),
                 fsync=False, mode=0o644)


# -------------------------------------------------------------------- rendering

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


def render(data: dict[str, Any], now_ns: int | None = None) -> str:
    now_ns = now_ns if now_ns is not None else time.time_ns()
    node = data.get("node", {})
    fp = data.get("fingerprint", {})
    out = []
    out.append(f"gpuagent {data.get('agent_version', '?')}  pid {data.get('pid')}  "
               f"up {(now_ns - data.get('started_ns', now_ns)) / 1e9:.0f} s  "
               f"updated {_ago(data.get('updated_ns', 0), now_ns)}  interval {data.get('interval_s')} s")
    labels = node.get("labels") or {}
    out.append(f"node      {node.get('hostname', '?')}  id {node.get('node_id') or '(not registered yet)'}  "
               f"machine {node.get('machine_id', '?')[:12]}")
    if labels:
        out.append("labels    " + "  ".join(f"{k}={v}" for k, v in sorted(labels.items())))
    virt = fp.get("virt_type") or "?"
    cont = fp.get("container_runtime") or ("yes" if fp.get("in_container") else "none")
    out.append(f"virt      {virt} (virtualized: {str(bool(fp.get('virtualized'))).lower()})  container: {cont}  "
               f"hypervisor vendor: {fp.get('cpuid_hypervisor_vendor') or '-'}  "
               f"DMI: {fp.get('dmi_sys_vendor') or '-'} / {fp.get('dmi_product_name') or '-'}  "
               f"clocksource: {fp.get('clocksource') or '-'}")
    if fp.get("container_markers"):
        out.append("          container markers: " + ", ".join(fp["container_markers"]))
    host = data.get("host") or {}
    if host:
        out.append(f"host      cpu busy {_fmt(host.get('cpu_busy_percent'), '.1f', '%')}  steal "
                   f"{_fmt(host.get('cpu_steal_percent'), '.1f', '%')}  iowait {_fmt(host.get('cpu_iowait_percent'), '.1f', '%')}  "
                   f"load1 {_fmt(host.get('load1'), '.2f')}  mem {_fmt_bytes(host.get('mem_used_bytes'))} / "
                   f"{_fmt_bytes(host.get('mem_total_bytes'))}")

    gpus = data.get("gpus") or []
    out.append("")
    if gpus:
        out.append(f"GPUs ({len(gpus)})")
        rows = [[str(g.get("index")), (g.get("name") or "?")[:28], _fmt(g.get("util_percent"), ".0f", "%"),
                 f"{_fmt_bytes(g.get('memory_used_bytes'))} / {_fmt_bytes(g.get('memory_total_bytes'))}",
                 _fmt(g.get("temperature_celsius"), ".0f", " C"),
                 f"{_fmt(g.get('power_watts'), '.0f')} / {_fmt(g.get('power_limit_watts'), '.0f')} W",
                 ",".join(g.get("throttle_reasons") or []) or "-"] for g in gpus]
        out.append(_table(["gpu", "name", "util", "memory", "temp", "power", "throttle"], rows))
    else:
        out.append("GPUs      none visible" + (f" ({data['gpu_note']})" if data.get("gpu_note") else ""))

    jobs = data.get("jobs") or []
    out.append("")
    if jobs:
        out.append(f"Jobs ({len(jobs)})")
        rows = [[j.get("job_id", "?"), str(j.get("pid", "")), str(j.get("rank", "")), str(j.get("gpu", "")),
                 _fmt(j.get("gpu_util_percent"), ".0f", "%"), _fmt(j.get("cpu_percent"), ".0f", "%"),
                 _fmt_bytes(j.get("rss_bytes")),
                 _fmt(j.get("steps_per_s"), ".2f") if j.get("steps_per_s") is not None else "-"] for j in jobs]
        out.append(_table(["job", "pid", "rank", "gpu", "gpu util", "cpu", "rss", "steps/s"], rows))
    else:
        out.append("Jobs      none active")
    throughput = data.get("job_throughput") or []
    if throughput:
        out.append("")
        out.append("Training throughput (gpuagent.jobs tracker, last window)")
        rows = [[t.get("job_id", "?"), (t.get("job_name") or "-")[:24],
                 ",".join(str(r) for r in t.get("ranks") or []) or "-",
                 _fmt(t.get("steps_per_s"), ".2f"), _fmt(t.get("samples_per_s"), ".1f"),
                 _fmt(t.get("tokens_per_s"), ".0f") if t.get("tokens_per_s") else "-",
                 _fmt((t.get("step_time_p50_s") or 0) * 1000, ".1f", " ms"),
                 _fmt((t.get("data_wait_fraction") or 0) * 100, ".0f", "%")
                 if (t.get("data_wait_fraction") is not None and t.get("data_wait_fraction") >= 0) else "-"]
                for t in throughput]
        out.append(_table(["job", "name", "ranks", "steps/s", "samples/s", "tokens/s", "step p50", "data wait"],
                          rows))

    probes = data.get("probes") or {}
    out.append("")
    if probes:
        out.append("Probes (last result)")
        rows = []
        for name, p in sorted(probes.items()):
            metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted((p.get("metrics") or {}).items())[:4])
            rows.append([name, p.get("status", "?"), _ago(p.get("ended_ns", 0), now_ns),
                         (p.get("reason") or metrics)[:70]])
        out.append(_table(["probe", "status", "when", "metrics / reason"], rows))
    else:
        out.append("Probes    no results yet")

    link = data.get("collector") or {}
    sp = data.get("spool") or {}
    out.append("")
    state = "connected" if link.get("connected") else "NOT connected"
    out.append(f"collector {link.get('collector', '?')}  {state} (since {_ago(link.get('since_ns', 0), now_ns)})  "
               f"last ack seq {link.get('last_ack_seq', 0)} {_ago(link.get('last_ack_ns', 0), now_ns)}")
    if link.get("last_error") and not link.get("connected"):
        out.append(f"          last error: {link['last_error']}")
    out.append(f"spool     backlog {sp.get('backlog_batches', 0)} batches / {_fmt_bytes(sp.get('backlog_bytes', 0))} "
               f"(max {_fmt_bytes(sp.get('max_bytes'))})  dropped {sp.get('dropped_batches', 0)} batches / "
               f"{sp.get('dropped_samples', 0)} samples  corrupt files {sp.get('corrupt_files', 0)}  "
               f"rejected {sp.get('rejected_batches', 0)}")
    unavailable = data.get("unavailable") or []
    if unavailable:
        out.append("")
        out.append("Unavailable")
        for u in unavailable[:20]:
            out.append(f"  - {u}")
    return "\n".join(out)
