"""Each host source fails alone (issue 23): one malformed line in a /proc or sysfs file is skipped and
counted, and only that source loses anything; a source that raises is caught while the rest still run;
interface names that differ in bytes stay different labels.

The fixture trees are SYNTHETIC, written here in the kernel's formats (proc(5), Documentation/filesystems/
proc.rst, Documentation/accounting/psi.rst, Documentation/ABI/stable/sysfs-class-infiniband,
Documentation/ABI/testing/sysfs-class-net). The /proc/net/dev alias case failed on the sampler before this
change: the ValueError from ``ibr10:30`` stopped the tick, so no TCP or PSI series were emitted at all.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuagent.agent.samplers.host import HostSampler
from gpuagent.agent.samplers.hw_host import HwHostSampler
from gpuagent.agent.samplers.sampling import ListSink

SEC = 1_000_000_000
NET_HEADER = ("Inter-|   Receive                                                |  Transmit\n"
              " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls "
              "carrier compressed\n")


def _net_line(name: str, rx: int, tx: int) -> str:
    return f"{name:>6}: {rx} 10 0 0 0 0 0 0 {tx} 10 0 0 0 0 0 0\n"


def write_proc(root: Path, k: int, extra: dict[str, str] | None = None) -> None:
    """A SYNTHETIC /proc at tick k (counters grow with k); ``extra`` appends one line to a file."""
    extra = extra or {}
    files = {
        "stat": (f"cpu  {100 + 50 * k} 0 {50 + 20 * k} {1000 + 30 * k} 0 0 0 0 0 0\n"
                 f"cpu0 {100 + 50 * k} 0 {50 + 20 * k} {1000 + 30 * k} 0 0 0 0 0 0\n"
                 f"intr {5000 + 2500 * k} 0 0\nctxt {9000 + 12000 * k}\nbtime 1700000000\n"),
        "loadavg": "1.50 0.80 0.35 2/300 4242\n",
        "meminfo": "MemTotal:       16384000 kB\nMemFree:         4096000 kB\nMemAvailable:    8192000 kB\n"
                   "SwapTotal:       2097152 kB\nSwapFree:        1048576 kB\n",
        "diskstats": (f" 259       0 nvme0n1 {100 + 100 * k} 0 {800 + 800 * k} {50 + 50 * k} {200 + 200 * k} 0 "
                      f"{3200 + 3200 * k} {400 + 400 * k} 0 {250 + 250 * k} 450 0 0 0 0\n"
                      f"   8       0 sda {10 + k} 0 {80 + 8 * k} 5 {20 + 2 * k} 0 {320 + 32 * k} 40 0 25 45 0 0 0 0\n"),
        "net/dev": NET_HEADER + _net_line("lo", 1, 1) + _net_line("eth0", 1_000_000 * k, 500_000 * k)
        + _net_line("ib0", 2_000_000 * k, 1_000_000 * k),
        "net/snmp": ("Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets "
                     "CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors\n"
                     f"Tcp: 1 200 120000 -1 10 10 0 0 2 1000 {1000 + 1000 * k} {5 * k} 0 0 0\n"),
        "pressure/cpu": f"some avg10=1.50 avg60=1.00 avg300=0.50 total={100000 * k}\n"
                        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        "pressure/io": f"some avg10=2.00 avg60=1.00 avg300=0.50 total={200000 * k}\n"
                       "full avg10=1.00 avg60=0.50 avg300=0.25 total=100\n",
        "pressure/memory": f"some avg10=0.10 avg60=0.00 avg300=0.00 total={1000 * k}\n"
                           "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        data = text.encode() + extra.get(rel, "").encode("utf-8", "surrogateescape")
        p.write_bytes(data)


def two_ticks(tmp_path, extra=None, sampler_cls=HostSampler):
    root = tmp_path / "proc"
    write_proc(root, 0, extra)
    s = sampler_cls(proc_root=str(root), sys_root=str(tmp_path / "nosys"))
    sink = ListSink()
    s.sample(1000 * SEC, sink)
    write_proc(root, 1, extra)
    s.sample(1001 * SEC, sink)
    return s, {(x.metric, x.labels) for x in sink.samples if x.ts_ns == 1001 * SEC}


# Which series each source gives; a bad line in one source may cost only that source's series.
SOURCE_SERIES = {
    "stat": {("cpu_user_percent", ()), ("cpu_user_percent", (("cpu", "0"),)), ("context_switches_per_s", ()),
             ("interrupts_per_s", ())},
    "loadavg": {("load1", ()), ("load15", ())},
    "meminfo": {("mem_total_bytes", ()), ("mem_used_bytes", ()), ("swap_used_bytes", ())},
    "disks": {("disk_read_iops", (("device", "nvme0n1"),)), ("disk_read_iops", (("device", "sda"),))},
    "net": {("net_rx_bytes_per_s", (("nic", "eth0"),)), ("net_rx_bytes_per_s", (("nic", "ib0"),))},
    "tcp": {("net_tcp_retrans_percent", ())},
    "psi": {("psi_cpu_some_avg10_percent", ()), ("psi_io_full_avg10_percent", ()),
            ("psi_memory_some_stall_percent", ())},
}

# (source, file, one malformed line, series of that source that must survive it)
BAD_LINES = [
    ("stat", "stat", "cpu1 12 x 7\n", SOURCE_SERIES["stat"]),
    ("meminfo", "meminfo", "Cached:  lots kB\n", SOURCE_SERIES["meminfo"]),
    ("disks", "diskstats", "   8      16 sdb 1 2 x\n", SOURCE_SERIES["disks"]),
    ("net", "net/dev", "  eth9: 1 2 three 4 5 6 7 8 9 10 11 12 13 14 15 16\n", SOURCE_SERIES["net"]),
    ("net", "net/dev", "this line has no colon at all\n", SOURCE_SERIES["net"]),
    ("psi", "pressure/io", "partial avg10=abc\n", SOURCE_SERIES["psi"]),
]


def test_clean_fixture_gives_every_source(tmp_path):
    s, got = two_ticks(tmp_path)
    missing = set().union(*SOURCE_SERIES.values()) - got
    assert not missing and s.bad_lines == {} and s.unavailable == []


@pytest.mark.parametrize("source,rel,line,survivors", BAD_LINES, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_LINES)])
def test_one_bad_line_costs_only_that_line(tmp_path, source, rel, line, survivors):
    s, got = two_ticks(tmp_path, {rel: line})
    others = set().union(*(v for k, v in SOURCE_SERIES.items() if k != source))
    assert others <= got, f"a bad line in {rel} cost other sources: {sorted(others - got)}"
    assert survivors <= got, f"a bad line in {rel} cost the good lines of {source}: {sorted(survivors - got)}"
    assert s.bad_lines == {source: 2}          # the line, once per tick
    assert any(source in note for note in s.unavailable)


def test_whole_file_malformed_loadavg_and_tcp_lose_only_themselves(tmp_path):
    root = tmp_path / "proc"
    write_proc(root, 0)
    (root / "loadavg").write_text("not numbers\n")
    (root / "net/snmp").write_text("Tcp: OutSegs RetransSegs\nTcp: many few\n")
    s = HostSampler(proc_root=str(root), sys_root=str(tmp_path / "nosys"))
    sink = ListSink()
    s.sample(1000 * SEC, sink)
    s.sample(1001 * SEC, sink)
    got = {(x.metric, x.labels) for x in sink.samples}
    assert not SOURCE_SERIES["loadavg"] & got and ("mem_total_bytes", ()) in got
    assert s.bad_lines["loadavg"] == 2 and s.bad_lines["tcp"] == 2
    assert SOURCE_SERIES["psi"] <= {(x.metric, x.labels) for x in sink.samples if x.ts_ns == 1001 * SEC}


def test_net_dev_alias_keeps_its_name_and_the_later_sources_run(tmp_path):
    """``ibr10:30`` (an alias, counters after a second colon) raised in the old sampler and dropped the
    network, TCP and PSI series on every tick; this assertion failed on HEAD's agent/samplers/host.py."""
    s, got = two_ticks(tmp_path, {"net/dev": "ibr10:30: 123 1 0 0 0 0 0 0 456 1 0 0 0 0 0 0\n"})
    assert SOURCE_SERIES["tcp"] <= got and SOURCE_SERIES["psi"] <= got and SOURCE_SERIES["net"] <= got
    assert ("net_rx_bytes_per_s", (("nic", "ibr10:30"),)) in got
    assert s.bad_lines == {}


