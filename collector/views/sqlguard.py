"""Read-only SQL for the Query RPC (``gpuagent-collector sql``) against the live database.

Three independent layers, so that one gap does not open the file to writes:

1. the statement itself: DuckDB's own parser (``extract_statements``) must find exactly one
   statement of a read kind (SELECT, or EXPLAIN of a SELECT), and the parsed tree
   (``json_serialize_sql``) must not call functions that change state or reach outside the database;
2. the database: the collector disables external access (no file, network or extension access at
   all, including ``read_csv``, ``COPY``, ``ATTACH``, ``INSTALL``/``LOAD``) and locks the configuration
   (no ``SET``) right after it opens the file;
3. the transaction: every query runs in ``BEGIN TRANSACTION READ ONLY`` on its own cursor and is
   rolled back afterwards, so DuckDB itself refuses any write that got this far.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import json
import re
import threading
import uuid

import duckdb
import pyarrow as pa

from gpuagent.collector.views.result import QueryResult
from gpuagent.common.errors import first_line


class QueryRefused(ValueError):
    """The query is not allowed on the read-only endpoint (message says why)."""


class QueryFailed(RuntimeError):
    """DuckDB could not run the query (syntax error, unknown table, timeout, ...)."""


class QueryStopped(QueryFailed):
    """The query was interrupted: it ran past its time limit, or its caller went away."""


class QueryUnavailable(RuntimeError):
    """The database cannot answer now (invalidated, being reopened); the same query may work in seconds."""


_ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}

_REFUSE_REASON = {
    "INSERT": "it writes", "UPDATE": "it writes", "DELETE": "it writes", "CREATE": "it writes",
    "DROP": "it writes", "ALTER": "it writes", "COPY": "it reads or writes files",
    "EXPORT": "it writes files", "ATTACH": "it attaches another database", "DETACH": "it detaches a database",
    "LOAD": "it installs or loads an extension", "SET": "it changes settings", "PRAGMA": "it changes settings",
    "TRANSACTION": "transactions are managed by the collector", "CALL": "it calls a procedure",
    "VACUUM": "it writes", "ANALYZE": "it writes statistics", "PREPARE": "it prepares statements",
    "EXECUTE": "it executes prepared statements", "VARIABLE_SET": "it changes settings",
    "MULTI": "it writes", "MERGE_INTO": "it writes", "CREATE_FUNC": "it writes",
    "COPY_DATABASE": "it copies a database", "EXTENSION": "it installs or loads an extension",
}

# Functions that change state, read outside the database, or run SQL text we did not inspect.
_DENY_FUNCS = {
    "nextval", "setseed", "query", "query_table", "glob", "getenv", "sniff_csv", "read_text", "read_blob",
    "install", "load", "checkpoint", "force_checkpoint", "duckdb_secrets", "which_secret",
}
_DENY_PREFIXES = ("read_", "parquet_", "sqlite_", "postgres_", "mysql_", "iceberg_", "delta_", "json_execute",
                  "csv_", "http", "s3", "ducklake")

_EXPLAIN_HEAD = re.compile(r"^\s*explain\s+(analyze\s+)?", re.IGNORECASE)


def _walk_functions(node, out: set[str]) -> None:
    if isinstance(node, dict):
        name = node.get("function_name")
        if isinstance(name, str):
            out.add(name.lower())
        for v in node.values():
            _walk_functions(v, out)
    elif isinstance(node, list):
        for v in node:
            _walk_functions(v, out)


def check(con: duckdb.DuckDBPyConnection, sql: str) -> str:
    """Return the single statement's text if it may run read-only; raise QueryRefused otherwise."""
    if not sql or not sql.strip():
        raise QueryRefused("the query is empty")
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryFailed(str(exc).strip()) from None
    if len(statements) != 1:
        raise QueryRefused(f"send exactly one statement per query (found {len(statements)})")
    stmt = statements[0]
    text = stmt.query.strip()
    if stmt.type not in _ALLOWED:
        kind = stmt.type.name
        reason = _REFUSE_REASON.get(kind, "it is not a read-only query")
        raise QueryRefused(f"refused: {kind} statements are not allowed on the read-only SQL endpoint "
                           f"because {reason}; only SELECT (and EXPLAIN SELECT) can run here")
    inner = text
    if stmt.type == duckdb.StatementType.EXPLAIN:
        inner = _EXPLAIN_HEAD.sub("", text, count=1)
        inner_stmts = con.extract_statements(inner)
        if len(inner_stmts) != 1 or inner_stmts[0].type != duckdb.StatementType.SELECT:
            raise QueryRefused("refused: only EXPLAIN of a SELECT is allowed on the read-only SQL endpoint")
    tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [inner]).fetchone()[0])
    if tree.get("error"):
        # json_serialize_sql handles SELECT only; PRAGMA-style reads (SHOW, DESCRIBE) land here. They are
        # still covered by the read-only transaction and the disabled external access.
        return text
    funcs: set[str] = set()
    _walk_functions(tree.get("statements", []), funcs)
    denied = sorted(f for f in funcs if f in _DENY_FUNCS or f.startswith(_DENY_PREFIXES))
    if denied:
        raise QueryRefused(f"refused: the function {denied[0]}() changes state or reads outside the database, "
                           f"which the read-only SQL endpoint does not allow")
    return text


