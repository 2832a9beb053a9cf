"""A damaged database file: a bad block stops the collector at start with one sentence and exit code 1,
systemd's start limit bounds the restarts, and the recovery of docs/COLLECTOR.md ("Recovering a damaged
database") works. A truncated write-ahead log or garbage appended to the file or its log is tolerated:
the collector starts and what it holds is whole batches."""

from __future__ import annotations

import configparser
import os
import shutil
import signal
import subprocess
import sys

import grpc
import pytest

from collector_helpers import node_info, sample_batch
from fault_helpers import ROOT, Agent, Collector, can_unshare
from gpuagent.proto import pb, pb_grpc


def _duckdb_cli() -> list[str]:
    exe = shutil.which("duckdb") or str(ROOT / ".venv" / "bin" / "duckdb")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "duckdb_cli"]


def _start_exits(c: Collector) -> tuple[int, str]:
    """Start the collector on its (damaged) file; it must exit by itself. Returns (rc, what it printed)."""
    start = c.log.stat().st_size if c.log.exists() else 0
    proc = c.spawn()
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the collector kept running on a damaged database") from None
    finally:
        c.proc = None
    return rc, c.log.read_bytes()[start:].decode(errors="replace")


def test_unit_bounds_restarts():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "packaging" / "gpuagent-collector.service")
    burst = int(unit["Unit"]["StartLimitBurst"])
    interval = int(unit["Unit"]["StartLimitIntervalSec"])
    restart_sec = float(unit["Service"]["RestartSec"].rstrip("s"))
    # the limit can trip: `burst` restarts, RestartSec apart, fit inside the interval
    assert burst * restart_sec < interval, (burst, restart_sec, interval)


@pytest.mark.slow
@pytest.mark.skipif(bool(can_unshare()), reason=can_unshare() or "ok")
def test_bad_block_one_sentence_then_documented_recovery(tmp_path):
    c = Collector(tmp_path).start()
    a = Agent(tmp_path, "fault-b0", interval=0.1, batch_interval=0.2)
    try:
        a.start(c.address)
        a.wait_running()
        from conftest import wait_for
        wait_for(lambda: a.acked() >= 5, timeout=60, what="five batches stored")
        assert c.stop() == 0
        before = a.seq_high()
        size = c.db.stat().st_size
        with open(c.db, "r+b") as f:            # bad blocks: everything after DuckDB's three 4 KiB headers
            f.seek(3 * 4096)                    # (one block in the middle can land in free space and go unread)
            f.write(os.urandom(size - 3 * 4096))
        for _ in range(2):                      # each start: one sentence, exit 1, no retry loop inside
            rc, out = _start_exits(c)
            lines = [ln for ln in out.splitlines() if ln.strip()]
            print("collector on a damaged database:", lines)
            assert rc == 1
            assert len(lines) == 1 and lines[0].startswith(f"Error: cannot open the database {c.db}:"), lines
            assert "Traceback" not in out
        wait_for(lambda: a.status().get("spool", {}).get("backlog_batches", 0) >= 3, timeout=60,
                 what="the agent spooling while the collector is down")

        # The documented recovery: move the file (and its log) aside, check it with the CLI, start anew.
        damaged = c.db.with_name(c.db.name + ".damaged")
        os.replace(c.db, damaged)
        wal = c.db.with_name(c.db.name + ".wal")
        if wal.exists():
            os.replace(wal, damaged.with_name(damaged.name + ".wal"))
        chk = subprocess.run([*_duckdb_cli(), "-readonly", str(damaged), "-c", "SELECT count(*) FROM ingest_log"],
                             capture_output=True, text=True, timeout=60)
        assert chk.returncode != 0 and ("Corrupt" in chk.stderr + chk.stdout or "Error" in chk.stderr + chk.stdout), chk
        c.start()
        high = a.seq_high()
        wait_for(lambda: a.acked() > high, timeout=60, what="the agent's spool delivered to the new database")
        a.stop()
        node = a.status()["node"]["node_id"]
        stored = [r[0] for r in c.sql(f"SELECT seq FROM ingest_log WHERE node_id = '{node}' ORDER BY seq")]
        spooled = {int(p.name.split(".")[0]) for p in (a.state / "spool").glob("*.batch")}
        # Everything cut after the last batch the damaged file had acked is stored once or still spooled.
        assert len(stored) == len(set(stored))
        missing = [s for s in range(before + 1, a.seq_high() + 1) if s not in stored and s not in spooled]
        print(f"FAULT-ACCOUNTING damaged_db: acked into the damaged file up to seq {before}, new file holds "
              f"{len(stored)} batches, {len(spooled)} spooled, missing {missing}")
        assert not missing
        rows, logged = c.sql(f"SELECT (SELECT count(*) FROM samples WHERE node_id = '{node}'), "
                             f"(SELECT sum(n_samples) FROM ingest_log WHERE node_id = '{node}')")[0]
        assert rows == logged
    finally:
        a.kill()
        c.stop()


def _filled_then_killed(tmp_path, n: int = 6) -> Collector:
    """A collector that stored batches 1..n of one node and was SIGKILLed: its write-ahead log is left."""
    c = Collector(tmp_path).start()
    with grpc.insecure_channel(c.address) as ch:
        stub = pb_grpc.CollectorStub(ch)
        node = stub.Register(pb.RegisterRequest(node=node_info()), timeout=30).node_id
        acks = [x.seq for x in stub.Stream(iter([sample_batch(node, s, n=300) for s in range(1, n + 1)]), timeout=60)]
    assert acks == list(range(1, n + 1))
    c.proc.send_signal(signal.SIGKILL)
    c.proc.wait(timeout=30)
    c.proc = None
    return c


@pytest.mark.parametrize("damage", ["truncated_wal", "garbage_after_wal", "garbage_after_db"])
def test_tolerated_damage_starts_with_whole_batches(tmp_path, damage):
    c = _filled_then_killed(tmp_path)
    wal = c.db.with_name(c.db.name + ".wal")
    assert wal.exists()
    if damage == "truncated_wal":
        os.truncate(wal, wal.stat().st_size // 2)
    elif damage == "garbage_after_wal":
        with open(wal, "ab") as f:
            f.write(os.urandom(4096))
    else:
        with open(c.db, "ab") as f:
            f.write(os.urandom(4096))
    c.start()
    try:
        seqs, rows, logged = c.sql("SELECT (SELECT list(seq ORDER BY seq) FROM ingest_log), "
                                   "(SELECT count(*) FROM samples), (SELECT coalesce(sum(n_samples), 0) FROM ingest_log)")[0]
        print(f"FAULT-ACCOUNTING {damage}: batches kept {seqs}, samples {rows}")
        seqs = seqs or []
        assert rows == logged == 300 * len(seqs), "part of a batch survived"
        assert seqs == list(range(1, len(seqs) + 1)), "the kept batches are not a prefix of the log"
        if damage == "truncated_wal":
            assert len(seqs) < 6
        else:
            assert len(seqs) == 6
    finally:
        assert c.stop() == 0
