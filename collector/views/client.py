"""A small client for the collector's Query RPC (used by `gpuagent-collector sql` and tests)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from gpuagent.collector.views.result import QueryResult
from gpuagent.proto import pb, pb_grpc
from gpuagent.proto.wire import bearer_metadata

DEFAULT_TARGET = "127.0.0.1:7443"


class QueryError(RuntimeError):
    """The collector refused or failed the query, or could not be reached; the message says which."""


def channel(target: str, tls_ca: str | None = None, client_cert: str | None = None,
            client_key: str | None = None) -> grpc.Channel:
    """A channel to ``target``: TLS when ``tls_ca`` (PEM of the CA) is given, plaintext otherwise; with
    ``client_cert``/``client_key`` (PEM) for a collector that requires client certificates."""
    if tls_ca:
        cert = Path(client_cert).read_bytes() if client_cert else None
        key = Path(client_key).read_bytes() if client_key else None
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes(),
                                             private_key=key, certificate_chain=cert)
        return grpc.secure_channel(target, creds)
    return grpc.insecure_channel(target)


def _call(target: str, tls_ca: str | None, rpc: str, fn, client_cert: str | None = None,
          client_key: str | None = None):
    """Call ``fn(stub)`` on a fresh channel; turn gRPC failures into one-sentence QueryErrors."""
    with channel(target, tls_ca, client_cert, client_key) as ch:
        try:
            return fn(pb_grpc.CollectorStub(ch))
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.UNAVAILABLE:
                raise QueryError(f"no collector answers at {target} ({details})") from None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise QueryError(f"the collector refused the credentials: {details}") from None
            if code == grpc.StatusCode.PERMISSION_DENIED and "role" in details:
                raise QueryError(f"the collector refused {rpc} for these credentials: {details}") from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise QueryError(f"the collector at {target} is too old for {rpc}; upgrade it") from None
            raise QueryError(details or code.name) from None


def query(target: str, sql: str, token: str | None = None, max_rows: int = 0, timeout_s: float = 120.0,
          tls_ca: str | None = None, client_cert: str | None = None,
          client_key: str | None = None) -> QueryResult:
    """Run read-only ``sql`` on the live collector at ``target``."""
    resp = _call(target, tls_ca, "Query", lambda stub: stub.Query(
        pb.QueryRequest(sql=sql, max_rows=max_rows), timeout=timeout_s, metadata=bearer_metadata(token)),
        client_cert, client_key)
    return QueryResult(list(resp.columns), list(resp.column_types), json.loads(resp.rows_json or "[]"),
                       resp.truncated)


def _cell(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e16:
            return str(int(v))
        if 1e-4 <= abs(v) < 1e16:
            # at most 12 significant digits and 6 decimals: float noise like ...201.599998 is not data
            decimals = min(6, max(0, 12 - len(str(int(abs(v))))))
            return f"{v:.{decimals}f}".rstrip("0").rstrip(".")
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def format_result(result: QueryResult, fmt: str = "table") -> str:
    """Render ``result`` as an aligned text table, CSV, or JSON (a list of objects)."""
    if fmt == "json":
        return json.dumps([dict(zip(result.columns, r)) for r in result.rows], indent=None)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(result.columns)
        for r in result.rows:
            w.writerow(["" if v is None else (json.dumps(v) if isinstance(v, (dict, list)) else v) for v in r])
        return buf.getvalue().rstrip("\n")
    cells = [[_cell(v) for v in r] for r in result.rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(result.columns)]
    numeric = [bool(result.rows) and all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool)
                                          or r[i] is None for r in result.rows)
               for i in range(len(result.columns))]
    lines = ["  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(result.columns, widths, numeric)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip()
              for r in cells]
    n = len(result.rows)
    lines.append(f"({n} row{'s' if n != 1 else ''}{', truncated' if result.truncated else ''})")
    return "\n".join(lines)


@dataclass(frozen=True)
class AnalyzeResult:
    run: dict          # what the pass did (analyzer.PassResult.as_dict())
    flags: list[dict]  # open flags, worst first
    truncated: bool
    actions: list[dict] = field(default_factory=list)   # [actions] rows decided after the pass (wait_actions_s)
    actions_pending: bool = False                         # the wait ran out: more may follow


def analyze(target: str, window_s: float = 0.0, token: str | None = None, max_flags: int = 0,
            timeout_s: float = 300.0, tls_ca: str | None = None, client_cert: str | None = None,
            client_key: str | None = None, wait_actions_s: float = 0.0) -> AnalyzeResult:
    """Ask the live collector at ``target`` to run one analysis pass now; returns it, the open flags and (with
    ``wait_actions_s``) the actions its [actions] decided after the pass."""
    resp = _call(target, tls_ca, "Analyze", lambda stub: stub.Analyze(
        pb.AnalyzeRequest(window_s=window_s, max_flags=max_flags, wait_actions_s=wait_actions_s),
        timeout=timeout_s + wait_actions_s, metadata=bearer_metadata(token)), client_cert, client_key)
    return AnalyzeResult(json.loads(resp.pass_json or "{}"), json.loads(resp.flags_json or "[]"), resp.truncated,
                         json.loads(resp.actions_json or "[]"), resp.actions_pending)


def request_raw_window(target: str, node_id: str, seconds: float, reason: str = "", token: str | None = None,
                       timeout_s: float = 30.0, tls_ca: str | None = None, client_cert: str | None = None,
                       client_key: str | None = None) -> str:
    """Ask the live collector to fetch ``node_id``'s 1 s samples of its last ``seconds`` (docs/RESOLUTION.md);
    returns the request id (rows land in raw_windows once the node's next batches carry them)."""
    resp = _call(target, tls_ca, "RequestRawWindow", lambda stub: stub.RequestRawWindow(
        pb.RawWindowAsk(node_id=node_id, seconds=seconds, reason=reason), timeout=timeout_s,
        metadata=bearer_metadata(token)), client_cert, client_key)
    return resp.request_id
