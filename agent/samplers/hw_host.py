"""Host-side hardware signals: NVIDIA kernel-log records (XID, NVSwitch SXID, driver-init failures) from
/dev/kmsg, InfiniBand / RoCE port state and counters, and Ethernet carrier changes and link speed from sysfs.

All roots are injectable (``kmsg_path``, ``proc_root``, ``sys_root``) so tests feed fixture trees written in
the kernel's documented formats. Names of series and events: docs/METRICS.md ("Host sampler").

The kernel-log reader and its line formats are agent/samplers/kmsg.py; the InfiniBand and Ethernet sysfs
readers are agent/samplers/hw_links.py. This module joins them into one sampler and deduplicates the kernel
log's XIDs against NVML's.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Callable, Mapping

from gpuagent.agent.samplers.host import SourceGuard
from gpuagent.agent.samplers.hw_links import SYSFS_RELIST_S, EthLinks, IbPorts
from gpuagent.agent.samplers.kmsg import (KMSG_PATH, KMSG_STATE_FILE, KmsgReader, KmsgRecord, boot_id, boot_time_ns,
                                          bus_key, classify, parse_kmsg_record)
from gpuagent.common.timeutil import now_ns

XID_DEDUP_WINDOW_NS = 10 * 10**9  # an NVML XID and a kmsg XID for the same GPU and XID this close are one
DRIVER_ERROR_REPEAT_NS = 60 * 10**9

# What this module offered before the kernel-log and sysfs readers moved out; the old import path keeps working.
__all__ = ["HwHostSampler", "XidLedger", "EthLinks", "IbPorts", "KmsgReader", "KmsgRecord", "bus_key", "classify",
           "parse_kmsg_record", "boot_id", "boot_time_ns", "KMSG_PATH", "KMSG_STATE_FILE", "SYSFS_RELIST_S",
           "XID_DEDUP_WINDOW_NS", "DRIVER_ERROR_REPEAT_NS"]

# ---------------------------------------------------------------- NVML dedup

class XidLedger:
    """The XIDs NVML reported lately, for deduplicating the kernel log's copy of the same XID.

    ``tap(sink)`` wraps the sink the GPU sampler writes to: each ``xid`` event passes through unchanged and
    is remembered. ``seen(xid, bus_id, ts_ns)`` answers whether NVML reported that XID on that GPU within
    10 s of ``ts_ns``; ``bus_for_gpu`` maps an NVML index to its bus id when the event has no pci_bus_id."""

    def __init__(self, bus_for_gpu: Callable[[int], str | None] | None = None, keep: int = 512) -> None:
        self._bus_for_gpu = bus_for_gpu or (lambda _gpu: None)
        self._recent: deque[tuple[int, str, int]] = deque(maxlen=keep)   # (xid, bus key, ts_ns)

    def record(self, xid: int, gpu: int, ts_ns: int, pci_bus_id: str | None = None) -> None:
        bus = bus_key(pci_bus_id) or (bus_key(self._bus_for_gpu(gpu)) if gpu >= 0 else "")
        self._recent.append((int(xid), bus, int(ts_ns)))

    def seen(self, xid: int, bus_id: str, ts_ns: int) -> bool:
        bus = bus_key(bus_id)
        return any(x == xid and b == bus and abs(t - ts_ns) <= XID_DEDUP_WINDOW_NS for x, b, t in self._recent)

    def tap(self, sink: Any) -> Any:
        return _XidTap(sink, self)


class _XidTap:
    def __init__(self, sink: Any, ledger: XidLedger) -> None:
        self._sink, self._ledger = sink, ledger

    def event(self, kind, message, gpu=-1, value=0.0, attrs=None, ts_ns=None):
        if kind == "xid" and (attrs or {}).get("source") != "kmsg":
            self._ledger.record(int(value), int(gpu), ts_ns if ts_ns is not None else now_ns(),
                                (attrs or {}).get("pci_bus_id"))
        return self._sink.event(kind, message, gpu=gpu, value=value, attrs=attrs, ts_ns=ts_ns)

    def __getattr__(self, name):
        return getattr(self._sink, name)


# ---------------------------------------------------------------- the sampler

class HwHostSampler:
    """Sampler (agent/samplers/sampling.py) for the host's hardware signals; each source fails alone.

    ``nvml_seen(xid, bus_id, ts_ns)`` says whether NVML already reported that XID (then the kernel-log copy
    is not emitted); ``gpu_for_bus(bus_id)`` gives the NVML index for a bus id (None: unknown, gpu -1).
    A kernel-log XID younger than ``holdback_s`` waits (up to that long) so NVML's copy, read by the GPU
    sampler in the same or the next tick, is seen first. Sysfs is read every ``sysfs_every_s``."""

    name = "hw_host"

    def __init__(self, sys_root: str = "/sys", proc_root: str = "/proc", kmsg_path: str | None = KMSG_PATH,
                 state_dir: str | os.PathLike | None = None, kmsg: bool = True, infiniband: bool = True,
                 ethernet: bool = True, sysfs_every_s: float = 10.0, holdback_s: float = 5.0,
                 nvml_seen: Callable[[int, str, int], bool] | None = None,
                 gpu_for_bus: Callable[[str], int | None] | None = None,
                 kmsg_read: Callable[[int, int], bytes] = os.read,
                 ethernet_speed_mbps: Mapping[str, int] | None = None) -> None:
        self.guard = SourceGuard("hw_host")
        self.kmsg = KmsgReader(kmsg_path, state_dir, proc_root, self.guard, kmsg_read) \
            if kmsg and kmsg_path else None
        self.ib = IbPorts(sys_root, self.guard) if infiniband else None
        self.eth = EthLinks(sys_root, self.guard, expected_mbps=ethernet_speed_mbps) if ethernet else None
        self.sysfs_every_ns = int(sysfs_every_s * 1e9)
        self.holdback_ns = int(holdback_s * 1e9)
        self.nvml_seen = nvml_seen or (lambda _x, _b, _t: False)
        self.gpu_for_bus = gpu_for_bus or (lambda _b: None)
        self._last_sysfs_ns: int | None = None
        self._pending: list[tuple[int, int, str, float, dict[str, str]]] = []   # (ts, seq, kind, value, attrs)
        self._sxid_run: tuple[tuple[str, str], int, int, float, dict[str, str]] | None = None
        self._driver_err_at: dict[str, int] = {}
        self._saved_seq: int | None = None
        self.deduplicated = 0
        self.emitted: dict[str, int] = {}

    @property
    def unavailable(self) -> list[str]:
        out = self.guard.notes()
        if self.kmsg is not None and self.kmsg.unavailable:
            out.append(self.kmsg.unavailable)
        if self.kmsg is not None and self.kmsg.state_problem:
            out.append(self.kmsg.state_problem)
        if self.kmsg is not None and self.kmsg.lost_records:
            out.append(f"kernel log: {self.kmsg.lost_records} record(s) were overwritten before the agent read them")
        return out

    def sample(self, ts_ns: int, sink) -> None:
        if self.kmsg is not None:
            self.guard.run("kmsg", self._kmsg, ts_ns, sink)
        if self._last_sysfs_ns is None or ts_ns - self._last_sysfs_ns >= self.sysfs_every_ns:
            self._last_sysfs_ns = ts_ns

            def put(metric: str, v: float, labels: Mapping[str, str]) -> None:
                sink.add(metric, v, labels=labels, ts_ns=ts_ns)

            if self.ib is not None:
                self.guard.run("infiniband", self.ib.sample, put)
            if self.eth is not None:
                self.guard.run("ethernet", self.eth.sample, put)

    # ---------------------------------------------------------------- kmsg
    def _kmsg(self, now: int, sink) -> None:
        k = self.kmsg
        for rec in k.poll():
            c = classify(rec.message)
            if c is None:
                continue              # other kernel records between an SXID's records do not end its run
            kind, value, attrs = c
            ts = k.wall_ns(rec)
            if kind == "sxid":
                key = (attrs["device"], attrs["sxid"])
                desc = not attrs["message"].startswith(("Data {", "Severity "))
                run = self._sxid_run
                if run is not None and run[0] == key and 0 <= ts - run[1] <= 10**9:
                    if desc and run[4]["message"].startswith(("Data {", "Severity ")):
                        run[4]["message"] = attrs["message"]     # the record that says what it is
                    continue
                self._end_sxid_run(sink)
                self._sxid_run = (key, ts, rec.seq, value, attrs)
                continue
            if kind == "nvidia_driver_error":
                bus = attrs["pci_bus_id"]
                prev = self._driver_err_at.get(bus)
                if prev is not None and 0 <= ts - prev < DRIVER_ERROR_REPEAT_NS:
                    continue
                self._driver_err_at[bus] = ts
            self._pending.append((ts, rec.seq, kind, value, attrs))
        self._end_sxid_run(sink)
        self._release(now, sink)

    def _end_sxid_run(self, sink) -> None:
        run, self._sxid_run = self._sxid_run, None
        if run is not None:
            _key, ts, seq, value, attrs = run
            low = attrs["message"].lower()
            attrs["severity"] = "non-fatal" if "non-fatal" in low else ("fatal" if "fatal" in low else "")
            self._pending.append((ts, seq, "sxid", value, attrs))

    def _release(self, now: int, sink) -> None:
        keep = []
        self._pending.sort(key=lambda item: item[1])       # kernel order (an SXID run joins at its end)
        for item in self._pending:
            ts, _seq, kind, value, attrs = item
            if kind == "xid" and now - ts < self.holdback_ns:
                keep.append(item)
                continue
            self._emit(sink, ts, kind, value, attrs)
        self._pending = keep
        self._save()

    def _save(self) -> None:
        """Remember the last seq whose records are all emitted (pending ones are read again after a restart)."""
        k = self.kmsg
        if k.last_seq < 0:
            return
        seq = min(s for _t, s, *_ in self._pending) - 1 if self._pending else k.last_seq
        if seq != self._saved_seq:
            k.save_state(seq)
            self._saved_seq = seq

    def _emit(self, sink, ts: int, kind: str, value: float, attrs: dict[str, str]) -> None:
        bus = attrs.get("pci_bus_id", "")
        gpu = self.gpu_for_bus(bus) if bus else None
        gpu = -1 if gpu is None else int(gpu)
        if kind == "xid":
            xid = int(value)
            if self.nvml_seen(xid, bus, ts):
                self.deduplicated += 1
                return
            what = attrs.get("description", "")
            msg = f"XID {xid} on GPU {gpu if gpu >= 0 else bus} (kernel log): {what}"
        elif kind == "sxid":
            msg = f"SXID {int(value)} on {attrs['device']} (kernel log): {attrs['message']}"
        else:
            msg = f"NVIDIA driver error on {bus or 'a GPU'} (kernel log): {attrs['message']}"
        self.emitted[kind] = self.emitted.get(kind, 0) + 1
        sink.event(kind, msg[:500], gpu=gpu, value=value, attrs=attrs, ts_ns=ts)

    def close(self) -> None:
        if self.kmsg is not None:
            self._save()
            self.kmsg.close()
