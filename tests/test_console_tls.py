"""The web console over HTTPS with the collector's own TLS files (issue 48: "the query role's token or a client
certificate"): a real collector with mutual TLS for gRPC and --ui-listen, certificates made by openssl
(tests/certs.py), fetched with Python's ssl. A query or admin certificate opens the pages, a node (ingest)
certificate is refused with 403, no credential is 401, a certificate from another CA never completes the
handshake and the console goes on serving, and SIGHUP's reload gives new connections the rotated files."""

from __future__ import annotations

import hashlib
import shutil
import socket
import ssl
import urllib.error
import urllib.request

import pytest

import certs
from gpuagent.collector.service import start_collector
from tools import needs

pytestmark = needs("openssl")
QUERY_TOKEN = "console-tls-query-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    certs.make_ca(d)
    certs.make_ca(d, "other")
    certs.server_cert(d)
    certs.client_cert(d, "alice", "query")
    certs.client_cert(d, "root", "admin")
    certs.client_cert(d, "gpu-01", "ingest")
    certs.client_cert(d, "mallory", "query", ca="other")
    return d


@pytest.fixture(scope="module")
def col(pki, tmp_path_factory):
    d = tmp_path_factory.mktemp("console-tls")
    tokens = d / "tokens.toml"
    tokens.write_text(f'[[token]]\nname = "viewer"\ntoken = "{QUERY_TOKEN}"\nrole = "query"\n')
    handle = start_collector(d / "c.duckdb", "127.0.0.1:0", tls_cert=str(pki / "collector.pem"),
                             tls_key=str(pki / "collector.key"), tls_client_ca=str(pki / "ca.pem"),
                             tokens_file=str(tokens), analyze=False, ui_listen="127.0.0.1:0")
    yield handle
    handle.stop()


def context(pki, cert: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
    if cert:
        ctx.load_cert_chain(str(pki / f"{cert}.pem"), str(pki / f"{cert}.key"))
    return ctx


def get(col, pki, cert: str | None = None, token: str | None = None, path: str = "/"):
    req = urllib.request.Request(f"https://127.0.0.1:{col.console.port}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30, context=context(pki, cert)) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_the_console_is_https_with_the_collectors_certificate(col, pki):
    assert col.console.scheme == "https"
    status, text = get(col, pki, "query-alice")
    assert status == 200 and "<h1>Fleet</h1>" in text


@pytest.mark.parametrize("cert", ["query-alice", "admin-root"])
def test_a_query_or_admin_certificate_opens_every_page(col, pki, cert):
    for path in ("/", "/findings"):
        status, text = get(col, pki, cert, path=path)
        assert status == 200, (path, text[:300])


def test_a_node_certificate_is_403_and_no_credential_is_401_naming_the_certificate(col, pki):
    status, text = get(col, pki, "ingest-gpu-01")
    assert status == 403
    assert "the node certificate &#x27;gpu-01&#x27; has only ingest" in text
    status, text = get(col, pki)
    assert status == 401
    assert "or a client certificate with OU=query" in text
    assert "<h1>Fleet</h1>" not in text


def test_a_token_still_works_over_https_without_a_certificate(col, pki):
    assert get(col, pki, token=QUERY_TOKEN)[0] == 200
    assert get(col, pki, token="not-a-token")[0] == 401


def test_another_cas_certificate_and_plain_http_fail_and_the_console_goes_on(col, pki):
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
        get(col, pki, "query-mallory")
    with socket.create_connection(("127.0.0.1", col.console.port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        try:
            reply = s.recv(200)
        except ConnectionResetError:     # the server drops a connection whose handshake failed
            reply = b""
    assert b"Fleet" not in reply and not reply.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200"))
    assert get(col, pki, "query-alice")[0] == 200


def _served_cert_digest(col, pki) -> str:
    with socket.create_connection(("127.0.0.1", col.console.port), timeout=10) as raw:
        with context(pki, "query-alice").wrap_socket(raw, server_hostname="localhost") as s:
            return hashlib.sha256(s.getpeercert(binary_form=True)).hexdigest()


def test_sighup_reload_gives_new_connections_the_rotated_certificate(col, pki, tmp_path):
    before = _served_cert_digest(col, pki)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for name in ("ca.pem", "ca.key"):
        shutil.copy(pki / name, fresh / name)
    new_pem, new_key = certs.server_cert(fresh)
    shutil.copy(new_pem, pki / "collector.pem")
    shutil.copy(new_key, pki / "collector.key")
    assert col.reload() == []
    after = _served_cert_digest(col, pki)
    assert after != before
    assert get(col, pki, "query-alice")[0] == 200
