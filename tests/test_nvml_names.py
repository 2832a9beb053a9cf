"""Every NVML function and constant the agent and probes name exists in the real binding (nvidia-ml-py's
pynvml, installed here without a driver), and every fallback value they carry equals the binding's.

Why: Nvml.query turns a misspelt function into "not in this NVML binding", once, quietly. On a GPU node
that would lose a metric for good; the fake backend (tests/fake_nvml.py) cannot catch it because it is
written from the same names."""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest

from gpuagent.agent import gpu_sampler
from gpuagent.common import nvml

pynvml = pytest.importorskip("pynvml")

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "agent").glob("*.py")) + sorted((ROOT / "probes").glob("*.py"))


def _source() -> str:
    return "\n".join(p.read_text() for p in SOURCES)


def test_every_nvml_function_named_in_the_code_exists_in_pynvml():
    names = set(re.findall(r'"(nvml[A-Z][A-Za-z0-9_]+)"', _source()))
    functions = {n for n in names if not n.startswith("nvmlEventType")}
    assert len(functions) > 30   # the scan found the calls (a broken regex would pass vacuously)
    missing = sorted(n for n in functions if not callable(getattr(pynvml, n, None)))
    assert not missing, missing


@pytest.mark.parametrize("fn,nargs", [
    ("nvmlDeviceGetHandleByUUID", 1), ("nvmlDeviceGetHandleByPciBusId", 1),
    ("nvmlDeviceGetCurrPcieLinkGeneration", 1), ("nvmlDeviceGetCurrPcieLinkWidth", 1),
    ("nvmlDeviceGetMaxPcieLinkGeneration", 1), ("nvmlDeviceGetMaxPcieLinkWidth", 1),
    ("nvmlDeviceGetPcieThroughput", 2), ("nvmlDeviceGetFieldValues", 2), ("nvmlDeviceGetClockInfo", 2),
    ("nvmlDeviceGetMaxClockInfo", 2), ("nvmlDeviceGetTotalEccErrors", 3), ("nvmlDeviceGetTemperature", 2),
    ("nvmlDeviceGetProcessUtilization", 2), ("nvmlDeviceRegisterEvents", 3), ("nvmlEventSetWait", 2),
    ("nvmlDeviceGetNvLinkState", 2), ("nvmlDeviceGetCurrentClocksEventReasons", 1),
    ("nvmlDeviceGetCurrentClocksThrottleReasons", 1), ("nvmlDeviceGetMigMode", 1),
    ("nvmlDeviceGetVirtualizationMode", 1),
])
def test_call_arity_matches_pynvml(fn, nargs):
    """The number of arguments the code passes (handle first) is what pynvml's function takes."""
    params = inspect.signature(getattr(pynvml, fn)).parameters.values()
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert len(required) == nargs
    # and the code really calls it with that many arguments after the name (gpu=/report= are keywords)
    src = _source()
    call = r'(?:\.query|\.query_raw|\bq)\(\s*'
    args = r'((?:[^()]|\([^()]*\))*)\)'
    calls = re.findall(call + '"' + fn + '"' + args, src)
    for path in SOURCES:   # fn = "nvml..." then n.query(fn, h, ...), within the same file
        text = path.read_text()
        for var in re.findall(r'(\w+) = "' + fn + '"', text):
            calls += re.findall(call + var + r'\b' + args, text)
    assert calls, f"{fn} is not called through Nvml.query/query_raw"
    for args in calls:
        positional = [a for a in (x.strip() for x in args.split(",")) if a and "=" not in a]
        assert len(positional) == nargs, (fn, args)


def test_fallback_constants_equal_pynvml():
    src = _source()
    pairs = re.findall(r'const\("([A-Za-z0-9_]+)",\s*(0x[0-9a-fA-F]+|\d+)\)', src)
    assert len(pairs) >= 15
    # NVML_NVLINK_MAX_LINKS grew from 18 (R535 headers) to 36 (R570+); the fallback is only a loop bound
    # that stops at the first link the driver rejects.
    differ = {name: (int(v, 0), getattr(pynvml, name, None)) for name, v in pairs
              if name != "NVML_NVLINK_MAX_LINKS" and getattr(pynvml, name, None) != int(v, 0)}
    assert not differ, differ


def test_error_codes_event_type_throttle_bits_and_virtualization_modes_equal_pynvml():
    for name in ("UNINITIALIZED", "INVALID_ARGUMENT", "NOT_SUPPORTED", "NO_PERMISSION", "NOT_FOUND",
                 "DRIVER_NOT_LOADED", "TIMEOUT", "LIBRARY_NOT_FOUND", "FUNCTION_NOT_FOUND", "GPU_IS_LOST"):
        assert getattr(nvml, f"ERROR_{name}") == getattr(pynvml, f"NVML_ERROR_{name}"), name
    assert nvml.EVENT_TYPE_XID == pynvml.nvmlEventTypeXidCriticalError
    assert gpu_sampler.EVENT_TYPE_XID == pynvml.nvmlEventTypeXidCriticalError
    bits = dict((name, bit) for bit, name in nvml.THROTTLE_REASONS)
    for ours, theirs in (("gpu_idle", "GpuIdle"), ("applications_clocks_setting", "ApplicationsClocksSetting"),
                         ("sw_power_cap", "SwPowerCap"), ("hw_slowdown", "HwSlowdown"), ("sync_boost", "SyncBoost"),
                         ("sw_thermal", "SwThermalSlowdown"), ("hw_thermal", "HwThermalSlowdown"),
                         ("hw_power_brake", "HwPowerBrakeSlowdown"), ("display_clock_setting", "DisplayClockSetting")):
        assert bits[ours] == getattr(pynvml, f"nvmlClocksEventReason{theirs}") \
            == getattr(pynvml, f"nvmlClocksThrottleReason{theirs}"), ours
    for mode, word in nvml.VIRT_MODES.items():
        assert getattr(pynvml, f"NVML_GPU_VIRTUALIZATION_MODE_{word.upper()}") == mode
