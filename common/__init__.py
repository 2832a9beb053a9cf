"""What several parts of gpuagent use: the NVML seam, job identity, systemd notify, time and error helpers.

Every other package may import this one; it imports none of them (docs/ARCHITECTURE.md, "Import rules").
"""
