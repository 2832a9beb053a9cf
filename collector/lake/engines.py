"""Fleet-wide SQL over the lake on DuckDB (one machine) or Apache Spark (``local[*]`` or a cluster).

Both engines show the lake's tables under the collector's table names (``samples``, ``probe_metrics``,
``nodes``, ...), each with the partition columns ``date``, ``hour`` and ``shard`` (strings) added, and read
only the files a partition's ``_SUCCESS`` names. A table the lake does not hold yet is an empty table with
the collector's columns, so the same query runs on any lake. ``nodes`` and ``gpus`` keep one row per node
(the shard that saw it last), since an agent may have moved between shards.

Queries are written once in the SQL both engines accept (GROUP BY ALL, FILTER, median,
percentile_cont ... WITHIN GROUP, CAST(x AS STRING)); ``Dialect`` covers the two things that differ:
epoch seconds of a timestamp and a timestamp literal (collector/views/dialect.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa

from gpuagent.collector.lake import layout
from gpuagent.collector.lake.export import HOURLY, SNAPSHOTS, TABLES
from gpuagent.collector.lake.layout import Lake, LakeError
from gpuagent.collector.views.dialect import DUCKDB, SPARK

log = logging.getLogger("gpuagent.collector.lake")

ENGINES = ("duckdb", "spark")
_PART_HOURLY = pa.schema([("date", pa.string()), ("hour", pa.string()), ("shard", pa.string())])
_PART_SNAPSHOT = pa.schema([("shard", pa.string())])
_HOURLY_NAMES = {t.name for t in HOURLY}




def _collector_schema() -> dict[str, pa.Schema]:
    """The collector's column types per table, from the migrations (for tables the lake lacks)."""
    import duckdb  # noqa: PLC0415

    from gpuagent.collector.store import schema  # noqa: PLC0415

    con = duckdb.connect()
    try:
        schema.migrate(con)
        out = {}
        for name in TABLES:
            sql = SNAPSHOTS.get(name, f"SELECT * FROM {name}")
            out[name] = con.execute(f"SELECT * FROM ({sql}) LIMIT 0").to_arrow_table().schema
        return out
    finally:
        con.close()


class DuckDbLake:
    """The lake as DuckDB views over pyarrow datasets (any pyarrow filesystem, no DuckDB extension)."""

    dialect = DUCKDB

    def __init__(self, lake: Lake):
        import duckdb  # noqa: PLC0415
        import pyarrow.dataset as ds  # noqa: PLC0415

        self.lake = lake
        self.label = f"lake {lake.uri} (duckdb)"
        self.con = duckdb.connect()
        schemas = _collector_schema()
        for name in TABLES:
            files = layout.complete_files(lake, name)
            part = _PART_HOURLY if name in _HOURLY_NAMES else _PART_SNAPSHOT
            if files:
                data = ds.dataset(files, filesystem=lake.fs, format="parquet",
                                  partitioning=ds.partitioning(part, flavor="hive"),
                                  partition_base_dir=lake.path(name))
            else:
                empty = schemas[name]
                for f in part:
                    empty = empty.append(f)
                data = empty.empty_table()
            self.con.register(f"_lake_{name}", data)
            self.con.execute(f"CREATE VIEW {name} AS {_view_sql(name)}")

    def query(self, sql: str) -> list[dict[str, Any]]:
        cur = self.con.execute(sql)
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]

    def arrow(self, sql: str) -> pa.Table:
        return self.con.execute(sql).to_arrow_table()

    def has_table(self, name: str) -> bool:
        return name in TABLES

    def close(self) -> None:
        self.con.close()


def _view_sql(name: str) -> str:
    """The view of one lake table (portable SQL: both engines run it)."""
    if name == "nodes":
        # One row per node: the shard that saw it last (ties: the first shard by name).
        return ("SELECT n.* FROM _lake_nodes n WHERE NOT EXISTS (SELECT 1 FROM _lake_nodes m "
                "WHERE m.node_id = n.node_id AND (m.last_seen > n.last_seen "
                "OR (m.last_seen = n.last_seen AND m.shard < n.shard)))")
    if name == "gpus":
        return "SELECT g.* FROM _lake_gpus g JOIN nodes n ON n.node_id = g.node_id AND n.shard = g.shard"
    return f"SELECT * FROM _lake_{name}"


