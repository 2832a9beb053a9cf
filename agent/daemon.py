"""The resident daemon: a ticker that calls the samplers, cuts batches into the spool, and keeps the
sender thread and the local status file going.

The ticker runs on ``time.monotonic``: tick k is due at ``t0 + k * interval`` so the period does not
drift with the work done inside a tick; when it falls more than a whole interval behind (a stalled
host), it skips to the next due tick instead of bursting. SIGTERM/SIGINT: the current batch is cut into
the spool, the stream is half-closed, in-flight acks get a short grace, and the process exits well
within 5 s. This module never imports torch (tests check ``sys.modules`` of a running daemon).

The Agent's status snapshot (daemon_status.py), the hold on its state dir (daemon_state_dir.py) and the parts
it wires together (daemon_components.py: samplers, node info, EXTRA_FACTORIES) live beside it; every name
of theirs is importable from here as before.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpuagent import __version__
from gpuagent.agent.config import AgentConfig
from gpuagent.agent.daemon_components import (EXTRA_FACTORIES, bind_path_responder, build_node_info,
                                              default_samplers, hardware_sampler, start_exporter, start_fabric,
                                              start_job_step_receiver, start_probe_scheduler)
from gpuagent.agent.daemon_state_dir import LOCK_FILE, StartupError, _state_dir_problem, lock_state_dir
from gpuagent.agent.daemon_status import AgentStatus
from gpuagent.agent.pipeline.batcher import Batcher, SeqAllocator
from gpuagent.agent.pipeline.sender import Sender
from gpuagent.agent.pipeline.spool import Spool
from gpuagent.agent.samplers.sampling import Sampler, now_ns
from gpuagent.common.sdnotify import Notifier, WatchdogPinger
from gpuagent.proto import pb

__all__ = [
    "EXTRA_FACTORIES", "LOCK_FILE", "SHUTDOWN_SEND_GRACE_S", "Agent", "AgentStatus", "StartupError",
    "bind_path_responder", "build_node_info", "default_samplers", "hardware_sampler", "lock_state_dir", "run_agent",
    "setup_logging", "start_exporter", "start_fabric", "start_job_step_receiver", "start_probe_scheduler",
]

log = logging.getLogger("gpuagent.daemon")

SHUTDOWN_SEND_GRACE_S = 1.0   # in-flight acks may arrive this long after SIGTERM


class Agent(AgentStatus):
    """Everything the daemon runs, wired together. ``run()`` blocks until ``stop()`` or a signal."""

    def __init__(self, cfg: AgentConfig, samplers: list[Sampler] | None = None,
                 node_info: pb.NodeInfo | None = None, notifier: Notifier | None = None):
        self.cfg = cfg
        self.state_dir = Path(cfg.state_dir)
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.state_dir, 0o755)   # `gpuagent status` works for users who can read it
            probe = self.state_dir / ".writable"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StartupError(_state_dir_problem(self.state_dir, exc)) from None
        self._lock_fd: int | None = lock_state_dir(self.state_dir)
        self.token = cfg.resolved_token()
        self.stop_event = threading.Event()
        self.notifier = notifier or Notifier()
        self._pinger = WatchdogPinger(self.notifier)
        self.started_ns = time.time_ns()

        self.seq = SeqAllocator(self.state_dir)
        self._cut_lock = threading.Lock()    # a seq is handed out and its batch spooled as one step
        self.batcher = Batcher(self.seq, cfg.batch_interval_s, cfg.batch_max_samples,
                               summary_interval_s=cfg.summary_interval_s, raw_keep_s=cfg.raw_keep_s)
        self.spool = Spool(cfg.spool_dir, cfg.spool_max_bytes, on_event=self._spool_event)
        self.seq.raise_floor(max(self.spool.seqs(), default=0))
        self._fresh_state = self.seq.fresh and not self.spool.seqs()

        self.samplers: list[Sampler] = list(samplers) if samplers is not None else default_samplers(cfg)
        self.node_info = node_info if node_info is not None else build_node_info(cfg, self.samplers)
        self.sender = Sender(cfg.collector, self.spool, lambda: self.node_info, token=self.token,
                             on_registered=self._on_registered, batch_interval_s=cfg.batch_interval_s,
                             on_raw_requests=self.batcher.request_raw)
        self.extras: list[Any] = []          # probe scheduler and other parts with stop()
        self.job_steps: Any = None           # the JobStepReceiver when listening
        self.unavailable: list[str] = []     # optional parts that could not start (for status)
        self.exporter: Any = None            # the /metrics endpoint when [exporter] listen is set
        # The path-probe echo responder ([fabric] paths), bound now so that Register carries its port.
        self.path_responder: Any = bind_path_responder(self)
        self._sampler_errors: set[tuple[str, str]] = set()
        # The GPU sampler's events pass through the hardware sampler's XID ledger (kernel-log dedup).
        self._sinks: dict[int, Any] = {}
        ledger = next((s.xid_ledger for s in self.samplers if getattr(s, "xid_ledger", None) is not None), None)
        if ledger is not None:
            for s in self.samplers:
                if getattr(s, "name", "") == "gpu":
                    self._sinks[id(s)] = ledger.tap(self.batcher)
        self.ticks = 0
        self.late_ticks = 0
        self.skipped_ticks = 0
        self._stopped = threading.Event()

    # ---------------------------------------------------------------- wiring callbacks
    def _spool_event(self, kind: str, message: str, attrs: dict) -> None:
        self.batcher.event(kind, message, attrs=attrs)

    def _on_registered(self, resp: pb.RegisterResponse) -> None:
        """Guard against seqs the collector already holds from an earlier life of this node.

        When this state dir started empty (first install, or wiped) but the collector knows seqs up to
        N for this machine, or when the collector is ahead of our seq file, the batches spooled with a
        seq <= N are new data, not resends: move the allocator past N and renumber them before the
        sender drops everything <= N as already stored."""
        lc = resp.last_committed_seq
        fresh, self._fresh_state = self._fresh_state, False
        if lc == 0 or not (fresh or lc > self.seq.last):
            return
        with self._cut_lock:
            # After this, every batch with a seq <= lc is in the spool (a cut in progress has finished its
            # put) and every later cut gets a seq above lc, so the loop below misses none.
            self.seq.raise_floor(lc)
        moved = 0
        for old in self.spool.seqs():
            if old > lc:
                continue
            payload = self.spool.read(old)
            if payload is None:
                continue
            batch = pb.Batch.FromString(payload)
            batch.seq = self.seq.next()
            self.spool.put(batch.seq, batch.SerializeToString(), len(batch.samples.ts_ns), _n_items(batch))
            self.spool.ack(old)
            moved += 1
        log.warning("collector already holds seqs up to %d for this machine but %s started empty or behind "
                    "(reset or reinstalled?); new seqs start above %d, %d spooled batches renumbered",
                    lc, self.state_dir, lc, moved)

    # ---------------------------------------------------------------- main loop
    def install_signal_handlers(self) -> None:
        def _term(signum, frame):
            log.info("received %s: flushing and stopping", signal.Signals(signum).name)
            self.stop_event.set()

        def _hup(signum, frame):
            log.info("SIGHUP: configuration reload is not supported; restart the service to apply changes")

        signal.signal(signal.SIGTERM, _term)
        signal.signal(signal.SIGINT, _term)
        signal.signal(signal.SIGHUP, _hup)

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        cfg = self.cfg
        fp = self.node_info.fingerprint
        self.batcher.event("agent_start", f"gpuagent {__version__} started (pid {os.getpid()}, "
                           f"interval {cfg.interval_s:g} s)",
                           attrs={"version": __version__, "pid": str(os.getpid()),
                                  "interval_s": f"{cfg.interval_s:g}", "virt_type": fp.virt_type,
                                  "in_container": str(fp.in_container).lower(),
                                  # when the node booted: the hardware rules tell a reboot from an agent restart
                                  "boot_ns": str(time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME))})
        if self.path_responder is not None:
            self.path_responder.start()
        self.sender.start()
        self._start_extras()
        self.notifier.ready(f"sampling every {cfg.interval_s:g} s, collector {cfg.collector.address}")
        log.info("gpuagent %s running: %d samplers, interval %g s, batch %g s, collector %s, state %s",
                 __version__, len(self.samplers), cfg.interval_s, cfg.batch_interval_s,
                 cfg.collector.address, self.state_dir)
        interval = cfg.interval_s
        t0 = time.monotonic()
        self.batcher.start_clock(t0)     # batches are cut on the tick schedule
        k = 0
        try:
            while not self.stop_event.is_set():
                self.tick(t0 + k * interval)
                k += 1
                now = time.monotonic()
                due = t0 + k * interval
                if now - due > interval:
                    # More than a whole tick late: skip ahead instead of bursting to catch up.
                    missed = int((now - due) // interval)
                    self.skipped_ticks += missed
                    k += missed
                    due = t0 + k * interval
                elif now > due:
                    self.late_ticks += 1
                self.stop_event.wait(max(0.0, due - now))
        finally:
            self.shutdown()

    def tick(self, scheduled: float | None = None) -> None:
        """One sampling round; ``scheduled`` is the tick's planned monotonic time (batch clock)."""
        ts = now_ns()
        sinks = self._sinks
        for s in self.samplers:
            try:
                s.sample(ts, sinks.get(id(s), self.batcher))
            except Exception as exc:  # noqa: BLE001 - one broken source must not stop the others
                key = (getattr(s, "name", type(s).__name__), type(exc).__name__)
                if key not in self._sampler_errors:
                    self._sampler_errors.add(key)
                    log.exception("sampler %s failed (reported once per error type)", key[0])
                    self.batcher.event("sampler_error", f"sampler {key[0]} failed: {type(exc).__name__}: {exc}")
        self.ticks += 1
        if self.batcher.due(scheduled):
            self.flush(scheduled)
        self.write_status()
        self._pinger.maybe_ping()

    def flush(self, scheduled: float | None = None) -> None:
        with self._cut_lock:
            self._flush_locked(scheduled)

    def _flush_locked(self, scheduled: float | None) -> None:
        try:
            batch = self.batcher.cut(scheduled)
        except OSError as exc:
            # The seq could not be persisted (disk full, read-only): keep sampling into memory and retry
            # at the next cut; past 4 batches' worth, drop what is pending and count it.
            self._report_once(("seq", "write"), f"cannot persist the batch seq in {self.state_dir}: "
                              f"{exc.strerror or exc}; samples stay in memory until it can be written")
            if self.batcher.pending_samples > 4 * self.cfg.batch_max_samples:
                n = self.batcher.discard_pending()
                self.spool.count_dropped(0, n, f"dropped {n} samples held in memory: the seq cannot be persisted")
            return
        if batch is not None:
            self.spool.put(batch.seq, batch.SerializeToString(), len(batch.samples.ts_ns), _n_items(batch))

    def shutdown(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        t = time.monotonic()
        self.notifier.stopping()
        for x in self.extras:
            try:
                x.stop()
            except Exception:  # noqa: BLE001
                log.exception("stopping %r failed", x)
        if self.path_responder is not None:
            self.path_responder.close()
        if self.job_steps is not None:
            try:   # the training steps of the open window would otherwise be lost
                self.job_steps.flush_window(time.time_ns(), self.batcher)
            except Exception:  # noqa: BLE001
                log.exception("closing the job-step window failed")
        self.batcher.close_open_summaries()     # the partial interval would otherwise be lost
        try:
            self.flush()
            self.flush()     # events the first flush raised (e.g. spool_dropped) go into one more batch
        except Exception:  # noqa: BLE001
            log.exception("final flush to the spool failed")
        self.sender.stop(grace_s=SHUTDOWN_SEND_GRACE_S)
        for s in self.samplers:
            try:
                s.close()
            except Exception:  # noqa: BLE001
                log.exception("closing sampler %s failed", getattr(s, "name", s))
        self.write_status(state="stopped")
        self.notifier.close()
        sp = self.spool.stats()
        log.info("stopped in %.2f s; %d batches (%d bytes) remain spooled for the next start",
                 time.monotonic() - t, sp["backlog_batches"], sp["backlog_bytes"])
        if self._lock_fd is not None:
            os.close(self._lock_fd)     # releases the state dir for the next agent
            self._lock_fd = None

    # ---------------------------------------------------------------- extras (probe scheduler, job listener)
    def _start_extras(self) -> None:
        """Start the optional parts (EXTRA_FACTORIES: the jobs step listener, the probe scheduler); one
        that fails is reported and the rest of the agent keeps running."""
        for factory in EXTRA_FACTORIES:
            try:
                x = factory(self)
            except Exception as exc:  # noqa: BLE001 - an optional part failing leaves the rest running
                log.exception("optional component %s failed to start", getattr(factory, "__name__", factory))
                self.batcher.event("component_error", f"{getattr(factory, '__name__', factory)}: {exc}")
                continue
            if x is not None:
                self.extras.append(x)

    def _report_once(self, key: tuple[str, str], message: str) -> None:
        if key not in self._sampler_errors:
            self._sampler_errors.add(key)
            log.error(message + " (reported once)")
            self.batcher.event("agent_error", message)


def _n_items(batch: pb.Batch) -> int:
    return len(batch.probe_results) + len(batch.job_samples) + len(batch.job_steps) + len(batch.events)


def setup_logging(level: str = "info") -> None:
    # Under systemd, journald adds timestamps; in a terminal they help.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt, stream=sys.stderr)


def run_agent(cfg: AgentConfig) -> None:
    """Entry point of `gpuagent run`: build the agent, install signal handlers, run until stopped."""
    setup_logging(cfg.log_level)
    agent = Agent(cfg)
    agent.install_signal_handlers()
    agent.run()
