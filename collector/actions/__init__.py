"""Drains from the collector: after each analysis pass, findings become Slurm drains or alerts (docs/ACTIONS.md)."""
