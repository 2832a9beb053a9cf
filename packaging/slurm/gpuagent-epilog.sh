#!/bin/sh
# slurm.conf Epilog (docs/SLURM.md): the job's GPU-hours, effective GPU utilization and the faults it met,
# appended to /var/lib/gpuagent/slurm-epilog.jsonl. Always exits 0: a failing Epilog drains the node.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
# GPUAGENT: the gpuagent command when it is not on PATH (e.g. /opt/gpuagent/bin/gpuagent); extra
# arguments go to it (--state-dir, --config, --source).
timeout 30 "${GPUAGENT:-gpuagent}" slurm epilog --wait-s 8 "$@" >/dev/null
exit 0
