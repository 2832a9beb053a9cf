"""The synthetic fleet (SYNTHETIC data only): simulated nodes that stream through the agent's sender code.

Entry point ``gpuagent-sim`` (gpuagent.sim.run:main). Nothing it produces is a measurement.
"""
