"""net_pair: TCP throughput both ways and round-trip latency between two nodes; no torch needed.

One end listens (``NetPairListener``: a port picked at random in ``port_range``, so firewalls can
allow a known range), the other connects (``connect``). Every connection opens with a hello carrying
the pair's one-time secret; the listener compares it with ``hmac.compare_digest`` and answers a refusal
to anything else, and it gives up (``skipped``) when no valid peer arrives before its accept deadline.
The connecting end drives the run over one control connection (TCP_NODELAY):
  1. rtt: ``rtt_count`` ping-pongs of ``rtt_bytes`` (after ``rtt_warmup`` unrecorded ones), timed by the
     connecting end; p50/p99/min in microseconds;
  2. send: ``streams`` parallel connections carry data from the connecting end to the listener;
  3. recv: the same from the listener to the connecting end.
For each direction the *receiving* end counts the bytes that arrived between ``warmup_s`` and
``warmup_s + duration_s`` after it said go, so slow start is excluded and only delivered bytes count
(iperf3's receiver figure). Gbit/s means 10^9 bits per second. Each data stream runs in a small process
of its own (probes/net_pair_stream.py, which says why), so a link faster than one core is read as iperf3
reads it. The wire (hello, control messages, socket settings) is probes/net_pair_wire.py; the bulk
streams are probes/net_pair_bulk.py.

Metrics are named from the connecting end's point of view, and both ends report the same values (the
connecting end sends them to the listener at the end), so one link gives one row whichever end stored
it: ``send_gbits_per_s`` (connecting -> listening), ``recv_gbits_per_s`` (listening -> connecting),
``rtt_p50_us``, ``rtt_p99_us``, ``rtt_min_us``. ``env.role`` says which end wrote the result.

Nothing here raises to the caller: a peer that never comes or a refused connection gives ``skipped``,
a broken run ``failed``, each with one sentence. The secret never appears in a result.

Manual use (prints JSON; the secret may come from $GPUAGENT_NET_PAIR_SECRET instead of --secret)::

    python -m gpuagent.probes.net_pair listen --bind 10.0.0.2 --port-range 41000-41099 --secret S
    python -m gpuagent.probes.net_pair connect 10.0.0.2 41017 --secret S
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import secrets as _secrets
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from gpuagent.probes.net_pair_bulk import BulkStreams
from gpuagent.probes.net_pair_wire import (
    ACCEPTED, KIND_CONTROL, KIND_RECV, KIND_SEND, MAX_SECRET, REFUSED, NoAnswer, PairError, expect, hello,
    listen_in_range, read_hello, reason, recv_exact, recv_msg, send_msg, set_nodelay)
from gpuagent.probes.registry import ProbeSpec
from gpuagent.probes.result import ProbeResult

NAME = "net_pair"
SECRET_ENV = "GPUAGENT_NET_PAIR_SECRET"

SPEC = ProbeSpec(
    name=NAME,
    description="TCP throughput both ways (parallel streams) and round-trip latency to a peer node",
    platform="any",
    defaults={"role": "connect", "peer": "", "port": 0, "bind": "0.0.0.0", "port_lo": 0, "port_hi": 0,
              "secret": "", "streams": 4, "duration_s": 3.0, "warmup_s": 0.5, "rtt_count": 1000,
              "rtt_bytes": 32, "chunk_kib": 128, "accept_timeout_s": 30.0, "io_timeout_s": 10.0},
    resources=frozenset({"cpu"}),
    timeout_s=60.0,
    interval_s=3600.0,
    param_help={"role": "connect | listen", "peer": "the listener's address (connect)",
                "port_lo": "lowest port the listener may take (0 with port_hi 0: any free port)",
                "secret": f"the pair's one-time secret (or ${SECRET_ENV})",
                "duration_s": "measured seconds per direction, after warmup_s"},
    limits={"port": (0, 65535), "port_lo": (0, 65535), "port_hi": (0, 65535), "streams": (1, 64),
            "duration_s": (0.1, 60), "warmup_s": (0, 30), "rtt_count": (1, 100000), "rtt_bytes": (1, 65536),
            "chunk_kib": (4, 16384), "accept_timeout_s": (0.1, 3600), "io_timeout_s": (0.1, 600)},
)

HANDSHAKE_TIMEOUT_S = 2.0   # a connection that says nothing cannot hold the listener longer than this
RTT_WARMUP = 20


def new_secret() -> str:
    """A fresh one-time secret for one pair assignment."""
    return _secrets.token_hex(16)


@dataclass(frozen=True)
class PairSettings:
    """What the connecting end asks for; the listener checks it against SPEC's limits."""
    streams: int = 4
    duration_s: float = 3.0
    warmup_s: float = 0.5
    rtt_count: int = 1000
    rtt_bytes: int = 32
    chunk_kib: int = 128

    def problem(self) -> str:
        for key, value in asdict(self).items():
            lo, hi = SPEC.limits[key]
            kind = int if isinstance(SPEC.defaults[key], int) else (int, float)
            if not isinstance(value, kind) or isinstance(value, bool) or not lo <= value <= hi:
                return f"{key} must be between {lo:g} and {hi:g}, got {value!r}"
        return ""



