"""This node's hardware health: the agent's per-tick health section and the one-shot `gpuagent health`.

The rules are not here: :func:`gpuagent.common.hardware_faults.node_faults` (common/hardware_faults.toml,
the one place with the XID catalog, thresholds, severities, actions and their sources) judges the
readings, so the node and the collector can never disagree. This module only gathers the readings:

- in the agent, :func:`health_status` (called by the daemon's status snapshot each tick) keeps the
  health-relevant series from the batcher's latest values, a history of them for the counter rules'
  window, and the hardware events of that window, and puts the verdict in ``StatusSnapshot.health``;
- without a running agent, :func:`check_local` reads NVML once through the GPU sampler's own read code
  (gpuagent.common.nvml, no second NVML client) and sysfs / the kernel log through agent/samplers/hw_host.py's
  sampler.

:func:`check` (`gpuagent health`) picks the source and :func:`verdict` turns the section into one state
(OK / WARNING / CRITICAL / UNKNOWN) with Nagios' exit codes and node-problem-detector's (docs/HEALTH.md).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

from gpuagent.agent.snapshot import (GpuStatus, HardwareFault, HealthEvent, HealthReading, HealthStatus,
                                     JobStatus, StatusError, read_status)

log = logging.getLogger("gpuagent.health")

# Events that are hardware evidence (docs/METRICS.md, common/hardware_faults.toml [[event]]), and the
# agent's start, which the rules read as "the node restarted" (link flaps during a planned reboot).
HARDWARE_EVENT_KINDS = frozenset({"xid", "sxid", "nvidia_driver_error", "gpu_lost"})
WINDOW_S = 3600.0          # the counter rules look back this far (their thresholds are per hour)
MIN_WINDOW_S = 300.0       # a younger history is judged as if it spanned this (no rate from a few seconds)
HISTORY_EVERY_S = 60.0     # one history point per minute
JUDGE_EVERY_S = 10.0       # the agent judges at most this often (and at once on a new hardware event)
MAX_EVENTS = 200           # hardware events kept for the window (newest)

OK, WARNING, CRITICAL, UNKNOWN = "OK", "WARNING", "CRITICAL", "UNKNOWN"
NAGIOS_EXIT = {OK: 0, WARNING: 1, CRITICAL: 2, UNKNOWN: 3}
# node-problem-detector's custom plugin protocol (pkg/custompluginmonitor/types/types.go and plugin.go):
# exit 0 OK, 1 NonOK, anything else Unknown.
NPD_EXIT = {OK: 0, WARNING: 1, CRITICAL: 1, UNKNOWN: 2}


@lru_cache(maxsize=1)
def health_metrics() -> frozenset[str]:
    """Every batcher metric a hardware-fault rule reads (its metric, maximum and load metric)."""
    from gpuagent.common.hardware_faults import rules
    out: set[str] = set()
    for r in rules().rules:
        out.update(m for m in (r.metric, r.max_metric, r.load_metric) if m)
    return frozenset(out)


SeriesKey = tuple[str, int, tuple[tuple[str, str], ...]]


def _readings(latest: Mapping[SeriesKey, float]) -> list[HealthReading]:
    """The host series (InfiniBand ports, Ethernet links) the rules read; the GPUs' are in the snapshot's
    GpuStatus rows (their health fields), so the status file carries each value once."""
    return [HealthReading(metric=m, gpu=g, value=float(v), labels=dict(lab) or None)
            for (m, g, lab), v in sorted(latest.items()) if g < 0]


def _event_dict(e: HealthEvent) -> dict[str, Any]:
    return {"ts_ns": e.ts_ns, "kind": e.kind, "gpu": e.gpu, "value": e.value, "attrs": e.attrs or {},
            "message": e.message}


def _rules():
    from gpuagent.common.hardware_faults import rules
    return rules()


def _is_application_xid(e: HealthEvent) -> bool:
    from gpuagent.common.hardware_faults import xid_rule
    try:
        return xid_rule(int(e.value or float((e.attrs or {}).get("xid", 0)))).application
    except Exception:  # noqa: BLE001 - an unparsable XID or unreadable rules: not kept past the window
        return False


def judge(latest: Mapping[SeriesKey, float], previous: Mapping[SeriesKey, float] | None,
          events: Sequence[HealthEvent], window_s: float, now_ns: int, checked: list[str],
          not_checked: list[str]) -> HealthStatus:
    """The rules over one set of readings; a failure of the rules is one sentence in ``error``."""
    from gpuagent.common.hardware_faults import RulesError, node_faults, rules
    faults: list[HardwareFault] = []
    error = None
    try:
        grace_ns = int(rules().reboot_grace_s * 1e9)
        # agent_start silences the link-flap rules only within the reboot grace (the rules read any
        # agent_start they are given as "the node just restarted").
        evs = [_event_dict(e) for e in events if e.kind != "agent_start" or now_ns - e.ts_ns <= grace_ns]
        # events older than the window only count towards an application XID's repeats (forget_before)
        for f in node_faults(latest, previous, evs, window_s, now_ns, events_since_ns=now_ns - int(WINDOW_S * 1e9)):
            faults.append(HardwareFault(component=f.component, severity=f.severity, subject=f.subject, gpu=f.gpu,
                                        sentence=f.sentence, action=f.action, source=f.source,
                                        evidence=dict(f.evidence) or None, rule=f.rule))
    except (RulesError, OSError) as exc:
        error = f"the hardware-fault rules could not be read: {exc}"
    except Exception as exc:  # noqa: BLE001 - a rule bug must not take the status file down
        error = f"the hardware-fault rules failed: {type(exc).__name__}: {exc}"
    return HealthStatus(checked_ns=now_ns, window_s=window_s, faults=faults, readings=_readings(latest),
                        events=list(events), checked=checked, not_checked=not_checked, error=error)


# ------------------------------------------------------------------------------------- in the agent

@dataclass
class _Tracker:
    """One agent's health memory: a history of the health readings and the hardware events of the window."""
    history: deque = field(default_factory=deque)          # (ts_ns, {key: value}), oldest first
    events: deque = field(default_factory=deque)           # (identity, HealthEvent), in arrival order
    seen: set = field(default_factory=set)                 # the identities in ``events``
    last: HealthStatus | None = None                       # the latest verdict (reused for JUDGE_EVERY_S)
    last_gpus: int = 0

    def add_events(self, recent: Iterable[Mapping[str, Any]], jobs_on: Mapping[int, list[str]]) -> int:
        """The batcher's recent events (it keeps the last 20) not seen before; the hardware ones are kept.
        Returns how many were new."""
        n = len(self.events)
        for e in recent:
            kind = str(e.get("kind", ""))
            if kind not in HARDWARE_EVENT_KINDS and kind != "agent_start":
                continue
            attrs = {str(k): str(v) for k, v in (e.get("attrs") or {}).items()}
            ident = (e.get("ts_ns"), kind, e.get("gpu"), e.get("value"), e.get("message"), tuple(sorted(attrs.items())))
            if ident in self.seen:
                continue
            self.seen.add(ident)
            gpu = int(e.get("gpu", -1))
            if kind == "xid" and "job_id" not in attrs and jobs_on.get(gpu):
                # the job on that GPU when the XID came: application XIDs are the job's (common/hardware_faults.py)
                attrs["job_id"] = ",".join(jobs_on[gpu])
            self.events.append((ident, HealthEvent(ts_ns=int(e.get("ts_ns", 0)), kind=kind, gpu=gpu,
                                                   value=float(e.get("value") or 0.0),
                                                   message=str(e.get("message", "")), attrs=attrs or None)))
        return len(self.events) - n

    def forget_before(self, ts_ns: int, now_ns: int | None = None) -> None:
        """Forget events before ts_ns, except application XIDs younger than the rules' repeat window (24 h):
        a second one on the same GPU within it is escalated, as the collector does (MAX_EVENTS bounds both)."""
        keep_ns = ts_ns
        if now_ns is not None:
            try:
                keep_ns = now_ns - int(_rules().application_repeat_window_s * 1e9)
            except Exception:  # noqa: BLE001 - unreadable rules: judge() says so; keep the plain window
                pass
        kept = deque()
        for ident, e in self.events:
            app = e.kind == "xid" and _is_application_xid(e)
            if e.ts_ns >= ts_ns or (app and e.ts_ns >= keep_ns):
                kept.append((ident, e))
            else:
                self.seen.discard(ident)
        while len(kept) > MAX_EVENTS:
            self.seen.discard(kept.popleft()[0])
        self.events = kept
        while len(self.history) > 1 and self.history[1][0] <= ts_ns:
            self.history.popleft()

    def window_events(self) -> list[HealthEvent]:
        return [e for _ident, e in self.events]


