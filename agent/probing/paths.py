"""The agent's end of the cheap fabric layer: path probes, Pingmesh-style (common/path_probe.py).

Two parts, both on the node's fabric address:

* ``PathResponder``: a UDP socket and a thread that sends every datagram that starts with ``MAGIC`` back to
  its sender unchanged, and drops (and counts) anything else. It is bound when the daemon is built, before
  ``Register``, so the port it got goes to the collector as ``NodeInfo.path_port``: ``[fabric] path_port``
  when set, else the first free UDP port in ``port_lo``-``port_hi``, else any free port.
* ``PathProber``: takes the pinglist the collector sends each epoch over the Assignments stream (kind
  ``pinglist``, probe ``path_probe``; agent/probing/fabric.py routes it here) and, on a thread of its own,
  spreads that epoch's probes evenly over the time left in the epoch, less its tail. One probe of a path is
  ``pings`` datagrams one at a time, then a train of ``train_packets`` back to back (common/path_probe.py);
  echoes are matched by probe id and seq, timed by their kernel arrival time (SO_TIMESTAMPNS), and strays or
  late ones are ignored. A first reading that looks wrong against the node's recent paths is confirmed by
  ``confirm`` more, ``confirm_gap_s`` apart, between the epoch's other probes; the tail
  (PathSettings.tail_s) leaves room for the last path's. A confirmed suspect goes to the sink at once
  (params node_a/node_b/pair_id, so it lands in link_results) and reaches the collector before the next
  epoch's pinglists, which ask its other end to probe it. At the epoch's end (or when a new pinglist
  replaces it, or the agent stops) the sink gets the epoch's summary (``summary_metrics``), after the
  suspects of paths whose confirmations that cut short, so ``gpuagent status`` shows it as the last
  path_probe.

Not charged to the probe budget and not under the node-wide probe lock, unlike net_pair: a probe is a few
dozen datagrams (45 KB at the defaults) and k of them a minute, well under a thousandth of a core and of a
NIC, too small to disturb a job or another probe, and it must run continuously (a gap in coverage is what
the layer exists to avoid), while the lock is held for minutes by GPU probes. Lost echoes are what it
measures, so a busy moment reads as one odd probe, which the confirmations seconds later then clear.
"""

from __future__ import annotations

import collections
import logging
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gpuagent.common import path_probe as pp
from gpuagent.common.background import BackgroundThread
from gpuagent.common.errors import first_line
from gpuagent.common.hostport import AddressError, split_host_port
from gpuagent.common.parse import settings_key
from gpuagent.probes.result import ProbeResult

log = logging.getLogger("gpuagent.agent.probing.paths")

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)     # Linux's value where Python does not name it
_HDR = struct.Struct(pp.HEADER)
_TIMESPEC = struct.Struct("@ll")
_ANC_SPACE = socket.CMSG_SPACE(_TIMESPEC.size)
SOCKET_BUFFER = 4 << 20        # asked for on both sockets (the kernel caps it): a full train of jumbo echoes
POLL_S = 0.25                  # how often the responder looks at its stop event


class PathError(RuntimeError):
    """A socket could not be bound; the message is one sentence."""


def _udp_socket(host: str, port: int, port_range: tuple[int, int] = (0, 0), what: str = "path-probe") -> socket.socket:
    """A UDP socket bound on ``host``: on ``port`` when not 0, else the first free port of ``port_range``
    when it is not (0, 0), else any free port. Kernel arrival timestamps on. PathError (one sentence)."""
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    lo, hi = (port, port) if port else port_range if port_range[0] else (0, 0)
    last = ""
    for p in range(lo, hi + 1):
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((host, p))
        except OSError as exc:
            sock.close()
            last = exc.strerror or str(exc)
            continue
        for opt, value in ((socket.SO_RCVBUF, SOCKET_BUFFER), (socket.SO_SNDBUF, SOCKET_BUFFER), (SO_TIMESTAMPNS, 1)):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, value)
            except OSError:         # no kernel timestamps: arrival times are read after the wakeup
                pass
        return sock
    if lo == hi:
        raise PathError(f"the {what} socket cannot bind UDP {host}:{lo}: {last}")
    raise PathError(f"the {what} socket finds no free UDP port in {lo}-{hi} on {host} ({last})")


