"""The neighbour and network series of job discovery (agent/samplers/job_discovery.py, whose module doc says
what each series means): the CPU, storage and network used by everything outside a job, named by command, and
the job's own TCP connections off the node (rates, RTT, busy send rate). A mixin of JobDiscovery, apart from the
scan and the tick because it keeps its own state (every process's last CPU and I/O counters, the sockets'
counters and owners) and reads /proc and sock_diag on its own cadence."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gpuagent.agent.samplers.job_procfs import _CLK_TCK
from gpuagent.agent.samplers.tcp_sockets import socket_inodes_until, tcp_connections

log = logging.getLogger("gpuagent.agent.samplers.job_discovery")

NEIGHBOUR_NAMED_MIN = 5.0   # % of one core: below this a neighbour is not worth naming
NEIGHBOUR_TOP = 5
NEIGHBOUR_IO_NAMED_MIN = 1_000_000   # bytes/s: below this a disk neighbour is not worth naming
NEIGHBOUR_NET_NAMED_MIN = 1_000_000  # bytes/s: below this a network neighbour is not worth naming
SOCKET_OWNER_RETRY_S = 30.0   # a socket with no owner found (a kernel socket, another user's) is sought again then,
SOCKET_OWNER_RETRY_MAX_S = 600.0   # ... and after twice as long each time it is not found, up to this
OWNER_WALK_BUDGET_S = 0.02    # the most one read spends reading /proc/<pid>/fd (5-10 us an fd here)
NET_RETRY_S = 60.0            # sock_diag failed: asked again after this
BUSY_MIN_S = 0.01             # less busy sending than this in an interval: too little to give a job's busy rate


@dataclass
class _NetRead:
    """One read of the TCP connections that leave the node, per owning process (see _net_rates)."""
    rates: dict[int, float] = field(default_factory=dict)             # bytes/s sent (acked) + received
    rtts: dict[int, list[int]] = field(default_factory=dict)          # smoothed RTTs, us
    busy: dict[int, tuple[int, int]] = field(default_factory=dict)    # (bytes acked, us busy sending)


def _by_command(values: dict[int, float], excluded: set[int], comm: dict[int, str]) -> dict[str, list]:
    """Per-process values summed per command name, leaving out ``excluded`` pids: eight stress-ng workers at
    8 % each are one 64 % neighbour. Each entry: [total, processes, pid of the largest, its value]."""
    out: dict[str, list] = {}
    for p, v in values.items():
        if p not in excluded:
            e = out.setdefault(comm.get(p, "?"), [0.0, 0, p, 0.0])
            e[0] += v
            e[1] += 1
            if v > e[3]:
                e[2], e[3] = p, v
    return out


class JobContentionMixin:
    """JobDiscovery's neighbour and network series; the state it uses is set up in JobDiscovery.__init__."""

    proc: str
    net_interval_s: float
    _jobs: dict[str, Any]
    _read_bytes: Callable[[int, str], bytes | None]
    _io: Callable[[int], tuple[int, int] | None]

    def _contention(self, ts_ns: int, t: float, sink, job_pids: dict[str, set[int]],
                    gpu_progress: dict[str, float], job_attrs: dict[str, dict[str, str]]) -> None:
        """Per job: its progress, and the CPU used by everything outside it (see the module doc)."""
        if not job_pids:
            self._all_cpu.clear()
            self._all_io.clear()
            self._forget_connections()
            self._last_contention_t = None
            return
        try:
            names = [int(n) for n in os.listdir(self.proc) if n.isdigit()]
        except OSError:
            return
        cpu: dict[int, float] = {}
        parent: dict[int, int] = {}
        comm: dict[int, str] = {}
        seen: dict[int, tuple[int, int, float]] = {}
        for pid in names:
            raw = self._read_bytes(pid, "stat")
            if not raw:
                continue
            close = raw.rfind(b")")
            rest = raw[close + 2:].split()
            if rest[:1] == [b"Z"]:      # exited, not reaped yet: it runs nothing and holds no files
                continue
            try:
                ticks, start, ppid = int(rest[11]) + int(rest[12]), int(rest[19]), int(rest[1])
            except (IndexError, ValueError):
                continue
            comm[pid] = raw[raw.find(b"(") + 1:close].decode("utf-8", "replace")
            parent[pid] = ppid
            seen[pid] = (start, ticks, t)
            prev = self._all_cpu.get(pid)
            if prev is not None and prev[0] == start and t > prev[2]:
                cpu[pid] = max(0, ticks - prev[1]) / _CLK_TCK / (t - prev[2]) * 100.0
        dt_s = t - self._last_contention_t if self._last_contention_t is not None else None
        io_rate = self._io_rates(seen, cpu, dt_s)
        try:
            net = self._net_rates(seen, t)
        except Exception as e:   # noqa: BLE001 - the network series are extra; the tick goes on without them
            if not self._net_failed:
                log.warning("job discovery: reading the TCP connections failed (%s: %s); network neighbours are "
                            "not sampled until it works again", type(e).__name__, e)
            self._net_failed = True
            self._net_retry_t = t + NET_RETRY_S
            self._forget_connections()
            net = _NetRead()
        self._last_contention_t = t
        self._all_cpu = seen

        def tree(roots: set[int]) -> set[int]:
            """The roots and all their descendants."""
            children: dict[int, list[int]] = {}
            for pid, pp in parent.items():
                children.setdefault(pp, []).append(pid)
            out, todo = set(), list(roots)
            while todo:
                pid = todo.pop()
                if pid not in out:
                    out.add(pid)
                    todo.extend(children.get(pid, ()))
            return out

        agent = tree({self._self_pid})
        for job_id, pids in job_pids.items():
            mine = tree(pids)
            attrs = job_attrs.get(job_id, {})
            cg_ids = {v for k, v in attrs.items() if k in ("container_id", "pod_uid") and v}
            if cg_ids:   # a container or pod is a job boundary: everything in it is the job's
                for pid in names:
                    if pid not in mine:
                        cg = (self._read_bytes(pid, "cgroup") or b"").decode("utf-8", "replace")
                        if any(c in cg for c in cg_ids):
                            mine.add(pid)
            if job_id not in gpu_progress and not any(p in cpu for p in mine):
                continue   # the job's first tick: no CPU deltas yet, and 0 would read as a stall
            lab = {"job_id": job_id}
            if job_id in gpu_progress:
                sink.add("job_progress_percent", gpu_progress[job_id], labels=dict(lab, source="gpu_util"), ts_ns=ts_ns)
            else:
                sink.add("job_progress_percent", sum(cpu.get(p, 0.0) for p in mine),
                         labels=dict(lab, source="cpu_share"), ts_ns=ts_ns)
            outside = mine | agent
            by_comm = _by_command(cpu, outside, comm)
            sink.add("job_neighbour_cpu_percent", sum(e[0] for e in by_comm.values()), labels=lab, ts_ns=ts_ns)
            rtts = [r for p in mine for r in net.rtts.get(p, ())]
            if rtts:
                sink.add("job_tcp_srtt_ms", sum(rtts) / len(rtts) / 1000.0, labels=lab, ts_ns=ts_ns)
            own = [net.rates[p] for p in mine if p in net.rates]
            if own:
                sink.add("job_tcp_bytes_per_s", sum(own), labels=lab, ts_ns=ts_ns)
            busy = [net.busy[p] for p in mine if p in net.busy]
            sent, busy_us = sum(b[0] for b in busy), sum(b[1] for b in busy)
            if busy_us >= BUSY_MIN_S * 1e6:
                sink.add("job_tcp_busy_send_rate_bytes_per_s", sent / (busy_us / 1e6), labels=lab, ts_ns=ts_ns)
            for metric, per_comm, least in (("job_neighbour_process_cpu_percent", by_comm, NEIGHBOUR_NAMED_MIN),
                                            ("job_neighbour_process_io_bytes_per_s",
                                             _by_command(io_rate, outside, comm), NEIGHBOUR_IO_NAMED_MIN),
                                            ("job_neighbour_process_net_bytes_per_s",
                                             _by_command(net.rates, outside, comm), NEIGHBOUR_NET_NAMED_MIN)):
                top = sorted(per_comm.items(), key=lambda kv: kv[1][0], reverse=True)[:NEIGHBOUR_TOP]
                for name, (v, n, pid, _) in top:
                    if v < least:
                        break
                    sink.add(metric, v, labels=dict(lab, comm=name, pid=str(pid), processes=str(n)), ts_ns=ts_ns)

    def _io_rates(self, seen: dict[int, tuple[int, int, float]], cpu: dict[int, float],
                  dt_s: float | None) -> dict[int, float]:
        """Storage bytes/s per process since the last tick, for the processes that ran in it (a process that
        used no CPU issued no I/O, and its last reading stays valid). The first reading of a process gives
        no rate, as for CPU."""
        rates: dict[int, float] = {}
        kept = {pid: v for pid, v in self._all_io.items() if pid in seen and seen[pid][0] == v[0]}
        for pid, share in cpu.items():
            if share <= 0:
                continue
            io = self._io(pid)
            if io is None:
                continue
            total = io[0] + io[1]
            prev = kept.get(pid)
            if prev is not None and dt_s:
                rates[pid] = max(0, total - prev[1]) / dt_s
            kept[pid] = (seen[pid][0], total)
        self._all_io = kept
        return rates

    def _forget_connections(self) -> None:
        """No byte counts to take rates from: the next read is a first reading again (no jobs, or a failure)."""
        self._sock_bytes.clear()
        self._net_last = None

    def _net_rates(self, seen: dict[int, tuple[int, int, float]], t: float) -> _NetRead:
        """TCP bytes/s per process on connections that leave the node, the smoothed RTTs (us) of those that
        sent, and their (bytes acked, busy us) since the last read, per process. A socket's owner is sought
        only when it moved bytes and no live owner is known (_find_owners). A connection's first reading
        gives no rate, as for CPU. Read every ``net_interval_s``: the rates are over that interval, and the
        ticks between reuse them (a dump costs the kernel a walk of its whole connection table). Raises when
        the read fails; empty until NET_RETRY_S after that."""
        last = self._net_last
        if last is not None and 0 <= t - last[0] < self.net_interval_s:
            return last[1]
        if t < self._net_retry_t:
            return _NetRead()
        conns = tcp_connections()     # a failure (TcpSocketsUnavailable or any other) is the caller's to report
        dt_s = t - last[0] if last is not None and t > last[0] else None
        # (inode, bytes, srtt, bytes acked, busy us) since the last read
        moved: list[tuple[int, int, int, int, int]] = []
        now_bytes: dict[int, tuple[int, int, int]] = {}
        for c in conns:
            if c.local:
                continue
            now_bytes[c.cookie] = (c.bytes_total, c.bytes_acked, c.busy_us)
            prev = self._sock_bytes.get(c.cookie)
            if prev is not None and c.bytes_total > prev[0]:
                busy = c.busy_us - prev[2] if c.busy_us >= 0 and prev[2] >= 0 else 0
                moved.append((c.inode, c.bytes_total - prev[0], c.srtt_us, c.bytes_acked - prev[1], max(0, busy)))
        self._sock_bytes = now_bytes
        live = {c.inode for c in conns}
        # an owner holds only while that process lives (its pid and start time): a socket inherited by a
        # forked worker that has exited since is looked up again, and found in the process still holding it
        self._sock_owner = {i: o for i, o in self._sock_owner.items()
                            if i in live and o[0] in seen and seen[o[0]][0] == o[1]}
        self._sock_unowned = {i: r for i, r in self._sock_unowned.items() if i in live}
        wanted = {m[0] for m in moved
                  if m[0] not in self._sock_owner and self._sock_unowned.get(m[0], (0.0, 0.0))[0] <= t}
        if wanted:
            self._find_owners(wanted, seen, t)
        out = _NetRead()
        for inode, delta, srtt, acked, busy in moved:
            owner = self._sock_owner.get(inode)
            if owner is None:
                continue
            pid = owner[0]
            if dt_s:
                out.rates[pid] = out.rates.get(pid, 0.0) + delta / dt_s
            if acked > 0:     # a connection that only received keeps the RTT of its last send: stale
                out.rtts.setdefault(pid, []).append(srtt)
            if busy > 0:
                a, b = out.busy.get(pid, (0, 0))
                out.busy[pid] = (a + acked, b + busy)
        self._net_last = (t, out)
        self._net_failed = False      # a whole read went through: a later failure is news again
        return out

    def _find_owners(self, wanted: set[int], seen: dict[int, tuple[int, int, float]], t: float) -> None:
        """Owners of the socket inodes ``wanted``, from the processes' /proc/<pid>/fd, oldest process first,
        so that a socket several processes hold (a rank's, inherited by the data-loader workers it forked)
        belongs to the one that opened it; the walk stops once every socket is found. It spends at most
        OWNER_WALK_BUDGET_S a read: a walk cut off there goes on at the next read where it stopped (wrapping
        around), so every process is reached on a node with very many open files. A socket not found in a
        whole round (a kernel socket: NFS, iSCSI; another user's process when the agent is not root) is
        sought again after SOCKET_OWNER_RETRY_S, doubling up to SOCKET_OWNER_RETRY_MAX_S while it stays
        unfound."""
        order = sorted(seen, key=lambda p: (seen[p][0], p))
        begin = 0
        if self._walk_from is None:         # a new round: every process once
            self._walk_left = len(order)
        else:                               # where the last, cut-off walk stopped
            begin = next((i for i, p in enumerate(order) if (seen[p][0], p) >= self._walk_from), 0)
        deadline = time.monotonic() + OWNER_WALK_BUDGET_S
        self._walk_from = None
        left = set(wanted)
        for k in range(min(len(order), self._walk_left)):
            if not left:
                return
            pid = order[(begin + k) % len(order)]
            held, whole = socket_inodes_until(self.proc, pid, deadline)
            for inode in held & left:
                self._sock_owner[inode] = (pid, seen[pid][0])
                self._sock_unowned.pop(inode, None)
                left.discard(inode)
            # a process whose files alone outlast the budget is read as far as it goes, once, and passed
            if whole or k == 0:
                self._walk_left -= 1
            if left and self._walk_left > 0 and (not whole or time.monotonic() > deadline):
                nxt = pid if not whole and k > 0 else order[(begin + k + 1) % len(order)]
                self._walk_from = (seen[nxt][0], nxt)
                return
        for inode in left:      # a whole round without an owner
            last_delay = self._sock_unowned.get(inode, (0.0, SOCKET_OWNER_RETRY_S / 2))[1]
            delay = min(SOCKET_OWNER_RETRY_MAX_S, 2 * last_delay)
            self._sock_unowned[inode] = (t + delay, delay)