_TRACKERS: weakref.WeakKeyDictionary[Any, _Tracker] = weakref.WeakKeyDictionary()


def health_status(batcher: Any, gpus: Mapping[int, GpuStatus], jobs: Sequence[JobStatus] = (),
                  now_ns: int | None = None, latest_values: Mapping[SeriesKey, tuple[int, float]] | None = None
                  ) -> HealthStatus:
    """The daemon's health section for this tick (agent/daemon.py status_snapshot calls it once per tick).

    Reads the batcher's latest values and recent events (nothing is re-measured), sets the labelled health
    fields of ``gpus`` (retired pages by cause, NVLink errors and link state per link, clock-event seconds
    per reason), and judges the readings against the window's history. ``gpus`` are the snapshot's own
    GpuStatus rows, changed in place. Never raises: a failure is the section's ``error`` (one sentence)."""
    now = now_ns if now_ns is not None else time.time_ns()
    try:
        return _health_status(batcher, gpus, jobs, now, latest_values)
    except Exception as exc:  # the status file must still be written
        log.exception("judging the node's hardware health failed")
        return HealthStatus(checked_ns=now, window_s=0.0, faults=[], readings=[], events=[], checked=[],
                            not_checked=[], error=f"judging hardware health failed: {type(exc).__name__}: {exc}")


