#!/bin/sh
# slurm.conf HealthCheckProgram (docs/SLURM.md): drains THIS node (SLURMD_NODENAME) on a critical hardware
# fault, with "gpuagent: <the fault's sentence>" as the reason; resumes nothing. slurmd kills it after 60 s.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
# GPUAGENT: the gpuagent command when it is not on PATH (e.g. /opt/gpuagent/bin/gpuagent); extra
# arguments go to it (--state-dir, --config, --source).
exec timeout 50 "${GPUAGENT:-gpuagent}" slurm healthcheck "$@" >/dev/null
