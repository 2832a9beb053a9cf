"""Network faults between a real agent and a real collector on the namespace testbed
(scripts/netns_fleet.py): the agent runs in one node's namespace, the collector in another's, and the
faults are real (link down, tc shaping, a TCP proxy that resets connections, a blackhole qdisc).

The test process reaches the collector's Query RPC through a forwarder whose upstream socket lives in
the collector's namespace (a socket keeps the namespace it was created in), so accounting never crosses
a faulted link. The same forwarder class is the resetting proxy between agent and collector.
"""

from __future__ import annotations

import ctypes
import os
import selectors
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

from fault_helpers import ROOT, Collector, free_port

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def socket_in_netns(ns: str | None) -> socket.socket:
    """A TCP socket created in network namespace ``ns`` (None: this process's own). setns changes only
    the calling thread, so a short-lived thread makes the socket and the rest of the process stays put."""
    if ns is None:
        return socket.socket()
    out: dict = {}

    def make():
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if _libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
            finally:
                os.close(fd)
            out["sock"] = socket.socket()
        except OSError as exc:
            out["err"] = exc
    t = threading.Thread(target=make)
    t.start()
    t.join()
    if "err" in out:
        raise out["err"]
    return out["sock"]


class TcpProxy:
    """A TCP forwarder from ``listen`` (in namespace ``listen_ns``) to ``upstream`` (in ``upstream_ns``),
    one selector thread for all connections. ``reset_all()`` closes every connection with SO_LINGER 0,
    so both ends get a RST wherever their stream stands."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], listen_ns: str | None = None,
                 upstream_ns: str | None = None):
        self.upstream, self.upstream_ns = upstream, upstream_ns
        self.lsock = socket_in_netns(listen_ns)
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(listen)
        self.lsock.listen(64)
        self.address = "%s:%d" % self.lsock.getsockname()
        self.sel = selectors.DefaultSelector()
        self.peer: dict[socket.socket, socket.socket] = {}
        self.accepted = 0
        self.resets = 0               # connections reset (each has two sockets)
        self.bytes_since_reset = 0
        self.reset_with_data = 0      # resets of connections that had carried bytes since the last reset
        self._cmd: list = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self.sel.register(self.lsock, selectors.EVENT_READ, "accept")
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.thread = threading.Thread(target=self._loop, name="tcp-proxy", daemon=True)
        self.thread.start()

    def _call(self, fn):
        """Run ``fn`` on the proxy thread and return its result."""
        done = threading.Event()
        box: dict = {}

        def job():
            box["r"] = fn()
            done.set()
        with self._lock:
            self._cmd.append(job)
        self._wake_w.send(b"x")
        if not done.wait(30):
            raise AssertionError("the proxy thread did not answer within 30 s")
        return box.get("r")

    def reset_all(self) -> int:
        """RST every open connection now; returns how many."""
        def do():
            n, socks = 0, list(self.peer)
            had_data = self.bytes_since_reset > 0
            for s in socks:
                if s in self.peer:
                    n += 1
                    self._drop_pair(s, rst=True)
            self.resets += n
            self.reset_with_data += n if had_data else 0
            self.bytes_since_reset = 0
            return n
        return self._call(do)

    def open_connections(self) -> int:
        return self._call(lambda: len(self.peer) // 2)

    def close(self) -> None:
        self._stop = True
        self._wake_w.send(b"x")
        self.thread.join(10)
        for s in list(self.peer):
            s.close()
        self.lsock.close()
        self._wake_r.close()
        self._wake_w.close()

    def _drop_pair(self, s: socket.socket, rst: bool) -> None:
        other = self.peer.pop(s, None)
        pair = [s] + ([other] if other is not None else [])
        if other is not None:
            self.peer.pop(other, None)
        for x in pair:
            try:
                self.sel.unregister(x)
            except (KeyError, ValueError):
                pass
            if rst:
                x.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            x.close()

    def _accept(self) -> None:
        client, _ = self.lsock.accept()
        up = socket_in_netns(self.upstream_ns)
        up.settimeout(5)
        try:
            up.connect(self.upstream)
        except OSError:
            up.close()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()
            return
        up.settimeout(None)
        self.accepted += 1
        for a, b in ((client, up), (up, client)):
            a.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.peer[a] = b
            self.sel.register(a, selectors.EVENT_READ, "data")

    def _loop(self) -> None:
        while not self._stop:
            for key, _ in self.sel.select(timeout=0.5):
                s = key.fileobj
                if key.data == "wake":
                    s.recv(4096)
                    with self._lock:
                        jobs, self._cmd = self._cmd, []
                    for job in jobs:
                        job()
                elif key.data == "accept":
                    self._accept()
                elif s in self.peer:
                    try:
                        data = s.recv(65536)
                        if data:
                            self.peer[s].sendall(data)
                            self.bytes_since_reset += len(data)
                            continue
                    except OSError:
                        pass
                    self._drop_pair(s, rst=False)


class NetnsCollector(Collector):
    """The collector as a process in fleet node ``node`` (plaintext beyond loopback, with a token), queried
    from the test process through a forwarder into that namespace."""

    def __init__(self, workdir: Path, fleet, node: str, token: str):
        super().__init__(workdir)
        self.fleet, self.node_name, self.token = fleet, node, token
        self.ns = fleet.node(node).ns
        self.address = f"{fleet.node(node).ip}:{self.port}"
        self.forwarder = TcpProxy(("127.0.0.1", 0), (fleet.node(node).ip, self.port), upstream_ns=self.ns)
        self.query_address = self.forwarder.address
        self.env["GPUAGENT_COLLECTOR_TOKEN"] = token

    def spawn(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "gpuagent.collector.cli", "serve", "--db", str(self.db),
               "--listen", self.address, "--no-analyze", "--insecure"]
        with open(self.log, "ab") as log:
            self.proc = self.fleet.popen(self.node_name, cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=ROOT, start_new_session=True)
        self.starts += 1
        return self.proc

    def close(self) -> None:
        self.stop()
        self.forwarder.close()


def tc_stats(ns: str | None, dev: str) -> str:
    argv = ["tc", "-s"] + (["-n", ns] if ns else []) + ["qdisc", "show", "dev", dev]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout


def tc(*args: str) -> None:
    r = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"tc {' '.join(args)}: {r.stderr.strip()}"


def ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"ip {' '.join(args)}: {r.stderr.strip()}"