def test_non_ascii_interface_names_stay_distinct(tmp_path):
    # "eth\xe9" is Latin-1 (not valid UTF-8), "eth\xc3\xa9" is "ethé" in UTF-8, "eth\xea" another byte:
    # an "ascii, replace" decode made all three "eth\ufffd..." and merged their series.
    names = ["eth\udce9", "eth\u00e9", "eth\udcea"]
    extra = "".join(_net_line(n, 7, 7) for n in names)
    s, got = two_ticks(tmp_path, {"net/dev": extra})
    nics = {dict(lab)["nic"] for m, lab in got if m == "net_rx_bytes_per_s"}
    assert {"eth\\xe9", "ethé", "eth\\xea"} <= nics
    assert all(n.encode("utf-8") for n in nics)  # every label is valid UTF-8 (protobuf strings must be)
    assert s.bad_lines == {}


class _BrokenTcp(HostSampler):
    """A source that raises something no line check expects (a SYNTHETIC fault)."""

    def _tcp(self, put, dt):
        raise RuntimeError("SYNTHETIC failure inside the tcp source")


def test_a_source_that_raises_is_caught_counted_and_the_rest_run(tmp_path, caplog):
    s, got = two_ticks(tmp_path, sampler_cls=_BrokenTcp)
    assert SOURCE_SERIES["psi"] <= got and SOURCE_SERIES["net"] <= got
    assert not SOURCE_SERIES["tcp"] & got
    assert s.guard.errors == {"tcp": 2}
    assert sum("source tcp failed" in r.getMessage() for r in caplog.records) == 1   # rate-limited


