"""Host-side hardware signals: NVIDIA kernel-log records (XID, NVSwitch SXID, driver-init failures) from
/dev/kmsg, InfiniBand / RoCE port state and counters, and Ethernet carrier changes and link speed from sysfs.

All roots are injectable (``kmsg_path``, ``proc_root``, ``sys_root``) so tests feed fixture trees written in
the kernel's documented formats. Names of series and events: docs/METRICS.md ("Host sampler").

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

**InfiniBand** (Documentation/ABI/stable/sysfs-class-infiniband): ``ports/<n>/state`` "4: ACTIVE",
``phys_state`` "5: LinkUp", ``rate`` "200 Gb/sec (4X HDR)", ``link_layer`` "InfiniBand" or "Ethernet" (RoCE),
``counters/*`` (IBTA PortCounters, e.g. symbol_error, link_downed, port_rcv_errors) and ``hw_counters/*``
(driver counters; ``lifespan`` there is a setting, not a counter). A counter that does not apply answers the
read with an error (e.g. EINVAL on RoCE): it is skipped. The file list is cached and listed again every 60 s.

**Ethernet** (Documentation/ABI/testing/sysfs-class-net): ``carrier_changes`` (link up/down transitions since
the device was registered), ``speed`` in Mb/s (-1 or EINVAL while the link is down). Virtual devices
(under /sys/devices/virtual/net) and lo are skipped. ``net_link_speed_max_mbps`` is the speed the operator says
the link should run at (``[hardware] ethernet_speed_mbps``, a manifest, as fleet checks compare PCIe links
with one); without it none is sent. The NIC's own supported maximum would need the ETHTOOL_GLINKSETTINGS ioctl
and the kernel's link-mode table, which this module does not carry.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from gpuagent.agent.samplers.host import SourceGuard, decode
from gpuagent.agent.samplers.netif import _is_virtual as is_virtual
from gpuagent.common.timeutil import now_ns

log = logging.getLogger("gpuagent.hw_host")

KMSG_PATH = "/dev/kmsg"
KMSG_STATE_FILE = "kmsg.state.json"
KMSG_READ_SIZE = 16384          # a record is at most ~8 KiB (CONSOLE_EXT_LOG_MAX); a smaller buffer gets EINVAL
KMSG_MAX_RECORDS_PER_TICK = 5000  # a large boot ring is read over a few ticks rather than in one long one
XID_DEDUP_WINDOW_NS = 10 * 10**9  # an NVML XID and a kmsg XID for the same GPU and XID this close are one
DRIVER_ERROR_REPEAT_NS = 60 * 10**9
SYSFS_RELIST_S = 60.0

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
        return "xid", float(m.group(2)), attrs
    m = _SXID.search(message)
    if m:
        return "sxid", float(m.group(3)), {"source": "kmsg", "sxid": m.group(3), "device": m.group(1),
                                           "pci_bus_id": bus_key(m.group(2)), "message": _one_line(m.group(4))}
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


# ---------------------------------------------------------------- NVML dedup

class XidLedger:
    """The XIDs NVML reported lately, for deduplicating the kernel log's copy of the same XID.

    ``tap(sink)`` wraps the sink the GPU sampler writes to: each ``xid`` event passes through unchanged and
    is remembered. ``seen(xid, bus_id, ts_ns)`` answers whether NVML reported that XID on that GPU within
    10 s of ``ts_ns``; ``bus_for_gpu`` maps an NVML index to its bus id when the event has no pci_bus_id."""

    def __init__(self, bus_for_gpu: Callable[[int], str | None] | None = None, keep: int = 512) -> None:
        self._bus_for_gpu = bus_for_gpu or (lambda _gpu: None)
        self._recent: deque[tuple[int, str, int]] = deque(maxlen=keep)   # (xid, bus key, ts_ns)

    def record(self, xid: int, gpu: int, ts_ns: int, pci_bus_id: str | None = None) -> None:
        bus = bus_key(pci_bus_id) or (bus_key(self._bus_for_gpu(gpu)) if gpu >= 0 else "")
        self._recent.append((int(xid), bus, int(ts_ns)))

    def seen(self, xid: int, bus_id: str, ts_ns: int) -> bool:
        bus = bus_key(bus_id)
        return any(x == xid and b == bus and abs(t - ts_ns) <= XID_DEDUP_WINDOW_NS for x, b, t in self._recent)

    def tap(self, sink: Any) -> Any:
        return _XidTap(sink, self)


class _XidTap:
    def __init__(self, sink: Any, ledger: XidLedger) -> None:
        self._sink, self._ledger = sink, ledger

    def event(self, kind, message, gpu=-1, value=0.0, attrs=None, ts_ns=None):
        if kind == "xid" and (attrs or {}).get("source") != "kmsg":
            self._ledger.record(int(value), int(gpu), ts_ns if ts_ns is not None else now_ns(),
                                (attrs or {}).get("pci_bus_id"))
        return self._sink.event(kind, message, gpu=gpu, value=value, attrs=attrs, ts_ns=ts_ns)

    def __getattr__(self, name):
        return getattr(self._sink, name)


# ---------------------------------------------------------------- sysfs readers

_O_READ = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def _read_text(path: str) -> str | None:
    """A small sysfs attribute (one page at most), with the plain syscalls: a Python file object costs
    several times more, and a port has some 50 counter files."""
    try:
        fd = os.open(path, _O_READ)
    except OSError:
        return None
    try:
        return decode(os.read(fd, 4096)).strip()
    except OSError:
        return None
    finally:
        os.close(fd)


def _leading_number(text: str) -> int:
    """4 from "4: ACTIVE"; 200 from "200 Gb/sec (4X HDR)"; ValueError otherwise."""
    m = re.match(r"\s*(\d+(?:\.\d+)?)", text)
    if not m:
        raise ValueError(f"no leading number in {text!r}")
    return float(m.group(1)) if "." in m.group(1) else int(m.group(1))


class _Listed:
    """A sysfs directory listing kept for ``relist_s`` (listing costs more than reading a few files)."""

    def __init__(self, base: str, guard: SourceGuard | None, relist_s: float) -> None:
        self.base = base
        self.guard = guard or SourceGuard("hw_host")
        self.relist_s = relist_s
        self._items: list = []
        self._listed_at: float | None = None

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.base))
        except OSError:
            return []

    def _list(self) -> list:
        raise NotImplementedError

    def listing(self) -> list:
        now = time.monotonic()
        if self._listed_at is None or now - self._listed_at >= self.relist_s:
            self._items, self._listed_at = self._list(), now
        return self._items


@dataclass
class _IbPort:
    device: str
    port: str
    path: str
    counters: list[tuple[str, str]]     # (counter name, file path)
    link_layer: str = "InfiniBand"      # fixed for a port's life: read when listed


class IbPorts(_Listed):
    """ib_port_* samples from /sys/class/infiniband (see the module docstring)."""

    def __init__(self, sys_root: str = "/sys", guard: SourceGuard | None = None, relist_s: float = SYSFS_RELIST_S):
        super().__init__(os.path.join(sys_root, "class/infiniband"), guard, relist_s)

    def _list(self) -> list[_IbPort]:
        out = []
        for dev in self._names():
            pdir = os.path.join(self.base, dev, "ports")
            try:
                ports = sorted(os.listdir(pdir), key=lambda p: (len(p), p))
            except OSError:
                continue
            for port in ports:
                path = os.path.join(pdir, port)
                counters = []
                for sub in ("counters", "hw_counters"):
                    try:
                        names = sorted(os.listdir(os.path.join(path, sub)))
                    except OSError:
                        continue
                    counters += [(n, os.path.join(path, sub, n)) for n in names if n != "lifespan"]
                out.append(_IbPort(dev, port, path, counters,
                                   _read_text(os.path.join(path, "link_layer")) or "InfiniBand"))
        return out

    ports = _Listed.listing

    def sample(self, put) -> None:
        for p in self.ports():
            lab = {"device": p.device, "port": p.port, "link_layer": p.link_layer}
            for fname, metric in (("state", "ib_port_state"), ("phys_state", "ib_port_phys_state"),
                                  ("rate", "ib_port_rate_gbps")):
                text = _read_text(os.path.join(p.path, fname))
                if text is None:
                    continue
                try:
                    put(metric, _leading_number(text), lab)
                except ValueError as exc:
                    self.guard.bad_line("infiniband", os.path.join(p.path, fname), text, exc)
            for name, path in p.counters:
                text = _read_text(path)
                if text is None:
                    continue          # EINVAL and the like: the counter does not apply to this port
                try:
                    v = int(text)
                except ValueError as exc:
                    self.guard.bad_line("infiniband", path, text, exc)
                    continue
                put("ib_port_errors_total", v, {"device": p.device, "port": p.port, "counter": name})


class EthLinks(_Listed):
    """net_carrier_changes_total and net_link_speed_mbps from /sys/class/net (physical devices only)."""

    def __init__(self, sys_root: str = "/sys", guard: SourceGuard | None = None, relist_s: float = SYSFS_RELIST_S,
                 skip: str = r"^lo$", expected_mbps: Mapping[str, int] | None = None) -> None:
        super().__init__(os.path.join(sys_root, "class/net"), guard, relist_s)
        self._skip = re.compile(skip) if skip else None
        # [hardware] ethernet_speed_mbps: the speed each link should run at (a device name or fnmatch
        # pattern -> Mb/s), the operator's manifest; sent as net_link_speed_max_mbps. The NIC's own maximum
        # needs the ETHTOOL_GLINKSETTINGS ioctl and the kernel's link-mode table, which the agent does not read.
        self._expected = dict(expected_mbps or {})

    def expected_for(self, device: str) -> int | None:
        """The manifest's speed for a device: its exact name first, then the first matching pattern."""
        if device in self._expected:
            return self._expected[device]
        return next((v for pat, v in self._expected.items() if fnmatch.fnmatchcase(device, pat)), None)

    def _list(self) -> list[tuple[str, str]]:
        out = []
        for name in self._names():
            if self._skip and self._skip.search(name):
                continue
            path = os.path.join(self.base, name)
            if not is_virtual(Path(path)):
                out.append((name, path))
        return out

    devices = _Listed.listing

    def sample(self, put) -> None:
        for name, path in self.devices():
            lab = {"device": name}
            text = _read_text(os.path.join(path, "carrier_changes"))
            if text is not None:
                try:
                    put("net_carrier_changes_total", int(text), lab)
                except ValueError as exc:
                    self.guard.bad_line("ethernet", os.path.join(path, "carrier_changes"), text, exc)
            text = _read_text(os.path.join(path, "speed"))     # EINVAL while the link is down: no value
            if text is not None:
                try:
                    speed = int(text)
                except ValueError as exc:
                    self.guard.bad_line("ethernet", os.path.join(path, "speed"), text, exc)
                    continue
                if speed > 0:                                  # -1 (SPEED_UNKNOWN): no value
                    put("net_link_speed_mbps", speed, lab)
                    expected = self.expected_for(name)
                    if expected is not None:
                        put("net_link_speed_max_mbps", expected, lab)


