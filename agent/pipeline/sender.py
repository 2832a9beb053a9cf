"""The sender: the only network code on the node.

It registers with the collector, then opens one bidirectional ``Stream`` and sends the spooled batches
oldest first, deleting each one from the spool when its ``Ack`` arrives (the collector acks only after
the DuckDB commit). It never parses batches: the spooled bytes go out as they are, with the node id
appended as one more encoding of field 1 (a protobuf parser keeps the last value of a singular field).

Reconnects use the exponential backoff with jitter of :mod:`gpuagent.common.retry` (each wait is 50-100 %
of the current delay), shared with the synthetic fleet, which calls the same RPC paths. Every RPC has a
deadline: ``Register`` directly, the long-lived stream through an ack watchdog (a batch not acked within
``rpc_timeout_s`` cancels the call). ``stop()`` interrupts the backoff through ``threading.Event.wait``
(the pattern of the OpenTelemetry OTLP gRPC exporter). Error mapping:

* UNAUTHENTICATED / PERMISSION_DENIED: one clear log line naming the token setting; retried with backoff.
* INVALID_ARGUMENT (or RESOURCE_EXHAUSTED naming a batch: over the collector's size limit) on the
  stream: the collector will never take that batch; it is moved to ``spool/rejected/`` and counted,
  never retried forever; the others are resent at once.
* ALREADY_EXISTS (Register or Stream): another agent already streams as this node (same machine-id and
  hostname, see collector/ingest/identity.py). One log line and the status line carry the collector's sentence;
  the batches stay spooled and the agent retries with backoff (it takes over once the other stops).
* Anything else (UNAVAILABLE, DEADLINE_EXCEEDED, ...): reconnect with backoff, resend unacked batches.

The backoff starts over only after a session got an ack, so a collector that takes Register but then
refuses or drops the stream is retried at a growing interval, not in a tight loop.

Every call carries ``gpuagent-instance`` (this process: pid and a random part), and the stream also
``gpuagent-node-id`` and ``gpuagent-batch-interval-s``: the collector tells a restart of this agent
(a new process, or this one reconnecting) from a second agent presenting the same node by them.
"""

from __future__ import annotations

import logging
import os
import random
import re
import secrets
import threading
import time
from dataclasses import asdict, replace
from typing import Callable, Iterator

import grpc

from gpuagent.agent.config import CollectorConfig
from gpuagent.agent.pipeline.spool import Spool
from gpuagent.agent.snapshot import LinkState
from gpuagent.common.retry import REFUSED, REGISTER_METHOD, STREAM_METHOD, Backoff
from gpuagent.proto import pb
from gpuagent.proto.wire import INSTANCE_KEY, INTERVAL_KEY, NODE_KEY, bearer_metadata, length_delimited

log = logging.getLogger("gpuagent.sender")

_SEQ_IN_DETAILS = re.compile(r"\bseq\D{0,3}(\d+)")


def with_node_id(payload: bytes, node_id: str) -> bytes:
    """``payload`` (a serialized Batch) with ``node_id`` set, without parsing the batch."""
    raw = node_id.encode()
    return payload + length_delimited(1, raw)   # field 1 = Batch.node_id; the last value wins


# grpc's sync API wakes every thread that waits on a call 10 times a second (grpc._common.MAXIMUM_WAIT_TIMEOUT)
# so that a main thread blocked in gRPC still runs signal handlers. The agent's main thread never waits on
# gRPC; only the sender's threads do, and their wake-ups were about a fifth of the idle agent's CPU.
_GRPC_WAIT_SLICE_S = 1.0


def _slow_grpc_wait_polling() -> None:
    import grpc._common as grpc_common
    if getattr(grpc_common, "MAXIMUM_WAIT_TIMEOUT", None) is not None:
        grpc_common.MAXIMUM_WAIT_TIMEOUT = max(grpc_common.MAXIMUM_WAIT_TIMEOUT, _GRPC_WAIT_SLICE_S)


