"""Bounded on-disk spool of serialized batches waiting for the collector's ack.

One file per batch, ``<seq:020d>.batch``, holding a 28-byte header (magic, seq, sample count, item
count, payload length, CRC-32 of the payload) and the serialized ``Batch``.

Durability policy, and why:
* A new batch is written to a temp file, fsynced, renamed into place, and the folder is fsynced. A
  batch is cut every few seconds, so this costs well under one fsync per second, and after a SIGKILL or
  power loss a file under its final name is complete.
* An acked batch is unlinked without a folder fsync. If a crash brings the file back, it is resent and
  the collector recognises the seq as stored (at-least-once delivery, idempotent storage).
* The counters file (dropped/corrupt/rejected) is rewritten atomically, with fsync, whenever it changes
  (rare), so the exact drop counts survive restarts.

Past ``max_bytes``, or when the file system has less than ``min_free_bytes`` (1 MiB) left, the oldest
batches are deleted first and counted exactly (batches and samples, from the header, without parsing);
a write that still fails (ENOSPC) drops that batch, counted the same way, and the agent carries on. A file whose header or checksum is wrong is moved to ``corrupt/``,
counted and reported through ``on_event`` (kind ``spool_corrupt``); it never stops the agent.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import struct
import threading
import time
import zlib
from pathlib import Path
from typing import Callable

from gpuagent.common.atomic_file import atomic_write

log = logging.getLogger("gpuagent.spool")

MAGIC = b"GAB1"
HEADER = struct.Struct(">4sQIIII")  # magic, seq, n_samples, n_items, payload_len, crc32
_NAME = re.compile(r"^(\d{20})\.batch$")
MIN_FREE_BYTES = 1024 * 1024   # the spool gives way (oldest first) before the file system is this full

EventFn = Callable[[str, str, dict], None]   # (kind, message, attrs)


class CorruptRecord(ValueError):
    pass


def encode_record(seq: int, payload: bytes, n_samples: int, n_items: int) -> bytes:
    return HEADER.pack(MAGIC, seq, n_samples, n_items, len(payload), zlib.crc32(payload)) + payload


def decode_record(data: bytes) -> tuple[int, int, int, bytes]:
    """(seq, n_samples, n_items, payload); raises CorruptRecord with the reason."""
    if len(data) < HEADER.size:
        raise CorruptRecord(f"file is {len(data)} bytes, shorter than the {HEADER.size}-byte header")
    magic, seq, n_samples, n_items, length, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptRecord(f"bad magic {magic!r}")
    payload = data[HEADER.size:]
    if len(payload) != length:
        raise CorruptRecord(f"payload is {len(payload)} bytes, header says {length}")
    if zlib.crc32(payload) != crc:
        raise CorruptRecord("CRC-32 mismatch")
    return seq, n_samples, n_items, payload


class Spool:
    COUNTERS = ("dropped_batches", "dropped_samples", "corrupt_files", "rejected_batches",
                "rejected_samples", "write_errors")

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 512 * 1024 * 1024,
                 on_event: EventFn | None = None, min_free_bytes: int = MIN_FREE_BYTES):
        self.dir = Path(directory)
        self.max_bytes = int(max_bytes)
        self.min_free_bytes = int(min_free_bytes)
        self.on_event = on_event or (lambda kind, msg, attrs: None)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o750)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._index: dict[int, tuple[int, int]] = {}   # seq -> (file bytes, n_samples), oldest first
        self._bytes = 0
        self._samples = 0          # running totals, so stats() stays O(1) with 100k spooled batches
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self._load_counters()
        self._pending_events: list[tuple[str, str, dict]] = []
        self._last_drop_log = -1e9
        self._scan()

    # ---------------------------------------------------------------- startup
    def _counters_path(self) -> Path:
        return self.dir / "counters.json"

    def _load_counters(self) -> None:
        try:
            data = json.loads(self._counters_path().read_text())
            for k in self.COUNTERS:
                self.counters[k] = int(data.get(k, 0))
        except FileNotFoundError:
            pass
        except (ValueError, OSError) as exc:
            log.warning("spool counters file %s is unreadable (%s); counting from zero",
                        self._counters_path(), exc)

    def _save_counters(self) -> None:
        atomic_write(self._counters_path(), json.dumps(self.counters, sort_keys=True).encode(), fsync=True)

    def _path(self, seq: int) -> Path:
        return self.dir / f"{seq:020d}.batch"

    def _scan(self) -> None:
        """Index the files left by a previous run; verify each one fully and set aside the bad ones."""
        found = []
        for entry in os.scandir(self.dir):
            if not entry.is_file():
                continue
            m = _NAME.match(entry.name)
            if m:
                found.append(int(m.group(1)))
            elif ".tmp" in entry.name and entry.name.startswith("."):
                os.unlink(entry.path)   # a write that never reached its rename: never acknowledged
        for seq in sorted(found):
            path = self._path(seq)
            try:
                data = path.read_bytes()
                hseq, n_samples, _, _ = decode_record(data)
                if hseq != seq:
                    raise CorruptRecord(f"header seq {hseq} does not match the file name")
            except CorruptRecord as exc:
                self._set_aside(seq, str(exc))
                continue
            self._index[seq] = (len(data), n_samples)
            self._bytes += len(data)
            self._samples += n_samples
        if self._pending_events:
            self._save_counters()
        self._flush_events()

    def _set_aside(self, seq: int, reason: str) -> None:
        """Move a bad file to corrupt/ (caller holds the lock or is in __init__)."""
        src = self._path(seq)
        dst_dir = self.dir / "corrupt"
        dst_dir.mkdir(exist_ok=True)
        dst = dst_dir / f"{src.name}.{time.time_ns()}"
        try:
            os.replace(src, dst)
        except FileNotFoundError:
            return
        self.counters["corrupt_files"] += 1
        msg = f"spool file {src.name} is corrupt ({reason}); moved to {dst}"
        log.error(msg)
        self._pending_events.append(("spool_corrupt", msg, {"seq": str(seq), "path": str(dst),
                                                            "reason": reason}))

    def _flush_events(self) -> None:
        events, self._pending_events = self._pending_events, []
        for kind, msg, attrs in events:
            try:
                self.on_event(kind, msg, attrs)
            except Exception:  # noqa: BLE001 - a reporting failure must not break the spool
                log.exception("spool event callback failed")

    # ---------------------------------------------------------------- writing
    def put(self, seq: int, payload: bytes, n_samples: int, n_items: int = 0) -> bool:
        """Store one batch durably. Returns False when it could not be kept (counted as dropped)."""
        record = encode_record(seq, payload, n_samples, n_items)
        size = len(record)
        with self._cond:
            if size > self.max_bytes:
                self._count_drop(1, n_samples, f"batch {seq} ({size} bytes) is larger than the whole spool")
            else:
                while self._index and self._bytes + size > self.max_bytes:
                    old, (osize, osamples) = next(iter(self._index.items()))
                    self._remove(old)
                    self._count_drop(1, osamples, f"spool full ({self.max_bytes} bytes): dropped oldest batch {old}")
                # The file system may fill before the bound: keep min_free_bytes free for the seq and
                # status files (and everyone else) by dropping the oldest batches, not the newest.
                while self._index and self._free_bytes() < size + self.min_free_bytes:
                    old, (osize, osamples) = next(iter(self._index.items()))
                    self._remove(old)
                    self._count_drop(1, osamples, f"disk nearly full (less than {self.min_free_bytes} bytes free "
                                                  f"in {self.dir}): dropped oldest batch {old}")
                try:
                    atomic_write(self._path(seq), record, fsync=True, mode=0o640)
                except OSError as exc:
                    self.counters["write_errors"] += 1
                    self._count_drop(1, n_samples, f"cannot write batch {seq} to {self.dir}: "
                                                   f"{exc.strerror or exc}")
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO):
                        log.exception("unexpected spool write error")
                else:
                    self._index[seq] = (size, n_samples)
                    self._bytes += size
                    self._samples += n_samples
                    self._cond.notify_all()
                    self._flush_locked_events()
                    return True
            self._flush_locked_events()
            return False

    def _free_bytes(self) -> int:
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return 1 << 62
        return st.f_bavail * st.f_frsize

    def _flush_locked_events(self) -> None:
        if self._pending_events:
            try:
                self._save_counters()
            except OSError as exc:
                log.error("cannot save spool counters: %s", exc)
            self._flush_events()

    def count_dropped(self, batches: int, samples: int, reason: str) -> None:
        """Count data lost before it reached the spool (it still belongs in the exact drop counters)."""
        with self._lock:
            self._count_drop(batches, samples, reason)
            self._flush_locked_events()

    def _count_drop(self, batches: int, samples: int, reason: str) -> None:
        self.counters["dropped_batches"] += batches
        self.counters["dropped_samples"] += samples
        now = time.monotonic()
        if now - self._last_drop_log >= 60.0:     # at most one line a minute; the counters are exact
            self._last_drop_log = now
            log.warning("%s (%d batches / %d samples dropped so far; further drops are logged at most "
                        "once a minute)", reason, self.counters["dropped_batches"], self.counters["dropped_samples"])
        self._pending_events.append(("spool_dropped", reason,
                                     {"dropped_batches": str(self.counters["dropped_batches"]),
                                      "dropped_samples": str(self.counters["dropped_samples"])}))

    def _forget(self, seq: int) -> tuple[int, int] | None:
        """Drop ``seq`` from the index and the running totals (the file is the caller's business)."""
        entry = self._index.pop(seq, None)
        if entry is not None:
            self._bytes -= entry[0]
            self._samples -= entry[1]
        return entry

    def _remove(self, seq: int) -> bool:
        entry = self._forget(seq)
        if entry is None:
            return False
        try:
            os.unlink(self._path(seq))
        except FileNotFoundError:
            pass
        return True

    # ---------------------------------------------------------------- reading / acking
    def seqs(self) -> list[int]:
        with self._lock:
            return list(self._index)

    def next_after(self, seq: int) -> int | None:
        """The oldest spooled seq greater than ``seq``."""
        with self._lock:
            for s in self._index:
                if s > seq:
                    return s
        return None

    def wait_after(self, seq: int, timeout: float) -> int | None:
        """Block up to ``timeout`` seconds for a spooled seq greater than ``seq``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for s in self._index:
                    if s > seq:
                        return s
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def read(self, seq: int) -> bytes | None:
        """The payload of batch ``seq``; None if it is gone or was corrupt (then set aside and counted)."""
        with self._lock:
            if seq not in self._index:
                return None
            try:
                data = self._path(seq).read_bytes()
                hseq, _, _, payload = decode_record(data)
                if hseq != seq:
                    raise CorruptRecord(f"header seq {hseq} does not match the file name")
                return payload
            except FileNotFoundError:
                self._forget(seq)
                return None
            except CorruptRecord as exc:
                self._forget(seq)
                self._set_aside(seq, str(exc))
            self._flush_locked_events()
            return None

    def ack(self, seq: int) -> bool:
        """The collector stored ``seq``: forget it."""
        with self._lock:
            return self._remove(seq)

    def reject(self, seq: int, reason: str) -> None:
        """The collector refused this batch as malformed: set it aside in rejected/ and count it."""
        with self._lock:
            entry = self._forget(seq)
            if entry is None:
                return
            dst_dir = self.dir / "rejected"
            dst_dir.mkdir(exist_ok=True)
            try:
                os.replace(self._path(seq), dst_dir / self._path(seq).name)
            except FileNotFoundError:
                pass
            self.counters["rejected_batches"] += 1
            self.counters["rejected_samples"] += entry[1]
            msg = f"collector rejected batch {seq} ({reason}); moved to {dst_dir}"
            log.error(msg)
            self._pending_events.append(("batch_rejected", msg, {"seq": str(seq), "reason": reason}))
            self._flush_locked_events()

    # ---------------------------------------------------------------- status
    def stats(self) -> dict:
        with self._lock:
            idx = self._index
            return {
                "backlog_batches": len(idx),
                "backlog_bytes": self._bytes,
                "backlog_samples": self._samples,
                # Seqs enter in increasing order, so the index's ends are the oldest and newest.
                "oldest_seq": next(iter(idx)) if idx else 0,
                "newest_seq": next(reversed(idx)) if idx else 0,
                "max_bytes": self.max_bytes,
                **self.counters,
            }

    @property
    def total_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._index)
