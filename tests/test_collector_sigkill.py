"""Durability: the collector (a real process) is SIGKILLed mid-stream three times and restarted.
Afterwards every batch the client saw acked is stored exactly once, and resends are deduplicated."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import duckdb
import grpc
import pytest

from collector_helpers import NOW_NS, node_info, sample_batch
from conftest import wait_for
from gpuagent.proto import pb, pb_grpc

N_PER_BATCH = 2000
TOTAL = 240          # batches the client wants stored
KILLS = 3


def _serve(db: Path, tmp: Path, i: int):
    port_file = tmp / f"port-{i}"
    proc = subprocess.Popen([sys.executable, "-m", "gpuagent.collector", "serve", "--listen", "127.0.0.1:0",
                             "--db", str(db), "--port-file", str(port_file)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / f"collector-{i}.log", "w"))
    wait_for(lambda: port_file.exists() or proc.poll() is not None, timeout=60, what="collector port")
    assert proc.poll() is None, (tmp / f"collector-{i}.log").read_text()
    return proc, int(port_file.read_text())


@pytest.mark.slow
def test_every_acked_batch_survives_sigkill_exactly_once(tmp_path):
    db = tmp_path / "c.duckdb"
    acked: set[int] = set()
    seen_dup = 0
    kills_mid_stream = 0
    round_no = 0
    while len(acked) < TOTAL:
        proc, port = _serve(db, tmp_path, round_no)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.CollectorStub(ch)
                reg = stub.Register(pb.RegisterRequest(node=node_info()), timeout=30)
                # The register reply says what is stored; still resend a few acked batches to exercise dedupe.
                assert reg.last_committed_seq >= max(acked, default=0)
                todo = sorted(set(range(1, TOTAL + 1)) - acked)
                resend = sorted(acked)[-3:]
                batches = [sample_batch(reg.node_id, s, n=N_PER_BATCH) for s in resend + todo]
                acks_this_round = []
                killer = None
                if round_no < KILLS:
                    # SIGKILL once this round has seen a few acks: batches are still in flight then.
                    target = len(resend) + 20

                    def kill_when_ready():
                        wait_for(lambda: len(acks_this_round) >= target or proc.poll() is not None, timeout=60,
                                 interval=0.005, what="acks before the kill")
                        proc.send_signal(signal.SIGKILL)

                    killer = threading.Thread(target=kill_when_ready)
                    killer.start()
                try:
                    for ack in stub.Stream(iter(batches), timeout=120):
                        acks_this_round.append(ack)
                        if ack.duplicate:
                            seen_dup += 1
                        acked.add(ack.seq)
                except grpc.RpcError as exc:
                    assert round_no < KILLS, f"stream failed without a kill: {exc}"
                    assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                          grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
                    kills_mid_stream += 1
                if killer is not None:
                    killer.join(60)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        round_no += 1
        assert round_no <= KILLS + 2, "did not converge"

    assert kills_mid_stream == KILLS          # every kill interrupted a running stream
    assert seen_dup >= 3 * KILLS              # resent acked batches were recognised
    with duckdb.connect(str(db), read_only=True) as con:
        total, distinct = con.execute("SELECT count(*), count(DISTINCT (ts, metric, value)) FROM samples").fetchone()
        assert total == distinct == TOTAL * N_PER_BATCH
        # sample_batch puts batch seq at ts0 + seq seconds: every seq holds exactly its own samples
        per_seq = con.execute("SELECT (epoch_ns(ts) - ? + 500000000) // 1000000000 AS seq, count(*) AS n "
                              "FROM samples GROUP BY seq ORDER BY seq", [NOW_NS - 60 * 10**9]).fetchall()
        assert per_seq == [(s, N_PER_BATCH) for s in range(1, TOTAL + 1)]
        log = con.execute("SELECT count(*), count(DISTINCT seq), min(seq), max(seq), sum(n_samples) "
                          "FROM ingest_log").fetchone()
        assert log == (TOTAL, TOTAL, 1, TOTAL, TOTAL * N_PER_BATCH)
