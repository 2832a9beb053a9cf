"""Fleet fabric probing in the collector: handing the pair and group rounds to the agents (coordinator.py),
planned by gpuagent.common.pair_planner (shared with the simulator)."""
