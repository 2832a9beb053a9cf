"""The sysfs readers of the hardware-health sampler (agent/samplers/hw_host.py): InfiniBand / RoCE ports
and Ethernet links.

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

import fnmatch
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from gpuagent.agent.samplers.host import SourceGuard, decode
from gpuagent.agent.samplers.netif import _is_virtual as is_virtual

SYSFS_RELIST_S = 60.0

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
