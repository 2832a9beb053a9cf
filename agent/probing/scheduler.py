"""The agent's probe scheduler: runs active probes now and then, out of the way of real work.

* Each probe has an interval with jitter (so a fleet does not probe in lockstep).
* A node-wide flock (gpuagent.probes.lock) means no two probe runs overlap on the node, also with a
  second agent or a manual `gpuagent probe run`.
* Gating (unless ``force``): probes that use the GPUs run only when ``busy_gpus()`` (from job discovery)
  is empty; the storage probe runs only when its target disk is quiet (busy % and IOPS under thresholds,
  from ``disk_activity`` — e.g. the host sampler's last values — or a short /proc/diskstats reading).
* A time budget: probe wall time within a sliding window stays under ``budget_fraction`` of the window
  (default 2 % of an hour = 72 s); a run that would exceed it is skipped with reason "budget". Fabric
  pair runs (agent/probing/fabric.py) are charged to the same window; every run is charged before it releases
  the probe lock and checks the budget again once it holds it, so neither side misses the other's run.
* Probes run in subprocesses (gpuagent.probes.runner) on this scheduler's own thread, so the sampling
  tick never waits for them; results, skipped ones too (with their reason), go to ``sink.probe_result``.
This module imports no torch: the registry and runner are torch-free.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time
from typing import Any, Callable, Iterable, Mapping

from gpuagent.agent.config import ProbesConfig
from gpuagent.common.background import BackgroundThread
from gpuagent.probes import blockdev, registry
from gpuagent.probes.lock import LOCK_NAME, ProbeLock, default_state_dir
from gpuagent.probes.result import ProbeResult
from gpuagent.probes.runner import run_probe

log = logging.getLogger(__name__)

DiskActivity = Callable[[str], "tuple[float, float] | None"]


class ProbeScheduler:
    """Wire it in the daemon: ``ProbeScheduler(sink, cfg, busy_gpus=..., gpu_count=...).start()`` and
    ``.stop()`` at shutdown (which also kills an in-flight probe)."""

    def __init__(self, sink: Any, config: ProbesConfig | None = None, *,
                 busy_gpus: Callable[[], Iterable[int]] | None = None,
                 gpu_count: Callable[[], int] | None = None,
                 disk_activity: DiskActivity | None = None,
                 runner: Callable[..., ProbeResult] = run_probe,
                 rng: random.Random | None = None, state_dir: str | None = None) -> None:
        self.sink = sink
        self.config = config or ProbesConfig.from_mapping({})
        self.busy_gpus = busy_gpus
        self.gpu_count = gpu_count
        self.disk_activity = disk_activity or self.diskstats_activity
        self._runner = runner
        self._rng = rng or random.Random()
        self.lock_path = self.config.lock_path or os.path.join(state_dir or default_state_dir(), LOCK_NAME)
        self._lock = ProbeLock(self.lock_path)
        self._worker = BackgroundThread("probe-scheduler", self._loop)
        self._stop = self._worker.stopping
        self._window: collections.deque[tuple[float, float]] = collections.deque()  # (end monotonic, seconds)
        self._window_mu = threading.Lock()     # the fabric thread charges and checks it too
        self._last_duration: dict[str, float] = {}
        self._due: dict[str, float] = {}
        self.counts: collections.Counter[str] = collections.Counter()  # "<probe>:<status>"

    # ---------------------------------------------------------------- scheduling
    def _jittered(self, interval: float) -> float:
        j = self.config.jitter_fraction
        return interval * (1.0 + self._rng.uniform(-j, j))

    def start(self) -> None:
        if self._worker.started or not self.config.enabled:
            return
        now = time.monotonic()
        for s in self.config.schedules:
            if s.enabled:
                spread = self._rng.uniform(0, self.config.jitter_fraction * s.interval_s)
                self._due[s.name] = now + self.config.initial_delay_s + spread
        self._worker.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; an in-flight probe is killed (its process group) and recorded as cancelled."""
        self._worker.stop(timeout)

    def next_due(self) -> dict[str, float]:
        """Seconds until each enabled probe is due (for `gpuagent status`)."""
        now = time.monotonic()
        return {k: max(0.0, v - now) for k, v in self._due.items()}

    def _loop(self) -> None:
        while not self._stop.is_set() and self._due:
            name, due = min(self._due.items(), key=lambda kv: kv[1])
            if self._stop.wait(max(0.0, due - time.monotonic())):
                break
            try:
                self.run_once(name)
            except Exception:  # never let one probe's trouble stop the scheduler
                log.exception("probe %s: scheduler error", name)
            self._due[name] = time.monotonic() + self._jittered(self.config.schedule(name).interval_s)

    # ---------------------------------------------------------------- budget
    def budget_used_s(self) -> float:
        cutoff = time.monotonic() - self.config.budget_window_s
        with self._window_mu:
            while self._window and self._window[0][0] < cutoff:
                self._window.popleft()
            return sum(s for _, s in self._window)

    def charges_s(self) -> list[float]:
        """Each run counted in the window now (scheduled probes and fabric runs), oldest first."""
        self.budget_used_s()
        with self._window_mu:
            return [s for _, s in self._window]

    def last_run_s(self, name: str) -> float | None:
        """How long the last run of ``name`` took (the estimate the budget check uses); None before one."""
        return self._last_duration.get(name)

    @property
    def budget_s(self) -> float:
        return self.config.budget_fraction * self.config.budget_window_s

    def budget_problem(self, estimate_s: float) -> str:
        """"" when a run of about ``estimate_s`` fits the budget, else the reason (the text skips carry)."""
        used = self.budget_used_s()
        if used + estimate_s <= self.budget_s:
            return ""
        return (f"budget: {used:.1f} s of probe time in the last {self.config.budget_window_s:g} s, "
                f"next run estimated {estimate_s:.1f} s, limit {self.budget_s:.1f} s "
                f"({100 * self.config.budget_fraction:g} %)")

    def charge(self, seconds: float) -> None:
        """Count a run made outside this scheduler (a fabric pair run) against the same budget."""
        with self._window_mu:
            self._window.append((time.monotonic(), seconds))

    # ---------------------------------------------------------------- gating
    def diskstats_activity(self, device: str) -> tuple[float, float] | None:
        """(busy %, IOPS) of ``device`` over ``disk_quiet_window_s`` from /proc/diskstats; None if unknown."""
        a = blockdev.read_diskstats(device)
        if a is None:
            return None
        t0 = time.monotonic()
        self._stop.wait(self.config.disk_quiet_window_s)
        b = blockdev.read_diskstats(device)
        if b is None:
            return None
        return blockdev.busy_between(a, b, time.monotonic() - t0)

    def _gate(self, spec: registry.ProbeSpec, params: Mapping[str, Any]) -> str:
        """"" when the probe may run, else the reason it may not (without force)."""
        if "gpu" in spec.resources and self.busy_gpus is not None:
            busy = sorted(set(self.busy_gpus()))
            if busy:
                return f"gpus busy: a job holds GPU {', '.join(map(str, busy))}"
        if "disk" in spec.resources:
            target = os.path.dirname(os.path.abspath(params["file"])) if params.get("file") else params.get("path", "/")
            device = blockdev.device_for_path(target)
            act = None
            if device:
                act = self.disk_activity(device)
                if act is None and self.disk_activity != self.diskstats_activity:
                    act = self.diskstats_activity(device)  # the given source had nothing fresh
            if act is not None:
                busy_pct, iops = act
                c = self.config
                if busy_pct > c.disk_busy_percent_max or iops > c.disk_iops_max:
                    return (f"disk busy: {device} was {busy_pct:.0f} % busy at {iops:.0f} IOPS "
                            f"(limits {c.disk_busy_percent_max:g} %, {c.disk_iops_max:g} IOPS)")
        return ""

    def _platform(self, spec: registry.ProbeSpec) -> str:
        if self.gpu_count is None or spec.platform == "any":
            return ""
        n = self.gpu_count()
        need = 1 if spec.platform == "cuda" else 2
        if n < need:
            return f"platform: {spec.name} needs {spec.platform} and this node has {n} GPU(s)"
        return ""

    # ---------------------------------------------------------------- one run
    def _emit(self, result: ProbeResult) -> list[dict[str, Any]]:
        records = result.sink_records()
        for rec in records:
            self.counts[f"{rec['probe']}:{rec['status']}"] += 1
            try:
                self.sink.probe_result(rec)
            except Exception:
                log.exception("probe %s: sink refused the result", rec["probe"])
        return records

    def run_once(self, name: str, force: bool | None = None) -> list[dict[str, Any]]:
        """Gate, take the lock, run ``name`` now (blocking this thread) and emit its result(s)."""
        spec = registry.get(name)
        sched = self.config.schedule(name)
        params = registry.parse_params(name, sched.params)
        forced = self.config.force or sched.force if force is None else force

        def skip(reason: str) -> list[dict[str, Any]]:
            log.info("probe %s skipped: %s", name, reason)
            return self._emit(ProbeResult.skipped(name, reason, params, {"scheduler": "agent"}))

        reason = self._platform(spec) or ("" if forced else self._gate(spec, params))
        if reason:
            return skip(reason)
        over = self.budget_problem(self._last_duration.get(name, 0.0))
        if over:
            return skip(over)
        if not self._lock.acquire(self.config.lock_wait_s, what=name, cancel=self._stop):
            return skip(f"lock: another probe run holds {self._lock.path} ({self._lock.holder() or 'holder unknown'})")
        # Again with the lock held: a run that held it while this one waited (a fabric pair) is charged now.
        over = self.budget_problem(self._last_duration.get(name, 0.0))
        if over:
            self._lock.release()
            return skip(over)
        t0 = time.monotonic()
        try:
            result = self._runner(name, params, sched.timeout_s, cancel=self._stop)
        finally:
            took = time.monotonic() - t0
            self.charge(took)     # before the release: the next holder sees it
            self._last_duration[name] = took
            self._lock.release()
        result.env.setdefault("scheduler", "agent")
        if forced:
            result.env.setdefault("forced", 1)
        return self._emit(result)


