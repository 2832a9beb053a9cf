"""The faults where our rules were laxer or stricter than NVIDIA's XID catalog, DCGM and NVSentinel (issue 46
must-show 2), end to end: injected where a real node shows them (the NVML emulator under the real pynvml, and
kernel-log lines in the driver's formats appended to a /dev/kmsg stand-in; our own SYNTHETIC lines), read by
the real agent, streamed to the real collector, judged by its analysis pass, and cleared again.

- XID 154 with each recovery action (GPU Reset Required, Node Reboot Required, Drain and Reset, Drain P2P: each
  critical with the driver's action; None: nothing), NVML's own recovery action field (node reboot), NVML
  answering RESET_REQUIRED, XID 46 (the catalog's RESET_GPU, a warning here before), an NVLink5 XID 144 whose
  intrInfo/errorStatus decode (the catalog's 144-150 sheet) to Fatal, a Fatal SXid, NVLink replays (DCGM fails
  on any), 63 retired pages (DCGM's limit), XID 31 twice within a day on one GPU (escalated as NVSentinel does);
- and a contained XID 94 with its volatile uncorrected ECC counter +1: warnings only, no drain.
"""

from __future__ import annotations

import json
import time

import pytest

from agent_helpers import start_agent, stop, wait_running
from conftest import wait_for
from gpuagent.collector import service as server
from gpuagent.collector.views import client
from gpuagent.common import hardware_faults as hf
from gpuagent.sim.nvml_emulator import Emulator
from nvml_emulator_fixture import built_or_skip
from test_hardware_fault_chain import HEALTHY, UP_S, _hw_flags, _latest, judge_after_the_clear

pytestmark = pytest.mark.slow

# (gpu or None for a switch, component) -> (severity, the rules its evidence must name, words its action has)
EXPECTED = {
    (0, "xid"): ("critical", {"xid_154"}, "GPU Reset Required"),
    (1, "xid"): ("critical", {"xid_154"}, "Node Reboot Required"),
    (1, "nvlink"): ("critical", {"nvlink_replay"}, "NVLink replays"),
    (2, "xid"): ("warning", {"xid_94"}, "keeps serving"),
    (2, "ecc"): ("warning", {"ecc_uncorrected"}, "at the next drain"),
    (3, "xid"): ("critical", {"xid_154"}, "Drain and Reset"),
    (3, "retired_pages"): ("critical", {"retired_pages_limit", "retired_pages_sbe"}, "retired-page limit"),
    (4, "xid"): ("critical", {"recovery_node_reboot", "xid_46"}, "recovery action node reboot"),
    (5, "xid"): ("critical", {"nvml_reset_required"}, "RESET_REQUIRED"),
    (6, "xid"): ("critical", {"xid_144", "xid_154"}, "fatal NVLink5"),
    (7, "xid"): ("warning", {"xid_31"}, "dcgmi diag"),
    (None, "nvlink"): ("critical", {"sxid"}, "fatal NVSwitch"),
}


