"""Stage 3, active measurement: when a probe may run on this node (the scheduler) and the fabric pair probes.
"""
