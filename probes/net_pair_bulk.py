"""net_pair's bulk transfer: one process per data stream (probes/net_pair_stream.py says why), with the
receiving end counting delivered bytes in a shared file so the measuring thread reads them without a
syscall per stream."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import socket
import struct
import tempfile
import time

from gpuagent.probes.net_pair_wire import PairError, kernel_timeouts

FIRST_BYTE_TIMEOUT_S = 10.0   # from "go" to the first byte of a measured direction (stream processes start)
STREAM_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "net_pair_stream.py")


class BulkStreams:
    """Parallel bulk transfer over already-connected sockets, one process per stream
    (probes/net_pair_stream.py says why): senders send full chunks until told to stop, receivers read
    until end-of-file and write their byte count into a small shared file after every read, which the
    measuring thread here reads. The sockets go to the processes in blocking mode with the I/O timeout set
    in the kernel (SO_SNDTIMEO / SO_RCVTIMEO): a Python socket timeout is a poll() before every send and
    recv (on the unshaped testbed, removing it alone took the send ratio to iperf3 from 0.68 to 0.83)."""

    def __init__(self, socks: list[socket.socket], chunk: int, sending: bool) -> None:
        self.socks = socks
        self.sending = sending
        self.measured = False     # receivers: end-of-file before the window closed means the peer went away
        self.procs: list[subprocess.Popen] = []
        self._stderr: dict[int, str] = {}
        self._shared_fd, self.shared, self._go_w, go_r = -1, None, -1, -1
        role = "send" if sending else "recv"
        try:      # anything that fails here leaves nothing behind: _release takes a half-built object
            self._shared_fd = shared_fd(8 * (len(socks) + 1))
            self.shared = mmap.mmap(self._shared_fd, 0)
            go_r, self._go_w = os.pipe()
            for i, sock in enumerate(socks):
                kernel_timeouts(sock)
                argv = [sys.executable, "-I", "-S", STREAM_WORKER, role, str(sock.fileno()), str(self._shared_fd),
                        str(i + 1), str(chunk), str(go_r)]
                self.procs.append(subprocess.Popen(argv, pass_fds=(sock.fileno(), self._shared_fd, go_r),
                                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.PIPE))
            for sock in socks:     # each stream process owns its socket now: one that dies closes it at once
                sock.close()
        except OSError as exc:
            self._release()
            raise PairError(f"cannot start a data stream process: {exc.strerror or exc}") from None
        finally:
            if go_r >= 0:
                os.close(go_r)

    def start(self) -> None:
        """Senders begin (receivers read from the moment they exist)."""
        self.shared[0] = 1
        self._close_go()

    def _close_go(self) -> None:
        if self._go_w >= 0:
            os.close(self._go_w)
            self._go_w = -1

    def total_bytes(self) -> int:
        return sum(struct.unpack_from(f"={len(self.socks)}q", self.shared, 8))

    @property
    def errors(self) -> list[str]:
        """One sentence per stream process that has ended badly so far."""
        out = []
        for p in self.procs:
            rc = p.poll()
            if rc is None or (rc == 0 and (self.sending or self.measured)):
                continue
            if rc == 0:
                out.append("the peer closed a data stream before the end")
            else:
                if p.pid not in self._stderr:
                    self._stderr[p.pid] = p.stderr.read().decode(errors="replace").strip() if p.stderr else ""
                out.append(self._stderr[p.pid] or f"a data stream process exited with status {rc}")
        return out

    def measure(self, t_go: float, warmup_s: float, duration_s: float,
                first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S) -> tuple[float, int]:
        """(Gbit/s, bytes) received over ``duration_s``, from ``warmup_s`` after the first byte arrived.

        The warmup counts from the first byte, not from "go": each stream is a process of its own, and on a
        loaded machine the peer's can take longer to start than the warmup (a 0.3 s window on 2 busy cores
        once saw 0 bytes while the other direction carried 1 Gbit/s). No byte within
        ``first_byte_timeout_s`` of "go" is an error, not a rate of 0."""
        while self.total_bytes() == 0:
            if self.errors:
                raise PairError(f"a receiving stream broke: {self.errors[0]}")
            if time.monotonic() - t_go > first_byte_timeout_s:
                raise PairError(f"no data arrived within {first_byte_timeout_s:g} s of the start")
            time.sleep(0.002)
        sleep_until(time.monotonic() + warmup_s)
        b0, t0 = self.total_bytes(), time.monotonic()
        sleep_until(t0 + duration_s, watch=self)
        b1, t1 = self.total_bytes(), time.monotonic()
        errors = self.errors      # before ``measured``: a stream that ended inside the window is an error
        self.measured = True
        if errors:
            raise PairError(f"a receiving stream broke: {errors[0]}")
        return (b1 - b0) * 8 / (t1 - t0) / 1e9, b1 - b0

    def finish(self, timeout_s: float) -> None:
        """Stop the senders, wait for every stream process (killing what outlives the timeout), close all."""
        self.shared[1] = 1
        self._close_go()
        deadline = time.monotonic() + timeout_s
        stuck = False
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                stuck = True
                p.kill()
                p.wait()
        errors = [] if stuck else self.errors
        self._release()
        if stuck:
            raise PairError("a data stream did not finish within the I/O timeout")
        if errors and self.sending:
            raise PairError(f"a sending stream broke: {errors[0]}")

    def abort(self) -> None:
        """On an error: kill the stream processes and close everything now, so the peer's end breaks at
        once instead of the caller waiting out the I/O timeout. Never raises."""
        try:
            self._release()
        except Exception:  # noqa: BLE001 - already on an error path; the first error is the one reported
            pass

    def _release(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stderr:
                p.stderr.close()
        for s in self.socks:
            s.close()
        self._close_go()
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self._shared_fd >= 0:
            os.close(self._shared_fd)
            self._shared_fd = -1


def shared_fd(size: int) -> int:
    """A zeroed file of ``size`` bytes that the stream processes map (in memory where Linux allows)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("gpuagent-net_pair")
    else:
        fd, path = tempfile.mkstemp(prefix="gpuagent-net_pair-")
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


def sleep_until(t: float, watch: BulkStreams | None = None) -> None:
    while True:
        left = t - time.monotonic()
        if left <= 0 or (watch is not None and watch.errors):
            return
        time.sleep(min(left, 0.05))

