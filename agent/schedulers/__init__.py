"""What the node's scheduler says: the Slurm job behind a process, the pod behind a GPU (kubelet).

Read-only adapters, below the samplers that attribute processes to jobs with them.
"""
