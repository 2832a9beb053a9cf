"""Where and how the collector may listen: the listen policy, the port check and the TLS files.

Checked before the database is opened, so a collector that may not or cannot listen leaves no new database
file behind. ``CollectorError`` lives here, the lowest module that raises it, so the gRPC server (server.py)
and start-up (collector/service.py) raise the same class.
"""

from __future__ import annotations

import errno
import socket
import ssl
from pathlib import Path

import grpc

from gpuagent.common.hostport import AddressError, is_loopback, split_host_port


class CollectorError(RuntimeError):
    """The collector cannot start or keep running; the message is one sentence for a person."""


def split_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port); CollectorError for anything else."""
    try:
        return split_host_port(listen, "--listen")
    except AddressError as exc:
        raise CollectorError(str(exc)) from None


def port_in_use(listen: str) -> bool:
    """True when HOST:PORT is already bound by another listener. Port 0 is never in use."""
    host, port = split_listen(listen)
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False           # an unresolvable host: the gRPC bind reports it
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as gRPC binds
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def check_listen_policy(listen: str, token: str | None, tls: bool, insecure: bool) -> None:
    """Refuse exposed setups that would let anyone on the network write or read the fleet's data.
    ``token`` is any credential setting (shared token, tokens file or client CA)."""
    host, _ = split_listen(listen)
    if is_loopback(host):
        return
    if not token:
        raise CollectorError(
            f"refusing to listen on {listen} without a token: beyond loopback anyone who can reach the port "
            "could write data and read the database, so pass --token or --token-file "
            "(or GPUAGENT_COLLECTOR_TOKEN), --tokens-file or --tls-client-ca")
    if not tls and not insecure:
        raise CollectorError(
            f"refusing to listen on {listen} in plaintext: the token and the data would cross the network "
            "unencrypted, so pass --tls-cert/--tls-key, or --insecure if the network is trusted")


def check_tls_options(tls_cert: str | None, tls_key: str | None, tls_client_ca: str | None) -> bool:
    """Whether TLS is on; CollectorError when the TLS options do not go together."""
    tls = bool(tls_cert or tls_key)
    if tls and not (tls_cert and tls_key):
        raise CollectorError("TLS needs both --tls-cert and --tls-key")
    if tls_client_ca and not tls:
        raise CollectorError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    return tls


class TlsFiles:
    """The server's TLS key, certificate and (for mutual TLS) client CA, re-readable for rotation.

    gRPC asks ``fetch`` at each new handshake; after ``reload`` it gets the new files, so new connections
    use them while established ones keep theirs."""

    def __init__(self, cert: str, key: str, client_ca: str | None):
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._config = self._read()
        self._fresh = False
        self._ssl: ssl.SSLContext | None = None

    def _read(self):
        try:
            key, cert = Path(self.key).read_bytes(), Path(self.cert).read_bytes()
            ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        except OSError as exc:
            raise CollectorError(f"cannot read the TLS key, certificate or client CA: {exc.strerror}: "
                                 f"{exc.filename}") from None
        for what, data in (("--tls-cert", cert), ("--tls-key", key), ("--tls-client-ca", ca)):
            if data is not None and b"-----BEGIN" not in data:
                raise CollectorError(f"{what} is not a PEM file")
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._config, self.fetch,
                                                   require_client_authentication=bool(self.client_ca))

    def reload(self) -> None:
        """Read the files again (CollectorError, keeping the current ones, when they are unusable)."""
        self._config = self._read()
        self._fresh = True
        self._ssl = None

    def ssl_context(self) -> ssl.SSLContext:
        """The same files for the console's HTTPS: a client certificate is asked for (and verified against
        the client CA) but not required, so a browser without one can still log in with a token. Rebuilt
        after ``reload``, so new connections get the rotated files as gRPC's do."""
        if self._ssl is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                ctx.load_cert_chain(self.cert, self.key)
                if self.client_ca:
                    ctx.load_verify_locations(self.client_ca)
                    ctx.verify_mode = ssl.CERT_OPTIONAL
            except (OSError, ssl.SSLError) as exc:
                raise CollectorError(f"cannot use the TLS files for the console: {exc}") from None
            self._ssl = ctx
        return self._ssl

    def fetch(self):
        if not self._fresh:
            return None
        self._fresh = False
        return self._config
