"""TCP connections' byte counters and RTT from the kernel's sock_diag netlink interface (what `ss -ti` reads).

Why: Linux keeps no per-process network byte counters, but it keeps them per TCP socket (``tcp_info``:
bytes acked, bytes received, smoothed RTT, time busy sending), and a socket's inode names the process holding
it in /proc/<pid>/fd. That is enough to say which command outside a job moves the bytes on the node's links,
and whether the job's own connections slowed while it did (their RTT rose, or they sent fewer bytes per
second of having data to send), without eBPF.

Only established IPv4 and IPv6 connections, only the agent's own network namespace (the host's, for the
systemd service). A connection on a loopback address (127/8, ::1), or whose other end is in the same dump
(the reversed address pair, an IPv4-mapped IPv6 address taken as its IPv4 address, so a dual-stack server's
accepted socket pairs with its IPv4 client), never leaves the node: it is marked ``local``, since it loads the
CPU, not a link. A peer in another network namespace of the same node (a container on a bridge) is off the
node for this test. No privileges are needed for the dump; /proc/<pid>/fd needs root or the same user.

Layouts: ``struct inet_diag_req_v2``, ``struct inet_diag_msg`` (linux/inet_diag.h) and ``struct tcp_info``
(linux/tcp.h: ``tcpi_rtt`` at byte 68, ``tcpi_bytes_acked`` at 120, ``tcpi_bytes_received`` at 128, since
Linux 4.1/4.2, shorter records carry no byte counts and are skipped; ``tcpi_busy_time`` at 168 and
``tcpi_rwnd_limited`` at 176, since 4.10: the kernel's busy time is the sum of its busy, receive-window-limited
and send-buffer-limited timers (tcp_get_info_chrono_stats), so ``busy_us`` is busy_time - rwnd_limited, the
time the connection had data to send and was held up by the network or its own send buffer, not by a slow
receiver; -1 where the record is shorter)."""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_INFO = 2
TCP_ESTABLISHED = 1
_NLMSG = struct.Struct("=IHHII")           # len, type, flags, seq, pid
_MSG_LEN = 72                              # struct inet_diag_msg
_TCPI_RTT, _TCPI_ACKED, _TCPI_RECEIVED, _TCPI_BUSY, _TCPI_RWND_LIMITED = 68, 120, 128, 168, 176
_V4_MAPPED = b"\x00" * 10 + b"\xff\xff"
RECV_TIMEOUT_S = 1.0     # a dump that stalls this long is given up (the tick must not hang on it)


@dataclass(frozen=True)
class TcpConn:
    cookie: int          # the kernel's id of the socket, unique while the machine runs
    inode: int           # the socket inode, as /proc/<pid>/fd shows it: socket:[inode]
    bytes_total: int     # bytes acked (sent) + bytes received, since the connection opened
    srtt_us: int         # smoothed round-trip time, microseconds
    local: bool          # the other end is in this network namespace too: the bytes never leave the node
    bytes_acked: int = 0  # bytes sent and acked, since the connection opened
    busy_us: int = -1    # us with data to send, held up by the network (not the receiver), since it opened; -1: unknown


class TcpSocketsUnavailable(Exception):
    """sock_diag cannot be asked here (no netlink, a kernel without inet_diag, a seccomp filter)."""


