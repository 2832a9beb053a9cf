"""The role and node-identity matrix: every kind of credential against every RPC, over real gRPC on loopback,
with tokens from a tokens file and client certificates made by openssl (tests/certs.py)."""

from __future__ import annotations

import itertools

import grpc
import pytest

from tools import needs
from grpc_health.v1 import health_pb2, health_pb2_grpc

import certs
from collector_helpers import node_info, sample_batch
from gpuagent.collector.ingest.auth import TokenError, TokenTable, token_digest
from gpuagent.collector.service import CollectorError, start_collector
from gpuagent.proto import pb, pb_grpc

pytestmark = needs("openssl")

SHARED = "shared-secret"
TOKENS = {"ingest_a": "tok-ingest-a", "ingest_pool": "tok-ingest-pool", "query": "tok-query", "admin": "tok-admin"}
TOKENS_TOML = f"""
[[token]]
name = "gpu-01"
sha256 = "{token_digest(TOKENS['ingest_a'])}"
role = "ingest"
nodes = ["gpu-01"]

[[token]]
name = "pool a"
token = "{TOKENS['ingest_pool']}"
role = "ingest"
nodes = ["pool-a-*"]

[[token]]
sha256 = "{token_digest(TOKENS['query'])}"
role = "query"

[[token]]
sha256 = "{token_digest(TOKENS['admin'])}"
role = "admin"
"""
_seq = itertools.count(1)
_machine = itertools.count(1)


def md(token):
    return (("authorization", f"Bearer {token}"),) if token else ()


def machine_of(host):
    return f"m-{host}"


def outcome(ch, rpc, auth=(), node="gpu-01"):
    """'OK' or the status code name of one call of ``rpc`` on channel ``ch``."""
    stub = pb_grpc.CollectorStub(ch)
    try:
        if rpc == "Register":
            stub.Register(pb.RegisterRequest(node=node_info(node, machine_of(node))), metadata=auth, timeout=10)
        elif rpc == "Stream":
            acks = list(stub.Stream(iter([sample_batch(node, next(_seq))]), metadata=auth, timeout=10))
            assert len(acks) == 1
        elif rpc == "Query":
            stub.Query(pb.QueryRequest(sql="SELECT 1"), metadata=auth, timeout=10)
        elif rpc == "Analyze":
            stub.Analyze(pb.AnalyzeRequest(), metadata=auth, timeout=60)
        elif rpc == "health":
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name


OK, UA, PD = "OK", "UNAUTHENTICATED", "PERMISSION_DENIED"
# credential -> expected outcome for Register, Stream (as gpu-01), Query, Analyze, health
TOKEN_MATRIX = {
    "none": (None, [UA, UA, UA, UA, OK]),
    "bad": ("not-a-token", [UA, UA, UA, UA, OK]),
    "ingest_a": (TOKENS["ingest_a"], [OK, OK, PD, PD, OK]),
    "ingest_pool": (TOKENS["ingest_pool"], [PD, PD, PD, PD, OK]),
    "query": (TOKENS["query"], [PD, PD, OK, PD, OK]),
    "admin": (TOKENS["admin"], [PD, PD, OK, OK, OK]),
    "shared": (SHARED, [OK, OK, OK, OK, OK]),
}
RPCS = ("Register", "Stream", "Query", "Analyze", "health")