# ---------------------------------------------------------------- sysfs sources

def _write(p: Path, text: str) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def _sys_tree(root: Path) -> None:
    for dev in ("mlx5_0", "mlx5_1"):
        port = root / "class/infiniband" / dev / "ports/1"
        _write(port / "state", "4: ACTIVE\n")
        _write(port / "phys_state", "5: LinkUp\n")
        _write(port / "rate", "200 Gb/sec (4X HDR)\n")
        _write(port / "link_layer", "InfiniBand\n")
        _write(port / "counters/symbol_error", "0\n")
        _write(port / "counters/link_downed", "1\n")
        _write(port / "hw_counters/out_of_buffer", "0\n")
    for name in ("eth0", "eth1"):
        dev = root / "devices/pci0000:00/0000:00:03.0/net" / name
        _write(dev / "carrier_changes", "2\n" if name == "eth0" else "4\n")
        _write(dev / "speed", "100000\n")
        (root / "class/net").mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(dev, root / "class/net"), root / "class/net" / name)


# (file under mlx5_0's port 1 or eth0's device, bad text, the one series it costs, the source that counts it)
BAD_SYSFS = [
    ("ib:state", "ACTIVE-ish", ("ib_port_state", "mlx5_0", None), "infiniband"),
    ("ib:phys_state", "LinkUp-ish", ("ib_port_phys_state", "mlx5_0", None), "infiniband"),
    ("ib:rate", "fast Gb/sec", ("ib_port_rate_gbps", "mlx5_0", None), "infiniband"),
    ("ib:counters/symbol_error", "0x1f", ("ib_port_errors_total", "mlx5_0", "symbol_error"), "infiniband"),
    ("ib:hw_counters/out_of_buffer", "n/a", ("ib_port_errors_total", "mlx5_0", "out_of_buffer"), "infiniband"),
    ("eth:carrier_changes", "lots", ("net_carrier_changes_total", "eth0", None), "ethernet"),
    ("eth:speed", "fast", ("net_link_speed_mbps", "eth0", None), "ethernet"),
]


@pytest.mark.parametrize("rel, text, lost, source", BAD_SYSFS, ids=[b[0] for b in BAD_SYSFS])
def test_a_bad_sysfs_value_costs_only_its_own_series(tmp_path, rel, text, lost, source):
    sys_root = tmp_path / "sys"
    _sys_tree(sys_root)
    where, name = rel.split(":")
    base = (sys_root / "class/infiniband/mlx5_0/ports/1" if where == "ib"
            else sys_root / "devices/pci0000:00/0000:00:03.0/net/eth0")
    s = HwHostSampler(sys_root=str(sys_root), kmsg=False)
    def tick(k):
        sink = ListSink()
        s.sample(k * 10 * SEC, sink)
        return {(x.metric, dict(x.labels).get("device"), dict(x.labels).get("counter")) for x in sink.samples}
    clean = tick(100)
    assert lost in clean
    _write(base / name, text + "\n")
    got = tick(101)
    assert got == clean - {lost}, (sorted(clean - got), sorted(got - clean))
    assert s.guard.bad_lines == {source: 1}