# ---------------------------------------------------------------- wiring into the daemon

def _busy_gpus_from(samplers: Iterable[Any]) -> Callable[[], list[int]]:
    """GPUs held by the jobs that job discovery currently sees."""
    disc = next((s for s in samplers if hasattr(s, "active_jobs")), None)

    def busy() -> list[int]:
        if disc is None:
            return []
        for _ in range(3):  # the sampling thread may be updating the job table
            try:
                return sorted({g for j in disc.active_jobs() for g in j.get("gpus", ()) if g >= 0})
            except RuntimeError:
                time.sleep(0.01)
        return [-1]  # could not read it: treat the GPUs as busy rather than disturb a job
    return busy


def disk_activity_from(batcher: Any, max_age_s: float = 30.0) -> DiskActivity:
    """(busy %, IOPS) of a device from the host sampler's latest values, when fresh; else None."""
    def activity(device: str) -> tuple[float, float] | None:
        latest = getattr(batcher, "latest", None)
        if not latest:
            return None
        labels = (("device", device),)
        now = time.time_ns()
        vals = {}
        for metric in ("disk_busy_percent", "disk_read_iops", "disk_write_iops"):
            got = latest.get((metric, -1, labels))
            if got is None or now - got[0] > max_age_s * 1e9:
                return None
            vals[metric] = got[1]
        return vals["disk_busy_percent"], vals["disk_read_iops"] + vals["disk_write_iops"]
    return activity


def start_probe_scheduler(agent: Any) -> ProbeScheduler | None:
    """The daemon's EXTRA_FACTORIES hook: build from ``[probes]`` and start (None when disabled)."""
    cfg = agent.cfg.probes
    if not cfg.enabled:
        log.info("probes disabled ([probes] enabled = false)")
        return None
    gpus = len(agent.node_info.gpus)
    sched = ProbeScheduler(agent.batcher, cfg, busy_gpus=_busy_gpus_from(agent.samplers),
                           gpu_count=lambda: gpus, disk_activity=disk_activity_from(agent.batcher),
                           state_dir=str(agent.cfg.state_dir))
    sched.start()
    log.info("probe scheduler started: %s; budget %.0f s per %.0f s",
             ", ".join(f"{s.name} every {s.interval_s:g} s" for s in cfg.schedules if s.enabled),
             sched.budget_s, cfg.budget_window_s)
    return sched
