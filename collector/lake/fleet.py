"""What needs the whole fleet, computed over the lake: bare-metal baselines, each hardware class's median
noise (CV), and the pool comparison.

Both run the analyzer's own SQL on Spark or DuckDB, so a sharded fleet gets the numbers one collector would
compute: baselines take the node-class statement of 20_node_class.sql and the query of 25_fleet_baselines.sql;
noise medians take _ok_metrics (20_node_class.sql) and _nn_points, _nn_series, _nn_fleet_local
(40_noisy_neighbor_variance.sql) over the analyzer's probe and step windows. They reach the shards two ways:

- ``<lake>/fleet_baselines/current.parquet`` and ``<lake>/fleet_noise/current.parquet``: every shard with
  ``[lake] fleet_baselines = true`` loads them at each analysis pass (into ``fleet_baselines`` and the pass's
  ``_nn_fleet_lake``) instead of computing them from its part of the fleet (live shards: no RPC, no lock; each
  file is replaced in one rename or one object PUT);
- ``--db FILE``: baselines written straight into stopped collectors' database files.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from gpuagent.collector.lake import layout
from gpuagent.collector.lake.layout import Lake, LakeError
from gpuagent.common.timeutil import utc_now

BASELINE_COLUMNS = ("class_label", "component", "params_key", "baseline", "nodes", "runs", "computed_at")
_BASELINE_SCHEMA = pa.schema([("class_label", pa.string()), ("component", pa.string()),
                              ("params_key", pa.string()), ("baseline", pa.float64()), ("nodes", pa.int64()),
                              ("runs", pa.int64()), ("computed_at", pa.timestamp("us"))])


NOISE_COLUMNS = ("component", "peer_key", "fleet_cv", "nodes", "computed_at")
_NOISE_SCHEMA = pa.schema([("component", pa.string()), ("peer_key", pa.string()), ("fleet_cv", pa.float64()),
                           ("nodes", pa.int64()), ("computed_at", pa.timestamp("us"))])
_PARAM = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


def _select_of(statements: list[str], table: str, where: str) -> str:
    """The query of ``CREATE OR REPLACE TEMP TABLE <table> AS <query>`` among a step's statements."""
    head = f"CREATE OR REPLACE TEMP TABLE {table} AS"
    for stmt in statements:
        if stmt.startswith(head):
            return stmt[len(head):].rstrip().rstrip(";")
    raise LakeError(f"{where} no longer creates {table}")


def _bind(sql: str, params: dict[str, Any], dialect) -> str:
    """The analyzer's $parameters as literals of the engine's dialect."""
    def literal(m: re.Match) -> str:
        v = params[m.group(1)]
        if isinstance(v, dt.datetime):
            return dialect.ts_literal(v)
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(float(v)) if isinstance(v, float) else str(v)
        raise LakeError(f"parameter ${m.group(1)} has no literal form")
    return _PARAM.sub(literal, sql)


def _analysis_sql() -> tuple[str, str]:
    """(node-class SELECT, baselines SELECT) taken from the analyzer's SQL files."""
    from gpuagent.collector.analysis.analyzer import load_sql  # noqa: PLC0415
    from gpuagent.collector.analysis.steps import STEPS  # noqa: PLC0415

    sql = load_sql(tuple(s for s in STEPS if s.name in ("node_class", "fleet_baselines")))
    node_class = sql["node_class"][0]
    head = "CREATE OR REPLACE TEMP TABLE _node_class AS"
    if not node_class.startswith(head):
        raise LakeError("20_node_class.sql no longer starts with the _node_class statement")
    insert = next(s for s in sql["fleet_baselines"] if s.startswith("INSERT INTO fleet_baselines"))
    return node_class[len(head):].rstrip(";"), insert[len("INSERT INTO fleet_baselines"):].rstrip(";")