class Sender(threading.Thread):
    def __init__(self, cfg: CollectorConfig, spool: Spool, node_info: Callable[[], pb.NodeInfo],
                 token: str = "", on_registered: Callable[[pb.RegisterResponse], None] | None = None,
                 rng: random.Random | None = None, batch_interval_s: float = 0.0,
                 on_raw_requests: Callable[[list[pb.RawWindowRequest]], int] | None = None):
        super().__init__(name="gpuagent-sender", daemon=True)
        self.cfg = cfg
        self.spool = spool
        self._node_info = node_info
        self._token = token
        self._on_registered = on_registered or (lambda r: None)
        self._on_raw_requests = on_raw_requests       # the collector asked for raw windows (in an Ack)
        self._rng = rng or random.Random()
        self._halt = threading.Event()
        self._draining = threading.Event()
        self._lock = threading.Lock()
        self._call = None
        self._channel: grpc.Channel | None = None
        self._inflight: dict[int, float] = {}      # seq -> monotonic send time
        self.state = LinkState(collector=cfg.address, since_ns=time.time_ns())
        self._logged_error = ""
        self._registered = False
        self._acked = False               # this session got an ack (the stream was accepted and works)
        self.instance = f"{os.getpid()}-{secrets.token_hex(6)}"
        self._batch_interval_s = batch_interval_s

    # ---------------------------------------------------------------- lifecycle
    def stop(self, grace_s: float = 1.5) -> None:
        """Stop sending: half-close the stream, give in-flight acks ``grace_s``, then cancel."""
        if self.ident is None:       # never started (e.g. the agent failed before run())
            self._halt.set()
            return
        self._draining.set()
        with self._lock:
            if not self._inflight:
                self._halt.set()     # nothing to wait for (also interrupts a backoff wait)
        self.spool.wake()
        self.join(timeout=grace_s)
        self._halt.set()
        with self._lock:
            call, channel = self._call, self._channel
        if call is not None:
            call.cancel()
        if channel is not None:
            channel.close()
        self.spool.wake()
        self.join(timeout=2.0)

    @property
    def stopping(self) -> bool:
        return self._halt.is_set() or self._draining.is_set()

    def link(self) -> LinkState:
        """A copy of the link state, with the number of batches in flight."""
        with self._lock:
            return replace(self.state, in_flight=len(self._inflight))

    def snapshot(self) -> dict:
        return asdict(self.link())

    # ---------------------------------------------------------------- main loop
    def run(self) -> None:
        _slow_grpc_wait_polling()
        backoff = Backoff(self.cfg.backoff_initial_s, self.cfg.backoff_max_s, self._rng)
        while not self.stopping:
            self._registered = False
            self._acked = False
            retry_now = False
            try:
                self._session()
                retry_now = True          # the collector closed the stream cleanly
            except grpc.RpcError as exc:
                retry_now = self._handle_rpc_error(exc)
            except Exception as exc:  # noqa: BLE001 - the sender thread must survive anything
                log.exception("sender session failed unexpectedly")
                self._set_error(f"{type(exc).__name__}: {exc}")
            finally:
                self._close_channel()
            if self.stopping:
                break
            if self._registered and self._acked:
                backoff.reset()
            if retry_now:
                continue   # e.g. a rejected batch was set aside: resend the rest at once
            wait = backoff.next_wait()
            with self._lock:
                self.state.next_retry_ns = time.time_ns() + int(wait * 1e9)
            if self._halt.wait(wait) or self._draining.is_set():
                break
        with self._lock:
            self._set_connected(False)

    def open_channel(self) -> grpc.Channel:
        """A new channel to the collector with this sender's address and TLS (for side streams)."""
        return self._open_channel()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The token and instance headers this sender sends (for side streams)."""
        return self._metadata()

    def _metadata(self, *extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
        return (*bearer_metadata(self._token), (INSTANCE_KEY, self.instance), *extra)

    def _open_channel(self) -> grpc.Channel:
        opts = [("grpc.enable_retries", 0), ("grpc.max_send_message_length", 64 * 1024 * 1024)]
        if self.cfg.tls_ca:
            def read(path: str) -> bytes | None:
                if not path:
                    return None
                with open(path, "rb") as fh:
                    return fh.read()
            # Read at each connection, so a rotated client certificate is used from the next reconnect.
            creds = grpc.ssl_channel_credentials(root_certificates=read(self.cfg.tls_ca),
                                                 private_key=read(self.cfg.tls_client_key),
                                                 certificate_chain=read(self.cfg.tls_client_cert))
            return grpc.secure_channel(self.cfg.address, creds, options=opts)
        return grpc.insecure_channel(self.cfg.address, options=opts)

    def _close_channel(self) -> None:
        with self._lock:
            channel, self._channel, self._call = self._channel, None, None
            self._inflight.clear()
        if channel is not None:
            channel.close()

    def _session(self) -> None:
        """One connection: Register, then stream until the stream breaks or we stop."""
        channel = self._open_channel()
        with self._lock:
            self._channel = channel
        if self.stopping:
            return
        register = channel.unary_unary(REGISTER_METHOD, request_serializer=pb.RegisterRequest.SerializeToString,
                                       response_deserializer=pb.RegisterResponse.FromString)
        resp = register(pb.RegisterRequest(node=self._node_info()), timeout=self.cfg.rpc_timeout_s,
                        metadata=self._metadata())
        self._registered = True
        self._on_registered(resp)     # may renumber spooled batches when the collector is ahead of us
        # Nothing is dropped from the spool here: last_committed_seq is the highest stored seq, not "all
        # below it are stored" (a batch whose store failed while a later one committed leaves a hole).
        # Everything spooled is sent; the collector dedupes per seq and acks what it already holds.
        with self._lock:
            self.state.node_id = resp.node_id
            self.state.highest_committed_seq = max(self.state.highest_committed_seq, resp.last_committed_seq)
            self._set_connected(True)
            self.state.last_error = ""
        if self.state.consecutive_failures or self._logged_error:
            log.info("connected to collector %s again as node %s (after %d failed attempts)",
                     self.cfg.address, resp.node_id, self.state.consecutive_failures)
        else:
            log.info("connected to collector %s as node %s", self.cfg.address, resp.node_id)
        self._logged_error = ""
        self.state.consecutive_failures = 0

        stream = channel.stream_stream(STREAM_METHOD, request_serializer=lambda b: b,
                                       response_deserializer=pb.Ack.FromString)
        call = stream(self._requests(resp.node_id), metadata=self._metadata(
            (NODE_KEY, resp.node_id), (INTERVAL_KEY, f"{self._batch_interval_s:g}")))
        with self._lock:
            self._call = call
        for ack in call:
            self._on_ack(ack)
        # The server closed the stream without an error (we half-closed while draining).

    def _requests(self, node_id: str) -> Iterator[bytes]:
        """Spooled batches oldest first, at most ``max_in_flight`` unacked; runs on a gRPC thread."""
        sent_upto = 0
        while not self.stopping:
            with self._lock:
                call = self._call
                oldest = min(self._inflight.values(), default=None)
                full = len(self._inflight) >= self.cfg.max_in_flight
            if oldest is not None and time.monotonic() - oldest > self.cfg.rpc_timeout_s and call is not None:
                self._set_error(f"no ack within {self.cfg.rpc_timeout_s:g}s (deadline exceeded)")
                call.cancel()
                return
            if full:
                self._halt.wait(0.05)
                continue
            seq = self.spool.wait_after(sent_upto, timeout=1.0)    # put() and stop() wake it at once
            if seq is None:
                continue
            payload = self.spool.read(seq)
            sent_upto = seq
            if payload is None:
                continue   # acked meanwhile, or corrupt (set aside and counted by the spool)
            with self._lock:
                self._inflight[seq] = time.monotonic()
                self.state.sent_batches += 1
            yield with_node_id(payload, node_id)
        # Draining: wait (bounded by stop()'s grace) for the acks of what is in flight, then half-close.
        while self._inflight and not self._halt.is_set():
            self._halt.wait(0.02)

    def _on_ack(self, ack: pb.Ack) -> None:
        self.spool.ack(ack.seq)
        self._acked = True
        with self._lock:
            self._inflight.pop(ack.seq, None)
            st = self.state
            st.last_ack_ns = time.time_ns()
            st.last_ack_seq = ack.seq
            st.highest_committed_seq = max(st.highest_committed_seq, ack.highest_committed_seq, ack.seq)
            st.acked_batches += 1
            st.duplicate_acks += int(ack.duplicate)
        if ack.raw_requests and self._on_raw_requests is not None:
            n = self._on_raw_requests(list(ack.raw_requests))
            if n:
                log.info("the collector asked for %d raw window(s); they go out with the next batches", n)

    # ---------------------------------------------------------------- errors
    def _set_connected(self, value: bool) -> None:
        if self.state.connected != value:
            self.state.connected = value
            self.state.since_ns = time.time_ns()
            if value:
                self.state.reconnects += 1

    def _set_error(self, text: str) -> None:
        with self._lock:
            self._set_connected(False)
            self.state.last_error = text
            self.state.last_error_ns = time.time_ns()
            self.state.consecutive_failures += 1

    def _handle_rpc_error(self, exc: grpc.RpcError) -> bool:
        """Record/log the failure; True when the cause was dealt with and a resend may start at once."""
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        details = (exc.details() if hasattr(exc, "details") else "") or ""
        if self.stopping and code == grpc.StatusCode.CANCELLED:
            return False
        # A batch the collector will never take: malformed, or over its per-batch size limit (the
        # collector names it as "batch seq N: ..."). A RESOURCE_EXHAUSTED without a seq is back-pressure.
        per_batch = code == grpc.StatusCode.INVALID_ARGUMENT or (
            code == grpc.StatusCode.RESOURCE_EXHAUSTED and _SEQ_IN_DETAILS.search(details))
        if per_batch and self.state.connected:
            seq = self._rejected_seq(exc, details)
            if seq is not None:
                self.spool.reject(seq, details or "INVALID_ARGUMENT")
                with self._lock:
                    self._set_connected(False)
                    self.state.last_error = ""
                return True
        if code in REFUSED:
            text = (f"collector {self.cfg.address} refused this agent's credentials ({code.name}: {details}); "
                    "check collector.token / collector.token_file (GPUAGENT_TOKEN) against the collector's tokens")
        elif code == grpc.StatusCode.ALREADY_EXISTS:
            text = f"collector {self.cfg.address} refused this agent (ALREADY_EXISTS): {details}"
        elif code == grpc.StatusCode.UNAVAILABLE:
            text = f"collector {self.cfg.address} unavailable: {details}"
        else:
            text = f"collector {self.cfg.address}: {code.name}: {details}"
        if self.state.last_error.startswith("no ack within"):
            text = self.state.last_error
        self._set_error(text)
        if code.name != self._logged_error:
            # One line per kind of failure; the status file carries the rest.
            (log.error if code in REFUSED or code == grpc.StatusCode.ALREADY_EXISTS
             else log.warning)("%s; spooling and retrying with backoff", text)
            self._logged_error = code.name
        return False

    def _rejected_seq(self, exc: grpc.RpcError, details: str) -> int | None:
        """Which batch the collector refused: trailing metadata ``gpuagent-seq``, a ``seq N`` in the
        message, or else the oldest batch in flight (the collector handles batches in order)."""
        try:
            for key, value in exc.trailing_metadata() or ():
                if key == "gpuagent-seq":
                    return int(value)
        except Exception:  # noqa: BLE001
            pass
        m = _SEQ_IN_DETAILS.search(details)
        if m:
            return int(m.group(1))
        with self._lock:
            return min(self._inflight, default=None)
