"""Hardware faults end to end (issue 23): injected into the NVML emulator (SYNTHETIC GPUs, the real pynvml),
read by the real agent, streamed over gRPC to the real collector, judged by its real analysis pass. This is the
one test that proves the names agree along the whole chain: the sampler's series, the shared rules
(common/hardware_faults.toml) and the analysis step (70_hardware_fault.sql)."""

from __future__ import annotations

import pytest

from agent_helpers import start_agent, stop, wait_running
from conftest import wait_for
from gpuagent.collector.ingest import server
from gpuagent.common import hardware_faults
from gpuagent.collector.views import client
from nvml_emulator_fixture import H100_8GPU

pytestmark = pytest.mark.slow
HEALTHY = H100_8GPU.with_name("nvml_8gpu_h100_healthy.json")


def _hw_flags(address: str) -> dict[tuple[int, str], tuple[str, str]]:
    rows = client.query(address, "SELECT gpu, component, severity, sentence FROM flags "
                                  "WHERE kind = 'hardware_fault' AND state = 'open'").rows
    return {(r[0], r[1]): (r[2], r[3]) for r in rows}


def _latest(address: str, metric: str, gpu: int) -> float | None:
    rows = client.query(address, f"SELECT value FROM samples WHERE metric = '{metric}' AND gpu = {gpu} "
                                 "ORDER BY ts DESC LIMIT 1").rows
    return rows[0][0] if rows else None


def test_a_pending_row_remap_and_a_down_nvlink_open_flags_and_close_when_they_clear(nvml_emulator, tmp_path):
    emu = nvml_emulator(HEALTHY, clock="real")
    col = server.start_collector(tmp_path / "c.duckdb", "127.0.0.1:0", analyze=False)
    cfg = tmp_path / "agent.toml"
    cfg.write_text("[probes]\nenabled = false\n")
    state = tmp_path / "state"
    # A node up for a day: on a machine booted under 10 minutes ago (a fresh CI machine) the agent's start is
    # a reboot, and the NVLink down 5 s later is silenced as a link still training (a CI run, 2026-12-03).
    agent = start_agent(tmp_path, col.address, state, interval=0.5, batch_interval=0.5, up_longer_s=86400,
                        GPUAGENT_CONFIG=str(cfg), **emu.env_vars())
    try:
        wait_running(state, agent)
        wait_for(lambda: _latest(col.address, "gpu_remapped_rows_pending", 3) == 0.0, timeout=30, interval=0.5,
                 what="the healthy node's remap state stored")
        (up_s,) = client.query(col.address, "SELECT epoch_ns(ts) / 1e9 - CAST(json_extract_string(attrs, "
                                            "'$.boot_ns') AS BIGINT) / 1e9 FROM events WHERE kind = 'agent_start'").rows[0]
        assert up_s > hardware_faults.rules().reboot_grace_s, f"the agent's start reads as a reboot ({up_s:.0f} s up)"
        client.analyze(col.address, window_s=600)
        assert _hw_flags(col.address) == {}, "a healthy emulated 8-GPU node raises no hardware flag"

        emu.set(3, "remapped_rows", {"correctable": 0, "uncorrectable": 0, "pending": 1, "failure": 0})
        emu.inject_health(5, nvlink_down=[2])
        wait_for(lambda: _latest(col.address, "gpu_remapped_rows_pending", 3) == 1.0, timeout=30, interval=0.5,
                 what="the pending remap stored")
        # link state is read every 10th tick (5 s here)
        wait_for(lambda: client.query(col.address, "SELECT count(*) FROM samples WHERE metric = "
                                                   "'gpu_nvlink_link_up' AND gpu = 5 AND value = 0").rows[0][0],
                 timeout=30, interval=0.5, what="the down NVLink stored")
        client.analyze(col.address, window_s=600)
        flags = _hw_flags(col.address)
        pending = next(r for r in hardware_faults.rule_rows() if r["name"] == "row_remap_pending")
        assert flags.get((3, "row_remap"), ("", ""))[0] == pending["severity"], flags
        assert pending["action"] in flags[(3, "row_remap")][1], flags[(3, "row_remap")]   # the rule's action
        assert (5, "nvlink") in flags, flags
        assert {k for k in flags} == {(3, "row_remap"), (5, "nvlink")}, flags       # nothing else on the node

        emu.set(3, "remapped_rows", {"correctable": 0, "uncorrectable": 0, "pending": 0, "failure": 0})   # GPU reset
        emu.inject_health(5, nvlink_down=[])
        wait_for(lambda: _latest(col.address, "gpu_remapped_rows_pending", 3) == 0.0, timeout=30, interval=0.5,
                 what="the cleared remap stored")
        wait_for(lambda: _latest(col.address, "gpu_nvlink_link_up", 5) == 1.0, timeout=30, interval=0.5,
                 what="the link back up stored")
        # the other links' series are up too: wait one more state read so every link's latest value is new
        wait_for(lambda: client.query(col.address, "SELECT count(*) FROM (SELECT arg_max(value, ts) AS v FROM samples "
                                                   "WHERE metric = 'gpu_nvlink_link_up' AND gpu = 5 GROUP BY labels) "
                                                   "WHERE v = 0").rows[0][0] == 0,
                 timeout=30, interval=0.5, what="every link of GPU 5 up in its latest reading")
        client.analyze(col.address, window_s=600)
        assert (3, "row_remap") not in _hw_flags(col.address) and (5, "nvlink") not in _hw_flags(col.address)
        closed = client.query(col.address, "SELECT gpu, component FROM flags WHERE kind = 'hardware_fault' "
                                           "AND state = 'closed' ORDER BY gpu").rows
        assert [tuple(r) for r in closed] == [(3, "row_remap"), (5, "nvlink")]
    finally:
        stop(agent)
        col.stop()
