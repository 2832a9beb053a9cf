"""Who may call the collector, as what role, and as which nodes.

Three roles: ``ingest`` (an agent: Register, Stream), ``query`` (read-only SQL: Query) and ``admin``
(Analyze and future maintenance RPCs; admin may also query). A credential is one of

* the single shared token (``--token``): every role, any node -- the simple setup;
* an entry of the tokens file (``--tokens-file``, TOML, see ``TokenTable``): one role, and for ingest the
  node-name glob patterns it may write as;
* a client certificate signed by ``--tls-client-ca``: its CN (or, without a CN, its first DNS SAN) is the
  one node it may write as; an ``OU=query`` or ``OU=admin`` in its subject makes it a query/admin
  certificate instead (any other OU, or none, means ingest).

A bearer token, when the call carries one, is the credential; otherwise the client certificate. Missing or
invalid credentials end the call with UNAUTHENTICATED, a role that does not cover the method with
PERMISSION_DENIED; each with one sentence, counted by cause. The health service stays open. Tokens are kept
as SHA-256 digests and compared in constant time. ``AuthPolicy.reload`` swaps the tokens file in place
(SIGHUP) without touching established calls.
"""

from __future__ import annotations

import contextvars
import fnmatch
import hashlib
import hmac
import logging
import re
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path

import grpc

from gpuagent.proto.wire import AUTHORIZATION_KEY, BEARER_PREFIX

log = logging.getLogger("gpuagent.collector")

HEALTH_PREFIX = "/grpc.health.v1.Health/"
ROLES = ("ingest", "query", "admin")
# The role a method needs; a method not listed (reflection) needs any valid credential.
METHOD_ROLES = {
    "/gpuagent.v1.Collector/Register": "ingest",
    "/gpuagent.v1.Collector/Stream": "ingest",
    "/gpuagent.v1.Collector/Query": "query",
    "/gpuagent.v1.Collector/Analyze": "admin",
    # a person looking at a node: reads what the node holds (docs/RESOLUTION.md)
    "/gpuagent.v1.Collector/RequestRawWindow": "query",
}


class TokenError(ValueError):
    """The token option or tokens file is unusable; the message is one sentence."""


