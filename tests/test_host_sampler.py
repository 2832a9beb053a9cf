"""Host sampler: exact arithmetic on a synthetic /proc pair, parsing of a recorded /proc pair, and the
live /proc of this machine cross-checked against real psutil."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import pytest

from gpuagent.agent.samplers.host import HostSampler, numa_layout
from gpuagent.agent.samplers.sampling import ListSink, now_ns

DATA = Path(__file__).parent / "data"
SEC = 1_000_000_000


def _two_ticks(tmp_path, pair: Path):
    """Copy t0 into a proc root, tick, overwrite with t1, tick 1 s later (real files, real reads)."""
    root = tmp_path / "proc"
    shutil.copytree(pair / "t0", root)
    s = HostSampler(proc_root=str(root), sys_root=str(tmp_path / "nosys"))
    sink = ListSink()
    s.sample(1_000 * SEC, sink)
    first = list(sink.samples)
    shutil.rmtree(root)
    shutil.copytree(pair / "t1", root)
    s.sample(1_001 * SEC, sink)
    second = [x for x in sink.samples if x.ts_ns == 1_001 * SEC]
    return first, {(x.metric, x.labels): x.value for x in second}, s


def test_synthetic_pair_exact_values(tmp_path):
    first, m, s = _two_ticks(tmp_path, DATA / "proc_synthetic_vm")
    # first tick: gauges only, no rates
    assert not any(x.metric.endswith("_per_s") or x.metric.startswith("cpu_") for x in first)
    for lab in ((), (("cpu", "0"),)):
        assert m[("cpu_user_percent", lab)] == pytest.approx(50.0)
        assert m[("cpu_system_percent", lab)] == pytest.approx(20.0)
        assert m[("cpu_iowait_percent", lab)] == pytest.approx(10.0)
        assert m[("cpu_steal_percent", lab)] == pytest.approx(10.0)
        assert m[("cpu_idle_percent", lab)] == pytest.approx(10.0)
    assert m[("context_switches_per_s", ())] == 12000 and m[("interrupts_per_s", ())] == 2500
    assert (m[("load1", ())], m[("load15", ())]) == (1.5, 0.35)
    assert m[("mem_total_bytes", ())] == 16384000 * 1024
    assert m[("mem_used_bytes", ())] == (16384000 - 8192000) * 1024
    assert m[("swap_used_bytes", ())] == 1048576 * 1024
    d = (("device", "nvme0n1"),)
    assert m[("disk_read_bytes_per_s", d)] == 800 * 512 and m[("disk_write_bytes_per_s", d)] == 3200 * 512
    assert m[("disk_read_iops", d)] == 100 and m[("disk_write_iops", d)] == 200
    assert m[("disk_read_latency_ms", d)] == pytest.approx(0.5) and m[("disk_write_latency_ms", d)] == pytest.approx(2.0)
    assert m[("disk_busy_percent", d)] == pytest.approx(25.0)
    devices = {dict(k[1]).get("device") for k in m if k[0].startswith("disk_")}
    assert devices == {"nvme0n1"}          # partitions, loop, ram and zram skipped
    n = (("nic", "eth0"),)
    assert m[("net_rx_bytes_per_s", n)] == 1_000_000 and m[("net_tx_bytes_per_s", n)] == 500_000
    assert m[("net_rx_errors_per_s", n)] == 3 and m[("net_rx_drops_per_s", n)] == 2
    assert m[("net_tx_drops_per_s", n)] == 5
    assert m[("net_tcp_out_segs_per_s", ())] == 10_000 and m[("net_tcp_retrans_segs_per_s", ())] == 30
    assert m[("net_tcp_retrans_percent", ())] == pytest.approx(0.3)
    assert not any(dict(k[1]).get("nic") == "lo" for k in m)
    assert m[("psi_cpu_some_avg10_percent", ())] == 20.0
    assert m[("psi_cpu_some_stall_percent", ())] == pytest.approx(25.0)
    assert m[("psi_io_full_avg10_percent", ())] == 0.5
    assert ("psi_cpu_full_avg10_percent", ()) not in m
    assert s.last["cpu_steal_percent"] == pytest.approx(10.0)


def test_recorded_pair_parses(tmp_path):
    _, m, _ = _two_ticks(tmp_path, DATA / "proc_recorded_kvm")
    shares = [m[(k, ())] for k in ("cpu_user_percent", "cpu_system_percent", "cpu_iowait_percent",
                                   "cpu_steal_percent", "cpu_idle_percent")]
    assert all(0 <= v <= 100 for v in shares) and 99.0 <= sum(shares) <= 100.001
    assert {dict(k[1])["cpu"] for k in m if k[0] == "cpu_idle_percent" and k[1]} == {"0", "1"}
    assert {dict(k[1])["device"] for k in m if k[0] == "disk_read_iops"} == {"vda"}
    assert ("net_rx_bytes_per_s", (("nic", "eth0"),)) in m
    assert ("psi_memory_some_stall_percent", ()) in m


def test_live_proc_against_psutil(tmp_path):
    s = HostSampler()
    sink = ListSink()
    s.sample(now_ns(), sink)
    # real disk traffic between the ticks: 8 MiB written and fsynced in this test
    target = tmp_path / "blob"
    with open(target, "wb") as f:
        f.write(os.urandom(8 << 20))
        f.flush()
        os.fsync(f.fileno())
    t1 = now_ns()
    s.sample(t1, sink)
    m = {(x.metric, x.labels): x.value for x in sink.samples if x.ts_ns == t1}
    assert m[("mem_total_bytes", ())] == psutil.virtual_memory().total
    cpus = {dict(k[1])["cpu"] for k in m if k[0] == "cpu_idle_percent" and k[1]}
    assert len(cpus) == psutil.cpu_count()
    assert m[("load1", ())] == pytest.approx(os.getloadavg()[0], abs=0.5)
    assert 0.0 <= m[("cpu_steal_percent", ())] <= 100.0
    written = {dict(k[1])["device"]: v for k, v in m.items() if k[0] == "disk_write_bytes_per_s"}
    per_disk = psutil.disk_io_counters(perdisk=True)
    assert written and set(written) <= set(per_disk)
    dt = (t1 - sink.samples[0].ts_ns) / 1e9
    assert max(written.values()) * dt >= 8 << 20
    assert m[("context_switches_per_s", ())] > 0


def test_numa_layout_matches_this_machine():
    layout = numa_layout()
    if not layout:
        pytest.skip("no NUMA information in /sys here")
    cpus = 0
    for node in layout.values():
        for part in node["cpus"].split(","):
            lo, _, hi = part.partition("-")
            cpus += int(hi or lo) - int(lo) + 1
        assert node["mem_total_bytes"] > 0
    assert cpus == psutil.cpu_count()


def test_loopback_traffic_is_counted_when_lo_is_not_skipped():
    """Real traffic over a loopback TCP connection shows up in the lo series (lo is skipped by default)."""
    import socket
    import threading

    s = HostSampler(skip_nics="")
    sink = ListSink()
    t0 = now_ns()
    s.sample(t0, sink)
    srv = socket.create_server(("127.0.0.1", 0))
    got = []

    def drain():
        conn, _ = srv.accept()
        with conn:
            n = 0
            while chunk := conn.recv(1 << 16):
                n += len(chunk)
            got.append(n)

    th = threading.Thread(target=drain)
    th.start()
    with socket.create_connection(srv.getsockname()) as c:
        c.sendall(b"x" * (4 << 20))
    th.join(timeout=30)
    srv.close()
    t1 = now_ns()
    s.sample(t1, sink)
    assert got == [4 << 20]
    m = {(x.metric, x.labels): x.value for x in sink.samples if x.ts_ns == t1}
    lo = (("nic", "lo"),)
    assert m[("net_rx_bytes_per_s", lo)] * (t1 - t0) / 1e9 >= 4 << 20
    assert m[("net_tx_bytes_per_s", lo)] * (t1 - t0) / 1e9 >= 4 << 20
    assert not any(k[0].startswith("net_") and k[1] == lo for k in
                   {(x.metric, x.labels) for x in _default_tick_pair()})


def _default_tick_pair():
    s = HostSampler()
    sink = ListSink()
    s.sample(now_ns(), sink)
    s.sample(now_ns() + 1, sink)
    return sink.samples
