"""pytest fixture for the NVML emulator (gpuagent.sim.nvml_emulator): real pynvml over a SYNTHETIC node.

Register it once in conftest.py with ``from nvml_emulator_fixture import nvml_emulator  # noqa: F401``
(test modules can also import it themselves). In a test::

    def test_x(nvml_emulator):
        emu = nvml_emulator()                    # H100 x8 fixture, frozen clock, this process pointed at it
        nv = Nvml()                              # the real pynvml, answered by the emulator
        emu.advance(1.0); emu.inject_xid(3, 79)
        subprocess.run(cmd, env=emu.env())       # a subprocess sees the same node

Each call makes a fresh node in its own directory under tmp_path (safe under pytest-xdist); after the
test this process is pointed away again, so a later nvmlInit answers DRIVER_NOT_LOADED (no driver).
Without a C compiler (tools.need("cc")) or NVIDIA's nvml.h the library cannot be built and the test is
skipped with the one sentence saying why; under CI=true it fails instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tools
from gpuagent.sim.nvml_emulator import Emulator, EmulatorError, ensure_built

DATA = Path(__file__).parent / "data"
H100_8GPU = DATA / "nvml_8gpu_h100_sxm.json"
A10_VGPU = DATA / "nvml_1gpu_a10_vgpu.json"


def built_or_skip() -> None:
    """Build the emulator if needed; skip the test when this machine cannot (fail under CI=true, where
    every tool must be there). A missing C compiler is named as tools.need names every outside tool."""
    if tools.which("cc") is None:
        try:
            ensure_built()           # an up-to-date prebuilt library needs no compiler
            return
        except EmulatorError:
            tools.need("cc")         # skips with "missing tool cc (Debian package gcc)", fails under CI
            raise
    try:
        ensure_built()
    except EmulatorError as exc:
        if tools.in_ci():
            pytest.fail(f"CI=true, but the NVML emulator cannot be built: {exc}", pytrace=False)
        pytest.skip(f"the NVML emulator cannot be built here: {exc}")


@pytest.fixture
def nvml_emulator(tmp_path: Path) -> Iterator[Callable[..., Emulator]]:
    """Factory: ``nvml_emulator(fixture=H100_8GPU, *, clock="frozen", activate=True, **start_kw)``
    returns a started :class:`Emulator`; with ``activate`` this process's pynvml uses it."""
    built_or_skip()
    made: list[tuple[Emulator, bool]] = []

    def make(fixture: Any = H100_8GPU, *, clock: str = "frozen", activate: bool = True, **kw: Any) -> Emulator:
        emu = Emulator.start(tmp_path / f"nvmlemu{len(made)}", fixture, clock=clock, **kw)
        if activate:
            emu.activate()
        made.append((emu, activate))
        return emu

    yield make
    for emu, active in reversed(made):
        if active:
            emu.deactivate()


def numa_sysfs(root: Path, fixture: Path = H100_8GPU) -> Path:
    """A SYNTHETIC sysfs tree under ``root`` (GpuSampler's ``sys_root``) with one
    devices/system/node/nodeN/cpulist per NUMA node of the fixture's ``_about`` (the CPU sets the GPUs'
    ``cpu_affinity`` names: DGX H100's two sockets, node 0 first). Returns ``root``."""
    import json  # noqa: PLC0415

    sets = list(dict.fromkeys(g["cpu_affinity"] for g in json.loads(fixture.read_text())["gpus"]))
    for node, cpus in enumerate(sets):
        d = root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpulist").write_text(cpus + "\n")
    return root
