#!/usr/bin/env python3
"""A real multi-node network on one machine: N network namespaces on one bridge, for fabric tests and demos.

Each node is a namespace ``gpa<owner>-n<i>`` with a veth pair (``gpa<owner>-h<i>`` on the bridge
``gpa<owner>-br``, ``eth0`` inside) and the address 10.203.0.<i+1>/24. The bridge has no address and
no route leads there from the host, so test traffic stays between these namespaces. Commands run in a
node with ``ip netns exec`` plus ``unshare --uts`` and the node's own hostname, and ``ip netns exec``
bind-mounts the node's /etc/netns/<ns>/machine-id over /etc/machine-id, so an agent there sees a
distinct machine. The bridge does not call iptables (nf_call_iptables 0): the host firewall neither
drops nor slows this traffic.

Throttles (netem is not in every kernel; tbf and htb are):
  * node: tbf on both directions of its link (the host-side veth's egress is the node's ingress);
  * pair: an htb class with a u32 filter on the peer's address, on each of the two nodes' eth0 egress,
    so only traffic between those two is shaped (unclassified traffic bypasses htb unshaped).
  A node carries either a node throttle or pair throttles, not both (``unthrottle`` first).
  The bucket (``burst``, bytes) defaults to at least 64 KiB (``_burst_bytes``), which suits TCP (a GSO
  super-packet must fit) but lets any shorter burst through at the veth's own speed: a path probe's train
  (32 x 1400 B = 45 KB, common/path_probe.py) passes such a bucket unshaped, so a node throttled with
  the default burst looks healthy to the path probes while net_pair (seconds of TCP) sees the rate. A
  link that really came up at a lower rate has no such bucket; ``burst=16384`` (``--burst 16k``) shapes
  the train too. It must hold one full frame (at least 2 KiB).

Every name starts with ``gpa<ownerpid>-``, so parallel runs never collide, and everything with that
prefix is removed when the owner goes: by ``down``/context exit, by the CLI's SIGTERM/SIGINT handler,
and, when the owner is SIGKILLed, by a reaper (a setsid'd child) that waits for the owner to disappear.
``reap`` removes what any dead owner left behind. State lives in /run/gpuagent-netns/<prefix>.json.

CLI (root): up N [--owner PID] | down | list | reap | throttle-node NAME RATE | throttle-pair A B RATE |
unthrottle NAME | exec NAME -- CMD... | demo [--agents 4] [--group-size K]   (RATE as tc writes it: 200mbit, 1gbit,
500kbit; throttle-node and throttle-pair take --burst BYTES, e.g. 16k).
Without --owner, ``up`` holds the fleet in the foreground until Ctrl-C; with ``--owner $$`` it returns
and the fleet lives as long as that process. ``demo`` builds agents+1 nodes and runs a gpuagent collector
(fabric rounds on) in the last and an agent in each other one (``FabricProcesses``, which the e2e tests
use too), prints each finished round, and removes it all at Ctrl-C; run it with the project's Python.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

SUBNET = "10.203.0"
MAX_NODES = 250
STATE_DIR = Path("/run/gpuagent-netns")
ETC_NETNS = Path("/etc/netns")
PREFIX_RE = re.compile(r"^gpa(\d+)-")
REAP_POLL_S = 0.2


class FleetError(RuntimeError):
    """A fleet operation that cannot be done; the message is one sentence."""


def prefix_for(owner_pid: int) -> str:
    return f"gpa{owner_pid}-"


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise FleetError(f"{' '.join(argv)} failed: {msg[-1] if msg else f'exit code {proc.returncode}'}")
    return proc


def unavailable_reason() -> str:
    """'' when this process can build a fleet, else why not (one sentence)."""
    if os.geteuid() != 0:
        return "the namespace testbed needs root (ip netns, tc)"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"the namespace testbed needs {tool}, which is not on PATH"
    if _run(["ip", "netns", "list"], check=False).returncode != 0:
        return "`ip netns list` does not work here"
    return ""


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it does not exist; with the pid,
    this tells a live owner from a new process that reused its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def owner_alive(pid: int, start_time: int | None) -> bool:
    now = process_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def parse_rate(rate: str) -> int:
    """A tc rate ("200mbit", "1gbit", "500kbit", "1000000") as bits per second; FleetError if not one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*", str(rate).lower())
    if not m:
        raise FleetError(f"rate {rate!r} is not a tc rate such as 200mbit or 1gbit")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    bits = float(m.group(1)) * scale * (8 if m.group(3) == "bps" else 1)
    if bits < 8000:
        raise FleetError(f"rate {rate!r} is below 8kbit, too low to shape TCP meaningfully")
    return int(bits)


