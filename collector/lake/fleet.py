"""What needs the whole fleet, computed over the lake: bare-metal baselines and the pool comparison.

Baselines run the analyzer's own SQL (the node-class statement of 20_node_class.sql and the query of
25_fleet_baselines.sql) on Spark or DuckDB, so a sharded fleet gets the numbers one collector would compute.
They reach the shards two ways:

- ``<lake>/fleet_baselines/current.parquet``: every shard with ``[lake] fleet_baselines = true`` loads it
  into its own ``fleet_baselines`` at each analysis pass instead of computing them from its part of the
  fleet (live shards: no RPC, no lock; the file is replaced in one rename or one object PUT);
- ``--db FILE``: written straight into stopped collectors' database files.
"""

from __future__ import annotations

import datetime as dt
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

    rows = [f"('{c.kind}', '{c.component}', '{c.probe}', '{c.metric}')" for c in COMPONENTS]
    return "SELECT * FROM (VALUES " + ", ".join(rows) + ") AS t(kind, component, probe, metric)"


def _define(engine, name: str, sql: str) -> None:
    if engine.dialect.name == "spark":
        engine.spark.sql(f"CREATE OR REPLACE TEMP VIEW {name} AS {sql}")
    else:
        engine.con.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {sql}")


def compute_baselines(engine, now: dt.datetime | None = None, lookback_s: float = 86400.0) -> list[dict[str, Any]]:
    """Bare-metal baselines per hardware class over the lake, as rows of ``fleet_baselines``."""
    now = now or utc_now()
    node_class, baselines = _analysis_sql()
    _define(engine, "_pool_prices", "SELECT CAST(NULL AS STRING) AS pool, CAST(NULL AS DOUBLE) AS price_per_gpu_hour "
                                    "WHERE 1 = 0")
    _define(engine, "_components", _components_sql())
    _define(engine, "_node_class", node_class)
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


def baselines_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=_BASELINE_SCHEMA)


def publish_baselines(lake: Lake, rows: list[dict[str, Any]]) -> str:
    """Replace ``fleet_baselines/current.parquet`` in one step; returns its path."""
    fs = lake.fs
    final = lake.path(layout.BASELINES_FILE)
    fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
    table = baselines_table(rows)
    if lake.renames_atomically:
        tmp = lake.path(layout.TMP, f"baselines-{uuid.uuid4().hex[:8]}.parquet")
        fs.create_dir(tmp.rsplit("/", 1)[0], recursive=True)
        pq.write_table(table, tmp, filesystem=fs, compression="zstd")
        fs.move(tmp, final)
    else:
        pq.write_table(table, final, filesystem=fs, compression="zstd")
    return lake.uri_of(layout.BASELINES_FILE)


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
    """The analyzer's baseline step on a shard: load the lake's current baselines into fleet_baselines.

    Without the file (no `lake baselines` run yet) the shard keeps what it has and says so once."""

    def __init__(self, lake_uri: str):
        self.lake_uri = lake_uri
        self.missing_logged = False

    def __call__(self, con, now: dt.datetime) -> int:
        import logging  # noqa: PLC0415

        lake = layout.open_lake(self.lake_uri, create=True)
        path = lake.path(layout.BASELINES_FILE)
        if lake.fs.get_file_info(path).type != pafs.FileType.File:
            if not self.missing_logged:
                logging.getLogger("gpuagent.collector.lake").warning(
                    "fleet_baselines come from the lake, which has none yet (%s): run "
                    "`gpuagent-collector lake baselines`", lake.uri_of(layout.BASELINES_FILE))
                self.missing_logged = True
            return 0
        return replace_baselines(con, pq.read_table(path, filesystem=lake.fs))