def _components_sql() -> str:
    from gpuagent.collector.analysis.analyzer import COMPONENTS  # noqa: PLC0415

    rows = [f"('{c.kind}', '{c.component}', '{c.probe}', '{c.metric}', {'true' if c.per_gpu else 'false'})"
            for c in COMPONENTS]
    return "SELECT * FROM (VALUES " + ", ".join(rows) + ") AS t(kind, component, probe, metric, per_gpu)"


def _define(engine, name: str, sql: str) -> None:
    if engine.dialect.name == "spark":
        engine.spark.sql(f"CREATE OR REPLACE TEMP VIEW {name} AS {sql}")
    else:
        engine.con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {sql}")


def _define_context(engine) -> None:
    """_pool_prices (empty: prices do not change a class), _components and _node_class over the lake."""
    node_class, _ = _analysis_sql()
    _define(engine, "_pool_prices", "SELECT CAST(NULL AS STRING) AS pool, CAST(NULL AS DOUBLE) AS price_per_gpu_hour "
                                    "WHERE 1 = 0")
    _define(engine, "_components", _components_sql())
    _define(engine, "_node_class", node_class)


def compute_baselines(engine, now: dt.datetime | None = None, lookback_s: float = 86400.0) -> list[dict[str, Any]]:
    """Bare-metal baselines per hardware class over the lake, as rows of ``fleet_baselines``."""
    now = now or utc_now()
    _, baselines = _analysis_sql()
    _define_context(engine)
    d = engine.dialect
    sql = (baselines.replace("$lookback_start", d.ts_literal(now - dt.timedelta(seconds=lookback_s)))
           .replace("$now", d.ts_literal(now)))
    rows = engine.query(sql + " ORDER BY class_label, component, params_key")
    out = []
    for r in rows:
        out.append({"class_label": r["class_label"], "component": r["component"], "params_key": r["params_key"],
                    "baseline": None if r["baseline"] is None else float(r["baseline"]),
                    "nodes": int(r["nodes"]), "runs": int(r["runs"]), "computed_at": now})
    return out


def compute_noise_medians(engine, config=None, now: dt.datetime | None = None) -> list[dict[str, Any]]:
    """Each class's median CV over the whole fleet (the noisy-neighbor peers), as rows of ``_nn_fleet_lake``.

    ``config`` (an AnalyzerConfig; default: the analyzer's defaults) sets the windows and min_runs: give the
    shards' own [analyzer] settings, or a shard judges its series against medians of other windows."""
    from gpuagent.collector.analysis.analyzer import Analyzer, AnalyzerConfig, load_sql  # noqa: PLC0415
    from gpuagent.collector.analysis.steps import STEPS  # noqa: PLC0415

    now = now or utc_now()
    params = Analyzer(config or AnalyzerConfig()).params(now)
    sql = load_sql(tuple(s for s in STEPS if s.name in ("node_class", "noisy_neighbor_variance")))
    nn = sql["noisy_neighbor_variance"]
    _define_context(engine)
    d = engine.dialect
    _define(engine, "_ok_metrics", _bind(_select_of(sql["node_class"], "_ok_metrics", "20_node_class.sql"), params, d))
    for table in ("_nn_points", "_nn_series"):
        _define(engine, table, _bind(_select_of(nn, table, "40_noisy_neighbor_variance.sql"), params, d))
    query = _bind(_select_of(nn, "_nn_fleet_local", "40_noisy_neighbor_variance.sql"), params, d)
    rows = engine.query(query + " ORDER BY component, peer_key")
    return [{"component": r["component"], "peer_key": r["peer_key"],
             "fleet_cv": None if r["fleet_cv"] is None else float(r["fleet_cv"]), "nodes": int(r["nodes"]),
             "computed_at": now} for r in rows]


def noise_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=_NOISE_SCHEMA)


def baselines_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=_BASELINE_SCHEMA)


