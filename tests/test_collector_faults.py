"""Storage faults: when the database file cannot grow (a full disk, simulated with RLIMIT_FSIZE on the
real collector process), batches are refused with UNAVAILABLE and one clear sentence, acked data stays
exact, queries keep working, and the collector stops cleanly without a traceback."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys

import duckdb
import grpc

from collector_helpers import node_info, sample_batch
from conftest import wait_for
from gpuagent.proto import pb, pb_grpc

LIMIT = 3 << 20


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # get EFBIG from write(2) instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def test_full_disk_refuses_batches_in_one_sentence_and_keeps_acked_data(tmp_path):
    db, port_file = tmp_path / "c.duckdb", tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "gpuagent.collector", "serve", "--listen", "127.0.0.1:0",
                             "--db", str(db), "--port-file", str(port_file), "--no-analyze"],
                            preexec_fn=_limit_file_size, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: port_file.exists() or proc.poll() is not None, timeout=60, what="collector port")
        assert proc.poll() is None, proc.communicate()
        acked = set()
        with grpc.insecure_channel(f"127.0.0.1:{int(port_file.read_text())}") as ch:
            stub = pb_grpc.CollectorStub(ch)
            node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
            # a first small stream fits under the limit
            acked.update(a.seq for a in stub.Stream(iter([sample_batch(node_id, s, n=5000) for s in (1, 2)])))
            assert acked == {1, 2}
            errors = []
            for attempt in range(2):      # the second attempt resends what was refused: still refused
                todo = [s for s in range(3, 201) if s not in acked]
                try:
                    for ack in stub.Stream(iter([sample_batch(node_id, s, n=5000) for s in todo]), timeout=120):
                        acked.add(ack.seq)
                except grpc.RpcError as exc:
                    errors.append(exc)
            assert len(errors) == 2, "the file limit should stop ingest part way"
            for exc in errors:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                assert "the collector could not store batch" in exc.details()
                assert "File too large" in exc.details()
            # Batches queued behind a refused one may still commit after the stream ended (stored, never
            # acked: a resend gets duplicate=true). What must hold: nothing half-stored, acked ⊆ stored.
            res = stub.Query(pb.QueryRequest(sql="SELECT (SELECT count(*) FROM samples), "
                                                 "(SELECT count(*) FROM ingest_log)"))
            n_samples, n_batches = json.loads(res.rows_json)[0]
            assert n_samples == 5000 * n_batches and n_batches >= len(acked)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        assert "could not store" in err and "they are refused and the agents keep them" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    with duckdb.connect(str(db), read_only=True) as con:
        stored = {r[0] for r in con.execute("SELECT seq FROM ingest_log").fetchall()}
        assert acked <= stored
        assert con.execute("SELECT count(*) FROM samples").fetchone()[0] == 5000 * len(stored)
        assert con.execute("SELECT count(*) FROM (SELECT DISTINCT ts, metric, value FROM samples)").fetchone()[0] \
            == 5000 * len(stored)
