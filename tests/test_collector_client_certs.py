"""`analyze`, `compare` and `report` against a collector that requires client certificates (mutual TLS),
as real CLI subprocesses with certificates made by openssl (tests/certs.py), like `sql`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools import needs

import certs
from conftest import clean_env
from gpuagent.collector.service import start_collector

pytestmark = needs("openssl")

CLI = [sys.executable, "-m", "gpuagent.collector.cli"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    certs.make_ca(d)
    certs.server_cert(d)
    certs.client_cert(d, "root", "admin")
    certs.client_cert(d, "alice", "query")
    return d


@pytest.fixture(scope="module")
def mtls(pki, tmp_path_factory):
    d = tmp_path_factory.mktemp("mtls")
    handle = start_collector(d / "c.duckdb", tls_cert=str(pki / "collector.pem"), tls_key=str(pki / "collector.key"),
                             tls_client_ca=str(pki / "ca.pem"), analyze=False)
    yield handle
    handle.stop()


def cli(*args, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=clean_env())


def tls_args(pki, mtls, cert=None):
    out = ["--target", f"localhost:{mtls.port}", "--tls-ca", str(pki / "ca.pem")]
    if cert:
        out += ["--tls-client-cert", str(pki / f"{cert}.pem"), "--tls-client-key", str(pki / f"{cert}.key")]
    return out


def test_analyze_with_an_admin_certificate(pki, mtls):
    res = cli("analyze", *tls_args(pki, mtls, "admin-root"), "--format", "json")
    assert res.returncode == 0, res.stderr
    assert "open_flags" in json.loads(res.stdout)
    # A query certificate may read but not run a pass: refused, one sentence naming the role.
    res = cli("analyze", *tls_args(pki, mtls, "query-alice"))
    assert res.returncode != 0 and "needs the admin role" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


@pytest.mark.parametrize("command", ["compare", "report"])
def test_compare_and_report_with_a_query_certificate(pki, mtls, tmp_path, command):
    extra = ["--out", str(tmp_path / "r.html")] if command == "report" else ["--format", "json"]
    ok = cli(command, *tls_args(pki, mtls, "query-alice"), *extra)
    assert ok.returncode == 0, ok.stderr
    if command == "report":
        assert (tmp_path / "r.html").read_text().startswith("<!")
    else:
        json.loads(ok.stdout)
    # The same call without a client certificate is refused by the collector's TLS handshake.
    (tmp_path / "r.html").unlink(missing_ok=True)
    bare = cli(command, *tls_args(pki, mtls), *extra)
    assert bare.returncode != 0 and "Error:" in bare.stderr, bare.stderr
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("command", ["sql", "analyze", "compare", "report"])
def test_client_certificate_needs_its_key_and_tls(pki, mtls, tmp_path, command):
    head = [command] + (["SELECT 1"] if command == "sql" else []) + (
        ["--out", str(tmp_path / "r.html")] if command == "report" else [])
    res = cli(*head, "--target", f"localhost:{mtls.port}", "--tls-client-cert", str(pki / "query-alice.pem"),
              "--tls-client-key", str(pki / "query-alice.key"))
    assert res.returncode != 0 and "needs --tls-ca" in res.stderr, res.stderr
    res = cli(*head, *tls_args(pki, mtls), "--tls-client-cert", str(pki / "query-alice.pem"))
    assert res.returncode != 0 and "go together" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