@pytest.fixture(scope="module")
def token_collector(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    (d / "tokens.toml").write_text(TOKENS_TOML)
    handle = start_collector(d / "c.duckdb", token=SHARED, tokens_file=str(d / "tokens.toml"), analyze=False)
    with grpc.insecure_channel(handle.address) as ch:      # nodes exist before the stream checks
        for host in ("gpu-01", "gpu-02", "pool-a-7"):
            assert outcome(ch, "Register", md(SHARED), host) == OK
    yield handle
    handle.stop()


@pytest.mark.parametrize("cred", list(TOKEN_MATRIX))
def test_token_matrix(token_collector, cred):
    token, expected = TOKEN_MATRIX[cred]
    with grpc.insecure_channel(token_collector.address) as ch:
        got = [outcome(ch, rpc, md(token)) for rpc in RPCS]
    assert got == expected, dict(zip(RPCS, got))


def test_node_patterns_and_other_nodes(token_collector):
    refusals = token_collector.servicer.refusals
    before = refusals["node_not_allowed"]
    with grpc.insecure_channel(token_collector.address) as ch:
        assert outcome(ch, "Register", md(TOKENS["ingest_pool"]), "pool-a-7") == OK
        assert outcome(ch, "Stream", md(TOKENS["ingest_pool"]), "pool-a-7") == OK
        assert outcome(ch, "Register", md(TOKENS["ingest_a"]), "gpu-02") == PD
        assert outcome(ch, "Stream", md(TOKENS["ingest_a"]), "gpu-02") == PD
        # bound by metadata as the stream opens
        stub = pb_grpc.CollectorStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Stream(iter([sample_batch("gpu-02", next(_seq))]),
                             metadata=(*md(TOKENS["ingest_a"]), ("gpuagent-node-id", "gpu-02")), timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'gpu-02'" in err.value.details() and "gpu-01" in err.value.details()
    assert refusals["node_not_allowed"] == before + 3


def test_stream_that_switches_to_another_node_is_refused(token_collector):
    with grpc.insecure_channel(token_collector.address) as ch:
        stub = pb_grpc.CollectorStub(ch)
        call = stub.Stream(iter([sample_batch("gpu-01", next(_seq)), sample_batch("gpu-02", next(_seq))]),
                           metadata=md(TOKENS["ingest_a"]), timeout=10)
        acks = []
        with pytest.raises(grpc.RpcError) as err:
            for ack in call:
                acks.append(ack)
        assert len(acks) == 1
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "writes as node 'gpu-01'" in err.value.details()


def test_refusals_are_one_sentence_and_counted(token_collector):
    refusals = token_collector.servicer.refusals
    before = dict(refusals)
    with grpc.insecure_channel(token_collector.address) as ch:
        stub = pb_grpc.CollectorStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Query(pb.QueryRequest(sql="SELECT 1"), metadata=md(TOKENS["ingest_a"]), timeout=10)
        assert err.value.details() == ("Query needs the query role, and the ingest token 'gpu-01' has only ingest")
        with pytest.raises(grpc.RpcError) as err:
            stub.Analyze(pb.AnalyzeRequest(), metadata=md(TOKENS["query"]), timeout=10)
        assert "Analyze needs the admin role" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Query(pb.QueryRequest(sql="SELECT 1"), metadata=md("nope"), timeout=10)
        assert "does not match" in err.value.details() and "\n" not in err.value.details()
    assert refusals["role_query_missing"] == before.get("role_query_missing", 0) + 1
    assert refusals["role_admin_missing"] == before.get("role_admin_missing", 0) + 1
    assert refusals["unknown_token"] == before.get("unknown_token", 0) + 1


@pytest.mark.parametrize("text, words", [
    ('[[token]]\nsha256 = "abc"\nrole = "query"\n', "64 hex digits"),
    ('[[token]]\ntoken = "x"\nrole = "root"\n', "role must be one of"),
    ('[[token]]\ntoken = "x"\nrole = "ingest"\n', "needs nodes"),
    ('[[token]]\ntoken = "x"\nrole = "query"\nnodes = ["a"]\n', "only applies to ingest"),
    ('[[token]]\ntoken = "x"\nsha256 = "' + "0" * 64 + '"\nrole = "query"\n', "exactly one of"),
    ("[[token]\n", "not valid TOML"),
])
def test_bad_tokens_file_is_one_sentence(tmp_path, text, words):
    p = tmp_path / "tokens.toml"
    p.write_text(text)
    with pytest.raises(TokenError) as err:
        TokenTable.load(str(p))
    assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CollectorError, match=words):
        start_collector(tmp_path / "c.duckdb", tokens_file=str(p), analyze=False)
    assert not (tmp_path / "c.duckdb").exists()


# ------------------------------------------------------------------------------------------ mutual TLS

@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    certs.make_ca(d)
    certs.server_cert(d)
    for node, ou in (("gpu-01", "ingest"), ("gpu-02", "ingest"), ("alice", "query"), ("root", "admin")):
        certs.client_cert(d, node, ou)
    certs.make_ca(d, "rogue")
    certs.client_cert(d, "gpu-01", "ingest", ca="rogue", name="rogue-gpu-01")
    return d


@pytest.fixture(scope="module")
def mtls_collector(pki, tmp_path_factory):
    d = tmp_path_factory.mktemp("mtls")
    (d / "tokens.toml").write_text(TOKENS_TOML)
    handle = start_collector(d / "c.duckdb", tls_cert=str(pki / "collector.pem"), tls_key=str(pki / "collector.key"),
                             tls_client_ca=str(pki / "ca.pem"), tokens_file=str(d / "tokens.toml"), analyze=False)
    yield handle
    handle.stop()


def mtls_channel(pki, port, cert_name=None):
    key = (pki / f"{cert_name}.key").read_bytes() if cert_name else None
    chain = (pki / f"{cert_name}.pem").read_bytes() if cert_name else None
    creds = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(), key, chain)
    return grpc.secure_channel(f"localhost:{port}", creds)


MTLS_MATRIX = {
    # certificate (None: no client certificate), token -> Register, Stream, Query, Analyze, health as gpu-01
    "no certificate": (None, None, ["UNAVAILABLE"] * 5),
    "certificate of another CA": ("rogue-gpu-01", None, ["UNAVAILABLE"] * 5),
    "node certificate gpu-01": ("ingest-gpu-01", None, [OK, OK, PD, PD, OK]),
    "node certificate gpu-02": ("ingest-gpu-02", None, [PD, PD, PD, PD, OK]),
    "query certificate": ("query-alice", None, [PD, PD, OK, PD, OK]),
    "admin certificate": ("admin-root", None, [PD, PD, OK, OK, OK]),
    "node certificate + query token": ("ingest-gpu-02", TOKENS["query"], [PD, PD, OK, PD, OK]),
    "node certificate + bad token": ("ingest-gpu-01", "nope", [UA, UA, UA, UA, OK]),
}


@pytest.mark.parametrize("case", list(MTLS_MATRIX))
def test_mtls_matrix(pki, mtls_collector, case):
    cert, token, expected = MTLS_MATRIX[case]
    with mtls_channel(pki, mtls_collector.port, cert) as ch:
        got = [outcome(ch, rpc, md(token)) for rpc in RPCS]
    assert got == expected, dict(zip(RPCS, got))


def test_node_certificate_cannot_stream_as_another_node(pki, mtls_collector):
    with mtls_channel(pki, mtls_collector.port, "ingest-gpu-02") as ch:
        assert outcome(ch, "Register", (), "gpu-02") == OK
        stub = pb_grpc.CollectorStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Stream(iter([sample_batch("gpu-01", next(_seq))]), timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details().endswith(
            "the node certificate 'gpu-02' may write as nodes matching gpu-02, not as node 'gpu-01'")
        assert outcome(ch, "Stream", (), "gpu-02") == OK