def _health_status(batcher: Any, gpus: Mapping[int, GpuStatus], jobs: Sequence[JobStatus], now: int,
                   latest_values: Mapping[SeriesKey, tuple[int, float]] | None = None) -> HealthStatus:
    tracker = _TRACKERS.get(batcher)
    if tracker is None:
        tracker = _TRACKERS[batcher] = _Tracker()
    wanted = health_metrics()
    every = batcher.latest_values() if latest_values is None else latest_values
    latest = {key: v for key, (_ts, v) in every.items() if key[0] in wanted}
    _fill_gpus(latest, gpus)
    jobs_on: dict[int, list[str]] = {}
    for j in jobs:
        if j.gpu is not None and j.gpu >= 0 and j.job_id not in jobs_on.setdefault(j.gpu, []):
            jobs_on[j.gpu].append(j.job_id)
    new_events = tracker.add_events(batcher.last_events(20), jobs_on)
    tracker.forget_before(now - int(WINDOW_S * 1e9), now)
    if not tracker.history or now - tracker.history[-1][0] >= HISTORY_EVERY_S * 1e9:
        tracker.history.append((now, latest))
    last = tracker.last
    if last is not None and not new_events and 0 <= now - last.checked_ns < JUDGE_EVERY_S * 1e9 \
            and len(gpus) == tracker.last_gpus:
        return last          # judged less than JUDGE_EVERY_S ago and no new hardware event since
    prev_ts, previous = tracker.history[0]
    window = max((now - prev_ts) / 1e9, MIN_WINDOW_S)
    checked = _checked_from(latest, gpus)
    not_checked = [] if gpus else ["GPUs not checked: the agent reads no GPU (`gpuagent status` lists what is unavailable)."]
    tracker.last = judge(latest, previous if prev_ts < now else None, tracker.window_events(), window, now, checked,
                         not_checked)
    tracker.last_gpus = len(gpus)
    return tracker.last


def _fill_gpus(latest: Mapping[SeriesKey, float], gpus: Mapping[int, GpuStatus]) -> None:
    for (metric, gpu, labels), v in latest.items():
        g = gpus.get(gpu)
        if g is None or not labels:
            continue
        lab = dict(labels)
        if metric == "gpu_retired_pages_total":
            cause = lab.get("cause")
            if cause == "single_bit_ecc":
                g.retired_pages_sbe_total = v
            elif cause == "double_bit_ecc":
                g.retired_pages_dbe_total = v
        elif metric == "gpu_nvlink_errors_total" and "link" in lab and "counter" in lab:
            if g.nvlink_errors is None:
                g.nvlink_errors = {}
            g.nvlink_errors.setdefault(lab["link"], {})[lab["counter"]] = v
        elif metric == "gpu_nvlink_link_up" and "link" in lab:
            if g.nvlink_link_up is None:
                g.nvlink_link_up = {}
            g.nvlink_link_up[lab["link"]] = v
        elif metric == "gpu_clock_event_duration_seconds_total" and "reason" in lab:
            if g.clock_event_seconds is None:
                g.clock_event_seconds = {}
            g.clock_event_seconds[lab["reason"]] = v


