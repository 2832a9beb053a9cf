"""Opening the collector's DuckDB file: creating, migrating and locking it down, with one-sentence errors.

Every part of the collector that opens the database goes through here, so a locked, missing or damaged file
is worded the same way wherever it is met.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import duckdb

from gpuagent.collector.store import schema
from gpuagent.common.errors import first_line

log = logging.getLogger("gpuagent.collector.store")


class DatabaseError(RuntimeError):
    """The database cannot be opened or prepared; the message is one sentence for the user."""


_LOCK_RE = re.compile(r"Conflicting lock is held in (?P<prog>.*?) \(PID (?P<pid>\d+)\)(?: by user (?P<user>\S+))?")


def describe_open_error(db_path: str, exc: Exception) -> str:
    """One sentence for why ``db_path`` could not be opened."""
    text = str(exc)
    m = _LOCK_RE.search(text)
    if m:
        pid = int(m.group("pid"))
        who = m.group("prog")
        try:
            import psutil

            who = " ".join(psutil.Process(pid).cmdline()) or who
        except Exception:  # noqa: BLE001 - best effort: the PID alone is still useful
            pass
        user = f" (user {m.group('user')})" if m.group("user") else ""
        return (f"the database {db_path} is already open in another process, PID {pid}{user}: {who}; "
                "stop that collector first or use another --db")
    return f"cannot open the database {db_path}: {first_line(exc)}"


DEFAULT_MEMORY_LIMIT = "512MB"   # serve's --memory-limit default; analyze --db and the tools get the same


def _clear_stale_spill(db_path: str) -> list[str]:
    """Delete the spill files a killed process left in DuckDB's temp folder (<db>.tmp). DuckDB removes its own
    on a clean close, never those of a process that died: a collector killed in a 30,000-node pass left
    15 GB there. Called while this process holds the database's lock, so no other process can be using them."""
    folder = Path(db_path + ".tmp")
    gone = []
    if folder.is_dir():
        for f in folder.iterdir():
            if f.name.startswith("duckdb_temp_") and f.is_file():
                try:
                    f.unlink()
                    gone.append(f.name)
                except OSError:
                    pass
    return gone


def open_database(db_path: str | Path, memory_limit: str | None = DEFAULT_MEMORY_LIMIT,
                  profile: bool = False) -> duckdb.DuckDBPyConnection:
    """Open (creating if needed) and migrate the database, then close it to everything external.

    After this, no connection or cursor of this database can read or write files other than its own,
    load extensions or change settings; the SQL guard relies on it. ``profile``: this connection keeps
    DuckDB's profile of its last statement, printed nowhere (benchmarks/analysis_scale.py reads the rows
    each statement scanned); settings lock after it, so it cannot be turned on later.
    """
    db_path = str(db_path)
    parent = Path(db_path).expanduser().resolve().parent
    if not parent.is_dir():
        raise DatabaseError(f"cannot open the database {db_path}: the folder {parent} does not exist")
    try:
        con = duckdb.connect(db_path)
    except duckdb.Error as exc:
        raise DatabaseError(describe_open_error(db_path, exc)) from None
    stale = _clear_stale_spill(db_path)       # we hold the lock now
    if stale:
        log.info("removed %d spill files a stopped process left in %s.tmp", len(stale), db_path)
    try:
        schema.migrate(con)
        if memory_limit:
            con.execute("SET memory_limit = ?", [memory_limit])
        # Rows have no order without ORDER BY anyway; letting DuckDB append in parallel without keeping the
        # Arrow order costs about a third less CPU per inserted row (benchmarks/ingest.py). Each transaction's
        # rows still get rowids above every earlier one, which the analyzer's incremental rollups rely on.
        con.execute("SET preserve_insertion_order = false")
        con.execute("SET autoinstall_known_extensions = false")
        con.execute("SET autoload_known_extensions = false")
        if profile:
            con.execute("SET enable_profiling = 'no_output'")
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except schema.SchemaError as exc:
        con.close()
        raise DatabaseError(str(exc)) from None
    except duckdb.Error as exc:
        con.close()
        raise DatabaseError(f"cannot prepare the database {db_path}: {first_line(exc)}") from None
    return con


def open_readonly(db_path: str | Path) -> duckdb.DuckDBPyConnection:
    """A read-only connection for views and offline analysis; never migrates, never creates the file."""
    db_path = str(db_path)
    if not Path(db_path).expanduser().exists():
        raise DatabaseError(f"cannot open the database {db_path}: no such file")
    try:
        return duckdb.connect(db_path, read_only=True)
    except duckdb.Error as exc:
        raise DatabaseError(describe_open_error(db_path, exc)) from None
