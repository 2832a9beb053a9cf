"""TLS with --tls-cert/--tls-key (a self-signed certificate made with openssl) and opt-in reflection."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from tools import need

from collector_helpers import node_info, sample_batch
from gpuagent.collector.views import client
from gpuagent.collector.service import start_collector
from gpuagent.proto import pb, pb_grpc


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    need("openssl")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def test_tls_serves_and_plaintext_clients_fail(tmp_path, cert):
    cert_pem, key_pem = cert
    with start_collector(tmp_path / "c.duckdb", token="t", tls_cert=str(cert_pem), tls_key=str(key_pem)) as h:
        target = f"127.0.0.1:{h.port}"
        creds = grpc.ssl_channel_credentials(root_certificates=cert_pem.read_bytes())
        md = (("authorization", "Bearer t"),)
        with grpc.secure_channel(target, creds) as ch:
            stub = pb_grpc.CollectorStub(ch)
            node_id = stub.Register(pb.RegisterRequest(node=node_info()), metadata=md, timeout=30).node_id
            assert [a.seq for a in stub.Stream(iter([sample_batch(node_id, 1)]), metadata=md)] == [1]
        assert client.query(target, "SELECT count(*) FROM samples", token="t", tls_ca=str(cert_pem)).rows == [[6]]
        with grpc.insecure_channel(target) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.CollectorStub(ch).Query(pb.QueryRequest(sql="SELECT 1"), metadata=md, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_beyond_loopback_policy_accepts_token_and_tls(tmp_path, cert):
    from gpuagent.collector.ingest.listen import check_listen_policy, CollectorError

    check_listen_policy("0.0.0.0:7443", "t", tls=True, insecure=False)   # no exception
    with pytest.raises(CollectorError, match="without a token"):
        check_listen_policy("10.0.0.5:7443", None, tls=True, insecure=False)
    check_listen_policy("[::1]:7443", None, tls=False, insecure=False)


def test_reflection_is_off_by_default_and_on_when_asked(tmp_path):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with start_collector(tmp_path / "a.duckdb") as h, grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with start_collector(tmp_path / "b.duckdb", reflection=True) as h, \
            grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        assert {"gpuagent.v1.Collector", "grpc.health.v1.Health"} <= services
