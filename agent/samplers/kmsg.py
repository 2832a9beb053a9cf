"""The NVIDIA kernel-log reader of the hardware-health sampler (agent/samplers/hw_host.py): records from
/dev/kmsg, the XID / SXID / driver-failure lines in them, and where the reader stopped.

**/dev/kmsg** (Documentation/ABI/testing/dev-kmsg): one record per read(), ``prio,seq,usec,flags[,...];message``
followed by optional dictionary lines that start with a space (`` DEVICE=+pci:0000:3b:00.0``); non-printable
bytes in the message are escaped as ``\\xNN`` (a driver's multi-line message arrives as one record with
``\\x0a``). The first read after open() returns the oldest record still in the ring, so the first open reads
the XIDs logged while the agent was down; read() answers EAGAIN (O_NONBLOCK) when there is no more and EPIPE
when records were overwritten before we read them (the position moves to the next record; the gap in seq
says how many were lost). Only facility 0 (kernel) records count: userspace cannot write those ("It is not
possible to inject messages from userspace with the facility number LOG_KERN (0)"), so a forged
``NVRM: Xid`` line from a user process is ignored. The last seq handled is kept in the agent's state dir
with the boot id, so a restart does not emit the ring again. usec is time since boot; wall clock = boot time
(CLOCK_REALTIME - CLOCK_BOOTTIME on the live system, /proc/stat btime for a fixture root) + usec.

Line formats (the driver's, as printed in public kernel logs; the fixtures in tests/test_hw_host.py are our
own lines in these shapes):
- ``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.`` (pid/name only when a
  process is known; ``pid='<unknown>'`` also occurs; NVIDIA's XID guide shows the older
  ``NVRM: Xid (0000:03:00): 14, Channel 00000001``, docs.nvidia.com/deploy/xid-errors, "Viewing Xid messages";
  NVLink XIDs 144-150 carry sub-fields, e.g. open-gpu-kernel-modules issue #1150, leptonai/gpud PR #1174);
- ``nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 ...`` followed by ``Severity ...`` and
  ``Data {...}`` records for the same SXID (NVIDIA/nvtrust issue #124; Fabric Manager User Guide, SXid errors):
  one event per run of records of one SXID on one switch;
- ``NVRM: GPU 0000:98:00.0: RmInitAdapter failed! (0x62:0x65:1792)`` and the ``rm_init_adapter failed, device
  minor number 0`` that follows (open-gpu-kernel-modules issue #789, gpu-operator issue #1146), and
  ``NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has fallen off the bus and
  is not responding to commands.`` (NVIDIA/NVSentinel issue #155): ``nvidia_driver_error``, one per GPU per
  minute (the driver retries every few seconds).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpuagent.agent.samplers.host import SourceGuard, decode
from gpuagent.common import nvlink5

log = logging.getLogger("gpuagent.hw_host")

KMSG_PATH = "/dev/kmsg"
KMSG_STATE_FILE = "kmsg.state.json"
KMSG_READ_SIZE = 16384          # a record is at most ~8 KiB (CONSOLE_EXT_LOG_MAX); a smaller buffer gets EINVAL
KMSG_MAX_RECORDS_PER_TICK = 5000  # a large boot ring is read over a few ticks rather than in one long one

# ---------------------------------------------------------------- PCI bus ids

_BUS = re.compile(r"([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})(?:\.([0-7]))?")


def bus_key(bus_id: str | None) -> str:
    """A PCI bus id as ``dddd:bb:dd`` (lower case, 4-digit domain, no function), the form the XID line
    prints; NVML's ``00000000:3B:00.0`` and sysfs's ``0000:3b:00.0`` map to the same key. "" when unparsable."""
    m = _BUS.search(bus_id or "")
    if not m:
        return ""
    return f"{int(m.group(1), 16):04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}"


# ---------------------------------------------------------------- kmsg records

@dataclass
class KmsgRecord:
    prio: int
    seq: int
    usec: int
    flags: str
    message: str
    info: dict[str, str] = field(default_factory=dict)   # the dictionary lines (SUBSYSTEM=, DEVICE=)

    @property
    def facility(self) -> int:
        return self.prio >> 3


_ESC = re.compile(rb"\\x([0-9a-fA-F]{2})")


def parse_kmsg_record(raw: bytes) -> KmsgRecord:
    """One record (header line plus its dictionary lines); ValueError when it is not in the documented format."""
    lines = raw.split(b"\n")
    head, sep, msg = lines[0].partition(b";")
    if not sep:
        raise ValueError("no ';' after the record header")
    f = head.split(b",")
    if len(f) < 3:
        raise ValueError(f"{len(f)} header fields, at least 3 expected (prio,seq,usec)")
    prio, seq, usec = int(f[0]), int(f[1]), int(f[2])
    flags = decode(f[3]) if len(f) > 3 else "-"
    info = {}
    for d in lines[1:]:
        if d.startswith(b" "):
            k, _, v = decode(d[1:]).partition("=")
            info[k] = v
    text = decode(_ESC.sub(lambda m: bytes([int(m.group(1), 16)]), msg))
    return KmsgRecord(prio, seq, usec, flags, text, info)


_XID = re.compile(r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F:.]+)\): (\d+),\s*(.*)", re.S)
_PID = re.compile(r"pid=('?<?\w+>?'?),\s*(?:name=([^,]*),\s*)?")
_SXID = re.compile(r"(nvidia-nvswitch\d*): SXid \((?:PCI:)?([0-9a-fA-F:.]+)\): (\d+),\s*(.*)", re.S)
_DRV_GPU = re.compile(r"NVRM: GPU ([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d): (.*)", re.S)
_DRV_FAIL = re.compile(r"RmInitAdapter failed|rm_init_adapter failed|failed to initiali[sz]e", re.I)
_FALLEN = re.compile(r"NVRM: The NVIDIA GPU ([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d).*fallen off\s+"
                     r"(?:NVRM:\s*)?the bus", re.S)
_PROBE_FAIL = re.compile(r"NVRM: The NVIDIA probe routine failed for (\d+) device")


# XID 154 (the catalog: "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"): the new
# action, in the catalog's words, as snake case (the rules' recovery_action variants).
_RECOVERY = re.compile(r"recovery action changed from\s+\S+\s+\(([^)]*)\)\s+to\s+(0x[0-9a-fA-F]+)\s+\(([^)]*)\)", re.I)
# SXid lines carry "Fatal" or "Non-fatal" after the number (Fabric Manager User Guide, SXid errors).
_SXID_TAG = re.compile(r"^\s*(Non-fatal|Fatal)\b", re.I)


def _snake(words: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", words.strip().lower()).strip("_")


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*(?:NVRM:\s*)?", " ", text).strip()


def classify(message: str) -> tuple[str, float, dict[str, str]] | None:
    """(kind, value, attrs) for an NVIDIA kernel-log message, None for anything else."""
    if "NVRM" not in message and "SXid" not in message:
        return None
    m = _XID.search(message)
    if m:
        rest = m.group(3)
        attrs = {"source": "kmsg", "xid": m.group(2), "pci_bus_id": bus_key(m.group(1)), "message": _one_line(message)}
        p = _PID.match(rest)
        if p:
            if p.group(1).isdigit():
                attrs["pid"] = p.group(1)
            if p.group(2):
                attrs["process_name"] = p.group(2).strip()
            rest = rest[p.end():]
        attrs["description"] = _one_line(rest)
        xid = int(m.group(2))
        r = _RECOVERY.search(rest)
        if xid == 154 and r:
            attrs.update(recovery_action=_snake(r.group(3)), recovery_action_code=str(int(r.group(2), 16)),
                         recovery_action_before=_snake(r.group(1)))
        d = nvlink5.decode(xid, rest)
        if d is not None:
            attrs.update(nvlink5_severity=d.severity, nvlink5_decoded_by=d.how)
            if d.unit:
                attrs["nvlink5_unit"] = d.unit
        return "xid", float(m.group(2)), attrs
    m = _SXID.search(message)
    if m:
        attrs = {"source": "kmsg", "sxid": m.group(3), "device": m.group(1), "pci_bus_id": bus_key(m.group(2)),
                 "message": _one_line(m.group(4))}
        tag = _SXID_TAG.match(m.group(4))
        if tag:
            attrs["fatal"] = "0" if tag.group(1).lower().startswith("non") else "1"
        return "sxid", float(m.group(3)), attrs
    m = _FALLEN.search(message)
    if m:
        return "nvidia_driver_error", 0.0, {"source": "kmsg", "reason": "fallen_off_bus",
                                            "pci_bus_id": bus_key(m.group(1)), "message": _one_line(message)}
    m = _DRV_GPU.search(message)
    if m and _DRV_FAIL.search(m.group(2)):
        return "nvidia_driver_error", 0.0, {"source": "kmsg", "reason": "init_failed",
                                            "pci_bus_id": bus_key(m.group(1)), "message": _one_line(message)}
    m = _PROBE_FAIL.search(message)
    if m:
        return "nvidia_driver_error", float(m.group(1)), {"source": "kmsg", "reason": "probe_failed", "pci_bus_id": "",
                                                          "message": _one_line(message)}
    return None


def boot_time_ns(proc_root: str = "/proc") -> int:
    """Wall-clock ns of boot: CLOCK_REALTIME - CLOCK_BOOTTIME on the live system (sub-second), else the
    ``btime`` line of <proc_root>/stat (whole seconds). 0 when neither is known."""
    if os.path.realpath(proc_root) == "/proc" and hasattr(time, "CLOCK_BOOTTIME"):
        return time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    try:
        for line in Path(proc_root, "stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) * 10**9
    except (OSError, ValueError, IndexError):
        pass
    return 0


def boot_id(proc_root: str = "/proc") -> str:
    try:
        return Path(proc_root, "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


class KmsgReader:
    """Non-blocking reader of /dev/kmsg (or a fixture file in its format) that resumes after a restart."""

    def __init__(self, path: str = KMSG_PATH, state_dir: str | os.PathLike | None = None, proc_root: str = "/proc",
                 guard: SourceGuard | None = None, read: Callable[[int, int], bytes] = os.read) -> None:
        self.path = path
        self.state_path = Path(state_dir) / KMSG_STATE_FILE if state_dir is not None else None
        self.boot_id = boot_id(proc_root) or f"btime:{boot_time_ns(proc_root) // 10**9}"
        self.boot_ns = boot_time_ns(proc_root)
        self.guard = guard or SourceGuard("hw_host")
        self._read = read         # os.read; a test passes one that raises EPIPE as the kernel does
        self._fd: int | None = None
        self._buf = b""
        self.unavailable: str | None = None
        self.state_problem: str | None = None
        self.last_seq = -1        # the last seq handled (this boot)
        self.resume_after = self._load_state()
        self.lost_records = 0     # overwritten before we read them (EPIPE and seq gaps)
        self.epipe = 0
        self.records = 0

    def _load_state(self) -> int:
        if self.state_path is None:
            return -1
        try:
            st = json.loads(self.state_path.read_text())
            if st.get("boot_id") == self.boot_id:
                return int(st["seq"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return -1

    def save_state(self, seq: int | None = None) -> None:
        if self.state_path is None:
            return
        seq = self.last_seq if seq is None else seq
        if seq < 0:
            return
        tmp = self.state_path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps({"boot_id": self.boot_id, "seq": seq}))
            os.replace(tmp, self.state_path)
        except OSError as exc:
            if self.state_problem is None:
                self.state_problem = (f"kernel log position cannot be saved in {self.state_path} "
                                      f"({exc.strerror or exc}): a restart reads the ring again")
                log.warning(self.state_problem)

    def open(self) -> bool:
        if self._fd is not None:
            return True
        try:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            if self.unavailable is None:
                why = "needs root (CAP_SYSLOG or kernel.dmesg_restrict=0)" if exc.errno in (errno.EACCES, errno.EPERM) \
                    else (exc.strerror or str(exc))
                self.unavailable = (f"kernel log {self.path} cannot be read ({why}): XIDs come from NVML only, "
                                    "SXIDs and driver-init failures are not seen")
                log.info(self.unavailable)
            return False
        self.unavailable = None
        return True

    def poll(self, max_records: int = KMSG_MAX_RECORDS_PER_TICK) -> list[KmsgRecord]:
        """The new kernel-facility records since the last call (at most ``max_records``)."""
        if not self.open():
            return []
        out: list[KmsgRecord] = []
        n = 0
        while n < max_records:
            try:
                chunk = self._read(self._fd, KMSG_READ_SIZE)
            except BlockingIOError:
                break                           # EAGAIN: no more records now
            except OSError as exc:
                if exc.errno == errno.EPIPE:    # overwritten while we were away; position moved on
                    self.epipe += 1
                    continue
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not chunk:
                break                           # a regular file (fixture) at its end
            self._buf += chunk
            n += self._drain(out)
        return out

    def _drain(self, out: list[KmsgRecord]) -> int:
        """Parse the complete records in the buffer (a device read returns one; a fixture file several)."""
        lines = self._buf.split(b"\n")
        self._buf = lines.pop()               # an incomplete last line stays for the next read
        n = 0
        rec_lines: list[bytes] = []
        for line in lines:
            if line.startswith(b" ") and rec_lines:
                rec_lines.append(line)
                continue
            if rec_lines:
                n += self._take(b"\n".join(rec_lines), out)
            rec_lines = [line] if line else []
        if rec_lines:
            if self._buf.startswith(b" "):      # its dictionary may continue in the next read
                self._buf = b"\n".join(rec_lines) + b"\n" + self._buf
            else:
                n += self._take(b"\n".join(rec_lines), out)
        return n

    def _take(self, raw: bytes, out: list[KmsgRecord]) -> int:
        try:
            rec = parse_kmsg_record(raw)
        except ValueError as exc:
            self.guard.bad_line("kmsg", self.path, decode(raw[:200]), exc)
            return 0
        self.records += 1
        if self.last_seq >= 0 and rec.seq > self.last_seq + 1:
            self.lost_records += rec.seq - self.last_seq - 1
        elif self.last_seq < 0 and self.resume_after >= 0 and rec.seq > self.resume_after + 1:
            self.lost_records += rec.seq - self.resume_after - 1
        if rec.seq <= self.resume_after:
            self.last_seq = max(self.last_seq, rec.seq)
            return 1                            # handled by an earlier run of the agent
        self.last_seq = rec.seq
        if rec.facility == 0:
            out.append(rec)
        return 1

    def wall_ns(self, rec: KmsgRecord) -> int:
        return self.boot_ns + rec.usec * 1000

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
