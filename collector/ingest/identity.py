"""Who may stream as a node: one agent at a time, and a warning when hosts share a machine-id.

A node is the pair (machine_id, hostname) (``collector/store/nodes.find_node``). VM images cloned without a fresh
/etc/machine-id give several hosts one machine id, which causes two problems:

* Different hostnames: they are separate nodes and each one's data is stored completely, but the shared
  id is still a misconfiguration (journald, DHCP and dbus rely on it too). When two such nodes stream at
  the same time the collector logs one warning per pair (``shared_machine_id_sentence``) and marks both
  rows (``nodes.machine_id_shared_with``), where ``SELECT * FROM nodes`` shows it.
* The same hostname too: both agents are one node with one seq space, so one agent's batches would be
  acked as resends of the other's and dropped. The collector therefore lets one agent at a time stream as a
  node (a *claim*) and refuses another with ``ALREADY_EXISTS`` and one sentence
  (``refusal_sentence``); the refused agent keeps its batches spooled and retries with backoff.

A restart must not be mistaken for a second agent. The agent sends, as gRPC metadata on Register and
Stream, an id of its process (``gpuagent-instance``), the node its stream is for (``gpuagent-node-id``,
so the claim is taken when the stream opens, not at its first batch) and its batch interval. A claim gives
way to a newcomer when:

* it has the same instance id: the same process reconnecting (e.g. after its ack watchdog cancelled
  the call) while the collector has not yet noticed the old stream end;
* its stream has received nothing for ``max(takeover_idle_s, 3 x the agent's batch interval)``: the old
  peer is gone without closing its TCP connection (a crashed or rebooted host); a live agent sends a
  batch every batch interval, so a second live agent never qualifies;
* it ends within ``grace_s`` while the newcomer waits: a killed agent restarted at once, its old
  connection's reset not yet processed;
* it is a Register-only claim (Register done, no stream yet) older than ``PENDING_S``.

Clients that send no instance id (older agents, the simulator, tools) take no claim at Register and claim
at their stream's first batch of a node; the rules are the same. Claims live in memory only: after a
collector restart every agent reconnects and claims afresh. All methods run on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

log = logging.getLogger("gpuagent.collector")

PENDING_S = 15.0                              # a Register claim without a stream lapses after this
GRACE_S = 3.0                                 # a newcomer waits this long for a conflicting stream to end


class Refused(Exception):
    """Another agent streams as this node; the message is one sentence for the refused agent's operator."""


@dataclass(eq=False)
class Claim:
    node_id: str
    machine_id: str
    hostname: str
    instance: str | None
    peer: str
    interval_s: float
    owner: object | None                     # the stream holding it; None for a Register-only claim
    since_ns: int = field(default_factory=time.time_ns)
    active: float = field(default_factory=time.monotonic)     # last batch (or the claim itself)
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def who(self) -> str:
        pid = self.instance.split("-", 1)[0] if self.instance else ""
        host = peer_host(self.peer)
        return f"agent pid {pid} at {host}" if pid.isdigit() else f"a client at {host}"


def peer_host(peer: str) -> str:
    """'ipv4:10.0.0.5:41234' -> '10.0.0.5'; 'ipv6:[::1]:5' -> '::1'."""
    m = re.fullmatch(r"ipv[46]:\[?(.*?)\]?:\d+", peer or "")
    return m.group(1) if m else (peer or "an unknown address")


def _short(machine_id: str) -> str:
    return machine_id if len(machine_id) <= 12 else machine_id[:12] + "…"


def refusal_sentence(holder: Claim, node_id: str, hostname: str, machine_id: str) -> str:
    since = datetime.fromtimestamp(holder.since_ns / 1e9, timezone.utc).strftime("%H:%M:%S")
    idle = time.monotonic() - holder.active
    return (f"node {node_id} (hostname {hostname}, machine-id {_short(machine_id)}) is already streaming from "
            f"another agent ({holder.who()}, connected since {since} UTC, last batch {idle:.0f} s ago), so this "
            f"agent is refused rather than mixed into the same sequence numbers: stop the other agent, or if this "
            f"is a different host give it its own machine-id (`rm /etc/machine-id && systemd-machine-id-setup`) "
            f"and hostname, then restart gpuagent")