def _checked_from(latest: Mapping[SeriesKey, float], gpus: Mapping[int, GpuStatus] | int) -> list[str]:
    """What the readings cover, for the summary line: "8 GPUs (NVML)", "8 InfiniBand/RoCE ports", ..."""
    n = gpus if isinstance(gpus, int) else len(gpus)
    out = [f"{n} GPU{'s' if n != 1 else ''} (NVML)"] if n else []
    ports = {(dict(k[2]).get("device"), dict(k[2]).get("port")) for k in latest if k[0] == "ib_port_state"}
    if ports:
        out.append(f"{len(ports)} InfiniBand/RoCE port{'s' if len(ports) != 1 else ''}")
    nics = {dict(k[2]).get("device") for k in latest if k[0].startswith("net_")}
    if nics:
        out.append(f"{len(nics)} Ethernet interface{'s' if len(nics) != 1 else ''}")
    return out


# ------------------------------------------------------------------------------------- without an agent

def check_local(nvml: Any = None, sys_root: str = "/sys", kmsg_path: str | None = "/dev/kmsg",
                proc_root: str = "/proc", now_ns: int | None = None) -> HealthStatus:
    """One reading of this node without the agent: NVML through the GPU sampler, then agent/samplers/hw_host.py's
    sampler (InfiniBand / RoCE ports, Ethernet links, the kernel log's XIDs, SXIDs and driver errors of the
    last WINDOW_S). Counter rules need two readings, so only state rules (pending remaps, links down,
    ports not ACTIVE, ...) and events can fire here."""
    from gpuagent.agent.samplers.gpu import GpuSampler
    from gpuagent.agent.samplers.sampling import ListSink
    from gpuagent.common.nvml import Nvml
    now = now_ns if now_ns is not None else time.time_ns()
    sink = ListSink()
    not_checked: list[str] = []
    n_gpus = 0
    buses: dict[str, int] = {}
    nv = nvml if nvml is not None else Nvml()
    if nv.available:
        sampler = GpuSampler(nvml=nv, sys_root=sys_root)
        try:
            sampler.sample(now, sink)
            n_gpus = nv.device_count
            buses = {str(g.get("pci_bus_id") or ""): int(g["index"]) for g in sampler.gpu_inventory()}
        finally:
            sampler.close()
        if n_gpus == 0:
            not_checked.append("GPUs not checked: NVML sees no GPU.")
    else:
        not_checked.append(f"GPUs not checked: {(nv.reason or 'NVML is not available').rstrip('.')}.")
    host_notes, kmsg_read = _host_reads(sink, sys_root, kmsg_path, proc_root, buses, now)
    not_checked += host_notes
    wanted = health_metrics()
    latest = {key: v for key, v in sink.metrics().items() if key[0] in wanted}
    since = now - int(WINDOW_S * 1e9)
    events = [HealthEvent(ts_ns=e.ts_ns, kind=e.kind, gpu=e.gpu, value=e.value, message=e.message,
                          attrs=dict(e.attrs) or None)
              for e in sink.events if e.kind in HARDWARE_EVENT_KINDS and e.ts_ns >= since]
    checked = _checked_from(latest, n_gpus) + (["kernel log"] if kmsg_read else [])
    return judge(latest, None, events, 0.0, now, checked, not_checked)


def _host_reads(sink: Any, sys_root: str, kmsg_path: str | None, proc_root: str, buses: Mapping[str, int],
                now_ns: int) -> tuple[list[str], bool]:
    """agent/samplers/hw_host.py's sampler, once (the kernel log to its end): (one sentence per source not read,
    whether the kernel log was read)."""
    try:
        from gpuagent.agent.samplers.hw_host import HwHostSampler, bus_key
    except ImportError:
        return ["InfiniBand, Ethernet and the kernel log not checked (this gpuagent has no agent/samplers/hw_host.py)."], False
    by_bus = {bus_key(b): i for b, i in buses.items() if b}
    hw = HwHostSampler(sys_root=sys_root, proc_root=proc_root, kmsg_path=kmsg_path, state_dir=None, kmsg=bool(kmsg_path),
                       holdback_s=0.0, gpu_for_bus=lambda b: by_bus.get(bus_key(b)))
    try:
        for _ in range(20):                    # the ring is read in chunks; 20 x 5000 records at most
            before = hw.kmsg.records if hw.kmsg is not None else 0
            hw.sample(now_ns, sink)
            if hw.kmsg is None or hw.kmsg.records == before:
                break
        notes = [_sentence(n) for n in hw.unavailable]
        kmsg_read = hw.kmsg is not None and hw.kmsg.unavailable is None
    finally:
        if hw.kmsg is not None:
            hw.kmsg.close()
    if not kmsg_path:
        notes.append("Kernel log not checked (no kernel-log path).")
    return notes, kmsg_read


def _sentence(text: str) -> str:
    text = str(text).strip()
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


# ------------------------------------------------------------------------------------- the verdict

