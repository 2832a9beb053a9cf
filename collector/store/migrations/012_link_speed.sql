-- gpuagent collector schema, version 12: the line rate of each end's NIC in link_results (issue 12).
-- nic_speed_mbits: the Ethernet line rate, Mbit/s, of the NIC the reporting end's fabric traffic uses
-- (/sys/class/net/<iface>/speed, agent/samplers/netif.py); NULL when that end does not know it (a virtual NIC, a
-- link that is down, IPoIB, an agent that does not report it) and on the collector's own rows. A link's
-- line rate is the lower of its two ends' known rates (collector/analysis/sql/60_network_degraded.sql).
ALTER TABLE link_results ADD COLUMN nic_speed_mbits INTEGER;
