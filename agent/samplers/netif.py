"""The line rate of the NIC that fabric traffic uses, from Linux sysfs (``/sys/class/net/<iface>``).

The collector compares a link with a cited Ethernet ceiling for its line rate when its pool is too small for
a fleet median (collector/analysis/baselines.toml), so the rate reported must be a real Ethernet line rate
or nothing:
- ``speed`` is in Mbit/s; the kernel gives -1, or refuses the read (EINVAL), when the link is down or the
  driver does not know (virtio-net, lo, ifb);
- a virtual device (under ``/sys/devices/virtual``) has no line rate of its own: veth reports a fixed
  10000 whatever it carries. A virtual device with exactly one lower device (a VLAN, a macvlan, a bond of
  one port) takes that device's rate; others (veth, bridges, bonds of several ports) are unknown;
- only Ethernet devices (``type`` 1, ARPHRD_ETHER) count: IPoIB reports its InfiniBand rate, whose framing
  the Ethernet ceilings do not describe.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

SYS_CLASS_NET = "/sys/class/net"
ARPHRD_ETHER = 1
_MAX_DEPTH = 4      # VLAN on a bond on a NIC is 2 levels; deeper is a loop or a mistake


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _is_virtual(dev: Path) -> bool:
    parts = Path(os.path.realpath(dev)).parts
    return any(a == "devices" and b == "virtual" for a, b in zip(parts, parts[1:]))


def link_speed_mbits(iface: str, root: str | os.PathLike = SYS_CLASS_NET, _depth: int = 0) -> int | None:
    """The Ethernet line rate of ``iface`` in Mbit/s, or None when unknown (see the module docstring)."""
    if not iface or "/" in iface or iface in (".", "..") or _depth > _MAX_DEPTH:
        return None
    dev = Path(root) / iface
    if _read_int(dev / "type") != ARPHRD_ETHER:
        return None
    if _is_virtual(dev):
        try:
            lower = [p.name[len("lower_"):] for p in dev.iterdir() if p.name.startswith("lower_")]
        except OSError:
            return None
        return link_speed_mbits(lower[0], root, _depth + 1) if len(lower) == 1 else None
    speed = _read_int(dev / "speed")
    return speed if speed is not None and speed > 0 else None


def interface_for_address(address: str, addrs: dict | None = None) -> str:
    """The local interface holding ``address`` (an IP literal), or "" when none does or it is a name.

    ``addrs`` is psutil.net_if_addrs()'s shape: {iface: [snic(family, address, ...), ...]}."""
    try:
        want = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return ""
    if addrs is None:
        import psutil

        addrs = psutil.net_if_addrs()
    for iface, entries in addrs.items():
        for a in entries:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(a.address.split("%", 1)[0]) == want:
                    return iface
            except ValueError:
                continue
    return ""