def _burst_bytes(bits_per_s: int) -> int:
    # At least one 4 ms refill (a jiffy at HZ=250) and 64 KiB, so a GSO super-packet always fits.
    return max(64 * 1024, bits_per_s // 8 // 250)


MIN_BURST = 2048        # one full-size frame with room to spare: a smaller bucket would never pass one


def parse_burst(burst: "int | str | None", bits_per_s: int) -> int:
    """The bucket in bytes: ``_burst_bytes`` when None, else ``burst`` (bytes, or "16k"/"1m" as tc writes
    sizes), at least MIN_BURST; FleetError if not. (A bucket under one timer tick's refill, rate / HZ, held
    the rate only on kernels whose qdisc watchdog ran on jiffies; today's runs on hrtimers.)"""
    if burst is None:
        return _burst_bytes(bits_per_s)
    m = re.fullmatch(r"\s*(\d+)\s*([km]?)b?\s*", str(burst).lower())
    if not m:
        raise FleetError(f"burst {burst!r} is not a size in bytes such as 16384 or 16k")
    size = int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2)]
    if size < MIN_BURST:
        raise FleetError(f"burst {burst!r} is below {MIN_BURST} bytes: a bucket must hold one full-size frame")
    return size


@dataclass(frozen=True)
class Node:
    name: str          # n0, n1, ... (what the CLI takes)
    index: int
    ns: str            # the namespace: <prefix><name>
    ip: str
    hostname: str      # the UTS hostname commands see
    host_veth: str     # the bridge side of its link


# ---------------------------------------------------------------- teardown (used by every exit path)

def _links_with(prefix: str) -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            name = parts[1].strip().split("@", 1)[0]
            if name.startswith(prefix):
                names.append(name)
    return names


def _netns_with(prefix: str) -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def teardown_prefix(prefix: str, grace_s: float = 1.0) -> None:
    """Remove every namespace, link, /etc/netns entry and state file with ``prefix``; processes still
    running in those namespaces get SIGTERM, then SIGKILL after ``grace_s``. Idempotent."""
    namespaces = _netns_with(prefix)
    pids: set[int] = set()
    for ns in namespaces:
        pids.update(int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit())
    pids.discard(os.getpid())
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 0)
        while time.monotonic() < deadline and any(process_start_time(p) is not None for p in pids):
            time.sleep(0.02)
    for link in _links_with(prefix):
        _run(["ip", "link", "del", link], check=False)   # one end of a veth takes its peer with it
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)
    if ETC_NETNS.is_dir():
        for entry in ETC_NETNS.iterdir():
            if entry.name.startswith(prefix):
                shutil.rmtree(entry, ignore_errors=True)
    (STATE_DIR / f"{prefix}.json").unlink(missing_ok=True)


def fleets() -> list[dict[str, Any]]:
    """Every fleet prefix seen in state files, namespaces or links: {prefix, owner, alive}."""
    seen: dict[str, dict[str, Any]] = {}
    if STATE_DIR.is_dir():
        for f in STATE_DIR.glob("gpa*-.json"):
            try:
                state = json.loads(f.read_text())
                seen[state["prefix"]] = {"prefix": state["prefix"], "owner": int(state["owner"]),
                                         "owner_start": state.get("owner_start")}
            except (OSError, ValueError, KeyError, TypeError):
                continue
    names = _run(["ip", "netns", "list"], check=False).stdout.split() + _links_with("gpa")
    for name in names:
        m = PREFIX_RE.match(name)
        if m and m.group(0) not in seen:
            seen[m.group(0)] = {"prefix": m.group(0), "owner": int(m.group(1)), "owner_start": None}
    for f in seen.values():
        f["alive"] = owner_alive(f["owner"], f["owner_start"])
    return sorted(seen.values(), key=lambda f: f["owner"])