def _record(seq: int, message: str, ago_s: float = 0.0) -> str:
    """One /dev/kmsg record dated ago_s before now on the agent's boot clock (its time namespace is UP_S ahead)."""
    usec = (time.clock_gettime_ns(time.CLOCK_BOOTTIME) + int((UP_S - ago_s) * 1e9)) // 1000
    return f"3,{seq},{usec},-;{message}\n"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    built_or_skip()
    tmp = tmp_path_factory.mktemp("hw-catalog")
    doc = json.loads(HEALTHY.read_text())
    emu = Emulator.start(tmp / "nvmlemu", doc, clock="real")
    emu.inject_health(1, nvlink_errors={0: {"crc_flit": 0, "crc_data": 0, "replay": 0, "recovery": 0}})
    emu.inject_health(3, retired_pages={})                 # a GPU with page retirement (pre-Ampere), none yet
    bus = [g["pci_bus_id"].split(":", 1)[1][:5].lower() for g in doc["gpus"]]    # "AB:00.0" -> "ab:00"
    kmsg = tmp / "kmsg"
    kmsg.write_text(_record(0, "Linux version SYNTHETIC"))
    cfg = tmp / "agent.toml"
    cfg.write_text(f'[probes]\nenabled = false\n[hardware]\nkmsg_path = "{kmsg}"\nsys_root = "{tmp / "sys"}"\n')
    col = server.start_collector(tmp / "c.duckdb", "127.0.0.1:0", analyze=False)
    state = tmp / "state"
    # Unchanged health counters are sent once per summary interval (docs/RESOLUTION.md): 5 s, so that the test's
    # waits for readings after each step stay short.
    agent = start_agent(tmp, col.address, state, interval=0.5, batch_interval=0.5, up_longer_s=UP_S,
                        GPUAGENT_CONFIG=str(cfg), GPUAGENT_SUMMARY_INTERVAL="5", **emu.env_vars())
    out: dict = {}
    n = lambda sql: client.query(col.address, sql).rows[0][0]  # noqa: E731
    try:
        wait_running(state, agent)
        wait_for(lambda: n("SELECT count(DISTINCT ts) FROM samples WHERE metric = 'gpu_recovery_action' "
                           "AND gpu = 4") >= 2, timeout=40, interval=0.5, what="two health reads of the healthy node")
        client.analyze(col.address, window_s=600)
        out["healthy"] = _hw_flags(col.address)

        t_fault = time.time()
        action = "GPU recovery action changed from 0x0 (None) to {} ({})"
        lines = [
            (f"NVRM: Xid (PCI:0000:{bus[7]}): 31, pid=4242, name=python3, MMU Fault: ENGINE GRAPHICS", 900),
            (f"NVRM: Xid (PCI:0000:{bus[0]}): 154, {action.format('0x1', 'GPU Reset Required')}", 0),
            (f"NVRM: Xid (PCI:0000:{bus[1]}): 154, {action.format('0x2', 'Node Reboot Required')}", 0),
            (f"NVRM: Xid (PCI:0000:{bus[2]}): 94, pid=4243, name=python3, Contained: CE User Channel (0x9)", 0),
            (f"NVRM: Xid (PCI:0000:{bus[3]}): 154, {action.format('0x4', 'Drain and Reset')}", 0),
            (f"NVRM: Xid (PCI:0000:{bus[4]}): 46, pid=4244, name=python3, GPU stopped processing", 0),
            # NVLink5 (the catalog's format): SAW_MVB with errorStatus bit 1, which its decode sheet calls Fatal
            (f"NVRM: Xid (PCI:0000:{bus[6]}): 144, SAW_MVB Fatal XC0 i0 Link 03 (0x00000001 0x00000002 0x00000000 "
             "0x00000000 0x00000000 0x00000000 0x00000000)", 0),
            (f"NVRM: Xid (PCI:0000:{bus[6]}): 154, {action.format('0x3', 'Drain P2P')}", 0),
            (f"NVRM: Xid (PCI:0000:{bus[7]}): 31, pid=5151, name=python3, MMU Fault: ENGINE GRAPHICS", 0),
            (f"NVRM: Xid (PCI:0000:{bus[7]}): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to "
             "0x0 (None)", 0),
            ("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Fatal, Link 20 egress non-posted PRIV error", 0),
        ]
        with kmsg.open("a") as f:
            for seq, (line, ago_s) in enumerate(lines, start=1):
                f.write(_record(seq, line, ago_s))
        emu.inject_health(1, nvlink_errors={0: {"crc_flit": 0, "crc_data": 0, "replay": 3, "recovery": 0}})
        emu.set(2, "ecc_uncorrected", 1)               # the contained error's volatile count
        emu.inject_health(3, retired_pages={"single_bit_ecc": 63})
        emu.set(4, "recovery_action", 2)               # NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
        rule = emu.fail("nvmlDeviceGetPowerUsage", "RESET_REQUIRED", gpu=5)

        def stored():
            return (n("SELECT count(*) FROM events WHERE kind IN ('xid', 'sxid')") >= len(lines)
                    and n("SELECT count(DISTINCT ts) FROM samples WHERE metric = 'gpu_ecc_uncorrected_total' "
                          f"AND gpu = 2 AND epoch(ts) > {t_fault}") >= 2
                    and _latest(col.address, "gpu_recovery_action", "AND gpu = 4") == 2.0
                    and _latest(col.address, "gpu_nvml_reset_required", "AND gpu = 5") == 1.0
                    and (_latest(col.address, "gpu_retired_pages_total",
                                 "AND gpu = 3 AND labels = 'cause=single_bit_ecc'") or 0) == 63.0
                    and (_latest(col.address, "gpu_nvlink_errors_total",
                                 "AND gpu = 1 AND labels = 'counter=replay,link=0'") or 0) == 3.0)
        wait_for(stored, timeout=60, interval=0.5, what="every injected fault stored")
        client.analyze(col.address, window_s=600)
        out["faulty"] = _hw_flags(col.address)
        out["events"] = client.query(col.address, "SELECT gpu, kind, value, attrs FROM events "
                                                  "WHERE kind IN ('xid', 'sxid') ORDER BY ts").rows

        # Cleared: the GPUs reset (recovery actions back to none, NVML answers again), the retired-page GPU
        # replaced (RMA), counters stay where they are.
        emu.set(4, "recovery_action", 0)
        emu.clear_fail(rule)
        emu.inject_health(3, retired_pages={})
        t_clear = time.time()
        wait_for(lambda: n("SELECT count(DISTINCT ts) FROM samples WHERE metric = 'gpu_recovery_action' "
                           f"AND gpu = 4 AND epoch(ts) > {t_clear + 1}") >= 2
                 and _latest(col.address, "gpu_recovery_action", "AND gpu = 4") == 0.0
                 and _latest(col.address, "gpu_nvml_reset_required", "AND gpu = 5") == 0.0,
                 timeout=60, interval=0.5, what="the cleared state stored")
        judge_after_the_clear(col.address, t_clear, out)
    finally:
        stop(agent)
        col.stop()
    return out


