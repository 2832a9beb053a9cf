"""The GPU's one nvmlDeviceGetFieldValues call per tick, and the PCIe and NVLink byte rates from its
cumulative counters (with nvmlDeviceGetPcieThroughput as the fallback where the PCIe counters do not answer).

The same call carries the memory temperature and raw NVLink bytes (gpu_dcgm.py) and the hardware-health
fields (gpu_health.py), so a tick asks NVML for field values once per GPU.
"""

from __future__ import annotations

from typing import Any

from gpuagent.agent.samplers.gpu_health import HEALTH_FIDS, NVLINK_ERR_TOTALS, SLOW_FIDS
from gpuagent.common.nvml import ERROR_INVALID_ARGUMENT, ERROR_NOT_SUPPORTED, Nvml

PCIE_RETRY_S = 60.0      # PCIe byte counters (fields 197/198) dropped out: ask for them again this often


class GpuFieldsMixin:
    """GpuSampler's field values and byte rates (agent/samplers/gpu.py)."""

    nvml: Nvml

    def _init_fields(self, pcie_fallback_every: int, pcie_retry_s: float) -> None:
        self.pcie_fallback_every = pcie_fallback_every
        self.pcie_retry_s = pcie_retry_s
        self._pcie_retry_at: dict[int, float] = {}  # GPU -> tick time (s) to ask the PCIe byte counters again
        self._counter_prev: dict[tuple[str, int], tuple[float, int, int]] = {}
        self._pcie_counters: dict[int, bool] = {}
        self._pcie_fallback_tick: dict[int, int] = {}
        n = self.nvml
        if n.available:
            self._tx = n.const("NVML_PCIE_UTIL_TX_BYTES", 0)
            self._rx = n.const("NVML_PCIE_UTIL_RX_BYTES", 1)
            self._fi_pcie_tx = n.const("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 197)
            self._fi_pcie_rx = n.const("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 198)
            self._fi_nvl_tx = n.const("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138)
            self._fi_nvl_rx = n.const("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139)
            # Reads for the exporter's dcgm-exporter defaults (gpu_dcgm.py); nvml.h field ids.
            self._fi_mem_temp = n.const("NVML_FI_DEV_MEMORY_TEMP", 82)
            self._fi_nvl_raw_tx = n.const("NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX", 140)
            self._fi_nvl_raw_rx = n.const("NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX", 141)

    def _want_pcie(self, i: int, ts: int) -> bool:
        """Whether this tick asks for the PCIe byte counters: while they answer, and at each retry after
        they dropped out (tick time ``ts``, ns)."""
        want_pcie = self._pcie_counters.get(i, True)
        if not want_pcie and ts / 1e9 >= self._pcie_retry_at.get(i, 0.0):
            want_pcie = True      # time to see whether the counters answer again
        return want_pcie

    def _field_values(self, i: int, h: Any, want_pcie: bool, links: int | None, slow: bool) -> dict[int, Any] | None:
        """The GPU's one nvmlDeviceGetFieldValues call per tick: field id -> value union of the fields
        that answered; None when the whole call failed. It carries the PCIe byte counters (when wanted)
        and NVLink bytes (``_counters``), the memory temperature and raw NVLink bytes (``_dcgm_values``)
        and the health fields (``_health_values``) this GPU has not refused: the NVLink error totals every
        tick, the others when ``slow`` (every ``health_every`` ticks). A health field answering NOT_SUPPORTED
        is not asked again (``_health_values`` says so once, or falls back to a call)."""
        n = self.nvml
        fields: list[tuple[int, int]] = []
        if want_pcie:
            fields += [(self._fi_pcie_tx, 0), (self._fi_pcie_rx, 0)]
        if links is not None:
            # scopeId UINT_MAX: the sum over all links (nvml.h, NVLink throughput field values)
            fields += [(self._fi_nvl_tx, 0xFFFFFFFF), (self._fi_nvl_rx, 0xFFFFFFFF)]
        fields.append((self._fi_mem_temp, 0))
        if links is not None:
            # Data + protocol overhead (nvml.h), summed over all links (scopeId UINT_MAX): DCGM's
            # PROF_NVLINK_*_BYTES count header and payload.
            fields += [(self._fi_nvl_raw_tx, 0xFFFFFFFF), (self._fi_nvl_raw_rx, 0xFFFFFFFF)]
        off = self._fields_off.setdefault(i, set())
        if links is not None:
            fields += [(fid, 0) for fid, _ in NVLINK_ERR_TOTALS if fid not in off]
        if slow:
            fields += [(fid, 0) for fid in sorted(SLOW_FIDS - off)]
        vals = n.query("nvmlDeviceGetFieldValues", h, fields, gpu=i)
        if vals is None:
            return None
        got: dict[int, Any] = {}
        for v in vals:
            fid, rc = int(v.fieldId), int(v.nvmlReturn)
            if rc == 0:
                got[fid] = v.value
            elif fid in HEALTH_FIDS and rc in (ERROR_NOT_SUPPORTED, ERROR_INVALID_ARGUMENT):
                off.add(fid)      # INVALID_ARGUMENT: a field id newer than this driver
        return got

    def _counters(self, i: int, h: Any, ts: int, put, got: dict[int, Any] | None, want_pcie: bool) -> None:
        """PCIe and NVLink byte rates from cumulative counters, from the tick's field-values call.

        Why counters: nvmlDeviceGetPcieThroughput samples for 20 ms per call (2 calls per GPU per
        tick would block the tick for 40 ms x GPUs). When the PCIe byte counter fields
        (NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES) do not answer, it falls back to that snapshot, once every
        ``pcie_fallback_every`` ticks, and asks for the counters again every ``pcie_retry_s`` seconds
        (tick time), so they are used again once they answer.
        """
        n = self.nvml
        t = ts / 1e9
        if got is None and want_pcie and self._pcie_counters.get(i, True) \
                and not n.is_unsupported("nvmlDeviceGetFieldValues", i):
            return    # the whole call failed for now (UNKNOWN, ...): no rates this tick, same mode next
        got = {fid: int(v.ullVal) for fid, v in (got or {}).items()
               if fid in (self._fi_pcie_tx, self._fi_pcie_rx, self._fi_nvl_tx, self._fi_nvl_rx)}
        if want_pcie and self._fi_pcie_tx in got and self._fi_pcie_rx in got:
            if not self._pcie_counters.get(i, True):
                self._pcie_counters[i] = True      # back: the snapshot stops
                self._pcie_fallback_tick.pop(i, None)
            self._rate(("pcie", i), t, got[self._fi_pcie_tx], got[self._fi_pcie_rx], 1.0,
                       "gpu_pcie_tx_bytes_per_s", "gpu_pcie_rx_bytes_per_s", put)
        else:
            if want_pcie:     # dropped out (or still out at a retry): the snapshot until the next retry
                self._pcie_counters[i] = False
                self._pcie_retry_at[i] = t + self.pcie_retry_s
                self._counter_prev.pop(("pcie", i), None)   # no rate across the gap
            self._pcie_fallback(i, h, put)
        if self._fi_nvl_tx in got and self._fi_nvl_rx in got:
            self._rate(("nvlink", i), t, got[self._fi_nvl_tx], got[self._fi_nvl_rx], 1024.0,
                       "gpu_nvlink_tx_bytes_per_s", "gpu_nvlink_rx_bytes_per_s", put)

    def _rate(self, key, t: float, tx: int, rx: int, scale: float, m_tx: str, m_rx: str, put) -> None:
        prev = self._counter_prev.get(key)
        self._counter_prev[key] = (t, tx, rx)
        if prev is not None and t > prev[0] and tx >= prev[1] and rx >= prev[2]:   # skip resets
            dt = t - prev[0]
            put(m_tx, (tx - prev[1]) * scale / dt)
            put(m_rx, (rx - prev[2]) * scale / dt)

    def _pcie_fallback(self, i: int, h: Any, put) -> None:
        k = self._pcie_fallback_tick.get(i, 0)
        self._pcie_fallback_tick[i] = k + 1
        if k % self.pcie_fallback_every:
            return
        q = self.nvml.query
        tx = q("nvmlDeviceGetPcieThroughput", h, self._tx, gpu=i)   # KB/s over a 20 ms window
        if tx is None:
            return
        rx = q("nvmlDeviceGetPcieThroughput", h, self._rx, gpu=i)
        put("gpu_pcie_tx_bytes_per_s", tx * 1024.0)
        put("gpu_pcie_rx_bytes_per_s", rx * 1024.0 if rx is not None else None)