class SparkLake:
    """The lake as Spark temp views. ``master`` is ``local[*]`` by default or a cluster URL."""

    dialect = SPARK

    def __init__(self, lake: Lake, master: str = "local[*]", app_name: str = "gpuagent-lake",
                 conf: dict[str, str] | None = None):
        try:
            from pyspark.sql import SparkSession  # noqa: PLC0415
        except ImportError:
            raise LakeError("--engine spark needs pyspark and Java 17+: pip install 'gpuagent[lake]' "
                            "(see docs/LAKE.md)") from None
        self.lake = lake
        self.label = f"lake {lake.uri} (spark {master})"
        builder = (SparkSession.builder.master(master).appName(app_name)
                   .config("spark.sql.session.timeZone", "UTC")
                   .config("spark.ui.enabled", "false")
                   # Partition values stay strings (a shard named 01 is not the number 1).
                   .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
                   .config("spark.sql.shuffle.partitions", "8"))
        for k, v in (conf or {}).items():
            builder = builder.config(k, v)
        try:
            self.spark = builder.getOrCreate()
        except Exception as exc:  # noqa: BLE001 - a missing JVM surfaces here
            raise LakeError(f"cannot start Spark ({master}): {str(exc).splitlines()[0]}; Spark needs Java 17+ "
                            "(see docs/LAKE.md)") from None
        # pyspark 4 logs every failed query's plan and Java stack to stderr; callers report it in one sentence.
        logging.getLogger("SQLQueryContextLogger").setLevel(logging.CRITICAL)
        schemas = None
        for name in TABLES:
            files = layout.complete_files(lake, name)
            if files:
                uris = [self._uri(f) for f in files]
                df = self.spark.read.option("basePath", self._uri(lake.path(name))).parquet(*uris)
            else:
                if schemas is None:
                    schemas = _collector_schema()
                df = self.spark.createDataFrame([], _spark_schema(schemas[name], name in _HOURLY_NAMES))
            df.createOrReplaceTempView(f"_lake_{name}")
            self.spark.sql(f"CREATE OR REPLACE TEMP VIEW {name} AS {_view_sql(name)}")

    def _uri(self, path: str) -> str:
        if self.lake.renames_atomically:
            return "file://" + path
        scheme = self.lake.uri.split("://", 1)[0]
        return f"{'s3a' if scheme == 's3' else scheme}://{path}"

    def query(self, sql: str) -> list[dict[str, Any]]:
        return [r.asDict() for r in self.spark.sql(sql).collect()]

    def arrow(self, sql: str) -> pa.Table:
        return self.spark.sql(sql).toArrow()

    def has_table(self, name: str) -> bool:
        return name in TABLES

    def close(self) -> None:
        """Leaves the session up: a SparkSession is per process, and stopping it costs the next query ~10 s."""


def _spark_schema(schema: pa.Schema, hourly: bool):
    from pyspark.sql import types as T  # noqa: PLC0415

    def conv(t: pa.DataType):
        if pa.types.is_timestamp(t):
            return T.TimestampNTZType()
        if pa.types.is_int16(t):
            return T.ShortType()
        if pa.types.is_int32(t):
            return T.IntegerType()
        if pa.types.is_integer(t):
            return T.LongType()
        if pa.types.is_floating(t):
            return T.DoubleType()
        if pa.types.is_boolean(t):
            return T.BooleanType()
        if pa.types.is_map(t):
            return T.MapType(T.StringType(), T.StringType())
        return T.StringType()

    fields = [T.StructField(f.name, conv(f.type), True) for f in schema]
    fields += [T.StructField(n, T.StringType(), True) for n in (("date", "hour", "shard") if hourly else ("shard",))]
    return T.StructType(fields)


def open_engine(engine: str, lake_uri: str, master: str | None = None):
    """A DuckDbLake or SparkLake over the lake at ``lake_uri``."""
    if engine not in ENGINES:
        raise LakeError(f"--engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    lake = layout.open_lake(lake_uri)
    if engine == "spark":
        return SparkLake(lake, master or "local[*]")
    if master:
        raise LakeError("--master applies to --engine spark only")
    return DuckDbLake(lake)
