"""`[auth] tokens_file` and `tls_client_ca` in the collector's --config TOML, on a real `serve` subprocess:
relative paths from the config's directory, re-read on SIGHUP, flags win, bad keys are one sentence."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import grpc
import pytest

from tools import needs

import certs
from conftest import clean_env, wait_for
from gpuagent.collector.ingest.auth import token_digest
from gpuagent.proto import pb, pb_grpc

pytestmark = needs("openssl")

SERVE = [sys.executable, "-m", "gpuagent.collector.cli", "serve", "--listen", "127.0.0.1:0", "--no-analyze"]


def tokens(token):
    return f'[[token]]\nsha256 = "{token_digest(token)}"\nrole = "query"\n'


def query(ch, token):
    try:
        pb_grpc.CollectorStub(ch).Query(pb.QueryRequest(sql="SELECT 1"),
                                        metadata=(("authorization", f"Bearer {token}"),) if token else (), timeout=10)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


@pytest.fixture
def pki(tmp_path):
    d = tmp_path / "pki"
    certs.make_ca(d)
    certs.server_cert(d)
    certs.client_cert(d, "alice", "query")
    return d


def serve(tmp_path, *extra):
    port_file = tmp_path / "port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([*SERVE, "--db", str(tmp_path / "c.duckdb"), "--port-file", str(port_file), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())

    def port():
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}: {proc.stderr.read()[-1000:]}")
        return port_file.exists() and int(port_file.read_text())
    return proc, wait_for(port, timeout=60, what="the collector's port file")


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_auth_table_in_config_rotates_on_sighup(tmp_path, pki):
    etc = tmp_path / "etc"
    etc.mkdir()
    shutil.copy(pki / "ca.pem", etc / "client-ca.pem")
    (etc / "tokens.toml").write_text(tokens("old-token"))
    (etc / "collector.toml").write_text('[auth]\ntokens_file = "tokens.toml"\ntls_client_ca = "client-ca.pem"\n')
    proc, port = serve(tmp_path, "--config", str(etc / "collector.toml"), "--tls-cert", str(pki / "collector.pem"),
                       "--tls-key", str(pki / "collector.key"))
    try:
        with_cert = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(), (pki / "query-alice.key").read_bytes(),
                                                 (pki / "query-alice.pem").read_bytes())
        no_cert = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
        with grpc.secure_channel(f"localhost:{port}", no_cert) as ch:
            assert query(ch, "old-token") == "UNAVAILABLE"       # the client CA from [auth] is enforced
        with grpc.secure_channel(f"localhost:{port}", with_cert) as ch:
            assert query(ch, "old-token") == "OK"
            assert query(ch, "new-token") == "UNAUTHENTICATED"   # the tokens file from [auth] is enforced
            (etc / "tokens.toml").write_text(tokens("new-token"))
            proc.send_signal(signal.SIGHUP)
            wait_for(lambda: query(ch, "new-token") == "OK", timeout=60, what="the new token after SIGHUP")
            assert query(ch, "old-token") == "UNAUTHENTICATED"
    finally:
        stop(proc)
    assert proc.returncode == 0, proc.stderr.read()[-1000:]


def test_tokens_file_flag_wins_over_config(tmp_path):
    (tmp_path / "config.toml").write_text('[auth]\ntokens_file = "from-config.toml"\n')
    (tmp_path / "from-config.toml").write_text(tokens("config-token"))
    (tmp_path / "from-flag.toml").write_text(tokens("flag-token"))
    proc, port = serve(tmp_path, "--config", str(tmp_path / "config.toml"),
                       "--tokens-file", str(tmp_path / "from-flag.toml"))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            assert query(ch, "flag-token") == "OK"
            assert query(ch, "config-token") == "UNAUTHENTICATED"
    finally:
        stop(proc)


@pytest.mark.parametrize("text,words", [
    ('[auth]\ntoken_file = "t.toml"\n', "unknown key auth.token_file"),
    ('[auth]\ntokens_file = 3\n', "auth.tokens_file must be a file path"),
    ('[auth]\ntokens_file = "missing.toml"\n', "missing.toml"),
])
def test_bad_auth_table_is_one_sentence(tmp_path, text, words):
    (tmp_path / "config.toml").write_text(text)
    res = subprocess.run([*SERVE, "--db", str(tmp_path / "c.duckdb"), "--config", str(tmp_path / "config.toml")],
                         capture_output=True, text=True, timeout=120, env=clean_env())
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], res.stderr
    assert not (tmp_path / "c.duckdb").exists()