def _kernel_ns(ancdata) -> int | None:
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack_from(data)
            return sec * 1_000_000_000 + nsec
    return None


class PathResponder:
    """Echoes path-probe datagrams on the fabric address (``port``: where it listens)."""

    def __init__(self, address: str, port: int = 0, port_range: tuple[int, int] = (0, 0)) -> None:
        self._sock = _udp_socket(address, port, port_range, "path-probe responder")
        self._sock.settimeout(POLL_S)
        self.address = address
        self.port: int = self._sock.getsockname()[1]
        self.echoed = 0
        self.dropped = 0          # datagrams without MAGIC, never answered
        self.errors = 0           # echoes the kernel refused to send
        self._worker = BackgroundThread("gpuagent-path-responder", self._loop)
        self._closed = False

    def start(self) -> "PathResponder":
        self._worker.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread and close the socket; a second call does nothing."""
        self._worker.stopping.set()
        if self._worker.alive:
            try:        # wake the thread's recvfrom now rather than at its next poll
                self._sock.sendto(b"", self._sock.getsockname()[:2])
            except OSError:
                pass
        self._worker.stop(timeout)
        if not self._closed:
            self._closed = True
            self._sock.close()

    stop = close

    @property
    def running(self) -> bool:
        return self._worker.alive

    def status(self) -> dict[str, int]:
        return {"responder_port": self.port, "echoed": self.echoed, "dropped": self.dropped,
                "echo_errors": self.errors}

    def _loop(self) -> None:
        sock, magic, n = self._sock, pp.MAGIC, len(pp.MAGIC)
        while not self._worker.stopping.is_set():
            try:
                data, peer = sock.recvfrom(65535)
            except socket.timeout:
                continue
            except OSError:
                if self._worker.stopping.is_set():
                    return
                self.errors += 1
                self._worker.stopping.wait(0.01)
                continue
            if data[:n] != magic:
                if self._worker.stopping.is_set():
                    return
                self.dropped += 1
                continue
            try:
                sock.sendto(data, peer)
                self.echoed += 1
            except OSError:
                self.errors += 1


@dataclass
class _Epoch:
    """One pinglist while it is probed."""
    epoch: int
    peers: list[tuple[str, str, int]]           # (node id, host, port)
    settings: pp.PathSettings
    started_ns: int
    end_ns: int
    phase: float = field(default_factory=lambda: random.uniform(0.0, 0.5))   # where in its slot a probe starts
    next: int = 0
    verdicts: list[tuple[pp.PathVerdict, int, int]] = field(default_factory=list)   # (verdict, start, end ns)
    odd: list["_Odd"] = field(default_factory=list)     # paths awaiting confirmations, soonest due first

    @property
    def gap_ns(self) -> int:
        return int(self.settings.gap_s((self.end_ns - self.started_ns) / 1e9) * 1e9)

    def due_ns(self, i: int) -> int:
        """When the i-th first probe is due: spread over the epoch less its tail (PathSettings.tail_s), the
        time the last path's confirmations take at worst."""
        length = self.end_ns - self.started_ns
        tail = int(self.settings.tail_s(length / 1e9) * 1e9)
        return self.started_ns + int((i + self.phase) * (length - tail) / max(1, len(self.peers)))

    def defer(self, odd: "_Odd") -> None:
        """The path's next reading is due a gap after its last one ended (not after it was due: a thread
        that fell behind must not run them back to back)."""
        odd.due_ns = time.time_ns() + self.gap_ns
        self.odd.append(odd)
        self.odd.sort(key=lambda o: o.due_ns)

    def key(self) -> tuple:
        return self.epoch, tuple(self.peers), self.settings, self.end_ns


@dataclass
class _Odd:
    """A path whose first reading looked wrong, with the readings so far; the next one is due at due_ns."""
    peer: str
    host: str
    port: int
    ref: tuple[float | None, float | None]      # the node's reference (rtt, train) when it was first probed
    readings: list[pp.ProbeReading]
    started_ns: int
    due_ns: int


