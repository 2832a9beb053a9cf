from gpuagent.probes.registry import ProbeSpec
SPEC = ProbeSpec(name="pcie", description="tbd", platform="cuda", defaults={})
def run(params): raise NotImplementedError
