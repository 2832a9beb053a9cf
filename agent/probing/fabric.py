"""The agent's end of fabric probes: takes pair assignments from the collector and runs net_pair.

A thread holds the ``Assignments`` stream (collector/fabric/coordinator.py). On an ``offer`` the agent
answers at once: busy (``busy()`` gives the reason: a job holds the GPUs), the probe lock is taken, or the
run would not fit the probe budget (``FabricBudget``, checked with the lock held), else accepted. An
accepting listener binds in the offered port range on its fabric address first and answers with the port;
an accepting connector waits for ``go``. The lock is held from the accept until the run ends or the pair
is cancelled, and the offer's deadline bounds the wait, so a silent collector or peer cannot hold the
node. Both ends hand their result (probe ``net_pair``, params with ``node_a``, ``node_b`` and
``pair_id``) to ``sink.probe_result`` for the next batch, charge its recorded duration to the budget
before releasing the lock, and tell the collector when their part of the run is over. A pair cancelled
before its peer connected leaves no result and no charge. Each end also puts its own NIC's line rate in
the result's env (``nic``, ``nic_speed_mbits``; agent/samplers/netif.py), read at each run since a link can
renegotiate; the collector takes the lower of the two ends as the link's.

A group offer (probe ``collective``) is gated the same way, and also refused when torch is not installed
here or the group's settings do not parse. Rank 0 answers with a free port in its range, which the torch
rendezvous (TCPStore) then binds; on ``go`` every member runs the collective probe as a subprocess
(probes/runner.py) with ``nnodes``, ``node_rank``, ``master_addr`` and ``master_port`` from the assignment
and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set to the fabric interface; a ``cancel`` kills it. The result
carries ``group_id``, ``members`` and ``group_params`` in its params, which puts it in ``group_results``.
An ``rdma_pair`` offer takes the same path as a group of two, [listener, connector]: refused with the
probe's own reason when this node has no RDMA device or perftest; the listener answers with a port whose
successor is free too (perftest's latency run uses it); its result carries ``node_a``/``node_b`` like a
net_pair's, which puts it in ``link_results``. A ``pinglist`` (probe ``path_probe``) goes to the path prober
(agent/probing/paths.py, ``[fabric] paths``), which needs neither lock nor budget and answers nothing.
"""

from __future__ import annotations

import collections
import importlib.util
import logging
import os
import threading
import time
from typing import Any, Callable

import grpc

from gpuagent.agent.samplers import netif
from gpuagent.agent.snapshot import FabricRun, FabricStatus
from gpuagent.common.background import BackgroundThread
from gpuagent.common.errors import first_line
from gpuagent.common.parse import settings_key
from gpuagent.probes import net_pair, rdma_pair, registry, runner
from gpuagent.probes.lock import ProbeLock
from gpuagent.probes.result import ProbeResult
from gpuagent.proto import pb, pb_grpc

log = logging.getLogger("gpuagent.agent.probing.fabric")

GROUP_PROBES = ("collective", "rdma_pair")     # run through the group path: offer, go to all, a subprocess

_SETTINGS = {"streams": int, "duration_s": float, "warmup_s": float, "rtt_count": int, "rtt_bytes": int,
             "chunk_kib": int}


def _settings(params) -> net_pair.PairSettings | str:
    """PairSettings from the assignment's text params, or the sentence saying what is wrong."""
    try:
        got = {k: conv(params[k]) for k, conv in _SETTINGS.items() if k in params}
    except ValueError as exc:
        return f"the assignment's probe parameters do not parse: {exc}"
    s = net_pair.PairSettings(**got)
    return s.problem() or s


RECENT_RUNS = 8     # runs kept for `gpuagent status`