def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            return None
        return v
    if isinstance(v, (_dt.datetime, _dt.date, _dt.time)):
        return v.isoformat()
    if isinstance(v, _dt.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return int(v) if v == v.to_integral_value() and v.as_tuple().exponent >= 0 else float(v)
    if isinstance(v, pa.MonthDayNano):       # an INTERVAL, in seconds (a month counted as 30 days)
        return (v.months * 30 + v.days) * 86400.0 + v.nanoseconds / 1e9
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v).hex()
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


DEFAULT_MAX_RESULT_BYTES = 16 * 1024 * 1024


def _rows(batch) -> list[list]:
    """Arrow rows as JSON-ready lists (maps as objects, like DuckDB's own Python conversion)."""
    cols = batch.schema.names
    return [[_jsonable(r[c]) for c in cols] for r in batch.to_pylist(maps_as_pydicts="lossy")]


def run_readonly(cursor, sql: str, max_rows: int, timeout_s: float,
                 max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> QueryResult:
    """Check ``sql`` and run it read-only on ``cursor`` (a fresh cursor; this closes it).

    At most ``max_rows`` rows and about ``max_bytes`` of result come back (``truncated`` says when more
    existed). The result is read in Arrow batches and measured before any Python object is made, so one
    huge row cannot blow up the collector's memory. The caller may ``cursor.interrupt()`` from another
    thread (an abandoned RPC); the query then ends with QueryFailed.
    """
    cur = cursor
    timer = threading.Timer(timeout_s, cur.interrupt)
    try:
        text = check(cur, sql)
        cur.execute("BEGIN TRANSACTION READ ONLY")
        timer.start()
        try:
            cur.execute(text)
            if cur.description is None:
                return QueryResult([], [], [], False)
            columns = [d[0] for d in cur.description]
            types = [str(d[1]) for d in cur.description]
            rows: list[list] = []
            used = 0
            truncated = False
            for batch in cur.to_arrow_reader(batch_size=1024):
                i = 0
                while i < batch.num_rows and not truncated:
                    chunk = batch.slice(i, min(batch.num_rows - i, max_rows + 1 - len(rows)))
                    while chunk.num_rows > 1 and used + chunk.nbytes > max_bytes:
                        chunk = chunk.slice(0, chunk.num_rows // 2)
                    if used + chunk.nbytes > max_bytes:
                        if not rows:
                            raise QueryFailed(
                                f"the first row of the result alone is {chunk.nbytes / 2**20:.1f} MiB, above the "
                                f"{max_bytes / 2**20:g} MiB a query may return; select fewer or smaller columns")
                        truncated = True
                        break
                    rows.extend(_rows(chunk))
                    used += chunk.nbytes
                    i += chunk.num_rows
                    if len(rows) > max_rows:
                        truncated = True
                if truncated:
                    break
        except duckdb.InterruptException:
            raise QueryStopped(f"the query was stopped: it ran longer than {timeout_s:g} s or its caller went "
                              "away") from None
        except duckdb.PermissionException as exc:
            raise QueryRefused("refused: the read-only SQL endpoint has no file, network or extension access "
                               f"({first_line(exc)})") from None
        except duckdb.TransactionException as exc:
            raise QueryRefused(f"refused: the read-only SQL endpoint cannot write ({first_line(exc)})") from None
        except (duckdb.FatalException, duckdb.ConnectionException) as exc:
            raise QueryUnavailable(f"the database cannot answer now ({first_line(exc)}); try again in a few "
                                   "seconds") from None
        except duckdb.Error as exc:
            raise QueryFailed(str(exc).strip()) from None
        except pa.ArrowException as exc:      # an interrupt can surface through the Arrow reader
            if "interrupt" in str(exc).lower():
                raise QueryStopped(f"the query was stopped: it ran longer than {timeout_s:g} s or its caller "
                                  "went away") from None
            raise QueryFailed(first_line(exc)) from None
        return QueryResult(columns, types, rows[:max_rows], truncated)
    finally:
        timer.cancel()
        try:
            cur.execute("ROLLBACK")
        except duckdb.Error:
            pass
        cur.close()
