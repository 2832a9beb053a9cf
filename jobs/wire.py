"""The datagram format between the tracker (in the training process) and the agent (jobs socket).

Little-endian, fixed layouts so both sides use one precompiled ``struct.Struct`` each. Two kinds:

HELLO (sent once per connect; tells the agent who is sending)::

    header  <IBBH  magic "GAJ1", kind=1, version=1, 0
    body    <iiiiI  pid, rank, local_rank, world_size, tracker_id
    then three strings, each <H length + UTF-8: job_id, job_name, source
    then, optionally, <dd  flops_per_step, flops_per_token (what the script declared for MFU; 0: not
    declared). A hello without them (a tracker from before MFU) decodes with both 0.

STEPS (one datagram carries 1..MAX_RECORDS step records of one tracker)::

    header  <IBBH  magic, kind=2, count, 0
    body    <iiI   pid, rank, tracker_id
    records <QqqqQQ  step_index, t_end_ns (wall clock), step_ns, data_wait_ns (-1: not measured),
                     samples, tokens

BYE (the tracker closed; the agent reports its last partial window at the next tick)::

    header  <IBBH  magic, kind=3, 0, 0
    body    <iiI   pid, rank, tracker_id

The pid in the message is what the sender says; the agent prefers the kernel's view
(``SO_PASSCRED``), which is right across PID namespaces and cannot be forged.
"""

from __future__ import annotations

import struct

MAGIC = 0x314A4147          # b"GAJ1" read as little-endian u32
KIND_HELLO = 1
KIND_STEPS = 2
KIND_BYE = 3
VERSION = 1
MAX_RECORDS = 64

HEADER = struct.Struct("<IBBH")
HELLO_BODY = struct.Struct("<iiiiI")
STEPS_BODY = struct.Struct("<iiI")
RECORD = struct.Struct("<QqqqQQ")
STEPS_PREFIX = HEADER.size + STEPS_BODY.size
MAX_STEPS_BYTES = STEPS_PREFIX + MAX_RECORDS * RECORD.size
_LEN = struct.Struct("<H")
HELLO_FLOPS = struct.Struct("<dd")

DEFAULT_SOCKET = "/run/gpuagent/jobs.sock"
SOCKET_ENV = "GPUAGENT_JOBS_SOCKET"


def socket_path(environ=None) -> str:
    """Where the agent listens: ``$GPUAGENT_JOBS_SOCKET`` or ``/run/gpuagent/jobs.sock``."""
    import os  # noqa: PLC0415

    env = os.environ if environ is None else environ
    return env.get(SOCKET_ENV) or DEFAULT_SOCKET


def encode_hello(pid: int, rank: int, local_rank: int, world_size: int, tracker_id: int,
                 job_id: str, job_name: str, source: str, flops_per_step: float = 0.0,
                 flops_per_token: float = 0.0) -> bytes:
    parts = [HEADER.pack(MAGIC, KIND_HELLO, VERSION, 0),
             HELLO_BODY.pack(pid, rank, local_rank, world_size, tracker_id)]
    for text in (job_id, job_name, source):
        raw = text.encode("utf-8")[:1024]
        parts.append(_LEN.pack(len(raw)))
        parts.append(raw)
    parts.append(HELLO_FLOPS.pack(float(flops_per_step), float(flops_per_token)))
    return b"".join(parts)


def encode_bye(pid: int, rank: int, tracker_id: int) -> bytes:
    return HEADER.pack(MAGIC, KIND_BYE, 0, 0) + STEPS_BODY.pack(pid, rank, tracker_id)


class WireError(ValueError):
    """A datagram that is not in this format (wrong magic, kind, or length)."""


def decode(data: bytes):
    """('hello' | 'bye', dict) or ('steps', dict with 'records': list of tuples). Raises WireError."""
    if len(data) < HEADER.size:
        raise WireError(f"datagram of {len(data)} bytes is shorter than the header")
    magic, kind, arg, _ = HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic 0x{magic:08x}")
    off = HEADER.size
    if kind == KIND_HELLO:
        if len(data) < off + HELLO_BODY.size:
            raise WireError("hello datagram too short")
        pid, rank, local_rank, world_size, tracker_id = HELLO_BODY.unpack_from(data, off)
        off += HELLO_BODY.size
        texts = []
        for _ in range(3):
            if len(data) < off + _LEN.size:
                raise WireError("hello datagram truncated")
            (n,) = _LEN.unpack_from(data, off)
            off += _LEN.size
            if len(data) < off + n:
                raise WireError("hello datagram truncated")
            texts.append(bytes(data[off:off + n]).decode("utf-8", errors="replace"))
            off += n
        flops_per_step = flops_per_token = 0.0
        rest = len(data) - off
        if rest >= HELLO_FLOPS.size:
            flops_per_step, flops_per_token = HELLO_FLOPS.unpack_from(data, off)
        elif rest:
            raise WireError("hello datagram truncated")
        return "hello", {"pid": pid, "rank": rank, "local_rank": local_rank,
                         "world_size": world_size, "tracker_id": tracker_id,
                         "job_id": texts[0], "job_name": texts[1], "source": texts[2],
                         "flops_per_step": _finite(flops_per_step), "flops_per_token": _finite(flops_per_token)}
    if kind == KIND_BYE:
        if len(data) != off + STEPS_BODY.size:
            raise WireError("bye datagram has the wrong length")
        pid, rank, tracker_id = STEPS_BODY.unpack_from(data, off)
        return "bye", {"pid": pid, "rank": rank, "tracker_id": tracker_id}
    if kind == KIND_STEPS:
        count = arg
        if len(data) != STEPS_PREFIX + count * RECORD.size:
            raise WireError(f"steps datagram of {len(data)} bytes does not hold {count} records")
        pid, rank, tracker_id = STEPS_BODY.unpack_from(data, off)
        records = list(RECORD.iter_unpack(memoryview(data)[STEPS_PREFIX:]))
        return "steps", {"pid": pid, "rank": rank, "tracker_id": tracker_id, "records": records}
    raise WireError(f"unknown datagram kind {kind}")


def _finite(v: float) -> float:
    """A declared FLOP count: positive and finite, else 0 (not declared)."""
    return v if v > 0 and v != float("inf") else 0.0
