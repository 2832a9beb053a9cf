"""net_pair's wire: the hello that carries the pair's secret, length-prefixed JSON control messages,
and the socket settings both ends use. Shared by the listening and connecting ends (probes/net_pair.py)
and the bulk streams (probes/net_pair_bulk.py); nothing here measures."""

from __future__ import annotations

import errno
import json
import random
import socket
import struct
from typing import Any

MAGIC = b"GPAPAIR1"
KIND_CONTROL, KIND_SEND, KIND_RECV = b"C", b"S", b"R"   # SEND/RECV: from the connecting end's view
ACCEPTED, REFUSED = b"\x01", b"\x00"
MAX_SECRET = 256
MAX_CONTROL_MSG = 64 * 1024


class PairError(Exception):
    """A broken run; the message is the result's one-sentence reason."""


class NoAnswer(Exception):
    """Nobody accepted a connection before the deadline."""


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PairError("the peer closed the connection")
        got += k


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(4)
    recv_exact(sock, memoryview(head))
    (n,) = struct.unpack(">I", head)
    if n > MAX_CONTROL_MSG:
        raise PairError(f"the peer sent a control message of {n} bytes, more than {MAX_CONTROL_MSG}")
    body = bytearray(n)
    recv_exact(sock, memoryview(body))
    try:
        msg = json.loads(body)
    except ValueError:
        raise PairError("the peer sent a control message that is not JSON") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise PairError("the peer sent a control message without an op")
    return msg


def expect(sock: socket.socket, op: str) -> dict[str, Any]:
    msg = recv_msg(sock)
    if msg["op"] == "error":
        raise PairError(f"the peer reported: {msg.get('reason', 'no reason given')}")
    if msg["op"] != op:
        raise PairError(f"expected {op!r} from the peer, got {msg['op']!r}")
    return msg


def hello(kind: bytes, secret: bytes) -> bytes:
    return MAGIC + kind + struct.pack(">H", len(secret)) + secret


def read_hello(conn: socket.socket) -> tuple[bytes, bytes] | None:
    """(kind, secret) from a new connection, or None when it does not speak this protocol."""
    head = bytearray(len(MAGIC) + 3)
    try:
        recv_exact(conn, memoryview(head))
        if bytes(head[:len(MAGIC)]) != MAGIC:
            return None
        (n,) = struct.unpack(">H", head[len(MAGIC) + 1:])
        if n == 0 or n > MAX_SECRET:
            return None
        secret = bytearray(n)
        recv_exact(conn, memoryview(secret))
    except (OSError, PairError):
        return None
    return bytes(head[len(MAGIC):len(MAGIC) + 1]), bytes(secret)


def reason(exc: BaseException) -> str:
    if isinstance(exc, PairError):
        return str(exc)
    if isinstance(exc, socket.timeout):
        return "the peer did not answer within the I/O timeout"
    if isinstance(exc, OSError):
        return f"network error: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


def set_nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def kernel_timeouts(sock: socket.socket) -> None:
    """Blocking mode, with the socket's Python timeout moved into the kernel (see BulkStreams)."""
    timeout = sock.gettimeout()
    sock.settimeout(None)
    if timeout:
        tv = struct.pack("ll", int(timeout), int((timeout % 1) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def listen_in_range(bind: str, port_range: tuple[int, int]) -> tuple[socket.socket | None, str]:
    """A listening socket on ``bind`` at a port picked at random in ``port_range`` ((0, 0): any free port),
    or (None, the sentence saying why not)."""
    lo, hi = port_range
    if not (0 <= lo <= hi <= 65535) or (lo == 0) != (hi == 0):
        return None, f"port range {lo}-{hi} is not a range of ports (use 0-0 for any free port)"
    ports = [0] if lo == 0 else random.sample(range(lo, hi + 1), hi - lo + 1)
    last: OSError | None = None
    for port in ports:
        sock = None
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind, port))
            sock.listen(64)
        except OSError as exc:
            if sock is not None:
                sock.close()
            if exc.errno != errno.EADDRINUSE:
                return None, f"cannot listen on {bind}:{port}: {exc.strerror or exc}"
            last = exc
            continue
        return sock, ""
    return None, f"no free port in {lo}-{hi} on {bind} ({last.strerror if last else 'none tried'})"

