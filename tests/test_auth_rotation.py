"""SIGHUP rotation on a real `gpuagent-collector serve` subprocess: a token and the TLS certificates change,
the old ones are refused, the new ones accepted, and a stream opened before keeps getting acks."""

from __future__ import annotations

import queue
import shutil
import signal
import subprocess
import sys
import time

import grpc

from tools import needs

import certs
from collector_helpers import node_info, sample_batch
from gpuagent.collector.ingest.auth import token_digest
from gpuagent.proto import pb, pb_grpc

pytestmark = needs("openssl")


def tokens(token):
    return f'[[token]]\nsha256 = "{token_digest(token)}"\nrole = "query"\n'


def channel(d, port, ca, cert):
    creds = grpc.ssl_channel_credentials((d / f"{ca}.pem").read_bytes(), (d / f"{cert}.key").read_bytes(),
                                         (d / f"{cert}.pem").read_bytes())
    return grpc.secure_channel(f"localhost:{port}", creds)


def query(ch, token):
    try:
        pb_grpc.CollectorStub(ch).Query(pb.QueryRequest(sql="SELECT 1"),
                                        metadata=(("authorization", f"Bearer {token}"),), timeout=10)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def test_sighup_rotates_token_and_certificates(tmp_path):
    pki = tmp_path / "pki"
    certs.make_ca(pki, "ca1")
    certs.make_ca(pki, "ca2")
    for ca in ("ca1", "ca2"):
        certs.server_cert(pki, f"collector-{ca}", ca)
        certs.client_cert(pki, "gpu-01", "ingest", ca, name=f"gpu-01-{ca}")
    live = tmp_path / "live"
    live.mkdir()
    for src, dst in (("collector-ca1.pem", "server.pem"), ("collector-ca1.key", "server.key"), ("ca1.pem", "client-ca.pem")):
        shutil.copy(pki / src, live / dst)
    (live / "tokens.toml").write_text(tokens("old-token"))
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuagent.collector", "serve", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "c.duckdb"),
         "--no-analyze", "--port-file", str(port_file), "--tokens-file", str(live / "tokens.toml"),
         "--tls-cert", str(live / "server.pem"), "--tls-key", str(live / "server.key"),
         "--tls-client-ca", str(live / "client-ca.pem")],
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "collector did not start"
            time.sleep(0.1)
        port = int(port_file.read_text())
        old = channel(pki, port, "ca1", "gpu-01-ca1")
        assert query(old, "old-token") == "OK"
        stub = pb_grpc.CollectorStub(old)
        stub.Register(pb.RegisterRequest(node=node_info("gpu-01", "m-1")), timeout=10)
        outbox: queue.Queue = queue.Queue()
        acks = stub.Stream(iter(outbox.get, None), timeout=120)
        outbox.put(sample_batch("gpu-01", 1))
        assert next(acks).seq == 1

        for src, dst in (("collector-ca2.pem", "server.pem"), ("collector-ca2.key", "server.key"),
                         ("ca2.pem", "client-ca.pem")):
            shutil.copy(pki / src, live / dst)
        (live / "tokens.toml").write_text(tokens("new-token"))
        proc.send_signal(signal.SIGHUP)
        new = channel(pki, port, "ca2", "gpu-01-ca2")
        deadline = time.monotonic() + 20
        while query(new, "new-token") != "OK":
            assert time.monotonic() < deadline, "the new certificate and token were not accepted after SIGHUP"
            time.sleep(0.2)
        assert query(new, "old-token") == "UNAUTHENTICATED"
        with channel(pki, port, "ca1", "gpu-01-ca1") as stale:    # trusts only the old CA: handshake fails
            assert query(stale, "new-token") == "UNAVAILABLE"
        # the stream opened before the rotation keeps going on its established connection
        for seq in (2, 3):
            outbox.put(sample_batch("gpu-01", seq))
            assert next(acks).seq == seq
        outbox.put(None)
        assert list(acks) == []
        old.close()
        new.close()
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "SIGHUP: re-read the tokens file and TLS files" in err
