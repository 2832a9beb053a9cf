"""The programs Slurm runs on a node: HealthCheckProgram, Prolog and Epilog (`gpuagent slurm ...`,
docs/SLURM.md).

None of them judges hardware itself: :func:`gpuagent.agent.surface.health.check` (what `gpuagent health` runs)
gives the verdict, from the running agent's status file or from this command's own NVML and sysfs reads.

- :func:`healthcheck`: on a CRITICAL verdict, drains THIS node with ``scontrol update NodeName=<node>
  State=DRAIN Reason="gpuagent: <fault sentence>"``. Slurm takes no action on a health check program's
  exit code (slurm.conf(5): "Any action to be taken must be explicitly performed by the program"). A node
  that is already draining or drained is left as it is (its reason is someone's, gpuagent's or an
  operator's). It never resumes a node.
- :func:`prolog`: exits 1 on a CRITICAL verdict, so slurmd fails the launch: Slurm 22.05 sets the node
  to DRAIN and requeues the batch job in a held state (unless SchedulerParameters=nohold_on_prolog_fail).
  Before exiting it sets the drain reason to the fault's sentence itself (Slurm's own is "Prolog error"),
  and writes one line to stderr. Anything short of CRITICAL, its own failures included, exits 0:
  a prolog that fails for its own reasons would drain a healthy node.
- :func:`epilog`: one JSON line per job (GPU-hours, effective GPU utilization, the hardware faults it met)
  from the agent's view of the job, appended to ``<state_dir>/slurm-epilog.jsonl`` and printed. It
  always exits 0 (a failing Epilog drains the node).

The node's name is ``SLURMD_NODENAME`` (slurmd sets it for the health check, Prolog and Epilog), else
this host's short name. slurmd gives these programs a bare environment (no PATH): scontrol is looked
up on PATH, else in the usual system folders.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from gpuagent.agent.surface.health import CRITICAL, UNKNOWN, Verdict, check
from gpuagent.common.errors import first_line

REASON_PREFIX = "gpuagent: "
REASON_MAX = 240                   # the reason is one line in sinfo -R; long enough for one sentence
SCONTROL_TIMEOUT_S = 10.0          # HealthCheckProgram is killed after 60 s, the prolog should end within MessageTimeout
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EPILOG_FILE = "slurm-epilog.jsonl"

Runner = Callable[[Sequence[str]], str]


def node_name(env: dict[str, str] | None = None) -> str:
    """SLURMD_NODENAME when slurmd set it, else this host's short name (Slurm's NodeName default)."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def scontrol(args: Sequence[str]) -> str:
    """Run scontrol with a timeout; RuntimeError (one sentence) when it fails."""
    exe = shutil.which("scontrol") or shutil.which("scontrol", path=SYSTEM_PATH)
    if exe is None:
        raise RuntimeError("scontrol is not installed (not on PATH nor in the system folders)")
    try:
        p = subprocess.run([exe, *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S,
                           stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"scontrol {args[0]} did not answer within {SCONTROL_TIMEOUT_S:g} s") from None
    except OSError as exc:
        raise RuntimeError(f"scontrol could not be run: {first_line(exc)}") from None
    if p.returncode != 0:
        why = (p.stderr or p.stdout).strip().splitlines()
        raise RuntimeError(f"scontrol {' '.join(args[:2])} exited {p.returncode}"
                           + (f": {why[0]}" if why else ""))
    return p.stdout


def key_values(line: str) -> dict[str, str]:
    """One ``scontrol show ... -o`` line's Key=Value pairs (the first of each key)."""
    out: dict[str, str] = {}
    for tok in line.split():
        k, sep, v = tok.partition("=")
        if sep and k not in out:
            out[k] = v
    return out


def fault_reason(v: Verdict) -> str:
    """The drain reason: "gpuagent: " and the worst critical fault's sentence (+ how many more)."""
    crit = [f for f in (v.health.faults if v.health else []) if f.severity == "critical"]
    more = f" (+{len(crit) - 1} more critical)" if len(crit) > 1 else ""
    text = (crit[0].sentence if crit else v.summary).replace("\n", " ").strip()
    reason = REASON_PREFIX + text
    if len(reason) + len(more) > REASON_MAX:
        reason = reason[:REASON_MAX - len(more) - 3].rstrip() + "..."
    return reason + more


@dataclass
class HookResult:
    exit_code: int
    lines: list[str]                   # stdout
    err: list[str]                     # stderr


def _verdict(state_dir: str, source: str, **reads: Any) -> Verdict:
    from gpuagent.agent.surface.health import verdict
    try:
        return check(state_dir, source=source, **reads)
    except Exception as exc:  # noqa: BLE001 - a hook answers UNKNOWN, never a traceback
        return verdict(None, source, [f"the check itself failed: {first_line(exc)}"])


def _node_state(node: str, run: Runner) -> str:
    out = run(["show", "node", "-o", node]).strip()
    return key_values(out.splitlines()[0]).get("State", "") if out else ""


def drain(node: str, reason: str, run: Runner = scontrol) -> tuple[bool, str]:
    """Drain ``node`` with ``reason`` unless it is already draining/drained: (drained now, what happened)."""
    state = _node_state(node, run)
    if "DRAIN" in state.upper():
        return False, f"node {node} is already {state}; its reason is left as it is."
    run(["update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"])
    return True, f"drained node {node} (was {state or 'unknown'}): {reason}"


def healthcheck(state_dir: str, source: str = "auto", node: str | None = None, run: Runner = scontrol,
                **reads: Any) -> HookResult:
    """HealthCheckProgram: the health verdict; on CRITICAL, drain this node with the fault's sentence.
    Exit 0 whatever the verdict (Slurm ignores it); 1 only when a needed drain failed."""
    v = _verdict(state_dir, source, **reads)
    lines = [v.summary, *v.lines]
    if v.state != CRITICAL:
        return HookResult(0, lines, [])
    node = node or node_name()
    try:
        _done, what = drain(node, fault_reason(v), run)
    except RuntimeError as exc:
        return HookResult(1, lines, [f"gpuagent slurm healthcheck: could not drain node {node}: {exc}."])
    return HookResult(0, lines + [what], [])


def prolog(state_dir: str, source: str = "auto", node: str | None = None, run: Runner = scontrol,
           env: dict[str, str] | None = None, **reads: Any) -> HookResult:
    """Prolog: exit 1 (Slurm drains the node, requeues the job held) when the node has an open critical
    fault; 0 otherwise, UNKNOWN included. One stderr line either way when there is something to say."""
    env = os.environ if env is None else env
    v = _verdict(state_dir, source, **reads)
    job = env.get("SLURM_JOB_ID", "?")
    if v.state == UNKNOWN:
        return HookResult(0, [], [f"gpuagent prolog: job {job} allowed, health unknown: {v.summary}"])
    if v.state != CRITICAL:
        return HookResult(0, [], [])
    node = node or node_name(env)
    reason = fault_reason(v)
    try:
        drain(node, reason, run)      # Slurm's own reason would be "Prolog error"; say which fault
    except RuntimeError:
        pass                          # Slurm drains it anyway when we exit 1
    return HookResult(1, [], [f"gpuagent prolog: refusing job {job} on {node}: {reason.removeprefix(REASON_PREFIX)}"])


# ------------------------------------------------------------------------------------------ epilog

def _show_job(job_id: str, run: Runner) -> dict[str, str]:
    try:
        out = run(["show", "job", "-o", job_id]).strip()
    except RuntimeError:
        return {}
    return key_values(out.splitlines()[0]) if out else {}


def _slurm_time_ns(text: str | None) -> int | None:
    """scontrol's local time (2026-12-01T18:40:02) -> ns since the epoch; None for Unknown/None."""
    if not text or not text[:1].isdigit():
        return None
    try:
        return int(datetime.fromisoformat(text).timestamp() * 1e9)
    except ValueError:
        return None


def _gpuagent_id(fields: dict[str, str], job_id: str) -> str:
    from gpuagent.agent.schedulers.slurm import parse_show_job
    job = parse_show_job(" ".join(f"{k}={v}" for k, v in fields.items())) if fields else None
    return job.gpuagent_job_id if job is not None else f"slurm:{job_id}"


def _agent_view(state_dir: str, gid: str, wait_s: float) -> tuple[Any, dict[str, Any] | None, list[str]]:
    """(snapshot or None, the job's job_end event or None, notes). Waits up to ``wait_s`` for the job_end
    the agent emits ``[jobs] end_grace_s`` after the job's last process is gone, when the agent saw the job."""
    from gpuagent.agent.snapshot import StatusError, read_status
    end = time.monotonic() + wait_s
    while True:
        try:
            snap = read_status(state_dir)
        except StatusError as exc:
            return None, None, [f"no agent view: {exc}"]
        evs = [e for e in snap.recent_events if (e.attrs or {}).get("job_id") == gid]
        job_end = next((e for e in reversed(evs) if e.kind == "job_end"), None)
        seen = evs or any(j.job_id == gid for j in snap.jobs)
        if job_end is not None or not seen or time.monotonic() >= end:
            notes = [] if seen else [(f"the agent did not see {gid} (no GPU process of it, or its job_start "
                                      f"left the status file's last events).")]
            return snap, job_end, notes
        time.sleep(0.25)


def epilog_record(state_dir: str, env: dict[str, str] | None = None, run: Runner = scontrol, wait_s: float = 10.0,
                  now_ns: int | None = None) -> dict[str, Any]:
    """The job's record: GPU-hours, effective GPU utilization (mean SM utilization of its GPUs, a fraction)
    and the faults it met, from the agent's view, Slurm's times where the agent has none."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id:
        raise ValueError("SLURM_JOB_ID is not set: `gpuagent slurm epilog` is for slurm.conf's Epilog")
    fields = _show_job(job_id, run)
    gid = _gpuagent_id(fields, job_id)
    snap, job_end, notes = _agent_view(state_dir, gid, wait_s)
    now = now_ns if now_ns is not None else time.time_ns()
    rec: dict[str, Any] = {
        "ts": datetime.fromtimestamp(now / 1e9).astimezone().isoformat(timespec="seconds"),
        "slurm_job_id": job_id, "job_id": gid, "node": node_name(env),
        "user": _clean(env.get("SLURM_JOB_USER") or fields.get("UserId", "").split("(", 1)[0]),
        "partition": _clean(env.get("SLURM_JOB_PARTITION") or fields.get("Partition")),
        "account": _clean(env.get("SLURM_JOB_ACCOUNT") or fields.get("Account")),
        "gpus": [], "duration_s": None, "gpu_hours": None, "effective_gpu_util": None, "util_basis": None,
        "faults": [], "source": "agent" if snap is not None else "slurm", "notes": notes,
    }
    start_ns = _slurm_time_ns(fields.get("StartTime"))
    if job_end is not None:
        a = job_end.attrs or {}
        gpus = sorted({int(g) for g in a.get("gpus", "").split(",") if g.strip().lstrip("-").isdigit()})
        dur = float(a.get("duration_s") or 0.0)
        util = job_end.value if job_end.value is not None and job_end.value == job_end.value else None
        rec.update(gpus=gpus, duration_s=round(dur, 3), util_basis="job_end (mean over the job's life)",
                   effective_gpu_util=None if util is None else round(util / 100.0, 4))
    elif snap is not None:
        rows = [j for j in snap.jobs if j.job_id == gid and j.gpu is not None and j.gpu >= 0]
        gpus = sorted({j.gpu for j in rows})
        starts = [int((e.attrs or {}).get("started_ns") or 0) for e in snap.recent_events
                  if e.kind == "job_start" and (e.attrs or {}).get("job_id") == gid]
        start = next((s for s in starts if s > 0), None) or start_ns
        utils = [j.gpu_util_percent for j in rows if j.gpu_util_percent is not None]
        rec.update(gpus=gpus, duration_s=None if start is None else round(max(0.0, (now - start) / 1e9), 3))
        if utils:
            rec.update(effective_gpu_util=round(sum(utils) / len(utils) / 100.0, 4),
                       util_basis="last sample (the agent's job_end had not come)")
    else:
        gres = key_values(fields.get("TRES", "").replace(",", " ")).get("gres/gpu")
        rec["gpus"] = [] if not gres else list(range(int(gres))) if gres.isdigit() else []
        end_ns = _slurm_time_ns(fields.get("EndTime")) or now
        rec["duration_s"] = None if start_ns is None else round(max(0.0, (min(end_ns, now) - start_ns) / 1e9), 3)
    if rec["duration_s"] is not None:
        rec["gpu_hours"] = round(rec["duration_s"] * len(rec["gpus"]) / 3600.0, 6)
    if snap is not None and snap.health is not None:
        rec["faults"] = _faults_met(snap.health, gid, set(rec["gpus"]))
    return rec


def _clean(v: str | None) -> str | None:
    return None if not v or v in ("(null)", "N/A") else v


def _faults_met(health: Any, gid: str, gpus: set[int]) -> list[dict[str, Any]]:
    """The open faults on the job's GPUs (or the host's) and the hardware events the agent tied to the job."""
    out = [{"severity": f.severity, "component": f.component, "subject": f.subject, "sentence": f.sentence}
           for f in health.faults if f.gpu < 0 or f.gpu in gpus]
    for e in health.events:
        if gid in (e.attrs or {}).get("job_id", "").split(","):
            out.append({"event": e.kind, "gpu": e.gpu, "value": e.value, "message": e.message})
    return out


def epilog(state_dir: str, env: dict[str, str] | None = None, run: Runner = scontrol, wait_s: float = 10.0) -> HookResult:
    """Epilog: the job's record appended to <state_dir>/slurm-epilog.jsonl and printed; always exit 0."""
    try:
        rec = epilog_record(state_dir, env=env, run=run, wait_s=wait_s)
    except ValueError as exc:
        return HookResult(0, [], [f"gpuagent slurm epilog: {exc}."])
    except Exception as exc:  # noqa: BLE001 - an Epilog that fails drains the node: say it, exit 0
        why = f"{type(exc).__name__}: {first_line(exc)}"
        return HookResult(0, [], [f"gpuagent slurm epilog: the job's record failed: {why}."])
    line = json.dumps(rec, sort_keys=True)
    err: list[str] = []
    path = Path(state_dir) / EPILOG_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError as exc:
        err.append(f"gpuagent slurm epilog: could not append to {path}: {first_line(exc)}.")
    return HookResult(0, [line], err)
