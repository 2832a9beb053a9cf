"""A fake /sys/class/net tree in a temporary directory, laid out as Linux lays it out: each NIC a directory
under devices/ (PCI or virtual) with its attribute files, and class/net/<name> a symlink to it."""

from __future__ import annotations

from pathlib import Path

ETHER, INFINIBAND = 1, 32     # ARPHRD_* values in the type file


def add_nic(root: Path, name: str, speed: str | None, *, virtual: bool = False, arp_type: int = ETHER,
            lower: tuple[str, ...] = ()) -> Path:
    """One NIC under ``root`` (speed: the speed file's text, None for no file); returns root/class/net."""
    parent = root / "devices" / ("virtual" if virtual else "pci0000:00/0000:00:03.0") / "net"
    dev = parent / name
    dev.mkdir(parents=True)
    (dev / "type").write_text(f"{arp_type}\n")
    if speed is not None:
        (dev / "speed").write_text(speed + "\n")
    for low in lower:
        (dev / f"lower_{low}").symlink_to(root / "class" / "net" / low)
    net = root / "class" / "net"
    net.mkdir(parents=True, exist_ok=True)
    (net / name).symlink_to(dev)
    return net
