"""Fleet fabric probing in the collector: which nodes measure each other, and when (planner.py)."""
