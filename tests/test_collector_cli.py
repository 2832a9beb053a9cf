"""`gpuagent-collector serve` and `sql` as real subprocesses: startup policy, lock holder, signals, formats."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from collector_helpers import node_info, sample_batch
from conftest import wait_for

CLI = [sys.executable, "-m", "gpuagent.collector"]


def run_cli(*args, env=None, timeout=60):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def start_serve(tmp_path: Path, *extra, db=None):
    port_file = tmp_path / f"port-{len(list(tmp_path.glob('port-*')))}"
    proc = subprocess.Popen([*CLI, "serve", "--listen", "127.0.0.1:0", "--db", str(db or tmp_path / "c.duckdb"),
                             "--port-file", str(port_file), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: port_file.exists() or proc.poll() is not None, timeout=60, what="collector port file")
    except AssertionError:
        proc.kill()
        raise
    if proc.poll() is not None:
        raise AssertionError(f"collector exited: {proc.communicate()}")
    return proc, int(port_file.read_text())


def stop(proc, sig=signal.SIGTERM):
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, err


@pytest.mark.parametrize("args, words", [
    (["--listen", "0.0.0.0:0"], "without a token"),
    (["--listen", "0.0.0.0:0", "--token", "t"], "in plaintext"),
    (["--listen", "nonsense"], "is not HOST:PORT"),
    (["--tls-cert", "/nonexistent.pem"], "needs both --tls-cert and --tls-key"),
])
def test_serve_refuses_unsafe_or_bad_setups_in_one_sentence(tmp_path, args, words):
    r = run_cli("serve", "--db", str(tmp_path / "c.duckdb"), *args)
    assert r.returncode == 1
    assert words in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_serve_beyond_loopback_with_token_and_insecure_starts(tmp_path):
    proc, port = start_serve(tmp_path, "--listen", "0.0.0.0:0", "--token", "t", "--insecure")
    # --listen is given twice; click takes the last one. SIGINT (Ctrl-C) stops it as cleanly as SIGTERM.
    code, err = stop(proc, signal.SIGINT)
    assert code == 0, err
    assert "listening on 0.0.0.0:" in err and "token required" in err
    assert "stopped; stored 0 batches" in err and "Traceback" not in err


def test_unwritable_db_path_is_one_sentence(tmp_path):
    r = run_cli("serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "missing" / "c.duckdb"))
    assert r.returncode == 1 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    # /proc refuses new files even for root, so this holds in CI containers too
    r = run_cli("serve", "--listen", "127.0.0.1:0", "--db", "/proc/gpuagent-test.duckdb")
    assert r.returncode == 1 and "cannot open the database /proc/gpuagent-test.duckdb" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_second_collector_on_same_db_names_the_lock_holder(tmp_path):
    proc, _ = start_serve(tmp_path)
    try:
        r = run_cli("serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.duckdb"))
        assert r.returncode == 1
        assert f"PID {proc.pid}" in r.stderr and "already open in another process" in r.stderr
        assert "gpuagent.collector" in r.stderr     # the holder's command line
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    finally:
        code, err = stop(proc)
    assert code == 0, err


def test_serve_stores_then_sigterm_drains_and_sql_formats(tmp_path):
    import grpc

    from gpuagent.proto import pb, pb_grpc

    proc, port = start_serve(tmp_path, "--token", "tok")
    target = f"127.0.0.1:{port}"
    md = (("authorization", "Bearer tok"),)
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.CollectorStub(ch)
        node_id = stub.Register(pb.RegisterRequest(node=node_info()), metadata=md).node_id
        acks = list(stub.Stream(iter([sample_batch(node_id, s) for s in (1, 2)]), metadata=md))
        assert [a.seq for a in acks] == [1, 2]

    q = "SELECT metric, count(*) AS n FROM samples GROUP BY metric ORDER BY metric"
    r = run_cli("sql", "--target", target, "--format", "json", q, env={"GPUAGENT_COLLECTOR_TOKEN": "tok"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [{"metric": "cpu_steal_percent", "n": 4}, {"metric": "gpu_throttle_active", "n": 4},
                                    {"metric": "gpu_util_percent", "n": 4}]
    r = run_cli("sql", "--target", target, "--token", "tok", "--format", "csv", q)
    assert r.stdout.splitlines() == ["metric,n", "cpu_steal_percent,4", "gpu_throttle_active,4",
                                     "gpu_util_percent,4"]
    token_file = tmp_path / "token"
    token_file.write_text("tok\n")
    r = run_cli("sql", "--target", target, "--token-file", str(token_file), q)
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["metric", "n"] and lines[2].split() == ["cpu_steal_percent", "4"]
    assert lines[-1] == "(3 rows)"
    r = run_cli("sql", "--target", target, q)
    assert r.returncode == 1 and "requires a token" in r.stderr
    r = run_cli("sql", "--target", target, "--token", "tok", "DROP TABLE samples")
    assert r.returncode == 1 and "refused: DROP" in r.stderr and "Traceback" not in r.stderr

    code, err = stop(proc)
    assert code == 0, err
    assert "stored 2 batches (12 samples)" in err


def test_sql_without_collector_is_one_sentence(tmp_path):
    r = run_cli("sql", "--target", "127.0.0.1:1", "SELECT 1")
    assert r.returncode == 1 and "no collector answers at 127.0.0.1:1" in r.stderr


def _duckdb_cli():
    import shutil

    exe = shutil.which("duckdb", path=str(Path(sys.executable).parent)) or shutil.which("duckdb")
    if exe is None:
        pytest.fail("the duckdb CLI (PyPI duckdb-cli, in the test extra) is not installed")
    return exe


def test_official_duckdb_cli_reads_a_collector_file_read_only(tmp_path):
    from gpuagent.collector.service import start_collector
    import grpc

    from gpuagent.proto import pb, pb_grpc

    db = tmp_path / "c.duckdb"
    with start_collector(db) as h, grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        stub = pb_grpc.CollectorStub(ch)
        node_id = stub.Register(pb.RegisterRequest(node=node_info())).node_id
        list(stub.Stream(iter([sample_batch(node_id, s, n=9) for s in (1, 2, 3)])))
    r = subprocess.run([_duckdb_cli(), "-readonly", "-csv", str(db), "-c",
                        "SELECT count(*) AS n, count(DISTINCT metric) AS metrics FROM samples"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["n,metrics", "27,3"]
    r = subprocess.run([_duckdb_cli(), "-readonly", str(db), "-c", "DELETE FROM samples"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "read-only" in (r.stdout + r.stderr).lower()


def test_sd_notify_ready_watchdog_and_stopping(tmp_path):
    import socket

    addr = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(addr)
    sock.settimeout(30)
    port_file = tmp_path / "port"
    proc = subprocess.Popen([*CLI, "serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.duckdb"),
                             "--port-file", str(port_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "200000"})
    try:
        messages = []

        def got(word):
            while not any(word in m for m in messages):
                messages.append(sock.recv(4096).decode())
            return True

        assert got("READY=1") and port_file.exists()
        assert got("WATCHDOG=1")
        proc.send_signal(signal.SIGTERM)
        assert got("STOPPING=1")
        proc.communicate(timeout=60)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        sock.close()


def test_port_in_use_is_one_sentence(tmp_path):
    proc, port = start_serve(tmp_path)
    try:
        r = run_cli("serve", "--listen", f"127.0.0.1:{port}", "--db", str(tmp_path / "other.duckdb"))
        assert r.returncode == 1
        assert r.stderr.strip().splitlines() == [
            f"Error: cannot listen on 127.0.0.1:{port}: the address is in use or not available on this host"]
        assert not (tmp_path / "other.duckdb").exists()     # the refused start created no database file
    finally:
        code, err = stop(proc)
    assert code == 0, err


def test_serve_config_with_a_typod_table_is_one_sentence_and_creates_nothing(tmp_path):
    cfg = tmp_path / "collector.toml"
    cfg.write_text('[analyzer]\nwindow = "1h"\n\n[pricng]\ncloud-a = 3.4\n')   # [pricing] misspelt
    db = tmp_path / "c.duckdb"
    r = run_cli("serve", "--listen", "127.0.0.1:0", "--db", str(db), "--config", str(cfg))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "Error: unknown table or key 'pricng' in the collector config (expected [analyzer], "
        "[[baselines.declared]], [pricing], [metrics], [fabric], [auth], [storage], [lake], [actions] and [console])"]
    assert not db.exists()


def test_a_file_that_is_not_duckdb_is_one_sentence_and_left_untouched(tmp_path):
    db = tmp_path / "notes.duckdb"
    db.write_text("these are somebody's notes, not a database\n")
    for args in (["serve", "--listen", "127.0.0.1:0", "--db", str(db)], ["analyze", "--db", str(db)],
                 ["compare", "--db", str(db)], ["report", "--db", str(db), "--out", str(tmp_path / "r.html")]):
        r = run_cli(*args)
        assert r.returncode == 1, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "not a valid DuckDB database file" in lines[0], (args, r.stderr)
    assert db.read_text() == "these are somebody's notes, not a database\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.duckdb"]      # no .wal, no report
