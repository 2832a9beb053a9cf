"""agent/samplers/hw_host.py: the kernel-log reader (boot ring, restart resume, EPIPE, NVML dedup), InfiniBand / RoCE
ports and Ethernet links, each through a SYNTHETIC fixture tree written here in the kernel's documented
formats: /dev/kmsg records "prio,seq,usec,flags;message" with " KEY=value" dictionary lines
(Documentation/ABI/testing/dev-kmsg), Documentation/ABI/stable/sysfs-class-infiniband and
Documentation/ABI/testing/sysfs-class-net. The NVIDIA lines are our own, in the driver's shapes cited in
agent/samplers/hw_host.py's docstring."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from gpuagent.agent.samplers.hw_host import EthLinks, HwHostSampler, IbPorts, XidLedger, bus_key, classify, parse_kmsg_record
from gpuagent.agent.samplers.sampling import ListSink

SEC = 1_000_000_000
BTIME = 1_764_600_000            # SYNTHETIC boot time (s) of the fixture /proc
BOOT_ID = "5d1c0f0e-0000-4000-8000-5y1t4e71c000"
GPUS = {"0000:3b:00": 2, "0000:86:00": 5}    # bus -> NVML index on the SYNTHETIC node

# (prio, usec, message): prio 3 = facility 0 (kernel), level err; prio 11 = facility 1 (user), level err.
BOOT_RING = [
    (6, 1_000_000, "Linux version 6.8.0-SYNTHETIC"),
    (4, 20_000_000, "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python3, GPU has fallen off the bus."),
    (3, 21_000_000, ("NVRM: Xid (PCI:0000:86:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception: "
                     "ESR 0x404600=0x80000002")),
    (3, 22_000_000, "NVRM: Xid (0000:86:00): 48, An uncorrectable double bit error (DBE) has been detected"),
    (4, 30_000_000, "nvidia-nvswitch2: SXid (PCI:0000:c5:00.0): 12028, Data {0x00000001, 0x00000002}"),
    (4, 30_000_100, "nvidia-nvswitch2: SXid (PCI:0000:c5:00.0): 12028, Fatal, Link 12 egress non-posted PRIV error"),
    (4, 30_000_200, "nvidia-nvswitch2: SXid (PCI:0000:c5:00.0): 12028, Severity 1 Engine instance 12"),
    (3, 40_000_000, "NVRM: GPU 0000:af:00.0: RmInitAdapter failed! (0x62:0x65:1792)"),
    (3, 40_000_500, "NVRM: GPU 0000:af:00.0: rm_init_adapter failed, device minor number 7"),
    (3, 41_000_000, (r"NVRM: The NVIDIA GPU 0000:b3:00.0\x0aNVRM: (PCI ID: 10de:2330) installed in this system has"
                     r"\x0aNVRM: fallen off the bus and is not responding to commands.")),
    (11, 50_000_000, "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=forged, written by a user process"),
    (6, 60_000_000, "mlx5_core 0000:ab:00.0 mlx5_5: Port: 1 Link ACTIVE"),
]


def record(seq: int, prio: int, usec: int, msg: str, info: dict[str, str] | None = None) -> str:
    return f"{prio},{seq},{usec},-;{msg}\n" + "".join(f" {k}={v}\n" for k, v in (info or {}).items())


def write_proc(root: Path, boot_id: str = BOOT_ID) -> None:
    (root / "sys/kernel/random").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  1 2 3 4 0 0 0 0\nbtime {BTIME}\n")
    (root / "sys/kernel/random/boot_id").write_text(boot_id + "\n")


@pytest.fixture
def node(tmp_path):
    proc, state = tmp_path / "proc", tmp_path / "state"
    write_proc(proc)
    state.mkdir()
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("".join(record(i, *r, info={"SUBSYSTEM": "pci"} if "Xid" in r[2] else None)
                            for i, r in enumerate(BOOT_RING)))
    return proc, state, kmsg


def sampler(node, **kw) -> HwHostSampler:
    proc, state, kmsg = node
    kw.setdefault("holdback_s", 0)
    return HwHostSampler(sys_root=str(proc.parent / "nosys"), proc_root=str(proc), kmsg_path=str(kmsg),
                         state_dir=str(state), gpu_for_bus=lambda b: GPUS.get(bus_key(b)), **kw)


NOW = (BTIME + 3600) * SEC


def test_boot_ring_gives_xid_sxid_and_driver_errors_once_each(node):
    s, sink = sampler(node), ListSink()
    s.sample(NOW, sink)
    ev = [(e.kind, int(e.value), e.gpu) for e in sink.events]
    assert ev == [("xid", 79, 2), ("xid", 13, 5), ("xid", 48, 5), ("sxid", 12028, -1),
                  ("nvidia_driver_error", 0, -1), ("nvidia_driver_error", 0, -1)]
    x79 = sink.events[0]
    assert x79.ts_ns == BTIME * SEC + 20_000_000 * 1000          # boot time + usec since boot
    assert x79.attrs["source"] == "kmsg" and x79.attrs["pci_bus_id"] == "0000:3b:00"
    assert x79.attrs["pid"] == "4242" and x79.attrs["process_name"] == "python3"
    assert x79.attrs["description"] == "GPU has fallen off the bus."
    assert "pid" not in sink.events[1].attrs                      # pid='<unknown>'
    sx = sink.events[3]
    assert sx.attrs["device"] == "nvidia-nvswitch2" and sx.attrs["severity"] == "fatal"
    assert sx.attrs["message"].startswith("Fatal, Link 12")        # three records, one event, the telling one
    init, fallen = sink.events[4], sink.events[5]
    assert init.attrs["reason"] == "init_failed" and init.attrs["pci_bus_id"] == "0000:af:00"
    assert fallen.attrs["reason"] == "fallen_off_bus" and "\n" not in fallen.attrs["message"]
    assert all("forged" not in e.message for e in sink.events)     # facility 1: written from userspace
    s.sample(NOW + SEC, sink)
    assert len(sink.events) == 6                                   # nothing twice


def test_restart_resumes_after_the_last_seq_and_a_new_boot_reads_the_ring_again(node):
    proc, _state, kmsg = node
    s, sink = sampler(node), ListSink()
    s.sample(NOW, sink)
    s.close()
    with kmsg.open("a") as f:
        f.write(record(len(BOOT_RING), 3, 70_000_000, "NVRM: Xid (PCI:0000:3b:00): 94, pid=77, name=train, "
                                                         "Contained ECC error"))
    s2, sink2 = sampler(node), ListSink()
    s2.sample(NOW + SEC, sink2)
    assert [(e.kind, int(e.value)) for e in sink2.events] == [("xid", 94)]
    s2.close()
    write_proc(proc, boot_id="a-new-boot")                         # rebooted: seq starts again, read it all
    s3, sink3 = sampler(node), ListSink()
    s3.sample(NOW + 2 * SEC, sink3)
    assert len([e for e in sink3.events if e.kind == "xid"]) == 4


def test_epipe_and_seq_gaps_are_counted_and_reading_goes_on(node):
    kmsg = node[2]
    kmsg.write_text(record(0, 3, 1, "NVRM: Xid (PCI:0000:3b:00): 31, pid=1, name=a, MMU Fault") +
                    record(9, 3, 2, "NVRM: Xid (PCI:0000:3b:00): 63, ECC page retirement or row remapping"))
    calls = {"n": 0}

    def read(fd, n):              # the kernel answers EPIPE once when records were overwritten
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EPIPE, "Broken pipe")
        return os.read(fd, n)

    s, sink = sampler(node, kmsg_read=read), ListSink()
    s.sample(NOW, sink)
    assert [int(e.value) for e in sink.events] == [31, 63]
    assert s.kmsg.epipe == 1 and s.kmsg.lost_records == 8          # seq 1..8 never arrived
    assert any("overwritten" in n for n in s.unavailable)


def test_a_malformed_record_is_counted_and_the_next_one_read(node):
    kmsg = node[2]
    kmsg.write_text("no header here\n" + "3,x,5,-;bad seq\n" +
                    record(2, 3, 3, "NVRM: Xid (PCI:0000:3b:00): 74, NVLink error"))
    s, sink = sampler(node), ListSink()
    s.sample(NOW, sink)
    assert [int(e.value) for e in sink.events] == [74]
    assert s.guard.bad_lines == {"kmsg": 2}


def test_nvml_xid_dedups_the_kernel_copy_within_10_s(node):
    kmsg = node[2]
    kmsg.write_text(record(0, 4, 20_000_000, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.") +
                    record(1, 4, 21_000_000, "NVRM: Xid (PCI:0000:3b:00): 45, pid=9, name=x, Preemptive cleanup"))
    t79 = BTIME * SEC + 20 * SEC
    ledger = XidLedger(bus_for_gpu={2: "00000000:3B:00.0"}.get)
    batcher = ListSink()
    # The GPU sampler's NVML event passes through the tap the daemon puts on its sink, 3 s after the kernel's.
    ledger.tap(batcher).event("xid", "XID 79 on GPU 2", gpu=2, value=79, attrs={"xid": "79"}, ts_ns=t79 + 3 * SEC)
    s = sampler(node, nvml_seen=ledger.seen, holdback_s=5)
    s.sample(t79 + 2 * SEC, batcher)               # both still inside the hold-back: nothing yet
    assert [e.kind for e in batcher.events] == ["xid"]
    s.sample(t79 + 30 * SEC, batcher)
    assert [(int(e.value), e.attrs.get("source", "nvml")) for e in batcher.events] == [(79, "nvml"), (45, "kmsg")]
    assert s.deduplicated == 1
    assert not ledger.seen(79, "0000:3b:00", t79 + 20 * SEC)       # outside 10 s it is another XID


def test_unreadable_kmsg_is_one_status_note_and_sysfs_still_runs(tmp_path):
    sys_root = tmp_path / "sys"
    _port(sys_root, "mlx5_0", "1")
    s = HwHostSampler(sys_root=str(sys_root), proc_root=str(tmp_path), kmsg_path=str(tmp_path / "absent"),
                      state_dir=str(tmp_path))
    sink = ListSink()
    s.sample(NOW, sink)
    s.sample(NOW + 20 * SEC, sink)
    assert len([n for n in s.unavailable if "kernel log" in n]) == 1
    assert any(x.metric == "ib_port_state" for x in sink.samples)


def test_record_parser_and_classifier_units():
    r = parse_kmsg_record(b"3,17,123456,-,caller=T42;NVRM: Xid (PCI:0000:3b:00): 79, x\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0")
    assert (r.prio, r.seq, r.usec, r.facility, r.info["DEVICE"]) == (3, 17, 123456, 0, "+pci:0000:3b:00.0")
    with pytest.raises(ValueError):
        parse_kmsg_record(b"3,17;no usec")
    assert classify("usb 1-1: new high-speed USB device") is None
    assert bus_key("00000000:3B:00.0") == bus_key("PCI:0000:3b:00") == "0000:3b:00"
    assert classify("NVRM: The NVIDIA probe routine failed for 1 device(s).")[2]["reason"] == "probe_failed"


# ---------------------------------------------------------------- InfiniBand / RoCE

def _w(p: Path, text: str) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text + "\n")


def _port(sys_root: Path, dev: str, port: str, state="4: ACTIVE", phys="5: LinkUp", rate="200 Gb/sec (4X HDR)",
          layer="InfiniBand", counters=None, hw=None) -> Path:
    p = sys_root / "class/infiniband" / dev / "ports" / port
    _w(p / "state", state)
    _w(p / "phys_state", phys)
    _w(p / "rate", rate)
    _w(p / "link_layer", layer)
    for k, v in (counters or {"symbol_error": 0, "link_downed": 0, "port_rcv_errors": 0}).items():
        _w(p / "counters" / k, str(v))
    for k, v in (hw or {}).items():
        _w(p / "hw_counters" / k, str(v))
    return p


def _ib_values(ib: IbPorts) -> dict:
    out = {}
    ib.sample(lambda m, v, lab: out.__setitem__((m, tuple(sorted(lab.items()))), v))
    return out


def test_ib_ports_state_rate_and_counters(tmp_path):
    sys_root = tmp_path / "sys"
    _port(sys_root, "mlx5_0", "1", counters={"symbol_error": 12, "link_downed": 2, "link_error_recovery": 1,
                                             "port_rcv_errors": 5, "port_xmit_discards": 0,
                                             "local_link_integrity_errors": 0, "excessive_buffer_overrun_errors": 0},
          hw={"out_of_buffer": 7, "lifespan": 10})
    _port(sys_root, "mlx5_1", "1", state="1: DOWN", phys="3: Disabled", rate="10 Gb/sec (4X SDR)", layer="Ethernet")
    v = _ib_values(IbPorts(str(sys_root)))
    up = (("device", "mlx5_0"), ("link_layer", "InfiniBand"), ("port", "1"))
    down = (("device", "mlx5_1"), ("link_layer", "Ethernet"), ("port", "1"))
    assert (v[("ib_port_state", up)], v[("ib_port_phys_state", up)], v[("ib_port_rate_gbps", up)]) == (4, 5, 200)
    assert (v[("ib_port_state", down)], v[("ib_port_phys_state", down)], v[("ib_port_rate_gbps", down)]) == (1, 3, 10)

    def err(counter):
        return v[("ib_port_errors_total", (("counter", counter), ("device", "mlx5_0"), ("port", "1")))]
    assert (err("symbol_error"), err("link_downed"), err("port_rcv_errors"), err("out_of_buffer")) == (12, 2, 5, 7)
    assert not any(dict(lab).get("counter") == "lifespan" for _m, lab in v)      # a setting, not a counter


def test_ib_file_list_is_cached_and_listed_again(tmp_path):
    sys_root = tmp_path / "sys"
    _port(sys_root, "mlx5_0", "1")
    ib = IbPorts(str(sys_root), relist_s=3600)
    assert len(ib.ports()) == 1
    _port(sys_root, "mlx5_1", "1")
    assert len(ib.ports()) == 1              # cached
    ib.relist_s = 0
    assert len(ib.ports()) == 2


# ---------------------------------------------------------------- Ethernet

def _netdev(sys_root: Path, name: str, parent: str, **files: str) -> None:
    dev = sys_root / "devices" / parent / "net" / name
    for k, v in files.items():
        _w(dev / k, v)
    (sys_root / "class/net").mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(dev, sys_root / "class/net"), sys_root / "class/net" / name)


def test_ethernet_carrier_changes_and_speed_physical_only(tmp_path):
    sys_root = tmp_path / "sys"
    _netdev(sys_root, "eth0", "pci0000:00/0000:00:03.0", carrier_changes="3", speed="100000", carrier="1",
            operstate="up")
    _netdev(sys_root, "eth1", "pci0000:00/0000:00:04.0", carrier_changes="8", speed="-1", carrier="0",
            operstate="down")
    _netdev(sys_root, "veth0", "virtual", carrier_changes="2", speed="10000")
    _netdev(sys_root, "lo", "virtual", carrier_changes="0")
    out = {}
    EthLinks(str(sys_root)).sample(lambda m, v, lab: out.__setitem__((m, lab["device"]), v))
    assert out == {("net_carrier_changes_total", "eth0"): 3, ("net_link_speed_mbps", "eth0"): 100000,
                   ("net_carrier_changes_total", "eth1"): 8}          # link down: no speed; veth and lo skipped


def test_ethernet_expected_speeds_from_the_manifest(tmp_path):
    """[hardware] ethernet_speed_mbps: exact names win over patterns; a device it does not name gets no maximum."""
    sys_root = tmp_path / "sys"
    for name, speed in (("ens1f0", "100000"), ("ens1f1", "200000"), ("eno1", "1000")):
        _netdev(sys_root, name, f"pci0000:00/0000:00:0{len(name)}.{name[-1]}", carrier_changes="1", speed=speed)
    out = {}
    EthLinks(str(sys_root), expected_mbps={"ens*": 200000, "ens1f1": 400000}).sample(
        lambda m, v, lab: out.__setitem__((m, lab["device"]), v))
    maxes = {d: v for (m, d), v in out.items() if m == "net_link_speed_max_mbps"}
    assert maxes == {"ens1f0": 200000, "ens1f1": 400000}


def test_sysfs_is_read_on_its_own_interval(tmp_path):
    sys_root = tmp_path / "sys"
    _port(sys_root, "mlx5_0", "1")
    s = HwHostSampler(sys_root=str(sys_root), kmsg=False, sysfs_every_s=10)
    sink = ListSink()
    for k in range(12):
        s.sample(NOW + k * SEC, sink)
    assert len({x.ts_ns for x in sink.samples}) == 2        # t=0 and t=10 s


def test_agent_dedups_an_nvml_xid_against_the_kernel_log_over_the_emulator(tmp_path, nvml_emulator):
    """The daemon's wiring: real pynvml over the NVML emulator (SYNTHETIC H100 x8, GPU 3 at bus 5D) reports
    XID 79 on GPU 3; the kernel log (a fixture in /dev/kmsg's format, timed on this machine's boot clock)
    holds the same XID 6 s earlier and an XID 31 on GPU 4 (bus 9A). One XID 79 reaches the batcher (NVML's),
    the kmsg XID 31 arrives with gpu 4 from the bus id."""
    import time

    from dataclasses import replace

    from gpuagent.agent.config import HardwareConfig, load_config
    from gpuagent.agent.daemon import Agent, build_node_info, hardware_sampler
    from gpuagent.agent.samplers.gpu import GpuSampler
    from gpuagent.common.nvml import Nvml
    from nvml_emulator_fixture import H100_8GPU

    boot_us = time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1000
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(record(0, 4, boot_us - 6_000_000, "NVRM: Xid (PCI:0000:5d:00): 79, GPU has fallen off the bus.") +
                    record(1, 4, boot_us - 6_000_000, "NVRM: Xid (PCI:0000:9a:00): 31, pid=7, name=t, MMU Fault"))
    cfg = load_config(None, env={}, state_dir=str(tmp_path / "state"), collector="127.0.0.1:9")
    cfg = replace(cfg, hardware=HardwareConfig(kmsg_path=str(kmsg), sys_root=str(tmp_path / "nosys")))
    emu = nvml_emulator(H100_8GPU)
    gpu = GpuSampler(nvml=Nvml())
    samplers = [gpu, hardware_sampler(cfg, gpu)]
    agent = Agent(cfg, samplers=samplers, node_info=build_node_info(cfg, samplers))
    try:
        emu.advance(1.0)
        emu.inject_xid(3, 79)
        emu.advance(1.0)
        for _ in range(2):
            agent.tick()
            emu.advance(1.0)
        events = [e for e in agent.batcher._events if e.kind == "xid"]
    finally:
        agent.shutdown()
    got = sorted((int(e.value), e.gpu, e.attrs.get("source", "nvml")) for e in events
                 if int(e.value) in (31, 79))      # the emulator's fixture holds XIDs of its own
    assert [g for g in got if g[2] == "kmsg"] == [(31, 4, "kmsg")]
    assert (79, 3, "nvml") in got
    assert samplers[1].deduplicated == 1


def test_sxid_runs_by_switch_and_an_xid_held_back_at_shutdown_is_read_again(node):
    proc, state, kmsg = node
    sw = "nvidia-nvswitch0: SXid (PCI:0000:07:00.0): 20034, "
    kmsg.write_text(record(0, 4, 1_000_000, sw + "Non-fatal, Link 30 LTSSM Fault Up") +
                    record(1, 6, 1_000_010, "mlx5_core 0000:ab:00.0: unrelated record in between") +
                    record(2, 4, 1_000_020, sw + "Severity 0 Engine instance 30 Sub-engine instance 00") +
                    record(3, 4, 1_000_030, "nvidia-nvswitch1: SXid (PCI:0000:08:00.0): 20034, Non-fatal, Link 2") +
                    record(4, 4, 3000 * 1_000_000, "NVRM: Xid (PCI:0000:3b:00): 119, Timeout after 6s of waiting "
                                                  "for RPC response from GPU0 GSP!"))
    s, sink = sampler(node, holdback_s=5), ListSink()
    s.sample(BTIME * SEC + 3001 * SEC, sink)        # the XID is 1 s old: held back
    assert [(e.kind, e.attrs["device"], e.attrs["severity"]) for e in sink.events] == [
        ("sxid", "nvidia-nvswitch0", "non-fatal"), ("sxid", "nvidia-nvswitch1", "non-fatal")]
    s.close()                                        # the agent stops before the hold-back ends
    s2, sink2 = sampler(node), ListSink()
    s2.sample(BTIME * SEC + 3010 * SEC, sink2)
    assert [(e.kind, int(e.value)) for e in sink2.events] == [("xid", 119)]


def test_hardware_config_table_and_its_one_sentence_errors(tmp_path):
    from gpuagent.agent.config import ConfigError, load_config

    f = tmp_path / "agent.toml"
    f.write_text('[hardware]\nkmsg = false\nkmsg_path = "/tmp/k"\nsysfs_interval_s = 30\n')
    hw = load_config(str(f), env={}).hardware
    assert (hw.kmsg, hw.kmsg_path, hw.sysfs_interval_s, hw.infiniband) == (False, "/tmp/k", 30.0, True)
    for text, words in (("sysfs_interval_s = 0", "hardware.sysfs_interval_s"), ("kmsg = 'maybe'", "true or false"),
                        ("kmesg = true", "unknown key hardware.kmesg")):
        f.write_text(f"[hardware]\n{text}\n")
        with pytest.raises(ConfigError) as err:
            load_config(str(f), env={})
        assert words in str(err.value) and "\n" not in str(err.value)


def test_classify_decodes_the_recovery_action_nvlink5_registers_and_sxid_tag():
    """What the catalog's rules read from a kernel line: XID 154's new action (the catalog's words, snake case),
    an NVLink5 XID's intrInfo/errorStatus through the catalog's 144-150 decode sheet, an SXid's Fatal tag."""
    _, _, a = classify("NVRM: Xid (PCI:0000:3b:00): 154, GPU recovery action changed from 0x0 (None) to 0x4 "
                       "(Drain and Reset)")
    assert (a["recovery_action"], a["recovery_action_code"], a["recovery_action_before"]) == ("drain_and_reset", "4", "none")
    regs = "(0x00000001 {} 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"
    fatal = classify(f"NVRM: Xid (PCI:0000:3b:00): 144, SAW_MVB Fatal XC0 i0 Link 03 {regs.format('0x00000002')}")[2]
    assert (fatal["nvlink5_severity"], fatal["nvlink5_unit"]) == ("fatal", "SAW_MVB")
    # the same unit with errorStatus bit 2: the sheet says Non-fatal / IGNORE, whatever the line's word
    quiet = classify(f"NVRM: Xid (PCI:0000:3b:00): 144, SAW_MVB Fatal XC0 i0 Link 03 {regs.format('0x00000004')}")[2]
    assert quiet["nvlink5_severity"] == "non_fatal" and quiet["nvlink5_decoded_by"].startswith("catalog decode")
    # registers the sheet does not know: the line's own word decides
    word = classify("NVRM: Xid (PCI:0000:3b:00): 149, NETIR_LINK_EVT Link Fatal XC0 i0 Link 12 (0x7fffffff 0x0)")[2]
    assert (word["nvlink5_severity"], word["nvlink5_decoded_by"]) == ("link_fatal", "message word")
    assert "nvlink5_severity" not in classify("NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.")[2]
    assert classify("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Fatal, Link 20 egress")[2]["fatal"] == "1"
    assert classify("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 22013, Non-fatal, Link 20 ...")[2]["fatal"] == "0"
