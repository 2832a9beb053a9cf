"""HOST:PORT addresses: split one (an IPv6 host in brackets) and tell a loopback host from the rest.

Its own module because two parts of the collector judge a listen address alike, the gRPC listen policy
(collector/ingest/listen.py) and the /metrics endpoint (collector/views/metrics.py), and views must not
import ingest. Standard library only.
"""

from __future__ import annotations

import ipaddress
import re


class AddressError(ValueError):
    """The text is not HOST:PORT; the message is one sentence naming the option it came from."""


def split_host_port(address: str, option: str = "--listen") -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port); AddressError (naming ``option``) for anything else."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", address.strip())
    if not m:
        raise AddressError(f"{option} {address!r} is not HOST:PORT (for example 127.0.0.1:50051)")
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    if port > 65535:
        raise AddressError(f"{option} {address!r} has port {port}, above 65535")
    return host, port


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1); False for names and the rest."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
