"""What ingest writes into which table: one declaration per table, column names and Arrow types in order.

Validation (collector/ingest/validate.py) builds its Arrow tables from these declarations and the writer
inserts them with the statements derived here, so a column is named and typed once in Python. The
migrations (migrations/*.sql) are the other half; ``schema_mismatches`` compares the two on a migrated
database (tests/test_collector_schema.py runs it), so neither can change without the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import pyarrow as pa

TS = pa.timestamp("ns")
STR = pa.string()
I16 = pa.int16()
I32 = pa.int32()
I64 = pa.int64()
U64 = pa.uint64()
F64 = pa.float64()

# The DuckDB column type each Arrow type is stored as (what DESCRIBE reports).
_SQL_TYPES = {pa.bool_(): "BOOLEAN", TS: "TIMESTAMP", STR: "VARCHAR", I16: "SMALLINT", I32: "INTEGER", I64: "BIGINT", U64: "UBIGINT",
              F64: "DOUBLE"}


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType

    @property
    def sql_type(self) -> str:
        return _SQL_TYPES[self.type]


def _cols(spec: str, **types: pa.DataType) -> tuple[Column, ...]:
    """Columns from a space-separated list of names; every name must get a type."""
    names = spec.split()
    if set(names) != set(types) or len(names) != len(types):
        raise ValueError(f"column list {names} and types {sorted(types)} differ")
    return tuple(Column(n, types[n]) for n in names)


@dataclass(frozen=True)
class Table:
    """Rows that ingest appends to the database table ``name`` (its columns, in the table's order)."""

    name: str
    columns: tuple[Column, ...]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([(c.name, c.type) for c in self.columns])

    def type(self, column: str) -> pa.DataType:
        return self.schema.field(column).type

    @property
    def view(self) -> str:
        """The name the writer registers this table's Arrow rows under for its INSERT."""
        return f"_in_{self.name}"

    @property
    def insert_sql(self) -> str:
        cols = ", ".join(self.names)
        return f"INSERT INTO {self.name} ({cols}) SELECT {cols} FROM {self.view}"

    def from_rows(self, rows: list[tuple]) -> pa.Table:
        """An Arrow table of ``rows`` (tuples in column order; None is NULL)."""
        columns = zip(*rows) if rows else [()] * len(self.columns)
        return pa.Table.from_arrays([pa.array(vals, c.type) for vals, c in zip(columns, self.columns)],
                                    schema=self.schema)


@dataclass(frozen=True)
class Staging(Table):
    """Rows registered for an upsert into another table (``jobs``): its own statement, no table of its name."""

    sql: str = ""

    @property
    def insert_sql(self) -> str:
        return self.sql.format(view=self.view)


SAMPLES = Table("samples", _cols("ts node_id gpu metric labels value",
                                 ts=TS, node_id=STR, gpu=I16, metric=STR, labels=STR, value=F64))

# Per-interval summaries (docs/RESOLUTION.md); the pass merges them into samples_1m and deletes them.
SAMPLES_SUMMARY = Table("samples_summary", _cols("ts node_id gpu metric labels interval_s n sum min max",
                                                 ts=TS, node_id=STR, gpu=I16, metric=STR, labels=STR,
                                                 interval_s=F64, n=I32, sum=F64, min=F64, max=F64))

# The 1 s samples of a raw-window answer, and what each answer part says of its request.
RAW_WINDOWS = Table("raw_windows", _cols("request_id ts node_id gpu metric labels value",
                                         request_id=STR, ts=TS, node_id=STR, gpu=I16, metric=STR, labels=STR,
                                         value=F64))
RAW_ANSWERED = Staging("raw_answered", _cols("request_id node_id rows final held_since arrived",
                                             request_id=STR, node_id=STR, rows=I64, final=pa.bool_(),
                                             held_since=TS, arrived=TS), sql="""
UPDATE raw_requests r SET rows = r.rows + a.rows,
                          answered_at = CASE WHEN a.final THEN a.arrived ELSE r.answered_at END,
                          held_since = coalesce(a.held_since, r.held_since)
FROM (SELECT request_id, node_id, sum(rows) AS rows, bool_or(final) AS final, min(held_since) AS held_since,
             max(arrived) AS arrived
      FROM {view} GROUP BY ALL) a
WHERE r.request_id = a.request_id AND r.node_id = a.node_id
""")

PROBE_RESULTS = Table("probe_results", _cols(
    "node_id probe gpu status reason params params_key env started_at ended_at duration_s",
    node_id=STR, probe=STR, gpu=I16, status=STR, reason=STR, params=STR, params_key=STR, env=STR,
    started_at=TS, ended_at=TS, duration_s=F64))

PROBE_METRICS = Table("probe_metrics", _cols(
    "node_id probe gpu params_key started_at metric value",
    node_id=STR, probe=STR, gpu=I16, params_key=STR, started_at=TS, metric=STR, value=F64))

JOB_SAMPLES = Table("job_samples", _cols(
    "ts node_id job_id pid rank local_rank gpu gpu_util_percent gpu_memory_bytes cpu_percent rss_bytes "
    "read_bytes_per_s write_bytes_per_s",
    ts=TS, node_id=STR, job_id=STR, pid=I32, rank=I32, local_rank=I32, gpu=I16, gpu_util_percent=F64,
    gpu_memory_bytes=F64, cpu_percent=F64, rss_bytes=F64, read_bytes_per_s=F64, write_bytes_per_s=F64))

JOB_STEPS = Table("job_steps", _cols(
    "ts node_id job_id job_name rank pid window_s steps step_time_p50_s step_time_p95_s step_time_max_s "
    "step_time_mean_s steps_per_s samples_per_s tokens_per_s data_wait_fraction model_flops_per_s peak_flops_per_s mfu",
    ts=TS, node_id=STR, job_id=STR, job_name=STR, rank=I32, pid=I32, window_s=F64, steps=I32,
    step_time_p50_s=F64, step_time_p95_s=F64, step_time_max_s=F64, step_time_mean_s=F64, steps_per_s=F64,
    samples_per_s=F64, tokens_per_s=F64, data_wait_fraction=F64, model_flops_per_s=F64, peak_flops_per_s=F64,
    mfu=F64))

EVENTS = Table("events", _cols("ts node_id gpu kind message value attrs",
                               ts=TS, node_id=STR, gpu=I16, kind=STR, message=STR, value=F64, attrs=STR))

INGEST_LOG = Table("ingest_log", _cols(
    "node_id seq committed_at n_samples n_probe_results n_job_samples n_job_steps n_events",
    node_id=STR, seq=U64, committed_at=TS, n_samples=I32, n_probe_results=I32, n_job_samples=I32,
    n_job_steps=I32, n_events=I32))

# Written by Register (store/nodes.py), upserted on (node_id, gpu).
GPUS = Table("gpus", _cols(
    "node_id gpu uuid name pci_bus_id pcie_gen_max pcie_gen_current pcie_width_max pcie_width_current "
    "memory_total_bytes mig_mode virtualization_mode numa_node",
    node_id=STR, gpu=I16, uuid=STR, name=STR, pci_bus_id=STR, pcie_gen_max=I16, pcie_gen_current=I16,
    pcie_width_max=I16, pcie_width_current=I16, memory_total_bytes=U64, mig_mode=STR,
    virtualization_mode=STR, numa_node=I16))

# Every job seen in a batch's job samples and job steps: opens or extends its row in ``jobs``.
JOB_SEEN = Staging("job_seen", _cols("node_id job_id ts job_name source world_size user_name partition_name account "
                                     "pod_name pod_namespace container_name",
                                     node_id=STR, job_id=STR, ts=TS, job_name=STR, source=STR, world_size=I32,
                                     user_name=STR, partition_name=STR, account=STR, pod_name=STR, pod_namespace=STR,
                                     container_name=STR),
                   sql="""
INSERT INTO jobs (node_id, job_id, job_name, source, first_seen, last_seen, world_size, user_name, partition_name,
                  account, pod_name, pod_namespace, container_name)
SELECT node_id, job_id, max(job_name), max(source), min(ts), max(ts), max(world_size), max(user_name),
       max(partition_name), max(account), max(pod_name), max(pod_namespace), max(container_name)
FROM {view} GROUP BY node_id, job_id
ON CONFLICT (node_id, job_id) DO UPDATE SET
    job_name = coalesce(excluded.job_name, jobs.job_name),
    source = coalesce(excluded.source, jobs.source),
    first_seen = least(jobs.first_seen, excluded.first_seen),
    last_seen = greatest(jobs.last_seen, excluded.last_seen),
    world_size = coalesce(excluded.world_size, jobs.world_size),
    user_name = coalesce(excluded.user_name, jobs.user_name),
    partition_name = coalesce(excluded.partition_name, jobs.partition_name),
    account = coalesce(excluded.account, jobs.account),
    pod_name = coalesce(excluded.pod_name, jobs.pod_name),
    pod_namespace = coalesce(excluded.pod_namespace, jobs.pod_namespace),
    container_name = coalesce(excluded.container_name, jobs.container_name)
""")

# Every job_end event of a batch: closes the job's row in ``jobs``. The *_ns times are optional on the wire.
JOB_END = Staging("job_end", _cols(
    "node_id job_id job_name ts duration_s avg_gpu_util_percent started_ns first_seen_ns last_seen_ns",
    node_id=STR, job_id=STR, job_name=STR, ts=TS, duration_s=F64, avg_gpu_util_percent=F64, started_ns=TS,
    first_seen_ns=TS, last_seen_ns=TS), sql="""
INSERT INTO jobs (node_id, job_id, job_name, first_seen, last_seen, started_at, ended_at, duration_s,
                  avg_gpu_util_percent)
SELECT node_id, job_id, job_name,
       -- without first_seen_ns: the event time less the job's duration
       coalesce(first_seen_ns::TIMESTAMP,
                ts::TIMESTAMP - to_microseconds(CAST(coalesce(duration_s, 0) * 1e6 AS BIGINT))),
       coalesce(last_seen_ns, ts)::TIMESTAMP, started_ns::TIMESTAMP, coalesce(last_seen_ns, ts)::TIMESTAMP,
       coalesce(duration_s, 0), avg_gpu_util_percent
FROM {view}
QUALIFY row_number() OVER (PARTITION BY node_id, job_id ORDER BY ts DESC) = 1
ON CONFLICT (node_id, job_id) DO UPDATE SET
    job_name = coalesce(jobs.job_name, excluded.job_name),
    last_seen = greatest(jobs.last_seen, excluded.last_seen),
    started_at = excluded.started_at,
    ended_at = excluded.ended_at,
    duration_s = CASE WHEN excluded.duration_s > 0 THEN excluded.duration_s
                      ELSE date_diff('microsecond', coalesce(excluded.started_at, jobs.first_seen),
                                     excluded.ended_at) / 1e6 END,
    avg_gpu_util_percent = excluded.avg_gpu_util_percent
""")

# The writer inserts a batch group's rows in this order; the job upserts come after the rows they summarise.
BATCH_TABLES = (SAMPLES, PROBE_RESULTS, PROBE_METRICS, JOB_SAMPLES, JOB_STEPS, EVENTS, JOB_SEEN, JOB_END,
                SAMPLES_SUMMARY, RAW_WINDOWS, RAW_ANSWERED)

# Every declaration of a real table, for the schema check.
DECLARED = (SAMPLES, PROBE_RESULTS, PROBE_METRICS, JOB_SAMPLES, JOB_STEPS, EVENTS, INGEST_LOG, GPUS, SAMPLES_SUMMARY,
            RAW_WINDOWS)


def schema_mismatches(con: duckdb.DuckDBPyConnection) -> list[str]:
    """One sentence per way a declaration here differs from the migrated database (names, order, types)."""
    problems = []
    for table in DECLARED:
        have = con.execute("SELECT column_name, data_type FROM information_schema.columns "
                           "WHERE table_schema = 'main' AND table_name = ? ORDER BY ordinal_position",
                           [table.name]).fetchall()
        want = [(c.name, c.sql_type) for c in table.columns]
        if have != want:
            problems.append(f"table {table.name}: the migrations give {have}, the declaration says {want}")
    return problems
