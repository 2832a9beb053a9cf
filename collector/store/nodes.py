"""The node registry: which node id a host streams as, and its ``nodes`` and ``gpus`` rows.

A node is the pair (machine_id, hostname), not the machine id alone (``find_node`` says why). Every function
here runs on the writer's connection, in the writer thread.
"""

from __future__ import annotations

import json
import re

import duckdb
from google.protobuf import json_format

from gpuagent.collector.store import tables
from gpuagent.collector.store.writer import StorageError
from gpuagent.common.parse import parse_bool
from gpuagent.common.timeutil import utc_now
from gpuagent.proto import pb

_HOST_RE = re.compile(r"[^a-z0-9._-]+")


_GPU_KEY = ("node_id", "gpu")
_GPUS_UPSERT = (tables.GPUS.insert_sql + f" ON CONFLICT ({', '.join(_GPU_KEY)}) DO UPDATE SET "
                + ", ".join(f"{c} = excluded.{c}" for c in tables.GPUS.names if c not in _GPU_KEY))


class InvalidNode(ValueError):
    """A Register whose node facts cannot be stored; the message is one sentence for the agent's operator."""


def _node_id_for(con: duckdb.DuckDBPyConnection, hostname: str, machine_id: str) -> str:
    base = _HOST_RE.sub("-", hostname.lower()).strip("-.") or "node"
    candidates = [base, f"{base}-{_HOST_RE.sub('', machine_id.lower())[:8]}"]
    candidates += [f"{candidates[1]}-{i}" for i in range(2, 1000)]
    for cand in candidates:
        if not con.execute("SELECT 1 FROM nodes WHERE node_id = ?", [cand]).fetchone():
            return cand
    raise StorageError("could not find a free node id")  # pragma: no cover - 1000 collisions


def find_node(con: duckdb.DuckDBPyConnection, hostname: str, machine_id: str) -> str | None:
    """The node id of the host presenting ``machine_id`` and ``hostname``, or None for a new node.

    A node is the pair, not the machine id alone: VM images cloned without a fresh /etc/machine-id give
    several hosts one id, and keyed by it alone they shared one node and one seq space, so one host's
    batches were dropped as resends of the other's. Hostnames compare case-insensitively (as in DNS).
    A renamed host therefore starts a new node (its old rows stay under the old id). One exception keeps
    the fix we ask for cheap: a host whose node was marked as sharing its machine id with other hosts
    (``machine_id_shared_with``) and that comes back with a new machine id keeps its node."""
    row = con.execute("SELECT node_id FROM nodes WHERE machine_id = ? AND lower(hostname) = lower(?) "
                      "ORDER BY first_seen LIMIT 1", [machine_id, hostname]).fetchone()
    if row:
        return row[0]
    row = con.execute("SELECT node_id FROM nodes WHERE lower(hostname) = lower(?) AND machine_id <> ? "
                      "AND machine_id_shared_with IS NOT NULL ORDER BY last_seen DESC LIMIT 1",
                      [hostname, machine_id]).fetchone()
    return row[0] if row else None


def mark_shared_machine_id(con: duckdb.DuckDBPyConnection, node_id: str, hostnames: list[str]) -> None:
    """Record on ``node_id`` that ``hostnames`` streamed beside it with the same machine id."""
    row = con.execute("SELECT machine_id_shared_with FROM nodes WHERE node_id = ?", [node_id]).fetchone()
    if row is None:
        return
    have = set(filter(None, (row[0] or "").split(",")))
    want = ",".join(sorted(have | set(hostnames)))
    if want != (row[0] or ""):
        con.execute("UPDATE nodes SET machine_id_shared_with = ? WHERE node_id = ?", [want, node_id])


def _stored_gpus(con: duckdb.DuckDBPyConnection, node_id: str) -> list[tuple]:
    """The node's gpus rows, columns in tables.GPUS order, by GPU index."""
    return con.execute(f"SELECT {', '.join(tables.GPUS.names)} FROM gpus WHERE node_id = ? ORDER BY gpu",
                       [node_id]).fetchall()


