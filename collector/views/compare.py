"""Pools side by side (``gpuagent-collector compare --by pool``): the bare-metal-versus-cloud answer.

For each pool, over a window that ends at the newest stored data:

- per probe headline metric: median, p10/p90 and spread ((p90 - p10) / median) of the ``ok`` runs, and
  the difference of the median from a reference pool (default: the largest all-bare-metal pool);
- effective GPU utilization (mean ``gpu_util_percent`` over every sampled GPU-minute, idle ones included);
- share of nodes with an open flag, overall and per kind;
- cost per effective GPU-hour = price paid for the sampled GPU-hours / (GPU-hours × utilization);
- throughput per GPU for the same job name across pools (median ``tokens_per_s`` / ``samples_per_s`` of
  a rank's step windows; one rank drives one GPU);
- inter-node bandwidth and latency: the median ``net_pair`` link rate (a run's slower direction, Gbit/s)
  and the median rtt p50 over the runs between two nodes of the pool (link_results).

Reads a DuckDB file (read-only), a live collector through its Query RPC, or the whole fleet's Parquet lake
on DuckDB or Spark (collector/lake/engines.py). The SQL (compare_sql.py) is written in what DuckDB and Spark
SQL both accept (only literals, no bind parameters, for the RPC path); a source's ``dialect`` spells the two
things that differ, a timestamp's epoch seconds and a timestamp literal. The text, CSV and JSON output is
compare_format.py's.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from gpuagent.collector.views.compare_format import formatter
from gpuagent.collector.views.comparison import PoolComparison, Window
from gpuagent.collector.views.compare_sql import (FLAG_KINDS, HEADLINE, NO_POOL, NOT_FABRIC_GROUP, POINT_METRICS,
                                                  SQL_FLAGS, SQL_FLAGS_ANY, SQL_JOBS, SQL_LINKS, SQL_POOL_MODELS,
                                                  SQL_POOLS, SQL_PROBES, SQL_UTIL_RAW, SQL_UTIL_ROLLUP, UTIL_TAIL)
from gpuagent.collector.views.dialect import DUCKDB, Dialect


class CompareError(RuntimeError):
    """The comparison cannot be made (no database, unreachable collector, ...): one sentence."""


# ------------------------------------------------------------------------------------------ sources


class DbSource:
    """A DuckDB file opened read-only (the collector must not hold it open for writing)."""

    def __init__(self, path: str):
        from gpuagent.collector.store import db  # noqa: PLC0415 - collector extra

        if not os.path.exists(path):
            raise CompareError(f"database {path} does not exist")
        try:
            self.con = db.open_readonly(path)
        except db.DatabaseError as exc:
            # store.db says why the file cannot be opened; what to do instead is this command's to say.
            raise CompareError(f"{exc}; a database held by a running collector is read with "
                               "--target HOST:PORT") from None
        self.label = path

    def query(self, sql: str) -> list[dict[str, Any]]:
        cur = self.con.execute(sql)
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]

    def close(self) -> None:
        self.con.close()


class RpcSource:
    """A live collector, through the read-only Query RPC."""

    MAX_ROWS = 500_000

    def __init__(self, target: str, token: str | None = None, timeout_s: float = 120.0,
                 tls_ca: str | None = None, client_cert: str | None = None, client_key: str | None = None):
        import grpc  # noqa: PLC0415

        from gpuagent.proto import pb, pb_grpc  # noqa: PLC0415
        from gpuagent.proto.wire import bearer_metadata  # noqa: PLC0415
        self._grpc, self._pb = grpc, pb
        opts = [("grpc.max_receive_message_length", 256 << 20)]
        if tls_ca:
            pem = {}
            for what, path in (("CA", tls_ca), ("client certificate", client_cert), ("client key", client_key)):
                try:
                    if path:
                        with open(path, "rb") as fh:
                            pem[what] = fh.read()
                except OSError as exc:
                    raise CompareError(f"cannot read the {what} file {path}: {exc.strerror}") from None
            creds = grpc.ssl_channel_credentials(root_certificates=pem["CA"], private_key=pem.get("client key"),
                                                 certificate_chain=pem.get("client certificate"))
            self.channel = grpc.secure_channel(target, creds, options=opts)
        else:
            self.channel = grpc.insecure_channel(target, options=opts)
        self.stub = pb_grpc.CollectorStub(self.channel)
        self.metadata = bearer_metadata(token) or None
        self.timeout_s = timeout_s
        self.label = target

    def query(self, sql: str) -> list[dict[str, Any]]:
        grpc = self._grpc
        try:
            resp = self.stub.Query(self._pb.QueryRequest(sql=sql, max_rows=self.MAX_ROWS),
                                   metadata=self.metadata, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise CompareError(f"cannot reach the collector at {self.label}: {exc.details()}") from None
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise CompareError(f"the collector at {self.label} refused the credentials: "
                                   f"{exc.details()}") from None
            raise CompareError(f"the collector at {self.label} refused a query: "
                               f"{exc.code().name}: {exc.details()}") from None
        if resp.truncated:
            raise CompareError("the collector truncated a result at its row limit; narrow --window or use --db")
        return [dict(zip(resp.columns, r)) for r in json.loads(resp.rows_json or "[]")]

    def close(self) -> None:
        self.channel.close()


def open_source(db: str | None, target: str | None, token: str | None = None, tls_ca: str | None = None,
                client_cert: str | None = None, client_key: str | None = None):
    if bool(db) == bool(target):
        raise CompareError("give exactly one of --db PATH or --target HOST:PORT")
    return DbSource(db) if db else RpcSource(target, token, tls_ca=tls_ca, client_cert=client_cert,
                                             client_key=client_key)


def has_table(src, name: str) -> bool:
    if hasattr(src, "has_table"):
        return src.has_table(name)
    rows = src.query("SELECT count(*) AS n FROM information_schema.tables "
                     f"WHERE table_schema = 'main' AND table_name = {_lit(name)}")
    return bool(rows and rows[0]["n"])


def _lit(text: str) -> str:
    return "'" + str(text).replace("'", "''") + "'"


def parse_window(text: str) -> float:
    """'90m', '24h', '7d', '3600s' or a number of seconds -> seconds."""
    t = str(text).strip().lower()
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    try:
        value = float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        value = -1
    if not value > 0 or math.isinf(value):
        raise CompareError(f"window {text!r} is not a positive duration like 30m, 24h or 7d")
    return value


# ------------------------------------------------------------------------------------------ window


def _dialect(src) -> Dialect:
    return getattr(src, "dialect", DUCKDB)


# The newest stored data anchors the window, so an old database file still compares its last day.
SQL_NEWEST = """
SELECT max(t) AS newest FROM (
    SELECT {epoch_ts} AS t FROM samples
    UNION ALL SELECT {epoch_started} AS t FROM probe_results
    UNION ALL SELECT {epoch_ts} AS t FROM job_steps
) AS newest_of_each
"""


def resolve_window(src, seconds: float) -> Window | None:
    d = _dialect(src)
    rows = src.query(SQL_NEWEST.format(epoch_ts=d.epoch("max(ts)"), epoch_started=d.epoch("max(started_at)")))
    newest = rows[0]["newest"] if rows else None
    if newest is None:
        return None
    newest = float(newest)
    return Window(newest - seconds, newest + 1e-6, seconds, d)


def _fmt(sql: str, window: Window | None = None, **kw: str) -> str:
    args = {"no_pool": NO_POOL.replace("'", "''"), **kw}
    if window is not None:
        args.update(start=window.start_sql, end=window.end_sql)
    return sql.format(**args)


def _num(v) -> float | None:
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def compare_pools(src, window_s: float = 86400.0, reference_pool: str | None = None) -> PoolComparison:
    """Compute the pool comparison from ``src`` (a DbSource or RpcSource)."""
    pools = src.query(_fmt(SQL_POOLS))
    models: dict[str, list[str]] = {}
    for r in src.query(_fmt(SQL_POOL_MODELS)):
        models.setdefault(r["pool"], []).append(r["gpu_model"])
    result = PoolComparison(window=None, reference_pool=None)
    result.total_nodes = sum(int(p["nodes"]) for p in pools)
    result.synthetic_nodes = sum(int(p["synthetic_nodes"] or 0) for p in pools)
    window = resolve_window(src, window_s)
    result.window = window
    by_pool: dict[str, dict[str, Any]] = {}
    for p in pools:
        row = {"pool": p["pool"], "nodes": int(p["nodes"]), "virtualized_nodes": int(p["virtualized_nodes"] or 0),
               "synthetic_nodes": int(p["synthetic_nodes"] or 0), "gpus": int(p["gpus"] or 0),
               "gpu_models": ", ".join(sorted(models.get(p["pool"], []))), "price_per_gpu_hour": _num(p["price_per_gpu_hour"]),
               "gpu_hours": 0.0, "effective_util_percent": None, "effective_gpu_hours": 0.0,
               "idle_minutes_percent": None, "cost": None, "cost_per_effective_gpu_hour": None,
               "nodes_flagged": 0, "nodes_flagged_percent": 0.0,
               "link_runs": 0, "links": 0, "link_gbits_median": None, "link_gbits_p10": None,
               "link_rtt_p50_us": None, "link_gbits_vs_reference_percent": None,
               **{f"{k}_nodes": 0 for k in FLAG_KINDS}}
        by_pool[row["pool"]] = row
    result.pools = list(by_pool.values())
    if reference_pool is not None and reference_pool not in by_pool:
        raise CompareError(f"reference pool {reference_pool!r} has no nodes "
                           f"(pools: {', '.join(by_pool) or 'none'})")
    if reference_pool is None:
        bare = [p for p in result.pools if p["virtualized_nodes"] == 0 and p["nodes"] > 0]
        if bare and len(result.pools) > 1:
            reference_pool = max(bare, key=lambda p: (p["nodes"], p["pool"]))["pool"]
    result.reference_pool = reference_pool
    if window is None:
        return result

    pairs = ", ".join(_lit(f"{p}.{m}") for p, m, _ in HEADLINE)
    better = {(p, m): b for p, m, b in HEADLINE}
    for r in src.query(_fmt(SQL_PROBES, window, pairs=pairs, not_group=NOT_FABRIC_GROUP)):
        med = _num(r["median"])
        p10, p90 = _num(r["p10"]), _num(r["p90"])
        points = r["metric"] in POINT_METRICS
        result.probes.append({
            "pool": r["pool"], "probe": r["probe"], "metric": r["metric"], "better": better[(r["probe"], r["metric"])],
            "runs": int(r["runs"]), "nodes": int(r["nodes"]), "median": med, "p10": p10, "p90": p90,
            "spread_percent": (p90 - p10) / abs(med) * 100
            if med and not points and p10 is not None and p90 is not None else None,
            "vs_reference_percent": None, "vs_reference_points": None})
    order = {(p, m): i for i, (p, m, _) in enumerate(HEADLINE)}
    result.probes.sort(key=lambda r: (order[(r["probe"], r["metric"])], r["pool"]))
    if reference_pool:
        for r in result.probes:
            ref = result.probe(reference_pool, r["probe"], r["metric"])
            if ref is None or ref["median"] is None or r["median"] is None:
                continue
            if r["metric"] in POINT_METRICS:
                r["vs_reference_points"] = r["median"] - ref["median"]
            elif ref["median"]:
                r["vs_reference_percent"] = (r["median"] - ref["median"]) / abs(ref["median"]) * 100

    util_sql = SQL_UTIL_RAW
    if has_table(src, "samples_1m"):
        got = src.query(_fmt("SELECT count(*) AS n FROM samples_1m WHERE metric = 'gpu_util_percent' "
                             "AND minute >= {start} AND minute < {end}", window))
        if got and got[0]["n"]:
            util_sql = SQL_UTIL_ROLLUP
    tail = _fmt(UTIL_TAIL)
    for r in src.query(_fmt(util_sql.replace("{util_tail}", tail), window)):
        row = by_pool.get(r["pool"])
        if row is None:
            continue
        row["gpu_hours"] = _num(r["gpu_hours"]) or 0.0
        row["effective_util_percent"] = _num(r["effective_util_percent"])
        row["effective_gpu_hours"] = _num(r["effective_gpu_hours"]) or 0.0
        row["idle_minutes_percent"] = _num(r["idle_minutes_percent"])
        if not r["unpriced_gpu_minutes"]:
            row["cost"] = _num(r["cost"])
            if row["cost"] is not None and row["effective_gpu_hours"] > 0:
                row["cost_per_effective_gpu_hour"] = row["cost"] / row["effective_gpu_hours"]

    if has_table(src, "flags"):
        for r in src.query(_fmt(SQL_FLAGS_ANY)):
            row = by_pool.get(r["pool"])
            if row is not None:
                row["nodes_flagged"] = int(r["nodes_flagged"])
                row["nodes_flagged_percent"] = 100.0 * row["nodes_flagged"] / row["nodes"] if row["nodes"] else 0.0
        for r in src.query(_fmt(SQL_FLAGS)):
            row = by_pool.get(r["pool"])
            if row is not None and r["kind"] in FLAG_KINDS:
                row[f"{r['kind']}_nodes"] = int(r["nodes_flagged"])

    if has_table(src, "link_results"):
        for r in src.query(_fmt(SQL_LINKS, window)):
            row = by_pool.get(r["pool"])
            if row is None:
                continue
            row.update(link_runs=int(r["runs"]), links=int(r["links"]), link_gbits_median=_num(r["link_gbits_median"]),
                       link_gbits_p10=_num(r["link_gbits_p10"]), link_rtt_p50_us=_num(r["link_rtt_p50_us"]))
        ref = by_pool.get(reference_pool) if reference_pool else None
        if ref is not None and ref["link_gbits_median"]:
            for row in result.pools:
                if row["link_gbits_median"] is not None:
                    row["link_gbits_vs_reference_percent"] = (
                        (row["link_gbits_median"] - ref["link_gbits_median"]) / ref["link_gbits_median"] * 100)

    for r in src.query(_fmt(SQL_JOBS, window)):
        result.jobs.append({"pool": r["pool"], "job_name": r["job_name"], "ranks": int(r["ranks"]),
                            "windows": int(r["windows"]),
                            "tokens_per_s_per_gpu": _num(r["tokens_per_s_per_gpu"]),
                            "samples_per_s_per_gpu": _num(r["samples_per_s_per_gpu"]),
                            "step_time_p50_s": _num(r["step_time_p50_s"])})
    return result


def run_compare(db: str | None, target: str | None, window: str = "24h", fmt: str = "table",
                token: str | None = None, reference_pool: str | None = None, tls_ca: str | None = None,
                client_cert: str | None = None, client_key: str | None = None) -> str:
    """The library call behind ``gpuagent-collector compare``: returns the formatted text."""
    seconds = parse_window(window)
    src = open_source(db, target, token, tls_ca, client_cert, client_key)
    try:
        c = compare_pools(src, seconds, reference_pool)
    finally:
        src.close()
    return formatter(fmt)(c)
