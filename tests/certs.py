"""A small CA made with the openssl command line, exactly as docs/COLLECTOR.md (Security) describes."""

from __future__ import annotations

import subprocess
from pathlib import Path

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str = "ca") -> Path:
    """``name``.pem / ``name``.key: a self-signed CA."""
    d.mkdir(parents=True, exist_ok=True)
    _run("req", "-x509", *EC, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "30",
         "-subj", f"/CN=gpuagent {name}", cwd=d)
    return d / f"{name}.pem"


def issue(d: Path, name: str, subject: str, ext: str, ca: str = "ca") -> tuple[Path, Path]:
    """``name``.pem / ``name``.key signed by ``ca``, with ``subject`` (e.g. /OU=ingest/CN=gpu-01) and the
    extensions ``ext`` (e.g. subjectAltName=DNS:gpu-01)."""
    (d / f"{name}.ext").write_text(ext + "\n")
    _run("req", "-new", *EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=d)
    _run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
         "-days", "30", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


def server_cert(d: Path, name: str = "collector", ca: str = "ca") -> tuple[Path, Path]:
    return issue(d, name, "/CN=collector", "subjectAltName=DNS:localhost,IP:127.0.0.1", ca)


def client_cert(d: Path, node: str, ou: str = "ingest", ca: str = "ca", name: str | None = None) -> tuple[Path, Path]:
    return issue(d, name or f"{ou}-{node}", f"/OU={ou}/CN={node}",
                 f"subjectAltName=DNS:{node}\nextendedKeyUsage=clientAuth", ca)
