from gpuagent.probes.registry import ProbeSpec
SPEC = ProbeSpec(name="gpu_compute", description="tbd", platform="cuda", defaults={})
def run(params): raise NotImplementedError