@dataclass
class Verdict:
    state: str                       # OK | WARNING | CRITICAL | UNKNOWN
    summary: str                     # the first line
    lines: list[str]                 # one per fault (with its action), then notes
    health: HealthStatus | None
    origin: str                      # "agent" (its status file) | "local" (this command's own reads)

    def exit_code(self, fmt: str = "nagios") -> int:
        return (NPD_EXIT if fmt == "npd" else NAGIOS_EXIT)[self.state]


def verdict(h: HealthStatus | None, origin: str, notes: Sequence[str] = (), age_s: float | None = None) -> Verdict:
    """OK / WARNING / CRITICAL from the faults; UNKNOWN when nothing was read or the rules failed."""
    notes = list(notes)
    if h is None:
        return Verdict(UNKNOWN, "HEALTH UNKNOWN: " + (notes[0] if notes else "nothing could be read."),
                       notes[1:], None, origin)
    where = "the running agent's check" + (f" {age_s:.0f} s ago" if age_s is not None else "") \
        if origin == "agent" else "read by this command, not the agent"
    notes += h.not_checked
    if h.error:
        return Verdict(UNKNOWN, f"HEALTH UNKNOWN: {h.error}", notes, h, origin)
    if not h.checked:
        return Verdict(UNKNOWN, "HEALTH UNKNOWN: nothing could be read on this node" +
                       (f": {notes[0]}" if notes else "."), notes[1:], h, origin)
    gpus_read = any("(NVML)" in c for c in h.checked)
    if not h.faults and not gpus_read:
        # the GPUs are what this check is for: a node whose GPUs cannot be read is not OK, it is unknown
        why = next((n for n in notes if n.startswith("GPUs not checked")), "GPUs not checked.")
        return Verdict(UNKNOWN, f"HEALTH UNKNOWN: {why}", [n for n in notes if n != why], h, origin)
    crit = [f for f in h.faults if f.severity == "critical"]
    warn = [f for f in h.faults if f.severity != "critical"]
    lines = [f"{f.severity.upper()} {f.component}: {f.sentence}" for f in crit + warn]
    what = ", ".join(h.checked)
    if not h.faults:
        return Verdict(OK, f"HEALTH OK: no hardware faults on {what} ({where}).", notes, h, origin)
    state = CRITICAL if crit else WARNING
    counts = ", ".join(x for x in (f"{len(crit)} critical" if crit else "", f"{len(warn)} warning" if warn else "")
                       if x)
    return Verdict(state, f"HEALTH {state}: {len(h.faults)} hardware fault{'s' if len(h.faults) != 1 else ''} "
                   f"({counts}) on {what} ({where}).", lines + notes, h, origin)


def check(state_dir: str, source: str = "auto", nvml: Any = None, sys_root: str = "/sys",
          kmsg_path: str | None = "/dev/kmsg", proc_root: str = "/proc", now_ns: int | None = None) -> Verdict:
    """`gpuagent health`: the running agent's verdict (``source`` "agent"), this command's own reads
    ("local"), or the agent's when it runs and reports health, else its own ("auto")."""
    now = now_ns if now_ns is not None else time.time_ns()
    notes: list[str] = []
    if source in ("auto", "agent"):
        try:
            snap = read_status(state_dir, now_ns=now)
        except StatusError as exc:
            if source == "agent":
                return verdict(None, "agent", [str(exc)])
            notes.append(str(exc))
        else:
            if snap.health is not None:
                return verdict(snap.health, "agent", age_s=max(0.0, (now - snap.health.checked_ns) / 1e9))
            why = (f"the running agent (gpuagent {snap.agent_version}, pid {snap.pid}) reports no hardware health; "
                   f"restart it after upgrading.")
            if source == "agent":
                return verdict(None, "agent", [why])
            notes.append(why)
    h = check_local(nvml=nvml, sys_root=sys_root, kmsg_path=kmsg_path, proc_root=proc_root, now_ns=now)
    return verdict(h, "local", notes)


def npd_message(v: Verdict) -> str:
    """node-problem-detector's condition message: NPD takes the plugin's whole stdout, trimmed, cut at its
    max_output_length (80 by default), so one line, the worst fault first."""
    if v.state == OK:
        return "OK: no hardware faults"
    if v.state == UNKNOWN or v.health is None:
        return v.summary.removeprefix("HEALTH ")
    worst = v.health.faults[0]
    more = len(v.health.faults) - 1       # said first: NPD cuts the end of a long message
    return f"{worst.severity.upper()}" + (f" (+{more} more)" if more else "") + f": {worst.sentence}"
