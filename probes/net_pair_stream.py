"""One net_pair data stream in a process of its own; started by ``net_pair_bulk.BulkStreams``, not by people.

Why it is built this way: on a link faster than one core can copy (a veth here, 100 GbE and up on real
nodes) the probe's own CPU per byte sets the rate, and it must cost what iperf3's does, or net_pair
under-reads the link. Three things closed that gap on the 2-core testbed (benchmarks/fabric_accuracy.py,
unshaped veth, 4 streams, ratio to iperf3 with one process per stream):
  - a process per stream, not a thread: threads share the interpreter lock and every return from
    send/recv waits for it;
  - page-aligned buffers (an anonymous mmap), as iperf3 uses: the kernel copies into a bytearray's
    unaligned memory much more slowly;
  - blocking sockets with the I/O timeout in the kernel (SO_SNDTIMEO / SO_RCVTIMEO, set by the parent):
    a Python socket timeout is a poll() before every call.
Before: send 0.68, recv 0.79; after: 0.95, 1.01 (docs/FABRIC.md, "Accuracy"). Receivers take what has
arrived (no MSG_WAITALL), which measured faster and keeps the byte count exact on slow links.

This file imports nothing from gpuagent: it runs as ``python -I -S net_pair_stream.py``, so it starts in
milliseconds, inside the probe's warm-up. Arguments: ``send|recv SOCKET_FD SHARED_FD SLOT CHUNK_BYTES
GO_FD``. The shared file holds native 8-byte integer slots: slot 0 byte 0 is "go" (senders start), byte 1
is "stop" (senders shut down writing and exit); a receiver writes its byte count into slot SLOT after
every read. Senders wait until GO_FD (a pipe) reads end-of-file and then start only if "go" is set.
A receiver exits at end-of-file. On an error the process prints one sentence to stderr and exits 1;
it also stops when its parent is gone.
"""

import mmap
import os
import socket
import sys

CHECK_PARENT_EVERY = 64   # chunks between checks that the parent is still there


def _sentence(exc: BaseException) -> str:
    if isinstance(exc, (socket.timeout, BlockingIOError)):   # BlockingIOError: SO_SNDTIMEO/SO_RCVTIMEO ran out
        return "the peer did not answer within the I/O timeout"
    if isinstance(exc, OSError):
        return f"network error: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


def _page_aligned(size: int) -> memoryview:
    """A buffer that starts on a page (see the module docstring)."""
    return memoryview(mmap.mmap(-1, size))


def _send(sock: socket.socket, shared: mmap.mmap, chunk: int, go_fd: int, parent: int) -> None:
    while os.read(go_fd, 1):    # the parent releases every sender at once by closing the pipe
        pass
    if shared[0] != 1 or shared[1] == 1:
        return
    view = _page_aligned(chunk)
    view[:] = (os.urandom(64) * (chunk // 64 + 1))[:chunk]
    fd, write, left = sock.fileno(), os.write, CHECK_PARENT_EVERY
    while shared[1] != 1:
        k = write(fd, view)
        if k != chunk:           # a short write (a signal, the send timeout): finish the chunk or raise
            sock.sendall(view[k:])
        left -= 1
        if not left:
            if os.getppid() != parent:
                return
            left = CHECK_PARENT_EVERY
    sock.shutdown(socket.SHUT_WR)


def _recv(sock: socket.socket, shared: mmap.mmap, slot: int, chunk: int, parent: int) -> None:
    counts = memoryview(shared).cast("q")
    fd, readv, bufs = sock.fileno(), os.readv, [_page_aligned(chunk)]
    count, left = 0, CHECK_PARENT_EVERY
    while True:
        k = readv(fd, bufs)
        if k == 0:
            return
        count += k
        counts[slot] = count
        left -= 1
        if not left:
            if os.getppid() != parent:
                return
            left = CHECK_PARENT_EVERY


def main(argv: list[str]) -> int:
    role, sock_fd, shared_fd, slot, chunk, go_fd = argv[0], *map(int, argv[1:6])
    parent = os.getppid()
    sock = socket.socket(fileno=sock_fd)
    sock.setblocking(True)
    shared = mmap.mmap(shared_fd, 0)
    try:
        if role == "send":
            _send(sock, shared, chunk, go_fd, parent)
        else:
            _recv(sock, shared, slot, chunk, parent)
    except BaseException as exc:  # noqa: BLE001 - one sentence for the parent
        print(_sentence(exc), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
