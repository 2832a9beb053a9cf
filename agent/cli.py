"""The `gpuagent` command (node side)."""

from __future__ import annotations

import click

from gpuagent.probes.cli import probe


@click.group()
def main() -> None:
    """gpuagent: node agent for GPU training fleets."""


main.add_command(probe)
