"""Hardware health (issue 23): aggregate ECC, retired pages per cause and pending, clock-event durations per
reason (field values, in the tick's one nvmlDeviceGetFieldValues call, every ``health_every`` ticks), NVLink
state per link (every ``health_every`` ticks) and error counters per link (read when the NVLink error
totals, fields asked every tick, change). docs/METRICS.md says how often; agent/surface/health.py judges them.
"""

from __future__ import annotations

import time
from typing import Any

from gpuagent.common.nvml import Nvml


# Hardware-health field values (nvml.h NVML_FI_DEV_*), read in the one field-values call per GPU per tick.
_FI_ECC_AGG = ((5, "gpu_ecc_aggregate_corrected_total", 0),       # NVML_FI_DEV_ECC_SBE_AGG_TOTAL
               (6, "gpu_ecc_aggregate_uncorrected_total", 1))     # NVML_FI_DEV_ECC_DBE_AGG_TOTAL
_FI_RETIRED_SBE, _FI_RETIRED_DBE, _FI_RETIRED_PENDING = 29, 30, 31  # NVML_FI_DEV_RETIRED_SBE/_DBE/_PENDING
# The driver's recovery action for the GPU (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION; nvmlDeviceGpuRecoveryAction_t:
# 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset, 5 recover IMEX domain, 6 bus reset, 7 reboot)
_FI_RECOVERY_ACTION = 230
_WEEK_S = 7 * 86400           # DCGM's retired-page check counts the DBE pages retired in the past week
# Clock-event durations in ns (nvml.h "Field values for Clock Throttle Reason Counters"): 74 and 76 are
# NVML_FI_DEV_PERF_POLICY_POWER / _SYNC_BOOST, which nvml.h names ..._CLOCKS_EVENT_REASON_SW_POWER_CAP /
# _SYNC_BOOST. NVML has no duration for the HW slowdown bit itself; its causes are hw_thermal and hw_power_brake.
_FI_CLOCK_EVENTS = ((74, "sw_power_cap"), (76, "sync_boost"), (269, "sw_thermal"), (270, "hw_thermal"),
                    (271, "hw_power_brake"))
# NVLink error totals over all links (NVML_FI_DEV_NVLINK_*_ERROR_COUNT_TOTAL): a change says a per-link read is due.
NVLINK_ERR_TOTALS = ((38, "crc_flit"), (45, "crc_data"), (52, "replay"), (59, "recovery"))
# nvmlNvLinkErrorCounter_t (nvml.h): the per-link counters, by the label they get
_NVLINK_ERRORS = (("crc_flit", 2), ("crc_data", 3), ("replay", 0), ("recovery", 1))
# Read every ``health_every`` ticks (they change seldom, or are cumulative: nothing is lost between reads) ...
SLOW_FIDS = frozenset([f for f, _, _ in _FI_ECC_AGG] + [_FI_RETIRED_SBE, _FI_RETIRED_DBE, _FI_RETIRED_PENDING,
                                                         _FI_RECOVERY_ACTION]
                      + [f for f, _ in _FI_CLOCK_EVENTS])
# ... and every tick: the NVLink error totals (a change triggers the per-link read)
_TICK_FIDS = frozenset(f for f, _ in NVLINK_ERR_TOTALS)
HEALTH_FIDS = SLOW_FIDS | _TICK_FIDS