class FabricClient:
    def __init__(self, channel: grpc.Channel, node_id: Callable[[], str], address: str, sink: Any, *,
                 busy: Callable[[], str] = lambda: "", lock: ProbeLock | None = None,
                 metadata: tuple[tuple[str, str], ...] = (), retry_s: float = 2.0,
                 budget: "FabricBudget | None" = None, port_range: tuple[int, int] = (0, 0),
                 interface: str = "", sys_class_net: str = netif.SYS_CLASS_NET) -> None:
        self._channel = channel
        self._owns_channel = False     # start_fabric_client hands over a channel of its own
        self._stub = pb_grpc.CollectorStub(channel)
        self._node_id = node_id
        self.address = address
        self.sink = sink
        self.busy = busy
        self.lock = lock
        self._md = metadata
        self._retry_s = retry_s
        self.budget = budget
        self._port_range = port_range     # this node's own range; (0, 0): the offer's
        self.interface = interface        # the NIC fabric traffic uses ("" unknown): its line rate is reported
        self._sys_class_net = sys_class_net
        self._worker = BackgroundThread("gpuagent-fabric", self._loop)
        self._stop = self._worker.stopping
        self._call = None
        self._pending: dict[str, tuple[pb.Assignment, Any]] = {}   # pair id -> (offer, listener or None)
        self._groups: dict[str, tuple[pb.Assignment, threading.Event]] = {}   # group id -> (offer, cancel)
        self._mu = threading.Lock()
        self.counts: dict[str, int] = {}
        self._recent: collections.deque[FabricRun] = collections.deque(maxlen=RECENT_RUNS)
        self._stream_open = False
        self._stream_error = ""
        self._last_message_ns = 0
        self.paths: Any = None            # the PathProber ([fabric] paths), which takes the pinglists

    # -- lifecycle
    def start(self) -> "FabricClient":
        self._worker.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        if self._owns_channel:
            self._channel.close()
        with self._mu:
            pending = list(self._pending)
            groups = list(self._groups)
        for pid in pending:
            self._drop(pid)
        for gid in groups:
            self._drop_group(gid)
        self._worker.stop(timeout)
        if self.paths is not None:
            self.paths.stop(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            node_id = self._node_id()
            if not node_id:
                self._stop.wait(0.2)
                continue
            try:
                self._call = self._stub.Assignments(pb.AssignmentsRequest(node_id=node_id), metadata=self._md)
                self._stream_open = True
                for msg in self._call:
                    self._last_message_ns = time.time_ns()
                    self._stream_error = ""
                    self._handle(node_id, msg)
                self._stream_error = "the collector ended the stream"
            except grpc.RpcError as exc:
                self._stream_error = first_line(exc.details() if hasattr(exc, "details") else exc)
                if not self._stop.is_set():
                    log.info("fabric assignments stream ended: %s", self._stream_error)
            self._stream_open = False
            self._stop.wait(self._retry_s)

    def fabric_status(self) -> FabricStatus:
        """What ``gpuagent status`` shows: the stream, the counters and the last runs, newest first."""
        with self._mu:
            recent = list(reversed(self._recent))
            counts = dict(self.counts)
        return FabricStatus(address=self.address, stream_open=self._stream_open, stream_error=self._stream_error,
                            last_message_ns=self._last_message_ns, counts=counts, recent=recent,
                            paths=self.paths.status() if self.paths is not None else None)

    # -- messages
    def _count(self, key: str) -> None:
        with self._mu:
            self.counts[key] = self.counts.get(key, 0) + 1

    def _answer(self, **kw) -> bool:
        try:
            return self._stub.AnswerAssignment(pb.AssignmentAnswer(**kw), metadata=self._md, timeout=5.0).known
        except grpc.RpcError as exc:
            log.warning("fabric: answering the collector failed: %s", first_line(exc))
            return False
        except ValueError as exc:        # the channel was closed: the client is stopping
            log.info("fabric: not answering the collector: %s", first_line(exc))
            return False

    def _handle(self, node_id: str, msg: pb.Assignment) -> None:
        if msg.kind == "pinglist":      # path probes: no answer, no lock, no budget
            if self.paths is not None:
                self.paths.take_pinglist(msg)
            return None
        if msg.probe in GROUP_PROBES:
            return self._handle_group(node_id, msg)
        if msg.kind == "offer" and msg.probe not in ("", "net_pair"):
            return self._refuse(node_id, msg, f"this agent does not run fabric probe {msg.probe!r}")
        if msg.kind == "offer":
            self._offer(node_id, msg)
        elif msg.kind == "go":
            with self._mu:
                known = msg.pair_id in self._pending
            if known:
                threading.Thread(target=self._connect, args=(node_id, msg), daemon=True,
                                 name="gpuagent-fabric-connect").start()
        elif msg.kind == "cancel":
            self._count("cancelled")
            self._drop(msg.pair_id)

    def _refuse(self, node_id: str, msg: pb.Assignment, reason: str) -> None:
        self._count("busy")
        log.info("fabric: pair %s refused: %s", msg.pair_id, reason)
        self._answer(node_id=node_id, pair_id=msg.pair_id, accepted=False, reason=reason)

    def _offer(self, node_id: str, msg: pb.Assignment) -> None:
        reason = self.busy()
        if reason:
            return self._refuse(node_id, msg, reason)
        settings = _settings(msg.params)
        if isinstance(settings, str):
            return self._refuse(node_id, msg, settings)
        if self.lock is not None and (self.lock.held or not self.lock.acquire(0.0, what=f"net_pair {msg.pair_id}")):
            return self._refuse(node_id, msg, f"lock: another probe run holds {self.lock.path}")
        # Checked while holding the lock: a run that held it before has been charged by now.
        reason = self.budget.problem(msg.params) if self.budget is not None else ""
        if reason:
            self._release()
            return self._refuse(node_id, msg, reason)
        listener = None
        port = 0
        if msg.role == "listen":
            wait_s = max(1.0, (msg.deadline_ns - time.time_ns()) / 1e9 + 30.0)
            ports = self._port_range if self._port_range[0] else (msg.port_lo, msg.port_hi)
            listener = net_pair.NetPairListener(msg.secret, self.address or "0.0.0.0", ports,
                                                accept_timeout_s=wait_s)
            if listener.error is not None:
                self._release()
                return self._refuse(node_id, msg, listener.error.reason)
            port = listener.port
        with self._mu:
            self._pending[msg.pair_id] = (msg, listener)
        if not self._answer(node_id=node_id, pair_id=msg.pair_id, accepted=True, port=port):
            self._drop(msg.pair_id)
            return
        self._count("accepted")
        if listener is not None:
            threading.Thread(target=self._serve, args=(node_id, msg, listener), daemon=True,
                             name="gpuagent-fabric-listen").start()
        else:
            self._give_up_without_go(msg, self._drop)

    @staticmethod
    def _give_up_without_go(offer: pb.Assignment, drop: Callable[[str, bool], None]) -> None:
        """The go must come before the offer's deadline plus the collector's answer wait; else ``drop``
        (with only_if_waiting) forgets the accepted offer and frees the lock."""
        timer = threading.Timer(max(1.0, (offer.deadline_ns - time.time_ns()) / 1e9 + 10.0),
                                drop, args=(offer.pair_id, True))
        timer.daemon = True
        timer.start()

    def _release(self) -> None:
        if self.lock is not None and self.lock.held:
            self.lock.release()

    def _drop(self, pair_id: str, only_if_waiting: bool = False) -> None:
        with self._mu:
            entry = self._pending.get(pair_id)
            if entry is None or (only_if_waiting and entry[1] is None and entry[0].kind != "offer"):
                return
            self._pending.pop(pair_id)
        _offer, listener = entry
        if listener is not None:
            listener.close()
        self._release()

    def _finish(self, offer: pb.Assignment, result: ProbeResult) -> None:
        # link_params: the run's settings as the collector set them, the same text at both ends.
        link_params = settings_key(offer.params)
        result.params.update({"node_a": offer.node_a, "node_b": offer.node_b, "pair_id": offer.pair_id,
                              "link_params": link_params})
        result.env.setdefault("scheduler", "fabric")
        self._nic_env(result)
        self._count(f"result:{result.status}")
        me_a = offer.role != "listen"
        m = result.metrics
        run = FabricRun(pair_id=offer.pair_id, peer=offer.peer_node_id or (offer.node_b if me_a else offer.node_a),
                        role="connect" if me_a else "listen", status=result.status, reason=result.reason or "",
                        ended_ns=time.time_ns(), send_gbits_per_s=m.get("send_gbits_per_s"),
                        recv_gbits_per_s=m.get("recv_gbits_per_s"), rtt_p50_us=m.get("rtt_p50_us"))
        self._keep(run, result)

    def _nic_env(self, result: ProbeResult) -> None:
        """The fabric NIC and its line rate, read now (a link can renegotiate), in the result's env."""
        if self.interface:
            result.env["nic"] = self.interface
            speed = netif.link_speed_mbits(self.interface, self._sys_class_net)
            if speed is not None:
                result.env["nic_speed_mbits"] = speed

    def _keep(self, run: FabricRun, result: ProbeResult) -> None:
        """Remember the run for `gpuagent status` and hand its result to the sink (the next batch)."""
        with self._mu:
            self._recent.append(run)
        for rec in result.sink_records():
            try:
                self.sink.probe_result(rec)
            except Exception:  # noqa: BLE001 - a sink problem must not kill the fabric thread
                log.exception("fabric: the sink refused the %s result", result.probe)

    def _charge(self, result: ProbeResult) -> None:
        """Charge the run's recorded duration (its result's started..ended, what link_results shows) to the
        probe budget; called before the lock is released, so the next holder sees it."""
        if self.budget is not None:
            self.budget.charge(result)

    def _serve(self, node_id: str, offer: pb.Assignment, listener: net_pair.NetPairListener) -> None:
        result = None
        try:
            result = listener.serve()
        finally:
            with self._mu:
                owned = self._pending.pop(offer.pair_id, None) is not None
            # A pair cancelled before its peer connected never ran: no row, no charge.
            ran = result is not None and (owned or bool(listener.peer))
            if ran:
                self._charge(result)
            if owned:
                self._release()
        if ran:
            self._finish(offer, result)
        if owned:
            self._answer(node_id=node_id, pair_id=offer.pair_id, finished=True, status=result.status,
                         reason=result.reason)

    def _connect(self, node_id: str, go: pb.Assignment) -> None:
        with self._mu:
            entry = self._pending.get(go.pair_id)
            if entry is not None:
                self._pending[go.pair_id] = (go, None)
        if entry is None:
            return
        settings = _settings(go.params)
        timeout = max(1.0, (go.deadline_ns - time.time_ns()) / 1e9)
        result = None
        try:
            result = net_pair.connect(go.peer_address, go.port, go.secret, settings,
                                      connect_timeout_s=min(10.0, timeout), io_timeout_s=min(10.0, timeout))
        finally:
            with self._mu:
                owned = self._pending.pop(go.pair_id, None) is not None
            if result is not None:
                self._charge(result)
            if owned:
                self._release()
        self._finish(go, result)
        self._answer(node_id=node_id, pair_id=go.pair_id, finished=True, status=result.status,
                     reason=result.reason)

    # -- groups: collective rings and rdma pairs
    def _handle_group(self, node_id: str, msg: pb.Assignment) -> None:
        if msg.kind == "offer":
            self._group_offer(node_id, msg)
        elif msg.kind == "go":
            with self._mu:      # one hold: the go-wait timer cannot drop the group in between
                entry = self._groups.get(msg.pair_id)
                waiting = entry is not None and entry[0].kind == "offer"
                if waiting:
                    self._groups[msg.pair_id] = (msg, entry[1])
            if waiting:
                threading.Thread(target=self._group_run, args=(node_id, msg, entry[1]), daemon=True,
                                 name="gpuagent-fabric-group").start()
        elif msg.kind == "cancel":
            self._count("cancelled")
            self._drop_group(msg.pair_id)

    def _group_params(self, msg: pb.Assignment) -> dict[str, Any] | str:
        """The probe's parameters for this member, or the sentence saying what is wrong."""
        members = list(msg.members)
        if len(members) < 2 or msg.node_rank >= len(members) or (msg.probe == "rdma_pair" and len(members) != 2):
            return f"the group offer is malformed: rank {msg.node_rank} of {len(members)} members"
        if msg.probe == "collective":
            params = {**msg.params, "nnodes": str(len(members)), "node_rank": str(msg.node_rank)}
        else:
            params = {**msg.params, "role": "listen" if msg.node_rank == 0 else "connect"}
        try:
            return registry.parse_params(msg.probe, params)
        except registry.ParamError as exc:
            return f"the group's {msg.probe} settings do not parse: {first_line(exc)}"

    def _rendezvous_port(self, msg: pb.Assignment) -> tuple[int, str]:
        """Rank 0's port for the run (torch's TCPStore, or perftest's exchange on it and the next one):
        free now in the range; the probe binds it on go."""
        lo, hi = self._port_range if self._port_range[0] else (msg.port_lo, msg.port_hi)
        need_next = msg.probe == "rdma_pair"
        bind = self.address or "0.0.0.0"
        for _ in range(16):
            sock, why = net_pair.listen_in_range(bind, (lo, hi - 1) if need_next and lo else (lo, hi))
            if sock is None:
                return 0, why
            port = sock.getsockname()[1]
            nxt = None
            if need_next:
                nxt, _why = net_pair.listen_in_range(bind, (port + 1, port + 1))
            sock.close()
            if nxt is not None:
                nxt.close()
            if not need_next or nxt is not None:
                return port, ""
        return 0, f"no two free consecutive ports in {lo}-{hi} on {bind}"

    def _group_offer(self, node_id: str, msg: pb.Assignment) -> None:
        reason = self.busy()
        if reason:
            return self._refuse(node_id, msg, reason)
        if msg.probe == "collective" and importlib.util.find_spec("torch") is None:
            return self._refuse(node_id, msg, "torch is not installed on this node, so it cannot run the "
                                "collective probe (pip install 'gpuagent[probes]')")
        if msg.probe == "rdma_pair":
            reason = rdma_pair.unavailable_reason()
            if reason:
                return self._refuse(node_id, msg, reason)
        params = self._group_params(msg)
        if isinstance(params, str):
            return self._refuse(node_id, msg, params)
        if list(msg.members)[msg.node_rank] != node_id:
            return self._refuse(node_id, msg, f"the group offer puts node {msg.members[msg.node_rank]} at "
                                f"rank {msg.node_rank}, not this node")
        if self.lock is not None and (self.lock.held or not self.lock.acquire(0.0, what=f"{msg.probe} {msg.pair_id}")):
            return self._refuse(node_id, msg, f"lock: another probe run holds {self.lock.path}")
        reason = self.budget.problem(msg.params, msg.probe) if self.budget is not None else ""
        if reason:
            self._release()
            return self._refuse(node_id, msg, reason)
        port = 0
        if msg.node_rank == 0:
            port, why = self._rendezvous_port(msg)
            if not port:
                self._release()
                return self._refuse(node_id, msg, why)
        cancel = threading.Event()
        with self._mu:
            self._groups[msg.pair_id] = (msg, cancel)
        if not self._answer(node_id=node_id, pair_id=msg.pair_id, accepted=True, port=port):
            self._drop_group(msg.pair_id)
            return
        self._count("accepted")
        self._give_up_without_go(msg, self._drop_group)

    def _drop_group(self, group_id: str, only_if_waiting: bool = False) -> None:
        """Forget a group: a waiting one releases the lock here; a running one is stopped (its run thread
        releases the lock when the probe subprocess is gone)."""
        with self._mu:
            entry = self._groups.get(group_id)
            if entry is None or (only_if_waiting and entry[0].kind != "offer"):
                return
            running = entry[0].kind == "go"
            if not running:
                self._groups.pop(group_id)
        entry[1].set()
        if not running:
            self._release()

    def _group_run(self, node_id: str, go: pb.Assignment, cancel: threading.Event) -> None:
        params = self._group_params(go)
        result = None
        try:
            if isinstance(params, str):
                result = ProbeResult(go.probe, "failed", params, {})
            else:
                # End the probe a little before the collector's deadline, so its own timeout is what the
                # group's outcome says, not a missing report.
                left = (go.deadline_ns - time.time_ns()) / 1e9
                timeout = max(1.0, left - min(10.0, 0.1 * left) - runner.TERM_GRACE_S)
                env = dict(os.environ)
                if go.probe == "collective":
                    params.update(master_addr=go.peer_address, master_port=go.port)
                    params["init_timeout_s"] = min(float(params["init_timeout_s"]), timeout)
                    if self.interface:
                        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = self.interface
                else:
                    params.update(tcp_port=go.port, peer=go.peer_address if go.node_rank else "")
                    params["accept_timeout_s"] = min(float(params["accept_timeout_s"]), timeout)
                try:
                    result = runner.run_probe(go.probe, params, timeout, cancel=cancel, env=env)
                except registry.ParamError as exc:    # e.g. a port the go carried that the probe refuses
                    result = ProbeResult(go.probe, "failed", f"the run's settings were refused: {first_line(exc)}",
                                         params)
        finally:
            with self._mu:
                self._groups.pop(go.pair_id, None)
            if result is not None:
                self._charge(result)
            self._release()
        if not cancel.is_set():         # a cancelled run is not a measurement
            self._finish_group(go, result)
        self._answer(node_id=node_id, pair_id=go.pair_id, finished=True,
                     status=result.status, reason=result.reason)

    def _finish_group(self, go: pb.Assignment, result: ProbeResult) -> None:
        settings = settings_key(go.params)
        if go.probe == "rdma_pair":
            listener, connector = go.members[0], go.members[1]
            result.params.update({"node_a": connector, "node_b": listener, "pair_id": go.pair_id,
                                  "link_params": settings})
        else:
            result.params.update({"group_id": go.pair_id, "members": ",".join(go.members),
                                  "node_rank": go.node_rank, "group_params": settings})
        result.env.setdefault("scheduler", "fabric")
        self._nic_env(result)
        self._count(f"result:{result.status}")
        if go.probe == "rdma_pair":
            run = FabricRun(pair_id=go.pair_id, peer=go.members[1 - go.node_rank],
                            role="listen" if go.node_rank == 0 else "connect", status=result.status,
                            reason=result.reason or "", ended_ns=time.time_ns(),
                            send_gbits_per_s=result.metrics.get("write_gbits_per_s"))
            return self._keep(run, result)
        run = FabricRun(pair_id=go.pair_id, peer=",".join(m for i, m in enumerate(go.members) if i != go.node_rank),
                        role=f"rank {go.node_rank}", status=result.status, reason=result.reason or "",
                        ended_ns=time.time_ns(), busbw_gbytes_per_s=result.metrics.get("busbw_gbps"))
        self._keep(run, result)


# ---------------------------------------------------------------- wiring into the daemon

OVERHEAD_S = 1.0    # latency pings, connection set-up and the report, on top of the timed transfer phases


def estimate_s(params) -> float:
    """A run's wall time from its settings, before one is measured: net_pair times each direction for
    warmup_s + duration_s, plus OVERHEAD_S (the defaults, 4.6 s of transfer, took 4.7 s on loopback).
    Unparsable settings give the defaults' figure; such an offer is refused anyway."""
    s = _settings(params)
    if isinstance(s, str):
        s = net_pair.PairSettings()
    return 2 * (s.warmup_s + s.duration_s) + OVERHEAD_S


# A collective group run before one has been measured: the probe's CPU defaults (64 KiB-16 MiB, 2 gloo
# ranks per node) took 8.8 s between two processes on a 2-core KVM guest, most of it starting torch; GPU
# sweeps to 1 GiB take longer, and the last completed run takes over from this figure.
COLLECTIVE_FIRST_ESTIMATE_S = 15.0
# rdma_pair beyond its bandwidth phase: two perftest start-ups and TCP exchanges, and the latency run. A
# guess, not a measurement (no RDMA device here); the last completed run takes over.
RDMA_OVERHEAD_S = 5.0


class FabricBudget:
    """The fabric's share of the node's probe budget: the probe scheduler's window, which the scheduled
    probes check too. An offer is refused with the scheduler's ``budget: ...`` reason unless a run fits,
    judged by the larger of the settings' estimate and the last completed run of that probe (a slow
    network makes runs longer than their settings say); every run is charged its recorded duration."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.last_s: dict[str, float] = {}     # probe -> its last completed run's duration

    def estimate_s(self, params, probe: str = "net_pair") -> float:
        if probe == "collective":
            first = COLLECTIVE_FIRST_ESTIMATE_S
        elif probe == "rdma_pair":     # ib_write_bw for duration_s, then ib_write_lat, each with its exchange
            default_s = rdma_pair.SPEC.defaults["duration_s"]
            try:
                first = float(params.get("duration_s", default_s)) + RDMA_OVERHEAD_S
            except ValueError:
                first = default_s + RDMA_OVERHEAD_S
        else:
            first = estimate_s(params)
        return max(first, self.last_s.get(probe, 0.0))

    def problem(self, offer_params, probe: str = "net_pair") -> str:
        return self.sched.budget_problem(self.estimate_s(offer_params, probe))

    def charge(self, result: ProbeResult) -> None:
        """Charge every run; only a completed one informs the estimate (a listener that waited in vain
        for its peer, or a run cut by a timeout, says nothing about how long a run takes)."""
        self.sched.charge(result.duration_s)
        if result.status == "ok":
            self.last_s[result.probe] = result.duration_s


def start_fabric_client(agent: Any) -> "FabricClient | None":
    """The daemon's EXTRA_FACTORIES hook (None unless ``[fabric] enabled``).

    Busy when job discovery sees a job on any GPU, when the probe budget (shared with the probe scheduler,
    which is charged for every fabric run) is spent, or when the node-wide probe lock is held. The
    stream uses the sender's collector settings (address, TLS, token) on a channel of its own."""
    cfg = agent.cfg
    if not cfg.fabric.enabled:
        return None
    from gpuagent.agent.probing.scheduler import ProbeScheduler, _busy_gpus_from

    sched = next((x for x in agent.extras if isinstance(x, ProbeScheduler)), None)
    if sched is None:      # probes are off: a scheduler that never starts still keeps the budget
        sched = ProbeScheduler(agent.batcher, cfg.probes, state_dir=str(cfg.state_dir))
    busy_gpus = _busy_gpus_from(agent.samplers)

    def busy() -> str:
        held = busy_gpus()
        return f"gpus busy: a job holds GPU {', '.join(map(str, held))}" if held else ""

    sender = agent.sender
    address = agent.node_info.fabric_address
    iface = cfg.fabric.interface or netif.interface_for_address(address)
    client = FabricClient(sender.open_channel(), lambda: sender.state.node_id, address,
                          agent.batcher, busy=busy, lock=ProbeLock(sched.lock_path), metadata=sender.metadata(),
                          budget=FabricBudget(sched), port_range=(cfg.fabric.port_lo, cfg.fabric.port_hi),
                          interface=iface)
    client._owns_channel = True
    if cfg.fabric.paths:
        from gpuagent.agent.probing.paths import start_path_prober
        client.paths = start_path_prober(agent, client)
    speed = netif.link_speed_mbits(iface) if iface else None
    log.info("fabric probes on: peers reach this node at %s%s; NIC %s, line rate %s", client.address,
             f", ports {cfg.fabric.port_lo}-{cfg.fabric.port_hi}" if cfg.fabric.port_lo else "",
             iface or "not found", f"{speed} Mbit/s" if speed else "unknown")
    return client.start()