class _Stopping(Exception):
    pass


class PathProber:
    """Probes the current pinglist's paths and hands the epoch's results to ``sink.probe_result``.

    ``node_id``: this node's id (the results' node_a); ``address``: the fabric address the probes leave
    from; ``nic_env(result)`` puts the fabric NIC and its line rate in a result's env; ``responder``: this
    node's PathResponder, whose counters ``status()`` shows."""

    def __init__(self, node_id: Callable[[], str], sink: Any, *, address: str = "",
                 nic_env: Callable[[ProbeResult], None] | None = None, responder: PathResponder | None = None) -> None:
        self._sock = _udp_socket(address, 0, what="path prober")
        self._node_id = node_id
        self.sink = sink
        self._nic_env = nic_env
        self.responder = responder
        self._worker = BackgroundThread("gpuagent-path-prober", self._loop)
        self._stop = self._worker.stopping
        self._wake = threading.Event()
        self._mu = threading.Lock()
        self._queue: list[_Epoch] = []           # pinglists not yet taken by the thread, oldest first
        self._current: _Epoch | None = None
        self._recent: collections.deque[pp.PathVerdict] = collections.deque(maxlen=pp.PathSettings().reference_paths)
        self._probe_id = random.getrandbits(32)
        self.counts: dict[str, int] = collections.Counter()
        self.last_summary: dict[str, Any] = {}
        self._closed = False

    # -- lifecycle
    def start(self) -> "PathProber":
        self._worker.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (what the current epoch measured is reported first) and close the socket."""
        self._stop.set()
        self._wake.set()
        self._worker.stop(timeout)
        if not self._closed and not self._worker.alive:
            self._closed = True
            self._sock.close()

    @property
    def running(self) -> bool:
        return self._worker.alive

    # -- the pinglist
    def set_pinglist(self, epoch: int, peers: list[tuple[str, str, int]], settings: pp.PathSettings,
                     epoch_end_ns: int) -> None:
        """Probe ``peers`` ((node id, host, port) each) before ``epoch_end_ns``; replaces the pinglist before
        (whose results go out first). The same pinglist again (a resent one) changes nothing."""
        new = _Epoch(int(epoch), list(peers), settings, time.time_ns(), int(epoch_end_ns))
        with self._mu:
            latest = self._latest()
            if latest is not None and latest.key() == new.key():
                self.counts["pinglists_repeated"] += 1
                return
            self._queue.append(new)
            self.counts["pinglists"] += 1
            self._wake.set()

    def _latest(self) -> _Epoch | None:
        return self._queue[-1] if self._queue else self._current

    def take_pinglist(self, msg: Any) -> str:
        """A ``pinglist`` Assignment: its peers (members with "host:port" peer_addresses), settings (params),
        epoch and end (deadline_ns). Returns "" or the sentence saying why it was refused (the last pinglist
        then stays); a peer whose address does not parse is left out, and counted."""
        settings = pp.PathSettings.from_params(msg.params)
        if isinstance(settings, str):
            why = settings
        elif len(msg.members) != len(msg.peer_addresses):
            why = f"it names {len(msg.members)} peers but {len(msg.peer_addresses)} addresses"
        else:
            why = ""
        if why:
            self._count("bad_pinglists")
            log.warning("path probes: the pinglist of epoch %d is refused and the last one kept: %s", msg.epoch, why)
            return why
        peers, bad = [], []
        for node, addr in zip(msg.members, msg.peer_addresses):
            try:
                host, port = split_host_port(addr, f"peer {node}'s path-probe address")
            except AddressError as exc:
                bad.append(str(exc))
                continue
            if port == 0:
                bad.append(f"peer {node} has no path-probe responder (port 0)")
                continue
            peers.append((node, host, port))
        if bad:
            self._count("bad_peer_addresses", len(bad))
            log.warning("path probes: epoch %d leaves out %d peer(s): %s", msg.epoch, len(bad), bad[0])
        self.set_pinglist(msg.epoch, peers, settings, msg.deadline_ns)
        return ""

    def status(self) -> dict[str, Any]:
        """What ``gpuagent status`` shows: the newest pinglist, counters since start, the last summary."""
        with self._mu:
            latest = self._latest()
            out: dict[str, Any] = dict(self.counts)
            out.update(epoch=latest.epoch if latest else None, peers=len(latest.peers) if latest else 0,
                       last_summary=dict(self.last_summary))
        if self.responder is not None:
            out.update(self.responder.status())
        return out

    # -- the thread
    def _wait(self, seconds: float) -> None:
        self._wake.wait(max(0.0, min(seconds, 60.0)))

    def _loop(self) -> None:
        cur: _Epoch | None = None
        while True:
            with self._mu:
                queue, self._queue = self._queue, []
                self._wake.clear()
            for new in queue:       # each replaces the one before, which is reported as it stands
                if cur is not None:
                    self._report(cur, replaced=True)
                cur = new
                with self._mu:
                    self._current = cur
            if queue and self._recent.maxlen != cur.settings.reference_paths:
                self._recent = collections.deque(self._recent, maxlen=cur.settings.reference_paths)
            if self._stop.is_set():
                break
            if cur is None:
                self._wait(1.0)
                continue
            now = time.time_ns()
            first_due = cur.due_ns(cur.next) if cur.next < len(cur.peers) else cur.end_ns
            due = min(first_due, cur.odd[0].due_ns) if cur.odd else first_due
            if now >= cur.end_ns:
                self._report(cur)
                cur = None
                with self._mu:
                    self._current = None
            elif now < due:
                self._wait((due - now) / 1e9)
            else:
                try:
                    if cur.odd and cur.odd[0].due_ns <= now:
                        self._confirm(cur, cur.odd[0])
                    else:
                        node, host, port = cur.peers[cur.next]
                        cur.next += 1
                        self._first(cur, node, host, port)
                except _Stopping:
                    break
        if cur is not None and (cur.verdicts or cur.odd):   # stopping: what it measured goes out with the last batch
            self._report(cur)

    # -- one path
    def _first(self, ep: _Epoch, peer: str, host: str, port: int) -> None:
        """A path's first reading: its verdict now, or its confirmations due from ``gap_ns`` on."""
        s, t0 = ep.settings, time.time_ns()
        ref = pp.reference(self._recent, s)
        r = self.probe_path(host, port, s)
        if s.confirm and pp.reading_is_odd(r, *ref, s):
            ep.defer(_Odd(peer, host, port, ref, [r], t0, 0))
        else:
            self._final(ep, self._verdict(peer, [r], ref, s), t0)

    def _final(self, ep: _Epoch, v: pp.PathVerdict, t0: int) -> None:
        """A path's verdict joins the epoch's; a suspect goes to the sink at once (with the next batch, so
        that the collector can ask for its other end's probe in the next epoch's pinglist)."""
        t1 = time.time_ns()
        ep.verdicts.append((v, t0, t1))
        if v.suspect:
            self._to_sink([self._suspect_result(ep, v, t0, t1)])

    def _confirm(self, ep: _Epoch, odd: _Odd) -> None:
        """The next reading of ``odd`` (the soonest due, still first in ep.odd, so a stop in the middle
        leaves it there for the report)."""
        odd.readings.append(self.probe_path(odd.host, odd.port, ep.settings))
        ep.odd.remove(odd)
        if len(odd.readings) > ep.settings.confirm:
            self._final(ep, self._verdict(odd.peer, odd.readings, odd.ref, ep.settings), odd.started_ns)
        else:
            ep.defer(odd)

    def judge(self, peer: str, host: str, port: int, s: pp.PathSettings) -> pp.PathVerdict:
        """Probe one path now: one reading, ``confirm`` more right after it when it looks wrong against the
        node's recent paths (the thread spaces those ``confirm_gap_s`` apart between its other paths instead)."""
        ref = pp.reference(self._recent, s)
        readings = [self.probe_path(host, port, s)]
        if s.confirm and pp.reading_is_odd(readings[0], *ref, s):
            readings += [self.probe_path(host, port, s) for _ in range(s.confirm)]
        return self._verdict(peer, readings, ref, s)

    def _verdict(self, peer: str, readings: list[pp.ProbeReading], ref: tuple[float | None, float | None],
                 s: pp.PathSettings) -> pp.PathVerdict:
        """The path's verdict from its readings; it joins the node's recent paths."""
        v = pp.verdict(peer, readings, *ref, s)
        self._recent.append(v)
        with self._mu:
            self.counts["paths_probed"] += 1
            self.counts["probes"] += len(readings)
            self.counts["datagrams_sent"] += sum(r.sent for r in readings)
            self.counts["datagrams_lost"] += sum(r.lost for r in readings)
            if v.suspect:
                self.counts["suspects"] += 1
        return v

    def probe_path(self, host: str, port: int, s: pp.PathSettings) -> pp.ProbeReading:
        """One probe: ``pings`` datagrams one at a time, each waiting up to timeout_s for its echo, then a
        train of ``train_packets`` back to back; the rate from the spread of the train echoes' arrivals."""
        dest = (host, port)
        timeout_ns = int(s.timeout_s * 1e9)
        rtts: list[float] = []
        lost = 0
        pid = self._new_probe_id()
        buf = bytearray(max(s.ping_bytes, s.train_bytes))
        for seq in range(s.pings):
            if self._stop.is_set():
                raise _Stopping
            t_mono = time.monotonic_ns()
            if not self._send(buf, s.ping_bytes, pp.KIND_PING, pid, seq, s.pings, dest):
                lost += 1
                continue
            got = self._await(pid, pp.KIND_PING, {seq}, t_mono + timeout_ns)
            if seq not in got:
                lost += 1
                continue
            rx_ns, sent_ns, rx_mono = got[seq]
            rtt_ns = rx_ns - sent_ns
            if not 0 < rtt_ns <= timeout_ns:      # the wall clock stepped: the user-space round trip instead
                rtt_ns = rx_mono - t_mono
            rtts.append(rtt_ns / 1e3)
        if self._stop.is_set():
            raise _Stopping
        sent_ok = sum(self._send(buf, s.train_bytes, pp.KIND_TRAIN, pid, seq, s.train_packets, dest)
                      for seq in range(s.train_packets))
        got = self._await(pid, pp.KIND_TRAIN, set(range(s.train_packets)), time.monotonic_ns() + timeout_ns) \
            if sent_ok else {}
        lost += s.train_packets - len(got)
        arrivals = sorted(rx for rx, _sent, _mono in got.values())
        spread = arrivals[-1] - arrivals[0] if len(arrivals) >= 2 else 0
        gbits = (len(arrivals) - 1) * s.train_bytes * 8 / spread if spread > 0 else None    # bit/ns = Gbit/s
        return pp.ProbeReading(rtts_us=rtts, sent=s.datagrams(), lost=lost, train_gbits=gbits)

    def _count(self, key: str, n: int = 1) -> None:
        with self._mu:
            self.counts[key] += n

    def _new_probe_id(self) -> int:
        self._probe_id = (self._probe_id + 1) & 0xFFFFFFFF
        return self._probe_id

    def _send(self, buf: bytearray, size: int, kind: int, pid: int, seq: int, count: int, dest) -> bool:
        _HDR.pack_into(buf, 0, pp.MAGIC, kind, pid, seq, count, time.time_ns())
        try:
            self._sock.sendto(memoryview(buf)[:size], dest)
            return True
        except OSError:
            self._count("send_errors")
            return False

    def _await(self, pid: int, kind: int, want: set[int], deadline_mono_ns: int) -> dict[int, tuple[int, int, int]]:
        """Echoes of probe ``pid`` with a seq in ``want`` until all came or the deadline: seq -> (arrival
        ns, kernel's or else user space's; send ns from the header; arrival on the monotonic clock)."""
        got: dict[int, tuple[int, int, int]] = {}
        sock = self._sock
        while len(got) < len(want):
            left = (deadline_mono_ns - time.monotonic_ns()) / 1e9
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                data, anc, _flags, _addr = sock.recvmsg(65535, _ANC_SPACE)
            except socket.timeout:
                break
            except OSError:         # e.g. an ICMP error queued on the socket: that datagram is lost
                self._count("recv_errors")
                continue
            rx_mono = time.monotonic_ns()
            kernel = _kernel_ns(anc)
            if len(data) < _HDR.size:
                self._count("stray")
                continue
            magic, k, p, seq, _count, sent_ns = _HDR.unpack_from(data)
            if magic != pp.MAGIC or k != kind or p != pid or seq not in want or seq in got:
                self._count("stray")
                continue
            if kernel is None:
                self._count("user_timestamps")
            else:
                self._count("kernel_timestamps")
            got[seq] = (kernel if kernel is not None else time.time_ns(), sent_ns, rx_mono)
        return got

    # -- results
    def _report(self, ep: _Epoch, replaced: bool = False) -> None:
        """The epoch's summary to the sink, after the suspects of paths whose confirmations it cut short (the
        others went as they were confirmed)."""
        me, s = self._node_id(), ep.settings
        link = settings_key(s.as_params())
        ended = max(ep.started_ns, min(time.time_ns(), ep.end_ns))
        results = []
        for odd in ep.odd:      # the epoch ended (or was replaced) before all its confirmations: what they gave
            v = self._verdict(odd.peer, odd.readings, odd.ref, s)
            ep.verdicts.append((v, odd.started_ns, ended))
            if v.suspect:
                results.append(self._suspect_result(ep, v, odd.started_ns, ended))
        ep.odd = []
        params = {**pp.result_params(me, ep.epoch), "link_params": link}
        verdicts = [v for v, _t0, _t1 in ep.verdicts]
        if verdicts:
            summary = ProbeResult(pp.PROBE, "ok", "", params, pp.summary_metrics(verdicts, s), ep.started_ns, ended)
        else:
            if not ep.peers:
                why = f"the pinglist of epoch {ep.epoch} names no peer"
            elif replaced:
                why = f"a new pinglist replaced epoch {ep.epoch}'s before any of its {len(ep.peers)} paths was probed"
            else:
                why = (f"none of the {len(ep.peers)} paths of epoch {ep.epoch} was probed before the epoch ended "
                       "(did the pinglist arrive after its end? compare this node's clock with the collector's)")
            summary = ProbeResult(pp.PROBE, "skipped", why, params, {}, ep.started_ns, ended)
        results.append(summary)
        with self._mu:
            self.counts["epochs_reported"] += 1
            self.last_summary = {"epoch": ep.epoch, "status": summary.status, "reason": summary.reason,
                                 **summary.metrics}
        self._to_sink(results)

    def _suspect_result(self, ep: _Epoch, v: pp.PathVerdict, t0: int, t1: int) -> ProbeResult:
        """A suspect path as a result (params node_a/node_b/pair_id: it lands in link_results)."""
        params = {**pp.result_params(self._node_id(), ep.epoch, v.peer),
                  "link_params": settings_key(ep.settings.as_params())}
        return ProbeResult(pp.PROBE, "ok", "", params, pp.suspect_metrics(v), t0, t1, {"suspect": v.suspect})

    def _to_sink(self, results: list[ProbeResult]) -> None:
        for r in results:
            r.env["scheduler"] = "fabric"
            if self._nic_env is not None:
                self._nic_env(r)
        for r in results:
            for rec in r.sink_records():
                try:
                    self.sink.probe_result(rec)
                except Exception as exc:  # noqa: BLE001 - a sink problem must not kill the prober thread
                    log.warning("path probes: the sink refused a result: %s", first_line(exc))


def start_path_prober(agent: Any, client: Any) -> PathProber | None:
    """The fabric client's path prober (``[fabric] paths``; started by start_fabric_client), with the
    responder the daemon bound before Register (``agent.path_responder``; None when it could not bind, and
    then this node still probes its peers). None, with one sentence in the agent's unavailable list, when
    the prober's own socket cannot be bound."""
    try:
        prober = PathProber(client._node_id, client.sink, address=client.address, nic_env=client._nic_env,
                            responder=getattr(agent, "path_responder", None))
    except PathError as exc:
        msg = f"{exc}; path probes are off on this node"
        log.warning(msg)
        agent.unavailable.append(msg)
        return None
    log.info("path probes on: echo responder on UDP port %s", prober.responder.port if prober.responder else "none")
    return prober.start()