def load_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The token from ``token`` or the first line of ``token_file`` (one of them at most)."""
    if token and token_file:
        raise TokenError("give either --token or --token-file, not both")
    if token_file:
        try:
            text = Path(token_file).read_text().strip()
        except OSError as exc:
            raise TokenError(f"cannot read the token file {token_file}: {exc.strerror}") from None
        if not text:
            raise TokenError(f"the token file {token_file} is empty")
        return text.splitlines()[0].strip()
    if token is not None and not token.strip():
        raise TokenError("the token is empty")
    return token.strip() if token else None


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# ------------------------------------------------------------------------------------------ principals

@dataclass(frozen=True)
class Principal:
    """An authenticated caller: its roles, the node-name patterns it may write as (None: any), and a
    description for refusal sentences."""
    roles: frozenset[str]
    nodes: tuple[str, ...] | None
    who: str

    def allows_role(self, role: str) -> bool:
        return role in self.roles or (role == "query" and "admin" in self.roles)

    def allows_node(self, hostname: str) -> bool:
        return self.nodes is None or any(fnmatch.fnmatchcase(hostname, p) for p in self.nodes)

    def node_refusal(self, hostname: str) -> str | None:
        """None when this caller may write as ``hostname``; else the sentence saying why not."""
        if self.allows_node(hostname):
            return None
        return (f"{self.who} may write as nodes matching {', '.join(self.nodes or ())}, "
                f"not as node {hostname!r}")


ANYONE = Principal(frozenset(ROLES), None, "an unauthenticated client")   # a collector with no auth at all
_current: contextvars.ContextVar[Principal] = contextvars.ContextVar("gpuagent_principal", default=ANYONE)


def current_principal() -> Principal:
    """The caller of the RPC running in this task (set by ``AuthInterceptor``)."""
    return _current.get()


def _check_patterns(value, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(p, str) and p.strip() for p in value):
        raise TokenError(f"{where}: nodes must be a non-empty list of node names or glob patterns")
    return tuple(p.strip() for p in value)


class TokenTable:
    """Tokens from a TOML file: one ``[[token]]`` table per credential::

        [[token]]
        name = "gpu-01 agent"           # optional, shown in refusals and logs
        sha256 = "<64 hex digits>"      # or: token = "<the token itself>"
        role = "ingest"                 # ingest | query | admin
        nodes = ["gpu-01", "pool-a-*"]  # ingest only: node names (glob patterns) it may write as
    """

    def __init__(self, entries: list[tuple[bytes, Principal]]):
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def load(cls, path: str) -> TokenTable:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise TokenError(f"cannot read the tokens file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise TokenError(f"the tokens file {path} is not valid TOML: {exc}") from None
        unknown = set(doc) - {"token"}
        if unknown:
            raise TokenError(f"the tokens file {path} has unknown tables {sorted(unknown)}; "
                             "only [[token]] entries belong there")
        raw = doc.get("token", [])
        if not isinstance(raw, list):
            raise TokenError(f"the tokens file {path}: write each credential as a [[token]] table")
        entries: list[tuple[bytes, Principal]] = []
        seen: set[bytes] = set()
        for i, e in enumerate(raw, 1):
            where = f"{path}, token entry {i}"
            extra = set(e) - {"name", "sha256", "token", "role", "nodes"}
            if extra:
                raise TokenError(f"{where}: unknown keys {sorted(extra)}")
            if ("sha256" in e) == ("token" in e):
                raise TokenError(f"{where}: give exactly one of sha256 (preferred) or token")
            if "token" in e:
                if not isinstance(e["token"], str) or not e["token"].strip():
                    raise TokenError(f"{where}: token must be a non-empty string")
                digest = bytes.fromhex(token_digest(e["token"].strip()))
            else:
                if not isinstance(e["sha256"], str) or not re.fullmatch(r"[0-9a-fA-F]{64}", e["sha256"]):
                    raise TokenError(f"{where}: sha256 must be 64 hex digits (gpuagent-collector token new)")
                digest = bytes.fromhex(e["sha256"])
            role = e.get("role")
            if role not in ROLES:
                raise TokenError(f"{where}: role must be one of {', '.join(ROLES)}, not {role!r}")
            if role == "ingest":
                if "nodes" not in e:
                    raise TokenError(f"{where}: an ingest token needs nodes = [...] (use [\"*\"] for any node)")
                nodes = _check_patterns(e["nodes"], where)
            elif "nodes" in e:
                raise TokenError(f"{where}: nodes only applies to ingest tokens")
            else:
                nodes = None
            if digest in seen:
                raise TokenError(f"{where}: the same token appears twice")
            seen.add(digest)
            name = e.get("name") or f"token entry {i}"
            entries.append((digest, Principal(frozenset({role}), nodes, f"the {role} token {name!r}")))
        return cls(entries)

    def find(self, token: str) -> Principal | None:
        """The entry for ``token``; every entry is compared (constant time per entry)."""
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for expected, principal in self._entries:
            if hmac.compare_digest(digest, expected):
                found = principal
        return found


def cert_principal(auth_context: dict) -> Principal | None:
    """The principal of a verified client certificate, from gRPC's auth context; None without one."""
    subject = b"".join(auth_context.get("x509_subject", [])).decode(errors="replace")
    cn = b"".join(auth_context.get("x509_common_name", [])).decode(errors="replace")
    sans = [s.decode(errors="replace") for s in auth_context.get("x509_subject_alternative_name", [])]
    ous = {m.lower() for m in re.findall(r"(?:^|,)OU=([^,]+)", subject)}
    return _cert_role(cn or (sans[0] if sans else ""), ous)