class NetPairListener:
    """The listening end. Binding happens here, so ``port`` can be handed to the peer before ``serve``.

    A bind failure does not raise: ``error`` holds the failed result and ``serve`` returns it.
    """

    def __init__(self, secret: str | bytes, bind: str = "0.0.0.0", port_range: tuple[int, int] = (0, 0), *,
                 accept_timeout_s: float = 30.0, io_timeout_s: float = 10.0) -> None:
        self.secret = secret.encode() if isinstance(secret, str) else bytes(secret)
        self.bind, self.port_range = bind, (int(port_range[0]), int(port_range[1]))
        self.accept_timeout_s, self.io_timeout_s = float(accept_timeout_s), float(io_timeout_s)
        self.port = 0
        self.refused = 0
        self.peer = ""        # set once a peer presented the secret: a run has begun
        self.sock: socket.socket | None = None
        self.error: ProbeResult | None = None
        self.started_ns = time.time_ns()
        self.params = {"role": "listen", "bind": bind, "port_lo": self.port_range[0],
                       "port_hi": self.port_range[1], "accept_timeout_s": self.accept_timeout_s,
                       "io_timeout_s": self.io_timeout_s}
        why = self._open()
        if why:
            self.error = self._result("failed", why)

    def _open(self) -> str:
        if not self.secret or len(self.secret) > MAX_SECRET:
            return f"the pair secret must be 1 to {MAX_SECRET} bytes"
        sock, why = listen_in_range(self.bind, self.port_range)
        if sock is None:
            return why
        self.sock, self.port = sock, sock.getsockname()[1]
        self.params["port"] = self.port
        return ""

    def _result(self, status: str, reason: str, metrics: dict[str, float] | None = None,
                env: dict[str, Any] | None = None) -> ProbeResult:
        return ProbeResult(NAME, status, reason, dict(self.params), dict(metrics or {}), self.started_ns,
                           time.time_ns(), {"role": "listen", "refused_connections": self.refused, **(env or {})})

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def _accept(self, kind: bytes, deadline: float) -> socket.socket | None:
        """The next connection of ``kind`` that presents the secret, or None at the deadline."""
        assert self.sock is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                return None
            conn.settimeout(min(HANDSHAKE_TIMEOUT_S, max(0.05, deadline - time.monotonic())))
            hello = read_hello(conn)
            ok = hello is not None and hello[0] == kind and hmac.compare_digest(hello[1], self.secret)
            try:
                conn.sendall(ACCEPTED if ok else REFUSED)
            except OSError:
                ok = False
            if ok:
                conn.settimeout(self.io_timeout_s)
                return conn
            self.refused += 1
            conn.close()

    def serve(self) -> ProbeResult:
        """Wait for the peer, answer its run, and return the result; never raises."""
        if self.error is not None:
            return self.error
        ctrl = None
        try:
            ctrl = self._accept(KIND_CONTROL, time.monotonic() + self.accept_timeout_s)
            if ctrl is None:
                extra = f" ({self.refused} connection(s) refused)" if self.refused else ""
                return self._result("skipped", f"no peer connected with the pair's secret within "
                                               f"{self.accept_timeout_s:g} s{extra}")
            peer = self.peer = ctrl.getpeername()[0]
            set_nodelay(ctrl)
            return self._serve(ctrl, peer)
        except BaseException as exc:  # noqa: BLE001 - a probe reports, it does not raise
            if isinstance(exc, KeyboardInterrupt):
                raise
            return self._result("failed", reason(exc))
        finally:
            if ctrl is not None:
                ctrl.close()
            self.close()

    def _serve(self, ctrl: socket.socket, peer: str) -> ProbeResult:
        env: dict[str, Any] = {"peer": peer}
        try:
            hello = expect(ctrl, "settings")
            settings = PairSettings(**{k: hello[k] for k in asdict(PairSettings()) if k in hello})
        except TypeError:
            raise PairError("the peer sent settings of the wrong types") from None
        why = settings.problem()
        if why:
            send_msg(ctrl, {"op": "error", "reason": why})
            return self._result("failed", f"the peer asked for unusable settings: {why}", env=env)
        self.params.update(asdict(settings))
        send_msg(ctrl, {"op": "ready"})
        chunk = settings.chunk_kib * 1024
        while True:
            msg = recv_msg(ctrl)
            op = msg["op"]
            if op == "rtt":
                buf = memoryview(bytearray(settings.rtt_bytes))
                for _ in range(RTT_WARMUP + settings.rtt_count):
                    recv_exact(ctrl, buf)
                    ctrl.sendall(buf)
            elif op == "send":      # the peer sends, this end receives and measures
                streams = self._accept_streams(KIND_SEND, settings.streams)
                rx = BulkStreams(streams, chunk, sending=False)
                try:
                    rx.start()
                    t_go = time.monotonic()
                    send_msg(ctrl, {"op": "go"})
                    rate, nbytes = rx.measure(t_go, settings.warmup_s, settings.duration_s)
                    send_msg(ctrl, {"op": "measured", "gbits_per_s": rate, "bytes": nbytes})
                except BaseException:
                    rx.abort()
                    raise
                rx.finish(self.io_timeout_s)
            elif op == "recv":      # this end sends until the peer has measured
                streams = self._accept_streams(KIND_RECV, settings.streams)
                tx = BulkStreams(streams, chunk, sending=True)
                try:
                    expect(ctrl, "go")
                    tx.start()
                    expect(ctrl, "stop")
                except BaseException:
                    tx.abort()
                    raise
                tx.finish(self.io_timeout_s)
            elif op == "done":
                metrics = msg.get("metrics")
                if not isinstance(metrics, dict):
                    raise PairError("the peer's final message has no metrics")
                return self._result("ok", "", {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                                    env=env)
            else:
                raise PairError(f"the peer sent an unknown op {op!r}")

    def _accept_streams(self, kind: bytes, n: int) -> list[socket.socket]:
        deadline = time.monotonic() + self.io_timeout_s
        out: list[socket.socket] = []
        try:
            for _ in range(n):
                conn = self._accept(kind, deadline)
                if conn is None:
                    raise PairError(f"only {len(out)} of {n} data streams connected within "
                                    f"{self.io_timeout_s:g} s")
                out.append(conn)
        except BaseException:
            for c in out:
                c.close()
            raise
        return out


# ---------------------------------------------------------------- connecting end

def _dial(host: str, port: int, kind: bytes, secret: bytes, deadline: float, io_timeout_s: float,
          retry_refused: bool) -> socket.socket:
    """A connection whose hello the listener accepted. Raises PairError, or NoAnswer when nobody
    answers before the deadline (retrying while the listener is not up yet, if ``retry_refused``)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NoAnswer
        try:
            sock = socket.create_connection((host, port), timeout=min(left, io_timeout_s))
        except ConnectionRefusedError:
            if not retry_refused:
                raise PairError(f"{host}:{port} refused the connection") from None
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            continue
        except socket.timeout:
            raise NoAnswer from None
        try:
            sock.settimeout(io_timeout_s)
            sock.sendall(hello(kind, secret))
            answer = bytearray(1)
            recv_exact(sock, memoryview(answer))
        except (OSError, PairError):
            sock.close()
            raise PairError(f"the listener at {host}:{port} dropped the connection during the hello") from None
        if bytes(answer) != ACCEPTED:
            sock.close()
            raise PairError(f"the listener at {host}:{port} refused this end's secret")
        return sock


def connect(host: str, port: int, secret: str | bytes, settings: PairSettings | None = None, *,
            connect_timeout_s: float = 30.0, io_timeout_s: float = 10.0) -> ProbeResult:
    """Run the pair test against a listener and return the result; never raises."""
    settings = settings or PairSettings()
    secret_b = secret.encode() if isinstance(secret, str) else bytes(secret)
    started = time.time_ns()
    params = {"role": "connect", "peer": host, "port": int(port), "accept_timeout_s": float(connect_timeout_s),
              "io_timeout_s": float(io_timeout_s), **asdict(settings)}
    env: dict[str, Any] = {"role": "connect", "peer": host}

    def result(status: str, reason: str, metrics: dict[str, float] | None = None) -> ProbeResult:
        return ProbeResult(NAME, status, reason, params, metrics or {}, started, time.time_ns(), env)

    why = settings.problem()
    if not why and not (1 <= int(port) <= 65535):
        why = f"port must be between 1 and 65535, got {port}"
    if not why and not (0 < len(secret_b) <= MAX_SECRET):
        why = f"the pair secret must be 1 to {MAX_SECRET} bytes"
    if why:
        return result("failed", why)
    ctrl = None
    try:
        try:
            ctrl = _dial(host, port, KIND_CONTROL, secret_b, time.monotonic() + connect_timeout_s,
                         io_timeout_s, retry_refused=True)
        except NoAnswer:
            return result("skipped", f"no listener answered at {host}:{port} within {connect_timeout_s:g} s")
        set_nodelay(ctrl)
        send_msg(ctrl, {"op": "settings", **asdict(settings)})
        expect(ctrl, "ready")
        metrics = _rtt(ctrl, settings)
        metrics["send_gbits_per_s"] = _run_send(ctrl, host, port, secret_b, settings, io_timeout_s)
        metrics["recv_gbits_per_s"] = _run_recv(ctrl, host, port, secret_b, settings, io_timeout_s)
        send_msg(ctrl, {"op": "done", "metrics": metrics})
        return result("ok", "", metrics)
    except BaseException as exc:  # noqa: BLE001 - a probe reports, it does not raise
        if isinstance(exc, KeyboardInterrupt):
            raise
        if isinstance(exc, NoAnswer):
            return result("failed", f"a data stream could not connect to {host}:{port} in time")
        return result("failed", reason(exc))
    finally:
        if ctrl is not None:
            ctrl.close()


def _rtt(ctrl: socket.socket, s: PairSettings) -> dict[str, float]:
    send_msg(ctrl, {"op": "rtt"})
    out = memoryview(bytearray(os.urandom(s.rtt_bytes)))
    back = memoryview(bytearray(s.rtt_bytes))
    clock = time.perf_counter_ns
    samples = []
    for i in range(RTT_WARMUP + s.rtt_count):
        t0 = clock()
        ctrl.sendall(out)
        recv_exact(ctrl, back)
        if i >= RTT_WARMUP:
            samples.append(clock() - t0)
    if back != out:
        raise PairError("the listener echoed different bytes than were sent")
    samples.sort()
    pick = lambda q: samples[min(len(samples) - 1, int(q * len(samples)))] / 1e3  # noqa: E731
    return {"rtt_p50_us": statistics.median(samples) / 1e3, "rtt_p99_us": pick(0.99), "rtt_min_us": samples[0] / 1e3}


def _open_streams(host: str, port: int, kind: bytes, secret: bytes, n: int, io_timeout_s: float) -> list[socket.socket]:
    deadline = time.monotonic() + io_timeout_s
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            socks.append(_dial(host, port, kind, secret, deadline, io_timeout_s, retry_refused=False))
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def _run_send(ctrl: socket.socket, host: str, port: int, secret: bytes, s: PairSettings,
              io_timeout_s: float) -> float:
    send_msg(ctrl, {"op": "send"})
    tx = BulkStreams(_open_streams(host, port, KIND_SEND, secret, s.streams, io_timeout_s), s.chunk_kib * 1024,
                  sending=True)
    try:
        expect(ctrl, "go")
        tx.start()
        ctrl.settimeout(s.warmup_s + s.duration_s + io_timeout_s)
        measured = expect(ctrl, "measured")
        ctrl.settimeout(io_timeout_s)
    except BaseException:
        tx.abort()
        raise
    tx.finish(io_timeout_s)
    rate = measured.get("gbits_per_s")
    if not isinstance(rate, (int, float)):
        raise PairError("the listener's measurement has no rate")
    return float(rate)


def _run_recv(ctrl: socket.socket, host: str, port: int, secret: bytes, s: PairSettings,
              io_timeout_s: float) -> float:
    send_msg(ctrl, {"op": "recv"})
    rx = BulkStreams(_open_streams(host, port, KIND_RECV, secret, s.streams, io_timeout_s), s.chunk_kib * 1024,
                  sending=False)
    try:
        rx.start()
        t_go = time.monotonic()
        send_msg(ctrl, {"op": "go"})
        rate, _ = rx.measure(t_go, s.warmup_s, s.duration_s)
        send_msg(ctrl, {"op": "stop"})
    except BaseException:
        rx.abort()
        raise
    rx.finish(io_timeout_s)
    return rate


# ---------------------------------------------------------------- registry-style entry

def run(params: dict[str, Any]) -> ProbeResult:
    """One end of a pair from SPEC-shaped params (role=connect needs peer and port; role=listen binds in
    port_lo..port_hi). The secret comes from params or $GPUAGENT_NET_PAIR_SECRET and is not recorded."""
    p = dict(params)
    secret = p.pop("secret", "") or os.environ.get(SECRET_ENV, "")
    settings = PairSettings(**{k: p[k] for k in asdict(PairSettings()) if k in p})
    if p.get("role") == "listen":
        return NetPairListener(secret, p["bind"], (p["port_lo"], p["port_hi"]),
                               accept_timeout_s=p["accept_timeout_s"], io_timeout_s=p["io_timeout_s"]).serve()
    if p.get("role") != "connect":
        return ProbeResult(NAME, "failed", f"role must be connect or listen, got {p.get('role')!r}", p)
    if not p.get("peer"):
        return ProbeResult(NAME, "failed", "role=connect needs the listener's address in peer", p)
    return connect(p["peer"], p["port"], secret, settings, connect_timeout_s=p["accept_timeout_s"],
                   io_timeout_s=p["io_timeout_s"])


# ---------------------------------------------------------------- CLI

def _port_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        return (int(lo), int(hi if sep else lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"port range must look like LO-HI, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpuagent.probes.net_pair",
                                 description="One end of a TCP pair test; prints JSON.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    lp = sub.add_parser("listen", help="wait for one peer; prints {\"listening\": ...} first, then the result")
    lp.add_argument("--bind", default="0.0.0.0")
    lp.add_argument("--port-range", type=_port_range, default=(0, 0), metavar="LO-HI")
    lp.add_argument("--accept-timeout", type=float, default=30.0)
    cp = sub.add_parser("connect", help="run the test against a listener")
    cp.add_argument("host")
    cp.add_argument("port", type=int)
    cp.add_argument("--connect-timeout", type=float, default=30.0)
    d = PairSettings()
    cp.add_argument("--streams", type=int, default=d.streams)
    cp.add_argument("--duration", type=float, default=d.duration_s, help="measured seconds per direction")
    cp.add_argument("--warmup", type=float, default=d.warmup_s)
    cp.add_argument("--rtt-count", type=int, default=d.rtt_count)
    cp.add_argument("--rtt-bytes", type=int, default=d.rtt_bytes)
    cp.add_argument("--chunk-kib", type=int, default=d.chunk_kib)
    for p in (lp, cp):
        p.add_argument("--secret", default=None, help=f"the pair's secret (default: ${SECRET_ENV})")
        p.add_argument("--io-timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    secret = args.secret if args.secret is not None else os.environ.get(SECRET_ENV, "")
    if not secret:
        print(f"net_pair: give the pair's secret with --secret or ${SECRET_ENV}", file=sys.stderr)
        return 2
    if args.cmd == "listen":
        lst = NetPairListener(secret, args.bind, args.port_range, accept_timeout_s=args.accept_timeout,
                              io_timeout_s=args.io_timeout)
        if lst.error is None:
            print(json.dumps({"listening": {"host": args.bind, "port": lst.port}}), flush=True)
        res = lst.serve()
    else:
        settings = PairSettings(args.streams, args.duration, args.warmup, args.rtt_count, args.rtt_bytes,
                                args.chunk_kib)
        res = connect(args.host, args.port, secret, settings, connect_timeout_s=args.connect_timeout,
                      io_timeout_s=args.io_timeout)
    print(res.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
