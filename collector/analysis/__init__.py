"""Analysis: rollups, baselines and flags, computed by SQL steps over the store."""