def _request(family: int, seq: int) -> bytes:
    req = struct.pack("=BBBBI48x", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1), 0, 1 << TCP_ESTABLISHED)
    return _NLMSG.pack(_NLMSG.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + req


def _parse(family: int, payload: bytes, out: list[tuple]) -> None:
    """One inet_diag_msg and its attributes -> (cookie, inode, total, srtt, src, sport, dst, dport, acked, busy)."""
    if len(payload) < _MSG_LEN:
        return
    sport, dport = struct.unpack_from("!HH", payload, 4)
    alen = 4 if family == socket.AF_INET else 16
    src, dst = _address(payload[8:8 + alen]), _address(payload[24:24 + alen])
    cookie = struct.unpack_from("=Q", payload, 44)[0]
    inode = struct.unpack_from("=I", payload, 68)[0]
    off = _MSG_LEN
    while off + 4 <= len(payload):
        rta_len, rta_type = struct.unpack_from("=HH", payload, off)
        if rta_len < 4 or off + rta_len > len(payload):
            break
        if rta_type == INET_DIAG_INFO and rta_len - 4 >= _TCPI_RECEIVED + 8:
            info = off + 4
            rtt = struct.unpack_from("=I", payload, info + _TCPI_RTT)[0]
            acked, received = struct.unpack_from("=QQ", payload, info + _TCPI_ACKED)
            busy = -1
            if rta_len - 4 >= _TCPI_RWND_LIMITED + 8:
                total, rwnd = struct.unpack_from("=QQ", payload, info + _TCPI_BUSY)
                busy = max(0, total - rwnd)
            out.append((cookie, inode, acked + received, rtt, src, sport, dst, dport, acked, busy))
            return
        off += (rta_len + 3) & ~3


def _address(raw: bytes) -> bytes:
    """An address as compared between the two ends: an IPv4-mapped IPv6 address as its 4 IPv4 bytes."""
    return raw[12:] if len(raw) == 16 and raw[:12] == _V4_MAPPED else raw


def _loopback(addr: bytes) -> bool:
    return (len(addr) == 4 and addr[0] == 127) or addr == b"\x00" * 15 + b"\x01"


def _dump(family: int) -> list[tuple]:
    try:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    except (OSError, AttributeError) as e:
        raise TcpSocketsUnavailable(f"sock_diag netlink socket: {e}") from None
    out: list[tuple] = []
    try:
        s.settimeout(RECV_TIMEOUT_S)
        s.sendto(_request(family, 1), (0, 0))
        while True:
            data = s.recv(1 << 16)
            if not data:
                return out
            off = 0
            while off + _NLMSG.size <= len(data):
                length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, off)
                if length < _NLMSG.size:
                    return out
                if kind == NLMSG_DONE:
                    return out
                if kind == NLMSG_ERROR:
                    err = -struct.unpack_from("=i", data, off + _NLMSG.size)[0]
                    if err:
                        raise TcpSocketsUnavailable(f"sock_diag: {os.strerror(err)}")
                    return out
                if kind == SOCK_DIAG_BY_FAMILY:
                    _parse(family, data[off + _NLMSG.size:off + length], out)
                off += (length + 3) & ~3
    except (OSError, struct.error) as e:     # socket.timeout is an OSError
        raise TcpSocketsUnavailable(f"sock_diag: {e or type(e).__name__}") from None
    finally:
        s.close()


def tcp_connections() -> list[TcpConn]:
    """Every established TCP connection of this network namespace (IPv4 and IPv6)."""
    rows: list[tuple] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            rows += _dump(family)
        except TcpSocketsUnavailable:
            if family == socket.AF_INET:
                raise
            # a kernel without IPv6 answers the second dump with an error: IPv4 alone then
    ends = {(r[4], r[5], r[6], r[7]) for r in rows}
    return [TcpConn(cookie=r[0], inode=r[1], bytes_total=r[2], srtt_us=r[3],
                    local=_loopback(r[4]) or _loopback(r[6]) or (r[6], r[7], r[4], r[5]) in ends,
                    bytes_acked=r[8], busy_us=r[9]) for r in rows]


def socket_inodes(proc_root: str, pid: int) -> set[int]:
    """The socket inodes a process holds (its /proc/<pid>/fd links ``socket:[N]``); empty when unreadable."""
    return socket_inodes_until(proc_root, pid, float("inf"))[0]


def socket_inodes_until(proc_root: str, pid: int, deadline: float) -> tuple[set[int], bool]:
    """socket_inodes, given up at ``deadline`` (time.monotonic()): (the inodes read, whether every fd was)."""
    out: set[int] = set()
    fd_dir = f"{proc_root}/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return out, True
    for k, name in enumerate(names):
        if k % 256 == 255 and time.monotonic() > deadline:    # a process with very many files
            return out, False
        try:
            target = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            try:
                out.add(int(target[8:-1]))
            except ValueError:
                pass
    return out, True