class GpuHealthMixin:
    """GpuSampler's hardware-health readings (agent/samplers/gpu.py)."""

    nvml: Nvml

    def _init_health(self, health_every: int) -> None:
        self.health_every = max(1, int(health_every))
        self._nvlink_links: dict[int, int | None] = {}
        self._nvlink_up: dict[int, dict[int, int] | None] = {}     # GPU -> {link: 1 up / 0 down}; None: no NVLink
        self._nvlink_err: dict[int, dict[int, dict[str, int]]] = {}  # GPU -> link -> counter -> count
        self._nvlink_totals: dict[int, tuple[int, ...] | None] = {}  # GPU -> the error totals at the last per-link read
        self._nvlink_bad: dict[int, dict[int, dict[str, int]]] = {}  # GPU -> the links with a non-zero error count
        self._fields_off: dict[int, set[int]] = {}       # GPU -> health field ids that answered NOT_SUPPORTED
        self._clock_s: dict[int, dict[str, float]] = {}   # GPU -> reason -> clock-event seconds (last read)
        n = self.nvml
        if n.available:
            self._nvl_max = n.const("NVML_NVLINK_MAX_LINKS", 18)
            self._feature_on = n.const("NVML_FEATURE_ENABLED", 1)
            self._ecc_agg = n.const("NVML_AGGREGATE_ECC", 1)

    def _nvlink_links_active(self, i: int, h: Any, tick: int) -> int | None:
        """Active NVLink links, from the state of each link (nvmlDeviceGetNvLinkState, links 0, 1, ...
        until one answers an error), re-read every ``health_every`` ticks; None when the GPU has no NVLink."""
        if i not in self._nvlink_links or tick % self.health_every == 0:
            self._read_nvlink_state(i, h)
        return self._nvlink_links.get(i)

    def _read_nvlink_state(self, i: int, h: Any) -> None:
        n = self.nvml
        if n.is_unsupported("nvmlDeviceGetNvLinkState", i) or i in n.lost:
            self._nvlink_links.setdefault(i, None)
            self._nvlink_up.setdefault(i, None)
            return
        up: dict[int, int] | None = None
        for link in range(self._nvl_max):
            st, code = n.query_raw("nvmlDeviceGetNvLinkState", h, link)
            if code is not None:
                if link == 0:   # no NVLink on this GPU (PCIe card, vGPU): say so once
                    n.mark_unsupported("nvmlDeviceGetNvLinkState", i, f"no NVLink (NVML error {code})")
                break
            up = up if up is not None else {}
            up[link] = 1 if int(st) == self._feature_on else 0
        self._nvlink_up[i] = up
        self._nvlink_links[i] = sum(up.values()) if up is not None else None

    def _health_values(self, i: int, h: Any, put, cur: dict[str, Any], got: dict[int, Any], tick: int) -> None:
        """Aggregate ECC, retired pages, clock-event durations (from the field values, every ``health_every``
        ticks) and NVLink per-link state and errors (docs/METRICS.md "GPU sampler"). A field this GPU
        refuses falls back to its call (ECC, retired pages) or is reported once (clock events)."""
        n = self.nvml
        if i in n.lost:
            return
        if tick % self.health_every:
            cur["clock_event_seconds"] = self._clock_s.get(i, {})
            self._nvlink_health(i, h, put, cur, got, tick)
            return
        # 1 when any NVML call on this GPU answered RESET_REQUIRED since the last health read, else 0
        put("gpu_nvml_reset_required", 1.0 if i in n.reset_required else 0.0)
        n.reset_required.discard(i)
        if _FI_RECOVERY_ACTION in got:
            put("gpu_recovery_action", int(got[_FI_RECOVERY_ACTION].ullVal) & 0xFFFFFFFF)   # an unsigned int
        refused = self._fields_off.get(i, set())       # fields this GPU answered NOT_SUPPORTED
        # without field values at all (the call is NOT_SUPPORTED: said once for the call), every field is off
        off = HEALTH_FIDS if n.is_unsupported("nvmlDeviceGetFieldValues", i) else refused
        for fid, metric, etype in _FI_ECC_AGG:   # lifetime counts (volatile + earlier driver loads)
            if fid in got:
                put(metric, got[fid].ullVal)
            elif fid in off:
                put(metric, n.query("nvmlDeviceGetTotalEccErrors", h, etype, self._ecc_agg, gpu=i,
                                    key="nvmlDeviceGetTotalEccErrors (aggregate)"))
        self._retired_pages(i, h, put, cur, got, off)
        clocks: dict[str, float] = {}
        for fid, reason in _FI_CLOCK_EVENTS:
            if fid in got:
                clocks[reason] = int(got[fid].ullVal) / 1e9      # ns -> s
                put("gpu_clock_event_duration_seconds_total", clocks[reason], {"reason": reason})
            elif fid in refused:
                n.mark_unsupported(f"clock-event duration {reason}", i,
                                   f"field value {fid} not supported by this GPU or driver")
        self._clock_s[i] = clocks
        cur["clock_event_seconds"] = clocks
        self._nvlink_health(i, h, put, cur, got, tick)

    def _retired_pages(self, i: int, h: Any, put, cur: dict[str, Any], got: dict[int, Any], off: set[int]) -> None:
        """Pages retired per cause and pages pending retirement: the field values, else (a driver without
        them) nvmlDeviceGetRetiredPages per cause and ...PendingStatus; both every ``health_every`` ticks. GPUs from
        Ampere on remap rows instead and answer NOT_SUPPORTED: never asked again, and said once only
        where the GPU has no row remapping either."""
        n = self.nvml
        if _FI_RETIRED_SBE in got and _FI_RETIRED_DBE in got:
            sbe, dbe = int(got[_FI_RETIRED_SBE].ullVal), int(got[_FI_RETIRED_DBE].ullVal)
            pend = int(got[_FI_RETIRED_PENDING].ullVal) if _FI_RETIRED_PENDING in got else None
        elif _FI_RETIRED_SBE in off or _FI_RETIRED_DBE in off:
            if n.is_unsupported("nvmlDeviceGetRetiredPages", i):
                return
            # NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS (0), _DOUBLE_BIT_ECC_ERROR (1)
            got_sbe = n.query("nvmlDeviceGetRetiredPages", h, 0, gpu=i, report=False)
            if got_sbe is None:
                # GPUs from Ampere on remap rows instead: nothing is missing where gpu_remapped_rows_* come
                if n.is_unsupported("nvmlDeviceGetRetiredPages", i) and "gpu_remapped_rows_pending" not in cur:
                    n.mark_unsupported("retired pages", i, "nvmlDeviceGetRetiredPages not supported and no "
                                       "row remapping either: no memory page retirement figures")
                return
            got_dbe = n.query("nvmlDeviceGetRetiredPages", h, 1, gpu=i)
            if got_dbe is None:
                return
            sbe, dbe = len(got_sbe), len(got_dbe)
            pend = n.query("nvmlDeviceGetRetiredPagesPendingStatus", h, gpu=i)
        else:
            return
        put("gpu_retired_pages_total", sbe, {"cause": "single_bit_ecc"})
        put("gpu_retired_pages_total", dbe, {"cause": "double_bit_ecc"})
        if dbe and not n.is_unsupported("nvmlDeviceGetRetiredPages_v2", i):
            # DBE pages retired in the past week (their timestamps): DCGM's second retired-page limit
            pages = n.query("nvmlDeviceGetRetiredPages_v2", h, 1, gpu=i, report=False)
            if pages is not None:
                since_us = (time.time() - _WEEK_S) * 1e6
                put("gpu_retired_pages_past_week", sum(1 for pg in pages if pg.get("timestamp", 0) >= since_us),
                    {"cause": "double_bit_ecc"})
        if pend is not None:
            put("gpu_retired_pages_pending", 1 if pend else 0)

    def _nvlink_health(self, i: int, h: Any, put, cur: dict[str, Any], got: dict[int, Any], tick: int) -> None:
        """gpu_nvlink_link_up{link} for each link that answers its state, and
        gpu_nvlink_errors_total{link,counter} (nvmlDeviceGetNvLinkErrorCounter per link and counter: the
        per-link field ids stop at link 11, an H100 has 18). The link state is read every ``health_every``
        ticks; the per-link errors on the first tick and whenever one of the GPU's NVLink error totals (4
        field values, every tick) changed (then the state too), so unchanged totals mean unchanged links;
        where the totals do not answer, every ``health_every`` ticks. Both series are emitted on those
        ticks only."""
        n = self.nvml
        if self._nvlink_up.get(i) is None:
            return
        fids = [f for f, _ in NVLINK_ERR_TOTALS]
        totals = tuple(int(got[f].ullVal) for f in fids) if all(f in got for f in fids) else None
        regular = tick % self.health_every == 0
        changed = totals is not None and totals != self._nvlink_totals.get(i)
        if i not in self._nvlink_err or changed or (regular and totals is None):
            if not regular:                   # a total moved between the regular reads: the state too
                self._read_nvlink_state(i, h)
            errs: dict[int, dict[str, int]] = {}
            for link in self._nvlink_up.get(i) or {}:
                row: dict[str, int] = {}
                for name, cid in _NVLINK_ERRORS:
                    v = n.query("nvmlDeviceGetNvLinkErrorCounter", h, link, cid, gpu=i,
                                key=f"nvmlDeviceGetNvLinkErrorCounter ({name})")
                    if v is not None:
                        row[name] = int(v)
                errs[link] = row
            self._nvlink_err[i] = errs
            self._nvlink_totals[i] = totals
            self._nvlink_bad[i] = {k: v for k, v in errs.items() if any(v.values())}
        elif not regular:
            cur["nvlink_link_up"], cur["nvlink_errors"] = self._nvlink_up.get(i) or {}, self._nvlink_bad.get(i, {})
            return
        up = self._nvlink_up.get(i) or {}
        errs = self._nvlink_err.get(i, {})
        for link, state in up.items():
            put("gpu_nvlink_link_up", state, {"link": str(link)})
            for name, v in errs.get(link, {}).items():
                put("gpu_nvlink_errors_total", v, {"link": str(link), "counter": name})
        cur["nvlink_link_up"], cur["nvlink_errors"] = up, self._nvlink_bad.get(i, {})