def _publish(lake: Lake, rel: str, table: pa.Table) -> str:
    """Replace the lake file ``rel`` in one step; returns its path."""
    fs = lake.fs
    final = lake.path(rel)
    fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
    if lake.renames_atomically:
        tmp = lake.path(layout.TMP, f"{rel.split('/', 1)[0]}-{uuid.uuid4().hex[:8]}.parquet")
        fs.create_dir(tmp.rsplit("/", 1)[0], recursive=True)
        pq.write_table(table, tmp, filesystem=fs, compression="zstd")
        fs.move(tmp, final)
    else:
        pq.write_table(table, final, filesystem=fs, compression="zstd")
    return lake.uri_of(rel)


def publish_baselines(lake: Lake, rows: list[dict[str, Any]]) -> str:
    """Replace ``fleet_baselines/current.parquet`` in one step; returns its path."""
    return _publish(lake, layout.BASELINES_FILE, baselines_table(rows))


def publish_noise_medians(lake: Lake, rows: list[dict[str, Any]]) -> str:
    """Replace ``fleet_noise/current.parquet`` in one step; returns its path."""
    return _publish(lake, layout.NOISE_FILE, noise_table(rows))


def replace_baselines(con, table: pa.Table) -> int:
    """Make ``fleet_baselines`` hold exactly ``table``'s rows (caller owns the transaction)."""
    con.execute("DELETE FROM fleet_baselines")
    con.register("_lake_baselines", table)
    try:
        con.execute(f"INSERT INTO fleet_baselines ({', '.join(BASELINE_COLUMNS)}) "
                    f"SELECT {', '.join(BASELINE_COLUMNS)} FROM _lake_baselines")
    finally:
        con.unregister("_lake_baselines")
    return table.num_rows


def write_baselines_to_db(db_path: str, rows: list[dict[str, Any]]) -> int:
    """Write the baselines into a stopped collector's database file."""
    from gpuagent.collector.analysis.analyzer import run_in_transaction  # noqa: PLC0415
    from gpuagent.collector.store import db  # noqa: PLC0415

    import os  # noqa: PLC0415

    if not os.path.exists(db_path):
        raise LakeError(f"database {db_path} does not exist")
    try:
        con = db.open_database(db_path)
    except db.DatabaseError as exc:
        raise LakeError(str(exc)) from None
    try:
        return run_in_transaction(con, lambda c: replace_baselines(c, baselines_table(rows)))
    finally:
        con.close()


class LakeBaselineLoader:
    """The analyzer's baseline step on a shard: load the lake's current baselines into fleet_baselines and its
    class noise medians into the pass's _nn_fleet_lake.

    Without a file (no `lake baselines` run yet) the shard keeps its own numbers and says so once per file."""

    def __init__(self, lake_uri: str):
        self.lake_uri = lake_uri
        self.missing_logged: set[str] = set()

    def _read(self, lake: Lake, rel: str) -> pa.Table | None:
        import logging  # noqa: PLC0415

        path = lake.path(rel)
        if lake.fs.get_file_info(path).type != pafs.FileType.File:
            if rel not in self.missing_logged:
                logging.getLogger("gpuagent.collector.lake").warning(
                    "%s come from the lake, which has none yet (%s): run `gpuagent-collector lake baselines`",
                    rel.split("/", 1)[0], lake.uri_of(rel))
                self.missing_logged.add(rel)
            return None
        return pq.read_table(path, filesystem=lake.fs)

    def __call__(self, con, now: dt.datetime) -> int:
        lake = layout.open_lake(self.lake_uri, create=True)
        n = 0
        baselines = self._read(lake, layout.BASELINES_FILE)
        if baselines is not None:
            n += replace_baselines(con, baselines)
        noise = self._read(lake, layout.NOISE_FILE)
        if noise is not None:
            con.register("_lake_noise", noise)
            try:
                con.execute("INSERT INTO _nn_fleet_lake SELECT component, peer_key, fleet_cv, nodes FROM _lake_noise")
            finally:
                con.unregister("_lake_noise")
            n += noise.num_rows
        return n
