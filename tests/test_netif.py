"""The fabric NIC's line rate from sysfs (agent/samplers/netif.py), read from a fake /sys/class/net tree built the way
Linux lays it out, and the interface found from the fabric address with this host's real addresses."""

from __future__ import annotations

import socket
from collections import namedtuple

from sysfs_helpers import INFINIBAND, add_nic

from gpuagent.agent.samplers import netif


def test_physical_ethernet_nics_report_their_speed_and_nothing_else_does(tmp_path):
    net = add_nic(tmp_path, "ens2f0np0", "100000")
    add_nic(tmp_path, "eth1", "25000")
    add_nic(tmp_path, "eth-down", "-1")                # link down, or a driver that does not know
    add_nic(tmp_path, "virtio0", None)                 # no speed file
    add_nic(tmp_path, "odd0", "fast")
    add_nic(tmp_path, "ib0", "100000", arp_type=INFINIBAND)   # IPoIB: an IB rate, not Ethernet framing
    add_nic(tmp_path, "veth9", "10000", virtual=True)  # veth reports a fixed 10000 whatever it carries
    add_nic(tmp_path, "unreadable0", None)
    (net / "unreadable0" / "speed").mkdir()            # reading it is an OSError, as EINVAL is on a down link
    assert netif.link_speed_mbits("ens2f0np0", net) == 100000
    assert netif.link_speed_mbits("eth1", net) == 25000
    for name in ("eth-down", "virtio0", "odd0", "ib0", "veth9", "unreadable0", "no-such-nic", "", "../eth1"):
        assert netif.link_speed_mbits(name, net) is None, name


def test_a_vlan_takes_its_nics_rate_and_a_bond_of_two_is_unknown(tmp_path):
    add_nic(tmp_path, "eth0", "100000")
    add_nic(tmp_path, "eth1", "100000")
    add_nic(tmp_path, "eth0.20", "100000", virtual=True, lower=("eth0",))
    net = add_nic(tmp_path, "bond0", "200000", virtual=True, lower=("eth0", "eth1"))
    add_nic(tmp_path, "loop0", "1000", virtual=True, lower=("loop1",))
    add_nic(tmp_path, "loop1", "1000", virtual=True, lower=("loop0",))
    assert netif.link_speed_mbits("eth0.20", net) == 100000
    assert netif.link_speed_mbits("bond0", net) is None
    assert netif.link_speed_mbits("loop0", net) is None     # a cycle ends at the depth limit


def test_the_interface_of_the_fabric_address():
    assert netif.interface_for_address("127.0.0.1") in ("lo", "lo0")     # this host's real table
    assert netif.interface_for_address("fabric-17.example") == ""
    snic = namedtuple("snic", "family address netmask broadcast ptp")
    table = {"eth0": [snic(socket.AF_INET, "10.0.0.5", None, None, None)],
             "eth1": [snic(socket.AF_INET6, "fe80::1%eth1", None, None, None),
                      snic(socket.AF_INET6, "fd00::17", None, None, None)]}
    assert netif.interface_for_address("10.0.0.5", table) == "eth0"
    assert netif.interface_for_address("[fd00:0::17]", table) == "eth1"
    assert netif.interface_for_address("10.0.0.6", table) == ""