def test_the_healthy_node_raises_nothing(chain):
    assert chain["healthy"] == {}


def test_every_injected_fault_and_nothing_else_is_flagged(chain):
    assert set(chain["faulty"]) == set(EXPECTED), sorted(chain["faulty"], key=str)


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: f"gpu{k[0]}-{k[1]}" if k[0] is not None else f"switch-{k[1]}")
def test_each_fault_has_its_severity_and_action_and_clears(chain, key):
    severity, rules, words = EXPECTED[key]
    assert key in chain["faulty"], sorted(chain["faulty"], key=str)
    got_severity, sentence, evidence = chain["faulty"][key]
    assert got_severity == severity, (key, sentence)
    assert {f["rule"] for f in evidence["faults"]} == rules, (key, evidence["faults"])
    lead = evidence["faults"][0]
    assert evidence["action"] == lead["action"] and lead["action"] in sentence, (key, sentence)
    assert words in sentence, (key, sentence)
    assert key not in chain["after"], f"{key} still open after it cleared: {chain['after'].get(key)}"
    assert key in chain["closed"], f"{key} was not closed"


def test_the_agent_decoded_what_the_rules_read(chain):
    attrs = [(gpu, kind, int(value), json.loads(a) if isinstance(a, str) else a) for gpu, kind, value, a in chain["events"]]
    actions = {a["recovery_action"] for _g, _k, x, a in attrs if x == 154}
    assert actions == {"gpu_reset_required", "node_reboot_required", "drain_and_reset", "drain_p2p", "none"}
    (nv5,) = [a for _g, _k, x, a in attrs if x == 144]
    assert nv5["nvlink5_severity"] == "fatal" and nv5["nvlink5_unit"] == "SAW_MVB", nv5
    assert nv5["nvlink5_decoded_by"].startswith("catalog decode")
    (sx,) = [a for _g, k, _x, a in attrs if k == "sxid"]
    assert sx["fatal"] == "1"


def test_a_contained_ecc_error_does_not_drain(chain):
    assert all(chain["faulty"][(2, c)][0] == "warning" for c in ("xid", "ecc"))
    ev = chain["faulty"][(2, "xid")][2]["faults"][0]["detail"]
    assert ev["resolution_bucket_immediate_action"] == "RESTART_APP"


def test_xid_31_once_before_and_once_now_counts_two_bursts_within_a_day(chain):
    detail = chain["faulty"][(7, "xid")][2]["faults"][0]["detail"]
    assert detail["bursts"] == 2 and hf.rules().application_repeat_count == 2
    assert "2 times on this GPU within 24 h" in chain["faulty"][(7, "xid")][1]
