"""How much of its volume the collector's database uses, and how much room is left: what the disk guard
and the storage benchmarks measure (``Usage``, ``measure``, ``table_bytes``).

"Bytes" for ``max_db_bytes`` are the bytes the database uses: the file's blocks minus its free blocks
(``PRAGMA database_size``; DuckDB reuses free blocks but never shrinks the file) plus the write-ahead log.
The volume floor counts the volume's free space plus the file's free blocks, since both take new data.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Usage:
    file_bytes: int
    wal_bytes: int
    free_block_bytes: int
    volume_free_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.file_bytes - self.free_block_bytes + self.wal_bytes

    @property
    def available_bytes(self) -> int:
        return self.volume_free_bytes + self.free_block_bytes


def measure(con, db_path: str) -> Usage:
    """The database's use of its volume (see the module docstring for what counts)."""
    row = con.execute("SELECT free_blocks, block_size FROM pragma_database_size() "
                      "WHERE database_name = current_database()").fetchone()
    free_blocks, block_size = (int(row[0]), int(row[1])) if row else (0, 0)
    size = lambda p: os.stat(p).st_size if os.path.exists(p) else 0  # noqa: E731
    return Usage(size(db_path), size(db_path + ".wal"), free_blocks * block_size,
                 shutil.disk_usage(Path(db_path).resolve().parent).free)


def table_bytes(con, table: str) -> int:
    """Bytes of the blocks that hold ``table``'s segments, each block counted whole (after a checkpoint)."""
    blocks, block_size = con.execute(
        f"SELECT (SELECT count(*) FROM (SELECT block_id FROM pragma_storage_info('{table}') WHERE block_id >= 0 "
        f"UNION SELECT unnest(additional_block_ids) FROM pragma_storage_info('{table}'))), "
        "(SELECT block_size FROM pragma_database_size() WHERE database_name = current_database())").fetchone()
    return int(blocks) * int(block_size)
