"""How a client talks to the collector and retries: the RPC paths, which failures are retried, and the
backoff with jitter. Shared by the agent's sender and the synthetic fleet (gpuagent-sim), so that the
simulator loads a collector the way a fleet of real agents would.

It lives in ``gpuagent.common`` and imports only ``grpc`` (a base dependency), no gpuagent package: the
method paths are spelled out here rather than read from ``gpuagent.proto``, and
``tests/test_sim.py::test_rpc_paths_match_the_proto`` checks them against the generated service.

The two callers differ only in how long they keep trying: the agent is a daemon and retries every failure
forever (a refused token may be fixed while it runs; a batch the collector rejects is set aside, see
agent/pipeline/sender.py), the simulator retries :data:`RETRYABLE` failures a bounded number of times and stops on
:data:`REFUSED`.
"""

from __future__ import annotations

import random

import grpc

REGISTER_METHOD = "/gpuagent.v1.Collector/Register"
STREAM_METHOD = "/gpuagent.v1.Collector/Stream"

# Failures that pass by themselves: the collector is restarting, overloaded or slow. Resending the
# unacknowledged batches unchanged may succeed (the collector dedupes per seq).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})

# The collector refused the credentials: nothing changes until someone fixes the token.
REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


class Backoff:
    """Exponential backoff with jitter.

    Each wait is a random 50-100 % of the current delay, so a fleet that lost its collector at the same
    moment does not reconnect in lockstep; the delay then doubles, up to ``max_s``. ``reset()`` after a
    success starts over at ``initial_s``.
    """

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None):
        self.initial_s = initial_s
        self.max_s = max_s
        self.delay = initial_s
        self._rng = rng or random.Random()

    def next_wait(self) -> float:
        """Seconds to wait before the next attempt; grows the delay for the attempt after it."""
        wait = self.delay * (0.5 + 0.5 * self._rng.random())
        self.delay = min(self.delay * 2, self.max_s)
        return wait

    def reset(self) -> None:
        self.delay = self.initial_s