def reap() -> list[str]:
    """Remove the fleets whose owner is gone; returns their prefixes."""
    gone = [f["prefix"] for f in fleets() if not f["alive"]]
    for prefix in gone:
        teardown_prefix(prefix)
    return gone


def _watch(owner: int, owner_start: int | None, prefix: str) -> None:
    """The reaper's loop: tear the fleet down once its owner is gone; leave quietly if it was torn down."""
    state = STATE_DIR / f"{prefix}.json"
    while owner_alive(owner, owner_start):
        if not state.exists():
            return
        time.sleep(REAP_POLL_S)
    teardown_prefix(prefix)


# ---------------------------------------------------------------- the fleet

class Fleet:
    """``Fleet.up(4)`` builds the nodes; ``down()`` (or leaving a ``with`` block) removes them."""

    def __init__(self, owner: int, owner_start: int | None, nodes: list[Node]) -> None:
        self.owner, self.owner_start = owner, owner_start
        self.prefix = prefix_for(owner)
        self.nodes = {n.name: n for n in nodes}
        self.reaper: subprocess.Popen | None = None

    # -- lifecycle
    @classmethod
    def up(cls, n: int, owner: int | None = None, reaper: bool = True) -> "Fleet":
        """Build ``n`` nodes owned by ``owner`` (default: this process). Anything built is removed again
        if a step fails. Raises FleetError."""
        why = unavailable_reason()
        if why:
            raise FleetError(why)
        if not 2 <= n <= MAX_NODES:
            raise FleetError(f"a fleet has 2 to {MAX_NODES} nodes, not {n}")
        owner = os.getpid() if owner is None else int(owner)
        owner_start = process_start_time(owner)
        if owner_start is None:
            raise FleetError(f"owner process {owner} does not exist")
        prefix = prefix_for(owner)
        if _netns_with(prefix) or _links_with(prefix):
            raise FleetError(f"process {owner} already owns a fleet ({prefix}*); take it down first")
        nodes = [Node(f"n{i}", i, f"{prefix}n{i}", f"{SUBNET}.{i + 1}", f"{prefix}n{i}", f"{prefix}h{i}")
                 for i in range(n)]
        fleet = cls(owner, owner_start, nodes)
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        fleet._save()
        try:
            if reaper:
                fleet.reaper = subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "_watch", str(owner), str(owner_start), prefix],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True, close_fds=True)
            fleet._build()
        except BaseException:
            teardown_prefix(prefix)
            raise
        return fleet

    @classmethod
    def attach(cls, owner: int | None = None) -> "Fleet":
        """The live fleet of ``owner``, or the only live fleet when no owner is given (CLI commands)."""
        live = [f for f in fleets() if f["alive"]]
        if owner is not None:
            live = [f for f in live if f["owner"] == owner]
        if not live:
            raise FleetError("no live fleet found" + (f" for owner {owner}" if owner is not None else ""))
        if len(live) > 1:
            raise FleetError(f"{len(live)} live fleets (owners {', '.join(str(f['owner']) for f in live)}); "
                             "pick one with --owner")
        try:
            state = json.loads((STATE_DIR / f"{live[0]['prefix']}.json").read_text())
        except (OSError, ValueError):
            raise FleetError(f"fleet {live[0]['prefix']} has no readable state file") from None
        return cls(state["owner"], state.get("owner_start"), [Node(**n) for n in state["nodes"]])

    def _save(self) -> None:
        state = {"prefix": self.prefix, "owner": self.owner, "owner_start": self.owner_start,
                 "nodes": [asdict(n) for n in self.nodes.values()]}
        tmp = STATE_DIR / f"{self.prefix}.json.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(STATE_DIR / f"{self.prefix}.json")

    def _build(self) -> None:
        br = f"{self.prefix}br"
        _run(["ip", "link", "add", br, "type", "bridge", "nf_call_iptables", "0", "nf_call_ip6tables", "0",
              "nf_call_arptables", "0"])
        _run(["ip", "link", "set", br, "up"])
        for node in self.nodes.values():
            etc = ETC_NETNS / node.ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "machine-id").write_text(hashlib.md5(node.ns.encode()).hexdigest() + "\n")
            (etc / "hostname").write_text(node.hostname + "\n")
            _run(["ip", "netns", "add", node.ns])
            _run(["ip", "link", "add", node.host_veth, "type", "veth", "peer", "name", "eth0", "netns", node.ns])
            _run(["ip", "link", "set", node.host_veth, "master", br, "up"])
            _run(["ip", "-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", "eth0"])
            _run(["ip", "-n", node.ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", node.ns, "link", "set", "lo", "up"])

    def down(self) -> None:
        teardown_prefix(self.prefix)
        if self.reaper is not None:
            try:
                self.reaper.wait(timeout=REAP_POLL_S * 10)   # it leaves once the state file is gone
            except subprocess.TimeoutExpired:
                self.reaper.kill()
                self.reaper.wait()
            self.reaper = None

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- running things in a node
    def node(self, name: str) -> Node:
        if name not in self.nodes:
            raise FleetError(f"no node {name!r} in fleet {self.prefix} (nodes: {', '.join(self.nodes)})")
        return self.nodes[name]

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside node ``name``, under the node's own hostname."""
        node = self.node(name)
        return ["ip", "netns", "exec", node.ns, "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', node.hostname, *argv]

    def exec(self, name: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.command(name, argv), **kw)

    def popen(self, name: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(self.command(name, argv), **kw)

    # -- throttles
    def _root_kind(self, ns_args: list[str], dev: str) -> str:
        out = _run(["tc", *ns_args, "qdisc", "show", "dev", dev, "root"], check=False).stdout.split()
        return out[1] if len(out) > 1 and out[0] == "qdisc" else ""

    def throttle_node(self, name: str, rate: str, burst: "int | str | None" = None) -> None:
        """Shape everything node ``name`` sends and receives to ``rate`` (tbf on both ends of its link), with
        a bucket of ``burst`` bytes (default ``_burst_bytes``: >= 64 KiB, which a path probe's train passes
        unshaped; see the module docstring)."""
        node, bits = self.node(name), parse_rate(rate)
        size = parse_burst(burst, bits)
        inside = ["-n", node.ns]
        if self._root_kind(inside, "eth0") == "htb":
            raise FleetError(f"node {name} has pair throttles; unthrottle it before a node throttle")
        for ns_args, dev in (([], node.host_veth), (inside, "eth0")):
            _run(["tc", *ns_args, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bits}bit",
                  "burst", str(size), "latency", "50ms"])

    def throttle_pair(self, a: str, b: str, rate: str, burst: "int | str | None" = None) -> None:
        """Shape only the traffic between nodes ``a`` and ``b`` to ``rate``, each way, with buckets (burst and
        cburst) of ``burst`` bytes (default ``_burst_bytes``, as for throttle_node)."""
        na, nb, bits = self.node(a), self.node(b), parse_rate(rate)
        size = parse_burst(burst, bits)
        if na == nb:
            raise FleetError("a pair throttle needs two different nodes")
        for src, dst in ((na, nb), (nb, na)):
            inside = ["-n", src.ns]
            kind = self._root_kind(inside, "eth0")
            if kind == "tbf":
                raise FleetError(f"node {src.name} has a node throttle; unthrottle it before a pair throttle")
            if kind != "htb":
                _run(["tc", *inside, "qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "htb"])
            classid = f"1:{dst.index + 10:x}"
            shape = ["rate", f"{bits}bit", "ceil", f"{bits}bit", "burst", str(size), "cburst", str(size),
                     "quantum", "60000"]
            classes = _run(["tc", *inside, "class", "show", "dev", "eth0"], check=False).stdout
            if f"htb {classid} " in classes:
                _run(["tc", *inside, "class", "change", "dev", "eth0", "parent", "1:", "classid", classid, "htb",
                      *shape])
                continue
            _run(["tc", *inside, "class", "add", "dev", "eth0", "parent", "1:", "classid", classid, "htb", *shape])
            _run(["tc", *inside, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1",
                  "u32", "match", "ip", "dst", f"{dst.ip}/32", "flowid", classid])

    def unthrottle(self, name: str) -> None:
        """Remove node ``name``'s node and pair throttles (a peer's pair class towards it stays)."""
        node = self.node(name)
        for ns_args, dev in (([], node.host_veth), (["-n", node.ns], "eth0")):
            if self._root_kind(ns_args, dev) in ("tbf", "htb"):
                _run(["tc", *ns_args, "qdisc", "del", "dev", dev, "root"])

    def net_pair(self, connector: str, listener: str, *, python: str = sys.executable,
                 port_range: str = "42000-42999", timeout_s: float = 120.0, **settings: Any) -> dict[str, Any]:
        """One gpuagent net_pair run from node ``connector`` to node ``listener`` (both ends real processes
        in their namespaces); the connecting end's result dict, with the listener's under "listener".
        ``settings`` are the connect CLI's options as keywords (duration=3, streams=4, ...)."""
        secret = os.urandom(16).hex()
        env = {**os.environ, "GPUAGENT_NET_PAIR_SECRET": secret, "PYTHONUNBUFFERED": "1"}
        target = self.node(listener)
        lst = self.popen(listener, [python, "-m", "gpuagent.probes.net_pair", "listen", "--bind", target.ip,
                                    "--port-range", port_range, "--accept-timeout", "20"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            first = json.loads(lst.stdout.readline() or "{}")
            if "listening" not in first:
                lst.wait(timeout=10)
                raise FleetError(f"the net_pair listener did not start: {first or lst.stderr.read()[-300:]}")
            args = [python, "-m", "gpuagent.probes.net_pair", "connect", target.ip, str(first["listening"]["port"])]
            for key, value in settings.items():
                args += [f"--{key.replace('_', '-')}", str(value)]
            con = self.exec(connector, args, env=env, timeout=timeout_s)
            lines = con.stdout.strip().splitlines()
            if con.returncode != 0 or not lines:
                raise FleetError(f"net_pair connect exited {con.returncode}: {con.stderr.strip()[-300:]}")
            result = json.loads(lines[-1])
            out, err = lst.communicate(timeout=timeout_s)
            result["listener"] = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"stderr": err[-300:]}
            return result
        finally:
            if lst.poll() is None:
                lst.kill()
                lst.wait()

    def describe(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "owner": self.owner,
                "nodes": [{"name": n.name, "ns": n.ns, "ip": n.ip, "hostname": n.hostname}
                          for n in self.nodes.values()]}


# ---------------------------------------------------------------- a collector and agents on a fleet

FABRIC_PORT = 7443


def fabric_collector_toml(*, analyze_every: str = "1h", interval_s: float = 0.0, group_size: int = 0,
                          answer_timeout_s: float = 3.0, run_timeout_s: float = 8.0) -> str:
    """A collector config that plans pair rounds on its own, with short runs (2 streams, 1 s each way), so a
    4-node sweep takes seconds; ``analyze_every`` is the analyzer's pass interval ("30s", "1h"). An end that
    has not answered an offer within ``answer_timeout_s``, or a run not over within ``run_timeout_s``, makes
    the pair a skip or a timeout (the collector's defaults are 5 s and 30 s). With
    ``group_size`` each sweep is followed by a round of collective groups of that size (gloo, one rank per
    node, messages up to 1 MiB: a run is mostly torch's start-up)."""
    groups = "" if not group_size else f"""group_size = {group_size}
group_run_timeout_s = 120
[fabric.collective_params]
backend = "gloo"
nprocs = 1
max_bytes = 1048576
iters = 5
latency_iters = 20
"""
    return f"""
[analyzer]
interval = "{analyze_every}"
fabric_runs = 1
[fabric.params]
streams = 2
duration_s = 1.0
warmup_s = 0.2
rtt_count = 50
[fabric]
enabled = true
interval_s = {interval_s:g}
scope_key = "pool"
answer_timeout_s = {answer_timeout_s:g}
run_timeout_s = {run_timeout_s:g}
port_lo = 42000
port_hi = 42100
{groups}"""


FABRIC_AGENT_TOML = """
[probes]
enabled = false
budget_fraction = 0.5
[fabric]
enabled = true
interface = "eth0"
"""


class FabricProcesses:
    """A gpuagent collector in one node and an agent in each of the others: real processes, started with
    ``python -m gpuagent...`` (the e2e tests pass ``agent_cmd`` for an agent on the NVML emulator), their
    logs, database and state under ``workdir``. Everything runs inside the namespaces, so taking the fleet
    down kills whatever is left. Used by tests/test_fabric_e2e.py and the ``demo`` command."""

    def __init__(self, fleet: Fleet, workdir: Path, agents: Sequence[str], collector: str, *, token: str,
                 collector_toml: str, agent_toml: str = FABRIC_AGENT_TOML, agent_cmd: Sequence[str] | None = None,
                 agent_env: Any = None, label: str = "pool=fab", python: str = sys.executable,
                 cwd: str | None = None) -> None:
        self.fleet, self.workdir = fleet, Path(workdir)
        self.agent_names, self.collector_name = list(agents), collector
        self.token, self.collector_toml, self.agent_toml = token, collector_toml, agent_toml
        self.agent_cmd = list(agent_cmd) if agent_cmd else [python, "-m", "gpuagent.agent.cli"]
        self.agent_env = agent_env or (lambda name: {})
        self.label, self.python, self.cwd = label, python, cwd
        self.addr = f"{fleet.node(collector).ip}:{FABRIC_PORT}"
        self.col_log = self.workdir / "collector.log"
        self.collector: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "agent.toml").write_text(self.agent_toml)
        self.start_collector()
        for name in self.agent_names:
            self.start_agent(name)

    def start_collector(self) -> None:
        """Start (or start again, after ``stop_collector``) the collector, with ``collector_toml`` as it is
        now (a test may change it between the two) and the same database; the agents reconnect by themselves."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "collector.toml").write_text(self.collector_toml)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPUAGENT_COLLECTOR_TOKEN": self.token}
        self.collector = self.fleet.popen(self.collector_name, [
            self.python, "-m", "gpuagent.collector.cli", "serve", "--listen", self.addr, "--insecure",
            "--db", str(self.workdir / "collector.duckdb"), "--config", str(self.workdir / "collector.toml")],
            stdout=open(self.col_log, "ab"), stderr=subprocess.STDOUT, env=env, cwd=self.cwd)

    def stop_collector(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to the collector (SIGKILL after ``timeout_s``); the agents keep running and spool."""
        p = self.collector
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def start_agent(self, name: str) -> None:
        """Start (or start again, after it was stopped) the agent of node ``name``, with its own state dir."""
        state = self.workdir / name
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUAGENT_")}
        env.update(GPUAGENT_JOBS_SOCKET=str(state / "jobs.sock"), MALLOC_ARENA_MAX="2", GPUAGENT_TOKEN=self.token,
                   **self.agent_env(name))
        self.agents[name] = self.fleet.popen(name, [
            *self.agent_cmd, "run", "--config", str(self.workdir / "agent.toml"), "--collector", self.addr,
            "--state-dir", str(state), "--interval", "1", "--batch-interval", "1", "--label", self.label],
            stdout=open(self.workdir / f"{name}.log", "ab"), stderr=subprocess.STDOUT, env=env, cwd=self.cwd)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to the agents and the collector, SIGKILL to whatever is still there after ``timeout_s``."""
        procs = [p for p in [*self.agents.values(), self.collector] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def cli(self, *args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        """``gpuagent-collector ARGS`` run in the collector's node, with the token."""
        return self.fleet.exec(self.collector_name, [self.python, "-m", "gpuagent.collector.cli", *args],
                               cwd=self.cwd, timeout=timeout_s,
                               env={**os.environ, "GPUAGENT_COLLECTOR_TOKEN": self.token})

    def rounds_done(self) -> list[str]:
        """The collector's "fabric round N done: ..." log lines so far, and its "fabric group round" and
        "fabric rdma round" ones (collective groups, rdma pairs), from "fabric" on, in log order."""
        try:
            text = self.col_log.read_text(errors="replace")
        except OSError:
            return []
        return [m.group(0) for m in re.finditer(r"fabric (?:group |rdma )?round \d+ done: .*", text)]


def _demo(args: argparse.Namespace) -> int:
    """A collector and ``--agents`` agents on a fresh fleet, until Ctrl-C (or ``--for`` seconds)."""
    import importlib.util
    import secrets
    import tempfile
    if importlib.util.find_spec("gpuagent") is None:
        raise FleetError(f"{sys.executable} cannot import gpuagent: run this with the project's Python "
                         "(.venv/bin/python scripts/netns_fleet.py demo, after make install)")
    if not 2 <= args.agents <= MAX_NODES - 1:
        raise FleetError(f"a demo has 2 to {MAX_NODES - 1} agents, not {args.agents}")
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="gpuagent-fabric-demo-"))
    token = secrets.token_hex(16)
    stop = {"sig": 0}

    def on_signal(signum: int, frame: object) -> None:  # noqa: ARG001
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    fleet = Fleet.up(args.agents + 1)
    names = [f"n{i}" for i in range(args.agents)]
    collector = f"n{args.agents}"
    procs = FabricProcesses(fleet, workdir, names, collector, token=token,
                            collector_toml=fabric_collector_toml(analyze_every=args.analyze_every,
                                                                 interval_s=args.interval_s,
                                                                 group_size=args.group_size))
    try:
        procs.start()
        token_file = workdir / "token"
        token_file.write_text(token + "\n")
        token_file.chmod(0o600)
        me = f"{sys.executable} {os.path.abspath(__file__)}"
        print(f"fabric demo: collector in {collector} ({procs.addr}), agents in {names[0]}..{names[-1]} "
              f"(label {procs.label}); logs and the database in {workdir}\n"
              f"In another root shell:\n"
              f"  {me} throttle-node n1 100mbit          # one slow node: network_degraded/node\n"
              f"  {me} unthrottle n1; {me} throttle-pair n0 n2 100mbit   # one slow pair: /link\n"
              f"  {me} exec {collector} -- env GPUAGENT_COLLECTOR_TOKEN=$(cat {token_file}) \\\n"
              f"      {sys.executable} -m gpuagent.collector.cli fabric --target {procs.addr}\n"
              f"The analyzer runs every {args.analyze_every}; a link counts once it has a run. "
              f"Ctrl-C stops everything and removes the namespaces.", flush=True)
        shown, deadline = 0, (time.monotonic() + args.for_s) if args.for_s else None
        while not stop["sig"] and (deadline is None or time.monotonic() < deadline):
            for name, p in [("collector", procs.collector), *procs.agents.items()]:
                if p is not None and p.poll() is not None:
                    log = procs.col_log if name == "collector" else workdir / f"{name}.log"
                    raise FleetError(f"the {name} process exited with status {p.returncode}; see {log}")
            done = procs.rounds_done()
            for line in done[shown:]:
                print(line, flush=True)
            shown = len(done)
            time.sleep(0.5)
    finally:
        procs.stop()
        fleet.down()
        print(f"fabric demo stopped; namespaces removed; files kept in {workdir}", flush=True)
    return 0


# ---------------------------------------------------------------- CLI

def _hold(fleet: Fleet) -> int:
    """Foreground owner: wait for SIGINT/SIGTERM, then take the fleet down."""
    stop = {"sig": 0}

    def on_signal(signum: int, frame: object) -> None:  # noqa: ARG001
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not stop["sig"]:
            signal.pause()
    finally:
        fleet.down()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="netns_fleet.py", description="Namespace testbed for fabric probes (root).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="build N nodes; holds them until Ctrl-C unless --owner is given")
    p.add_argument("n", type=int)
    p.add_argument("--owner", type=int, help="tie the fleet to this process (e.g. $$) and return")
    for name, hlp in (("down", "take a fleet down"), ("list", "show fleets and whether their owner lives"),
                      ("reap", "remove fleets whose owner is gone")):
        sp = sub.add_parser(name, help=hlp)
        if name == "down":
            sp.add_argument("--owner", type=int)
    burst_help = "the shaper's bucket in bytes (16384, 16k); default >= 64 KiB, which path-probe trains pass unshaped"
    p = sub.add_parser("throttle-node", help="shape one node's link, both ways")
    p.add_argument("name")
    p.add_argument("rate")
    p.add_argument("--burst", help=burst_help)
    p.add_argument("--owner", type=int)
    p = sub.add_parser("throttle-pair", help="shape only the path between two nodes")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("rate")
    p.add_argument("--burst", help=burst_help)
    p.add_argument("--owner", type=int)
    p = sub.add_parser("unthrottle", help="remove a node's throttles")
    p.add_argument("name")
    p.add_argument("--owner", type=int)
    p = sub.add_parser("exec", help="run a command in a node: exec NAME -- CMD...")
    p.add_argument("name")
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.add_argument("--owner", type=int)
    p = sub.add_parser("demo", help="a collector and agents with fabric probes on a fresh fleet, until Ctrl-C")
    p.add_argument("--agents", type=int, default=4, help="agent nodes (the collector gets one more)")
    p.add_argument("--dir", help="where logs, state and the database go (default: a new temporary folder)")
    p.add_argument("--interval-s", type=float, default=10.0, help="seconds between pair rounds")
    p.add_argument("--analyze-every", default="30s", help="the analyzer's interval (flags open after a pass)")
    p.add_argument("--for", dest="for_s", type=float, default=0.0, help="stop after this many seconds (0: Ctrl-C)")
    p.add_argument("--group-size", type=int, default=0,
                   help="after each sweep, a round of gloo collective rings of this many nodes (0: none; needs torch)")
    w = sub.add_parser("_watch")   # the reaper (internal)
    w.add_argument("owner", type=int)
    w.add_argument("owner_start", type=int)
    w.add_argument("prefix")
    args = ap.parse_args(argv)

    try:
        if args.cmd == "_watch":
            _watch(args.owner, args.owner_start, args.prefix)
            return 0
        if args.cmd == "up":
            fleet = Fleet.up(args.n, owner=args.owner)
            print(json.dumps(fleet.describe()), flush=True)
            return 0 if args.owner is not None else _hold(fleet)
        if args.cmd == "demo":
            return _demo(args)
        if args.cmd == "list":
            print(json.dumps(fleets()))
            return 0
        if args.cmd == "reap":
            print(json.dumps({"reaped": reap()}))
            return 0
        fleet = Fleet.attach(args.owner)
        if args.cmd == "down":
            fleet.down()
        elif args.cmd == "throttle-node":
            fleet.throttle_node(args.name, args.rate, args.burst)
        elif args.cmd == "throttle-pair":
            fleet.throttle_pair(args.a, args.b, args.rate, args.burst)
        elif args.cmd == "unthrottle":
            fleet.unthrottle(args.name)
        elif args.cmd == "exec":
            cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not cmd:
                raise FleetError("exec needs a command after --")
            return subprocess.run(fleet.command(args.name, cmd)).returncode
    except FleetError as exc:
        print(f"netns_fleet: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