def shared_machine_id_sentence(machine_id: str, a: tuple[str, str], b: tuple[str, str]) -> str:
    """``a`` and ``b`` are (hostname, node_id), in hostname order."""
    (ha, na), (hb, nb) = sorted([a, b])
    return (f"hosts {ha} and {hb} both present machine-id {machine_id} (a VM image cloned without a fresh "
            f"/etc/machine-id?); their data is kept apart as nodes {na} and {nb}, but give each host its own id: "
            f"on the clone run `rm /etc/machine-id && systemd-machine-id-setup` and restart gpuagent "
            f"(it keeps its node)")


class NodeClaims:
    """Which client streams as each node (see the module docstring for the rules)."""

    def __init__(self, takeover_idle_s: float = 60.0, grace_s: float = GRACE_S, pending_s: float = PENDING_S):
        self.takeover_idle_s = takeover_idle_s
        self.grace_s = grace_s
        self.pending_s = pending_s
        self._claims: dict[str, Claim] = {}
        self._warned: set[tuple[str, str]] = set()

    def _gives_way(self, held: Claim, instance: str | None, owner: object | None) -> str:
        """Why ``held`` may be replaced by this newcomer ('' when it may not)."""
        now = time.monotonic()
        if owner is not None and held.owner is owner:
            return "same stream"
        if instance and held.instance == instance:
            return "same agent process"
        if held.owner is None:
            return "register claim lapsed" if now - held.active > self.pending_s else ""
        bound = max(self.takeover_idle_s, 3.0 * held.interval_s)
        return f"stream idle {now - held.active:.0f} s" if now - held.active > bound else ""

    async def acquire(self, node_id: str, machine_id: str, hostname: str, instance: str | None, peer: str,
                      interval_s: float, owner: object | None) -> None:
        """Claim ``node_id`` for a stream (``owner``) or a Register (``owner`` None); raise Refused."""
        deadline = time.monotonic() + self.grace_s
        while True:
            held = self._claims.get(node_id)
            why = "" if held is None else self._gives_way(held, instance, owner)
            if held is None or why:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise Refused(refusal_sentence(held, node_id, hostname, machine_id))
            try:    # in short steps: the holder may also pass its idle bound meanwhile
                await asyncio.wait_for(asyncio.shield(held.released.wait()), min(left, 0.25))
            except asyncio.TimeoutError:
                pass
        if held is not None and held.owner is not None and owner is None and instance and held.instance == instance:
            return      # the same process registering again while its stream runs: the stream keeps it
        claim = Claim(node_id, machine_id, hostname, instance, peer, interval_s, owner)
        self._claims[node_id] = claim
        if held is not None and held is not claim:
            if held.owner is not None and held.owner is not owner:
                log.info("node %s: %s takes over from %s (%s)", node_id, claim.who(), held.who(), why)
                evict = getattr(held.owner, "evict", None)
                if evict is not None:
                    evict(f"another stream took over node {node_id} ({why})")
            held.released.set()

    def holds(self, node_id: str, owner: object) -> bool:
        """True (and the claim marked active) while ``owner`` holds ``node_id``."""
        c = self._claims.get(node_id)
        if c is None or c.owner is not owner:
            return False
        c.active = time.monotonic()
        return True

    def release(self, owner: object) -> None:
        """The stream ended: free what it held."""
        for node_id, c in list(self._claims.items()):
            if c.owner is owner:
                del self._claims[node_id]
                c.released.set()

    def streams(self) -> int:
        """Streams holding a node now (any thread: reads one snapshot of the claims)."""
        return sum(1 for c in list(self._claims.values()) if c.owner is not None)

    def newly_shared(self, node_id: str, machine_id: str, hostname: str) -> list[tuple[str, str, str]]:
        """Other live nodes presenting ``machine_id`` under another hostname, each pair reported once per
        collector run: [(sentence, other node_id, other hostname)]."""
        out = []
        now = time.monotonic()
        for other, c in self._claims.items():
            if other == node_id or c.machine_id != machine_id or c.hostname.lower() == hostname.lower():
                continue
            if c.owner is None and now - c.active > self.pending_s:
                continue
            key = tuple(sorted((node_id, other)))
            if key in self._warned:
                continue
            self._warned.add(key)
            out.append((shared_machine_id_sentence(machine_id, (hostname, node_id), (c.hostname, other)),
                        other, c.hostname))
        return out
