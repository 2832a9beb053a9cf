"""Where things are in the lake and which of them are complete (docs/LAKE.md is the contract).

A lake is a folder on any filesystem pyarrow supports (a local path, ``s3://bucket/prefix``, ...)::

    <table>/date=YYYY-MM-DD/hour=HH/shard=<shard>/part-<run>-<n>.parquet   hourly tables
    <table>/shard=<shard>/part-<run>-<n>.parquet                           snapshots (nodes, gpus, flags)
    <partition>/_SUCCESS                                                   manifest: the part files, one a line
    fleet_baselines/current.parquet                                        written by `lake baselines`
    fleet_noise/current.parquet                                            written by `lake baselines`
    _tmp/                                                                  exports in progress (never read)

A partition counts only when its ``_SUCCESS`` names its files: on a local filesystem the whole partition is
renamed into place (readers never see half of one), on object stores, where nothing renames atomically, the
manifest is written last. Readers take exactly the files a manifest names, so files of an interrupted export
are never read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

SUCCESS = "_SUCCESS"
TMP = "_tmp"
BASELINES_FILE = "fleet_baselines/current.parquet"
NOISE_FILE = "fleet_noise/current.parquet"
_SHARD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class LakeError(RuntimeError):
    """The lake cannot be used (bad path, unreachable filesystem, bad shard name); one sentence."""


@dataclass(frozen=True)
class Lake:
    """A filesystem and the root folder of the lake inside it."""

    fs: pafs.FileSystem
    root: str
    uri: str

    @property
    def renames_atomically(self) -> bool:
        """Local filesystems rename a folder in one step; object stores copy object by object."""
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def uri_of(self, *parts: str) -> str:
        """A path that other engines (Spark, DuckDB) can open: the local path, or scheme://..."""
        if self.renames_atomically:
            return self.path(*parts)
        scheme = self.uri.split("://", 1)[0]
        return f"{scheme}://" + self.path(*parts)


def open_lake(uri: str, create: bool = False) -> Lake:
    """A lake at ``uri``: a local path or any URI ``pyarrow.fs.FileSystem.from_uri`` understands."""
    import os

    text = str(uri).strip()
    if not text:
        raise LakeError("the lake path is empty; give a folder or a URI such as s3://bucket/lake")
    try:
        if "://" in text:
            fs, root = pafs.FileSystem.from_uri(text)
        else:
            fs, root = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(text))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise LakeError(f"cannot open the lake {text}: {str(exc).splitlines()[0]}") from None
    lake = Lake(fs, root.rstrip("/") or "/", text)
    info = fs.get_file_info(lake.root)
    if info.type == pafs.FileType.File:
        raise LakeError(f"the lake {text} is a file, not a folder")
    if info.type == pafs.FileType.NotFound:
        if not create:
            raise LakeError(f"the lake {text} does not exist")
        fs.create_dir(lake.root, recursive=True)
    return lake


def check_shard(shard: str) -> str:
    if not _SHARD.match(shard or ""):
        raise LakeError(f"shard name {shard!r} must be 1-63 letters, digits, '.', '_' or '-', starting with a "
                        "letter or digit (it becomes part of a path)")
    return shard


def hour_partition(table: str, date: str, hour: int, shard: str) -> str:
    return f"{table}/date={date}/hour={hour:02d}/shard={shard}"


def snapshot_partition(table: str, shard: str) -> str:
    return f"{table}/shard={shard}"


def read_manifest(lake: Lake, partition: str) -> list[str] | None:
    """The part files a partition's _SUCCESS names (relative to the partition), None when it has none."""
    try:
        with lake.fs.open_input_stream(lake.path(partition, SUCCESS)) as fh:
            text = fh.read().decode()
    except (FileNotFoundError, OSError):
        return None
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def complete_files(lake: Lake, table: str) -> list[str]:
    """Every part file of ``table`` that a _SUCCESS manifest names, as paths inside the lake's filesystem."""
    base = lake.path(table)
    if lake.fs.get_file_info(base).type != pafs.FileType.Directory:
        return []
    out = []
    for info in lake.fs.get_file_info(pafs.FileSelector(base, recursive=True)):
        if info.type != pafs.FileType.File or info.base_name != SUCCESS:
            continue
        partition = info.path.rsplit("/", 1)[0]
        rel = partition[len(lake.root.rstrip("/")) + 1:]
        if any(part.startswith(("_", ".")) for part in rel.split("/")):
            continue
        for name in read_manifest(lake, rel) or []:
            out.append(f"{partition}/{name}")
    return sorted(out)
