"""Numbered schema migrations for the collector's DuckDB file.

Migrations live in ``collector/store/migrations/NNN_name.sql`` and are applied in order, each in its own
transaction, recording its number in ``schema_migrations``. A file written by an older collector
therefore opens in a newer one (the missing migrations run); a file written by a *newer* collector
is refused, since this code would not know its tables.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from dataclasses import dataclass
from importlib import resources

import duckdb

_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


class SchemaError(RuntimeError):
    """The database file's schema cannot be used by this collector."""


def migrations() -> list[Migration]:
    """All migrations shipped with this package, in version order."""
    found = []
    for entry in resources.files("gpuagent.collector.store").joinpath("migrations").iterdir():
        m = _NAME.match(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text()))
    found.sort(key=lambda mig: mig.version)
    versions = [mig.version for mig in found]
    if versions != list(range(1, len(versions) + 1)):
        raise SchemaError(f"migration numbers must run 1..N without gaps, found {versions}")
    return found


LATEST_VERSION = len(migrations())


def current_version(con: duckdb.DuckDBPyConnection) -> int:
    exists = con.execute(
        "SELECT count(*) FROM information_schema.tables "
        "WHERE table_schema = 'main' AND table_name = 'schema_migrations'").fetchone()[0]
    if not exists:
        return 0
    return con.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()[0]


def migrate(con: duckdb.DuckDBPyConnection, target: int | None = None,
            available: list[Migration] | None = None) -> list[int]:
    """Bring the schema to ``target`` (default: latest). Returns the versions applied.

    ``available`` replaces the shipped migrations (tests use it to play an upgrade).
    """
    available = migrations() if available is None else available
    target = len(available) if target is None else target
    con.execute("CREATE TABLE IF NOT EXISTS schema_migrations ("
                "version INTEGER PRIMARY KEY, name VARCHAR NOT NULL, applied_at TIMESTAMP NOT NULL)")
    have = current_version(con)
    if have > len(available):
        raise SchemaError(
            f"the database has schema version {have} but this collector knows only up to "
            f"{len(available)}; upgrade gpuagent to open it")
    applied = []
    for mig in available[have:target]:
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute(mig.sql)
            con.execute("INSERT INTO schema_migrations VALUES (?, ?, ?)",
                        [mig.version, mig.name, datetime.now(timezone.utc).replace(tzinfo=None)])
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
        applied.append(mig.version)
    if applied:
        # Fold the schema changes into the file now. DuckDB 1.5.6 cannot replay an ALTER TABLE of a table with
        # a DEFAULT nextval(...) column from the write-ahead log (007 adds flags.finding_id): a collector
        # killed before its first checkpoint would not open again ("Calling DatabaseManager::
        # GetDefaultDatabase with no default database set"). After a checkpoint the WAL holds no DDL.
        con.execute("CHECKPOINT")
    return applied
