"""What travels beside the generated messages, spelled once for both ends (hand-written, not generated).

- The call metadata: the ``authorization: Bearer <token>`` header and the ``gpuagent-*`` keys an agent sends
  on Register and Stream. The agent's sender, the simulator and the collector's clients write them, the
  collector's auth and servicer read them, all from these names, so the two ends cannot drift apart.
- Protobuf wire-format helpers, used where a serialized ``Batch`` is patched or assembled without building
  message objects: the agent's sender appends the node id to spooled batches, and the synthetic fleet and
  the ingest benchmark assemble sample columns straight from buffers. See
  https://protobuf.dev/programming-guides/encoding/ for the format.

Standard library only: the node, the simulator and the collector all import it.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------- call metadata

AUTHORIZATION_KEY = "authorization"          # gRPC metadata keys are lower case
BEARER_PREFIX = "Bearer "                    # the scheme and its space: "Bearer <token>"
INSTANCE_KEY = "gpuagent-instance"           # "<pid>-<random hex>", one per agent process
NODE_KEY = "gpuagent-node-id"                # on Stream: the node (from Register) it streams for
INTERVAL_KEY = "gpuagent-batch-interval-s"   # on Stream: the agent cuts a batch at least this often


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying ``token`` (empty when there is none)."""
    return ((AUTHORIZATION_KEY, f"{BEARER_PREFIX}{token}"),) if token else ()


# ------------------------------------------------------------------------------- wire format


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
