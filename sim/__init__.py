"""The synthetic fleet (SYNTHETIC data only): simulated nodes that speak the agent's protocol to a real
collector, with the agent's retry rules (gpuagent.common.retry), and rows written straight into a collector
database for analyzer tests (synthetic_rows).

Entry point ``gpuagent-sim`` (gpuagent.sim.run:main). Nothing it produces is a measurement.
"""
