"""rdma_pair: where RDMA cannot be measured (no device in /sys/class/infiniband, or no perftest) the probe is
skipped with the reason, before anything starts; here that is the real machine's state. The perftest
table parser is checked on the table layout ib_write_bw / ib_write_lat print (format samples, not
measurements)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from gpuagent.probes import rdma_pair
from gpuagent.probes.registry import ParamError, get, names

HAS_RDMA = bool(rdma_pair.devices()) and all(shutil.which(t) for t in rdma_pair.TOOLS)


@pytest.mark.skipif(HAS_RDMA, reason="this machine has an RDMA device and perftest: nothing to skip")
def test_skipped_with_the_reason_on_this_machine():
    res = rdma_pair.run({**rdma_pair.SPEC.defaults, "peer": "10.203.0.9"})
    assert res.status == "skipped" and res.metrics == {} and res.env == {"role": "connect"}
    if not rdma_pair.devices():
        state = "empty" if os.path.isdir(rdma_pair.SYSFS) else "missing"
        assert res.reason.startswith(f"no RDMA device: /sys/class/infiniband is {state}")
    missing = [t for t in rdma_pair.TOOLS if shutil.which(t) is None]
    for tool in missing:
        assert tool in res.reason
    # The CLI, as a real process: one JSON object, exit 0, the same sentence; the listening end too.
    for args in (["connect", "10.203.0.9"], ["listen"]):
        out = subprocess.run([sys.executable, "-m", "gpuagent.probes.rdma_pair", *args], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert (doc["status"], doc["reason"], doc["env"]["role"]) == ("skipped", res.reason, args[0])


def test_reason_names_what_is_missing(tmp_path):
    sysfs = tmp_path / "infiniband"
    assert rdma_pair.unavailable_reason(str(sysfs), which=lambda t: None) == (
        f"no RDMA device: {sysfs} is missing, and perftest's ib_write_bw and ib_write_lat are not installed")
    sysfs.mkdir()
    assert rdma_pair.unavailable_reason(str(sysfs), which=lambda t: "/usr/bin/" + t) == (
        f"no RDMA device: {sysfs} is empty")
    (sysfs / "mlx5_0").mkdir()
    (sysfs / "mlx5_1").mkdir()
    assert rdma_pair.unavailable_reason(str(sysfs), which=lambda t: None if t == "ib_write_lat" else t) == (
        "perftest's ib_write_lat is not on PATH (RDMA devices: mlx5_0, mlx5_1; the Debian/Ubuntu package is perftest)")
    assert rdma_pair.unavailable_reason(str(sysfs), which=lambda t: "/usr/bin/" + t) == ""


def test_bad_settings_are_one_sentence():
    res = rdma_pair.run({**rdma_pair.SPEC.defaults, "role": "both"})
    assert res.status == "failed" and res.reason == "role must be connect or listen, got 'both'"
    from gpuagent.probes.registry import _check_limit
    with pytest.raises(ParamError, match="parameter tcp_port of probe rdma_pair must be between 1 and 65534"):
        _check_limit(rdma_pair.SPEC, "tcp_port", 70000)
    # A pair probe: the runner knows it (the fabric coordinator starts both ends together), the scheduler,
    # its config and `gpuagent probe list` do not.
    assert get("rdma_pair") is rdma_pair.SPEC and "rdma_pair" not in names()


BW_SAMPLE = """
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF          Device         : mlx5_0
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
Conflicting CPU frequency values detected: 1500.000000 != 3300.016000. CPU Frequency is not max.
 65536      560845           0.00               98.02                0.186950
---------------------------------------------------------------------------------------
"""

LAT_SAMPLE = """
                    RDMA_Write Latency Test
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]
 8       1000          1.71           5.32         1.76                1.78             0.09            2.11                   5.32
---------------------------------------------------------------------------------------
"""


def test_perftest_tables_parse_by_column_name():
    assert rdma_pair.bw_metrics(BW_SAMPLE) == {"write_gbits_per_s": 98.02, "write_peak_gbits_per_s": 0.0}
    assert rdma_pair.lat_metrics(LAT_SAMPLE) == {"lat_typical_us": 1.76, "lat_avg_us": 1.78, "lat_p99_us": 2.11,
                                                 "lat_min_us": 1.71}
    assert rdma_pair.bw_metrics("Couldn't connect to 10.0.0.2:18515") == {}
    argv = rdma_pair._argv("ib_write_bw", {**rdma_pair.SPEC.defaults, "peer": "10.0.0.2", "gid_index": 3},
                           "mlx5_0", 18515)
    assert argv == ["ib_write_bw", "-d", "mlx5_0", "-i", "1", "-p", "18515", "-x", "3", "-s", "65536", "-D", "3",
                    "--report_gbits", "10.0.0.2"]
