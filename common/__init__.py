"""What several parts of gpuagent use: the NVML seam, job identity, systemd notify, time, parsing and error helpers,
and the RPC retry policy (``retry``) that the agent's sender and the simulator share.

Every other package may import this one; it imports none of them (docs/ARCHITECTURE.md, "Import rules").
"""
