"""`python -m gpuagent.collector ...` runs the `gpuagent-collector` CLI."""

from gpuagent.collector.cli import main

main()
