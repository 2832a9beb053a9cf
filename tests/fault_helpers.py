"""Real processes for the fault-injection suite (tests/test_fault_*.py, benchmarks/soak.py) and the exact
accounting every fault ends with.

Agents run as `python -m gpuagent.agent.cli run`, each in its own UTS and mount namespace (``unshare``)
with its own hostname and /etc/machine-id, so several agents on this one machine are several nodes.
The collector runs as `python -m gpuagent.collector.cli serve` on a fixed port and DuckDB file so it can
be killed and restarted in place.

Accounting, per agent, from sources that survive a SIGKILL: the seq file (highest batch number cut), the
spool (record headers), the spool counters (dropped/rejected) and the collector's ingest_log and samples.
Samples an agent holds in memory and has not cut into a batch are gone with a SIGKILL by design; they
never had a seq and are not counted anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
TICK_METRIC = "mem_used_bytes"     # one sample per agent tick, no labels (the agents here send every sample raw)


def can_unshare() -> str:
    """'' when this process can give agents their own hostname and machine-id, else why not."""
    if os.geteuid() != 0:
        return "needs root to unshare a UTS and mount namespace per agent"
    r = subprocess.run(["unshare", "--uts", "--mount", "true"], capture_output=True, text=True, timeout=30)
    return "" if r.returncode == 0 else f"unshare failed: {r.stderr.strip()}"


class Collector:
    """The collector on a fixed loopback port and DuckDB file; can be SIGKILLed and restarted in place."""

    def __init__(self, workdir: Path, db: Path | None = None, port: int | None = None, extra_env=None,
                 extra_args: tuple[str, ...] = ()):
        self.dir = workdir
        self.db = db or workdir / "collector.duckdb"
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.query_address = self.address      # where the test reaches it (differs inside a namespace)
        self.log = workdir / "collector.log"
        self.env = {**os.environ, **(extra_env or {})}
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def spawn(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "gpuagent.collector.cli", "serve", "--db", str(self.db),
               "--listen", self.address, "--no-analyze", *self.extra_args]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                         start_new_session=True)
        self.starts += 1
        return self.proc

    def start(self, timeout: float = 60.0) -> "Collector":
        proc = self.spawn()

        def listening():
            if proc.poll() is not None:
                raise AssertionError(f"collector exited with {proc.returncode}: {self.tail()}")
            try:
                host, port = self.query_address.rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=0.5):
                    return True
            except OSError:
                return False
        wait_for(listening, timeout=timeout, interval=0.05, what="the collector port")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        p, self.proc = self.proc, None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        return p.returncode

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def sql(self, q: str, timeout: float = 30.0) -> list[list]:
        """Rows of a read-only query through the Query RPC, retried while the collector (re)starts."""
        import grpc

        from gpuagent import local_run
        deadline = time.monotonic() + timeout
        while True:
            try:
                return local_run.query(self.query_address, q, timeout=10.0)[1]
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


class Agent:
    """One real agent process with its own state dir, hostname and machine-id."""

    def __init__(self, workdir: Path, name: str, interval: float = 0.2, batch_interval: float = 0.2,
                 extra_env=None, toml: str = "", wrap=None):
        """``toml``: more agent config; ``wrap(argv) -> argv`` runs the agent elsewhere (e.g. in a network
        namespace whose exec already gives it its own hostname and machine-id) instead of ``unshare``."""
        self.dir = workdir / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.state = self.dir / "state"
        self.log = self.dir / "agent.log"
        self.interval = interval
        self.batch_interval = batch_interval
        self.machine_id_file = self.dir / "machine-id"
        self.machine_id_file.write_text(hashlib.md5(f"{workdir}/{name}".encode()).hexdigest() + "\n")
        (self.dir / "agent.toml").write_text("[probes]\nenabled = false\n" + toml)
        self.wrap = wrap
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAGENT_") and k != "NOTIFY_SOCKET"}
        # Every sample raw: these tests account for each tick's TICK_METRIC sample through the fault; summaries
        # travel in the same batches (tests/test_resolution.py covers them).
        env.update({"GPUAGENT_CONFIG": str(self.dir / "agent.toml"), "GPUAGENT_JOBS_SOCKET": str(self.dir / "jobs.sock"),
                    "MALLOC_ARENA_MAX": "2", "GPUAGENT_SUMMARY_INTERVAL": "0"})
        env.update(extra_env or {})
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.lives = 0
        self.cut_at_kill: list[int] = []     # seqs handed out but not yet spooled when SIGKILL came

    def start(self, collector: str) -> "Agent":
        run = [sys.executable, "-m", "gpuagent.agent.cli", "run", "--collector", collector, "--state-dir",
               str(self.state), "--interval", f"{self.interval:g}", "--batch-interval", f"{self.batch_interval:g}"]
        if self.wrap is not None:
            argv = self.wrap(run)
        else:
            argv = ["unshare", "--uts", "--mount", "sh", "-c", f"hostname {self.name} && mount --bind "
                    f"{self.machine_id_file} /etc/machine-id && exec \"$@\"", "sh", *run]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log,
                                         stderr=subprocess.STDOUT, env=self.env, cwd=ROOT, start_new_session=True)
        self.lives += 1
        return self

    def status(self) -> dict:
        try:
            return json.loads((self.state / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def wait_running(self, timeout: float = 60.0) -> dict:
        proc = self.proc

        def ok():
            if proc.poll() is not None:
                raise AssertionError(f"agent {self.name} exited with {proc.returncode}: {self.tail()}")
            st = self.status()
            return st if st.get("pid") == proc.pid and st.get("counters", {}).get("ticks", 0) >= 1 else None
        return wait_for(ok, timeout=timeout, what=f"agent {self.name} running")

    def acked(self) -> int:
        return int(self.status().get("collector", {}).get("last_ack_seq", 0) or 0)

    def kill(self, collector: "Collector | None" = None) -> None:
        """SIGKILL; record a seq that was handed out but neither spooled nor stored (cut in progress)."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None
        high = self.seq_high()
        if high and not (self.state / "spool" / f"{high:020d}.batch").exists():
            node = self.status().get("node", {}).get("node_id")
            stored = collector is not None and node and collector.sql(
                f"SELECT count(*) FROM ingest_log WHERE node_id = '{node}' AND seq = {high}")[0][0]
            if not stored:
                self.cut_at_kill.append(high)

    def stop(self) -> dict:
        """SIGTERM and wait; returns the final status (state 'stopped')."""
        if self.proc is not None:
            p, self.proc = self.proc, None
            p.send_signal(signal.SIGTERM)
            try:
                rc = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
                raise AssertionError(f"agent {self.name} did not stop within 30 s: {self.tail()}") from None
            assert rc == 0, f"agent {self.name} exited with {rc}: {self.tail()}"
        return self.status()

    def seq_high(self) -> int:
        try:
            return int((self.state / "seq").read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def spool_contents(state: Path) -> tuple[dict[int, int], int]:
    """{seq: n_samples} of the complete spooled batches, and the number of unreadable ones."""
    from gpuagent.agent.pipeline.spool import CorruptRecord, decode_record
    out, bad = {}, 0
    for f in (state / "spool").glob("*.batch"):
        try:
            seq, n, _, _ = decode_record(f.read_bytes())
        except FileNotFoundError:     # acked between the listing and the read: the collector has it
            continue
        except CorruptRecord:
            bad += 1
            continue
        out[seq] = n
    return out, bad


def _spool_counters(state: Path) -> dict:
    try:
        return json.loads((state / "spool" / "counters.json").read_text())
    except (OSError, ValueError):
        return {}


def account_agent(agent: Agent, collector: Collector, produced_samples: int | None = None) -> dict:
    """One snapshot of an agent's exact accounting. Read in this order so that a batch moving from the
    spool to the collector meanwhile is seen at least once: seq file, spool, then the collector."""
    high = agent.seq_high()
    spooled, unreadable = spool_contents(agent.state)
    counters = _spool_counters(agent.state)
    node = agent.status().get("node", {}).get("node_id") or ""
    # One statement, so ingest_log and samples are read from the same snapshot while agents stream.
    seqs, log_rows, log_distinct, logged_samples, rows, distinct_rows = collector.sql(
        f"SELECT (SELECT list(seq) FROM ingest_log WHERE node_id = '{node}' AND seq <= {high}), "
        f"(SELECT count(*) FROM ingest_log WHERE node_id = '{node}'), "
        f"(SELECT count(DISTINCT seq) FROM ingest_log WHERE node_id = '{node}'), "
        f"(SELECT coalesce(sum(n_samples), 0) FROM ingest_log WHERE node_id = '{node}'), "
        f"(SELECT count(*) FROM samples WHERE node_id = '{node}'), "
        f"(SELECT count(DISTINCT (epoch_ns(ts), gpu, metric, labels)) FROM samples WHERE node_id = '{node}')")[0]
    stored = set(seqs or [])
    rejected = len(list((agent.state / "spool" / "rejected").glob("*.batch")))
    pending = {s: n for s, n in spooled.items() if s not in stored and s <= high}
    dropped_b = int(counters.get("dropped_batches", 0))
    dropped_s = int(counters.get("dropped_samples", 0))
    missing = [s for s in range(1, high + 1) if s not in stored and s not in spooled and s not in agent.cut_at_kill]
    fig = {
        "agent": agent.name, "node_id": node, "lives": agent.lives,
        "batches_cut": high, "batches_stored": len(stored), "batches_spooled": len(pending),
        "batches_dropped": dropped_b, "batches_rejected": rejected, "cut_at_kill": len(agent.cut_at_kill),
        "lost_batches": len(missing) - dropped_b - rejected,
        "samples_stored": rows, "samples_logged": logged_samples,
        "samples_spooled": sum(pending.values()), "samples_dropped": dropped_s,
        "duplicate_batches": log_rows - log_distinct, "duplicate_samples": rows - distinct_rows,
        "unreadable_spool_files": unreadable,
    }
    if produced_samples is not None:
        fig["samples_produced"] = produced_samples
        fig["lost_samples"] = produced_samples - rows - fig["samples_spooled"] - dropped_s
    return fig


def account(fault: str, agents: list[Agent], collector: Collector, produced: dict[str, int] | None = None,
            settle_s: float = 5.0) -> list[dict]:
    """Exact accounting for every agent, printed as one JSON line per agent and asserted.

    A live agent may be between handing out a seq and spooling that batch; such a snapshot is retried
    for up to ``settle_s`` before a missing seq counts as lost."""
    out = []
    for a in agents:
        deadline = time.monotonic() + settle_s
        while True:
            fig = account_agent(a, collector, (produced or {}).get(a.name))
            if fig["lost_batches"] == 0 or a.proc is None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        fig = {"fault": fault, **fig}
        print("FAULT-ACCOUNTING " + json.dumps(fig, sort_keys=True), flush=True)
        assert_exact(fig)
        out.append(fig)
    return out


def assert_exact(fig: dict) -> None:
    assert fig["node_id"], f"agent never registered: {fig}"
    assert fig["duplicate_batches"] == 0, fig
    assert fig["duplicate_samples"] == 0, fig
    assert fig["samples_stored"] == fig["samples_logged"], f"a batch was stored in part: {fig}"
    assert fig["unreadable_spool_files"] == 0, fig
    assert fig["lost_batches"] == 0, fig
    assert fig["batches_stored"] + fig["batches_spooled"] + fig["batches_dropped"] + fig["batches_rejected"] \
        + fig["cut_at_kill"] == fig["batches_cut"], fig
    if "lost_samples" in fig:
        assert fig["lost_samples"] == 0, fig


@pytest.fixture(name="procs")
def started_procs():
    """Agents and collectors a fault test started, killed or stopped even when the test fails."""
    started: list = []
    yield started
    for p in reversed(started):
        try:
            p.kill() if isinstance(p, Agent) else p.stop()
        except Exception:  # noqa: BLE001 - cleanup goes on for the others
            pass
