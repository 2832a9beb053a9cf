#!/bin/sh
# slurm.conf Prolog (docs/SLURM.md): exit 1 when this node has an open critical hardware fault (Slurm drains
# the node and requeues the job held); its one stderr line is in slurmd's log ("prolog failed: ... output:").
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
# GPUAGENT: the gpuagent command when it is not on PATH (e.g. /opt/gpuagent/bin/gpuagent); extra
# arguments go to it (--state-dir, --config, --source).
timeout 20 "${GPUAGENT:-gpuagent}" slurm prolog "$@"
rc=$?
[ "$rc" -eq 1 ] && exit 1
exit 0          # anything else (gpuagent missing, timeout 124) must not drain a healthy node
