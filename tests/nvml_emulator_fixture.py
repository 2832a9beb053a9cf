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
Without a C compiler or NVIDIA's nvml.h the library cannot be built and the test is skipped with the
one sentence saying why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gpuagent.sim.nvml_emulator import Emulator, EmulatorError, ensure_built

DATA = Path(__file__).parent / "data"
H100_8GPU = DATA / "nvml_8gpu_h100_sxm.json"
A10_VGPU = DATA / "nvml_1gpu_a10_vgpu.json"


def built_or_skip() -> None:
    """Build the emulator if needed; skip the test when this machine cannot."""
    try:
        ensure_built()
    except EmulatorError as exc:
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