def peer_cert_principal(cert: dict | None) -> Principal | None:
    """The principal of a client certificate that Python's ssl verified (``SSLSocket.getpeercert()``), by
    the same rule as gRPC's: the console's HTTPS uses the collector's client CA too."""
    if not cert:
        return None
    fields = [(k, v) for rdn in cert.get("subject", ()) for k, v in rdn]
    cn = next((v for k, v in fields if k == "commonName"), "")
    sans = [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"]
    return _cert_role(cn or (sans[0] if sans else ""), {v.lower() for k, v in fields if k == "organizationalUnitName"})


def _cert_role(name: str, ous: set[str]) -> Principal | None:
    if not name:
        return None
    for role in ("admin", "query"):
        if role in ous:
            return Principal(frozenset({role}), None, f"the {role} certificate {name!r}")
    return Principal(frozenset({"ingest"}), (name,), f"the node certificate {name!r}")


# ------------------------------------------------------------------------------------------ policy

class AuthPolicy:
    """The credentials a collector accepts. Empty (no token, no tokens file, no client CA): open."""

    def __init__(self, shared_token: str | None = None, tokens_file: str | None = None,
                 client_certs: bool = False, counter=None):
        self._shared = hashlib.sha256(shared_token.encode()).digest() if shared_token else None
        self.tokens_file = tokens_file
        self.table = TokenTable.load(tokens_file) if tokens_file else TokenTable([])
        self.client_certs = client_certs
        self.refusals = counter if counter is not None else {}

    @property
    def enabled(self) -> bool:
        return bool(self._shared or self.tokens_file or self.client_certs)

    def reload(self) -> None:
        """Re-read the tokens file; on error keep the current table and raise TokenError."""
        if self.tokens_file:
            self.table = TokenTable.load(self.tokens_file)

    def _count(self, cause: str) -> None:
        self.refusals[cause] = self.refusals.get(cause, 0) + 1

    def authenticate(self, metadata, auth_context) -> tuple[Principal | None, str]:
        """(principal, "") or (None, the UNAUTHENTICATED sentence)."""
        got = None
        for key, value in metadata or ():
            if key == AUTHORIZATION_KEY:
                got = value.decode(errors="replace") if isinstance(value, bytes) else value
                break
        if got is not None:
            token = got[len(BEARER_PREFIX):].strip()
            if not got.startswith(BEARER_PREFIX) or not token:
                self._count("bad_authorization")
                return None, "the authorization metadata does not match the form 'Bearer <token>'"
            if self._shared is not None and hmac.compare_digest(
                    hashlib.sha256(token.encode()).digest(), self._shared):
                return Principal(frozenset(ROLES), None, "the shared token"), ""
            found = self.table.find(token)
            if found is not None:
                return found, ""
            self._count("unknown_token")
            return None, "the token does not match any of this collector's tokens (unknown, revoked or mistyped)"
        if self.client_certs:
            p = cert_principal(auth_context or {})
            if p is not None:
                return p, ""
        self._count("no_credentials")
        return None, ("this collector requires a token: send 'authorization: Bearer <token>' metadata"
                      + (" or a client certificate with a CN" if self.client_certs else ""))

    def authorize(self, method: str, principal: Principal) -> str | None:
        role = METHOD_ROLES.get(method)
        if role is None or principal.allows_role(role):
            return None
        self._count(f"role_{role}_missing")
        short = method.rsplit("/", 1)[-1]
        return f"{short} needs the {role} role, and {principal.who} has only {', '.join(sorted(principal.roles))}"


def new_token() -> str:
    return "gpa_" + secrets.token_urlsafe(32)


# ------------------------------------------------------------------------------------------ interceptor

def _wrap(handler: grpc.RpcMethodHandler, policy: AuthPolicy, method: str) -> grpc.RpcMethodHandler:
    """``handler`` with the credential check run inside the call, where the TLS auth context is known."""

    async def check(context) -> Principal:
        principal, why = policy.authenticate(context.invocation_metadata(), context.auth_context())
        if principal is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        refusal = policy.authorize(method, principal)
        if refusal:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        _current.set(principal)
        return principal

    def unary_response(behavior):
        async def call(request_or_iterator, context):
            await check(context)
            return await behavior(request_or_iterator, context)
        return call

    def streaming_response(behavior):
        async def call(request_or_iterator, context):
            await check(context)
            async for item in behavior(request_or_iterator, context):
                yield item
        return call

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming_response(handler.stream_stream), **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary_response(handler.stream_unary), **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming_response(handler.unary_stream), **kw)
    return grpc.unary_unary_rpc_method_handler(unary_response(handler.unary_unary), **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks credentials and roles of every call except health checks (see ``AuthPolicy``)."""

    def __init__(self, policy: AuthPolicy):
        self._policy = policy

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        return _wrap(handler, self._policy, method)