# ---------------------------------------------------------------- the sampler

class HwHostSampler:
    """Sampler (agent/samplers/sampling.py) for the host's hardware signals; each source fails alone.

    ``nvml_seen(xid, bus_id, ts_ns)`` says whether NVML already reported that XID (then the kernel-log copy
    is not emitted); ``gpu_for_bus(bus_id)`` gives the NVML index for a bus id (None: unknown, gpu -1).
    A kernel-log XID younger than ``holdback_s`` waits (up to that long) so NVML's copy, read by the GPU
    sampler in the same or the next tick, is seen first. Sysfs is read every ``sysfs_every_s``."""

    name = "hw_host"

    def __init__(self, sys_root: str = "/sys", proc_root: str = "/proc", kmsg_path: str | None = KMSG_PATH,
                 state_dir: str | os.PathLike | None = None, kmsg: bool = True, infiniband: bool = True,
                 ethernet: bool = True, sysfs_every_s: float = 10.0, holdback_s: float = 5.0,
                 nvml_seen: Callable[[int, str, int], bool] | None = None,
                 gpu_for_bus: Callable[[str], int | None] | None = None,
                 kmsg_read: Callable[[int, int], bytes] = os.read,
                 ethernet_speed_mbps: Mapping[str, int] | None = None) -> None:
        self.guard = SourceGuard("hw_host")
        self.kmsg = KmsgReader(kmsg_path, state_dir, proc_root, self.guard, kmsg_read) \
            if kmsg and kmsg_path else None
        self.ib = IbPorts(sys_root, self.guard) if infiniband else None
        self.eth = EthLinks(sys_root, self.guard, expected_mbps=ethernet_speed_mbps) if ethernet else None
        self.sysfs_every_ns = int(sysfs_every_s * 1e9)
        self.holdback_ns = int(holdback_s * 1e9)
        self.nvml_seen = nvml_seen or (lambda _x, _b, _t: False)
        self.gpu_for_bus = gpu_for_bus or (lambda _b: None)
        self._last_sysfs_ns: int | None = None
        self._pending: list[tuple[int, int, str, float, dict[str, str]]] = []   # (ts, seq, kind, value, attrs)
        self._sxid_run: tuple[tuple[str, str], int, int, float, dict[str, str]] | None = None
        self._driver_err_at: dict[str, int] = {}
        self._saved_seq: int | None = None
        self.deduplicated = 0
        self.emitted: dict[str, int] = {}

    @property
    def unavailable(self) -> list[str]:
        out = self.guard.notes()
        if self.kmsg is not None and self.kmsg.unavailable:
            out.append(self.kmsg.unavailable)
        if self.kmsg is not None and self.kmsg.state_problem:
            out.append(self.kmsg.state_problem)
        if self.kmsg is not None and self.kmsg.lost_records:
            out.append(f"kernel log: {self.kmsg.lost_records} record(s) were overwritten before the agent read them")
        return out

    def sample(self, ts_ns: int, sink) -> None:
        if self.kmsg is not None:
            self.guard.run("kmsg", self._kmsg, ts_ns, sink)
        if self._last_sysfs_ns is None or ts_ns - self._last_sysfs_ns >= self.sysfs_every_ns:
            self._last_sysfs_ns = ts_ns

            def put(metric: str, v: float, labels: Mapping[str, str]) -> None:
                sink.add(metric, v, labels=labels, ts_ns=ts_ns)

            if self.ib is not None:
                self.guard.run("infiniband", self.ib.sample, put)
            if self.eth is not None:
                self.guard.run("ethernet", self.eth.sample, put)

    # ---------------------------------------------------------------- kmsg
    def _kmsg(self, now: int, sink) -> None:
        k = self.kmsg
        for rec in k.poll():
            c = classify(rec.message)
            if c is None:
                continue              # other kernel records between an SXID's records do not end its run
            kind, value, attrs = c
            ts = k.wall_ns(rec)
            if kind == "sxid":
                key = (attrs["device"], attrs["sxid"])
                desc = not attrs["message"].startswith(("Data {", "Severity "))
                run = self._sxid_run
                if run is not None and run[0] == key and 0 <= ts - run[1] <= 10**9:
                    if desc and run[4]["message"].startswith(("Data {", "Severity ")):
                        run[4]["message"] = attrs["message"]     # the record that says what it is
                    continue
                self._end_sxid_run(sink)
                self._sxid_run = (key, ts, rec.seq, value, attrs)
                continue
            if kind == "nvidia_driver_error":
                bus = attrs["pci_bus_id"]
                prev = self._driver_err_at.get(bus)
                if prev is not None and 0 <= ts - prev < DRIVER_ERROR_REPEAT_NS:
                    continue
                self._driver_err_at[bus] = ts
            self._pending.append((ts, rec.seq, kind, value, attrs))
        self._end_sxid_run(sink)
        self._release(now, sink)

    def _end_sxid_run(self, sink) -> None:
        run, self._sxid_run = self._sxid_run, None
        if run is not None:
            _key, ts, seq, value, attrs = run
            low = attrs["message"].lower()
            attrs["severity"] = "non-fatal" if "non-fatal" in low else ("fatal" if "fatal" in low else "")
            self._pending.append((ts, seq, "sxid", value, attrs))

    def _release(self, now: int, sink) -> None:
        keep = []
        self._pending.sort(key=lambda item: item[1])       # kernel order (an SXID run joins at its end)
        for item in self._pending:
            ts, _seq, kind, value, attrs = item
            if kind == "xid" and now - ts < self.holdback_ns:
                keep.append(item)
                continue
            self._emit(sink, ts, kind, value, attrs)
        self._pending = keep
        self._save()

    def _save(self) -> None:
        """Remember the last seq whose records are all emitted (pending ones are read again after a restart)."""
        k = self.kmsg
        if k.last_seq < 0:
            return
        seq = min(s for _t, s, *_ in self._pending) - 1 if self._pending else k.last_seq
        if seq != self._saved_seq:
            k.save_state(seq)
            self._saved_seq = seq

    def _emit(self, sink, ts: int, kind: str, value: float, attrs: dict[str, str]) -> None:
        bus = attrs.get("pci_bus_id", "")
        gpu = self.gpu_for_bus(bus) if bus else None
        gpu = -1 if gpu is None else int(gpu)
        if kind == "xid":
            xid = int(value)
            if self.nvml_seen(xid, bus, ts):
                self.deduplicated += 1
                return
            what = attrs.get("description", "")
            msg = f"XID {xid} on GPU {gpu if gpu >= 0 else bus} (kernel log): {what}"
        elif kind == "sxid":
            msg = f"SXID {int(value)} on {attrs['device']} (kernel log): {attrs['message']}"
        else:
            msg = f"NVIDIA driver error on {bus or 'a GPU'} (kernel log): {attrs['message']}"
        self.emitted[kind] = self.emitted.get(kind, 0) + 1
        sink.event(kind, msg[:500], gpu=gpu, value=value, attrs=attrs, ts_ns=ts)

    def close(self) -> None:
        if self.kmsg is not None:
            self._save()
            self.kmsg.close()