def register_node(con: duckdb.DuckDBPyConnection, node: pb.NodeInfo) -> str:
    """Upsert ``nodes`` and ``gpus`` for this host; return its stable node id (see ``find_node``).
    Writer thread only."""
    now = utc_now()
    labels = dict(node.labels)
    price = labels.get("price_per_gpu_hour")
    try:
        price_f = float(price) if price not in (None, "") else None
    except ValueError:
        raise InvalidNode(f"label price_per_gpu_hour={price!r} is not a number") from None
    synthetic = parse_bool(labels.get("synthetic", "")) is True
    fp = node.fingerprint
    fingerprint_json = json.dumps(json_format.MessageToDict(fp, preserving_proto_field_name=True,
                                                            always_print_fields_with_no_presence=True),
                                  sort_keys=True)
    con.execute("BEGIN TRANSACTION")
    try:
        node_id = find_node(con, node.hostname, node.machine_id) or _node_id_for(con, node.hostname,
                                                                                 node.machine_id)
        values = {
            "machine_id": node.machine_id, "hostname": node.hostname, "agent_version": node.agent_version or None,
            "pool": labels.get("pool"), "provider": labels.get("provider"), "region": labels.get("region"),
            "price_per_gpu_hour": price_f, "synthetic": synthetic, "cpu_model": node.cpu_model or None,
            "cpu_cores_logical": node.cpu_cores_logical or None,
            "cpu_cores_physical": node.cpu_cores_physical or None,
            "memory_total_bytes": node.memory_total_bytes or None, "kernel": node.kernel or None,
            "os": node.os or None, "driver_version": node.driver_version or None,
            "cuda_version": node.cuda_version or None, "gpu_count": len(node.gpus),
            "gpu_model": node.gpus[0].name if node.gpus else None, "numa_nodes": node.numa_nodes or None,
            "virtualized": fp.virtualized, "virt_type": fp.virt_type or None, "in_container": fp.in_container,
            "container_runtime": fp.container_runtime or None, "clocksource": fp.clocksource or None,
            "fingerprint": fingerprint_json, "last_seen": now,
        }
        keys = sorted(labels)
        label_values = [labels[k] for k in keys]
        old = con.execute("SELECT machine_id, map_keys(labels), map_values(labels) FROM nodes WHERE node_id = ?",
                          [node_id]).fetchone()
        if old is None:
            cols = ["node_id", *values, "first_seen", "labels"]
            con.execute(f"INSERT INTO nodes ({', '.join(cols)}) VALUES ({', '.join('?' * (len(cols) - 1))}, "
                        "map(?::VARCHAR[], ?::VARCHAR[]))",
                        [node_id, *values.values(), now, keys, label_values])
        else:
            # A plain UPDATE of scalar columns, not INSERT ... ON CONFLICT: DuckDB rewrites a row with a MAP
            # column as delete + insert, and reverting that after a failed commit (a full disk) aborted the
            # collector ("duplicate key" in the primary-key index). The labels are rewritten only on change.
            shared = "machine_id_shared_with = CASE WHEN machine_id = ? THEN machine_id_shared_with END, "
            con.execute(f"UPDATE nodes SET {shared}{', '.join(f'{c} = ?' for c in values)} WHERE node_id = ?",
                        [node.machine_id, *values.values(), node_id])
            if (list(old[1] or []), list(old[2] or [])) != (keys, label_values):
                con.execute("UPDATE nodes SET labels = map(?::VARCHAR[], ?::VARCHAR[]) WHERE node_id = ?",
                            [keys, label_values, node_id])
        indexes = [g.index for g in node.gpus]
        gpu_rows = [(node_id, g.index, g.uuid or None, g.name or None, g.pci_bus_id or None, g.pcie_gen_max or None,
                     g.pcie_gen_current or None, g.pcie_width_max or None, g.pcie_width_current or None,
                     g.memory_total_bytes or None, g.mig_mode or None, g.virtualization_mode or None,
                     g.numa_node if g.numa_node >= 0 else None) for g in node.gpus]
        # An agent that reconnects registers the same GPUs again: leave the rows alone then. The upsert and
        # the delete each scan the whole gpus table (8 + 2.5 ms of a 24 ms Register at 30,000 nodes).
        if old is None or _stored_gpus(con, node_id) != sorted(gpu_rows, key=lambda r: r[1]):
            if gpu_rows:
                # One Arrow table for all GPUs, not bound parameters: DuckDB's Python binding does work
                # per bound value (it probes for pandas each time), which made Register cost ~60 ms.
                con.register(tables.GPUS.view, tables.GPUS.from_rows(gpu_rows))
                try:
                    con.execute(_GPUS_UPSERT)
                finally:
                    con.unregister(tables.GPUS.view)
            con.execute("DELETE FROM gpus WHERE node_id = ? AND NOT list_contains(?::SMALLINT[], gpu)",
                        [node_id, indexes])
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    return node_id
