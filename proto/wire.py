"""Protobuf wire-format helpers (hand-written, not generated).

Used where a serialized ``Batch`` is patched or assembled without building message objects: the
agent's sender appends the node id to spooled batches, and the synthetic fleet and the ingest
benchmark assemble sample columns straight from buffers. See
https://protobuf.dev/programming-guides/encoding/ for the format.
"""

from __future__ import annotations


def varint(n: int) -> bytes:
    """Base-128 varint encoding of a non-negative integer."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def length_delimited(field_number: int, payload: bytes) -> bytes:
    """One length-delimited field (wire type 2): tag, length, payload."""
    return varint(field_number << 3 | 2) + varint(len(payload)) + payload
