"""Every NVML function and constant the agent and probes name exists in the real binding (nvidia-ml-py's
pynvml, installed here without a driver), and every fallback value they carry equals the binding's.

Why: Nvml.query turns a misspelt function into "not in this NVML binding", once, quietly. On a GPU node
that would lose a metric for good; the NVML emulator cannot catch it either, because Nvml.query looks the
name up in the binding before any call reaches the library."""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import re

import pytest

from gpuagent.agent.samplers import gpu_events as gpu_sampler
from gpuagent.common import nvml

pynvml = pytest.importorskip("pynvml")

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "agent").rglob("*.py")) + sorted((ROOT / "probes").glob("*.py")) + [ROOT / "common" / "nvml.py"]
NAME = re.compile(r"nvml[A-Z][A-Za-z0-9_]*")
SEAM_CALLS = {"query", "query_raw", "q"}      # Nvml.query / query_raw, and the samplers' ``q = n.query``


def _source() -> str:
    return "\n".join(p.read_text() for p in SOURCES)


@functools.lru_cache(maxsize=None)
def _c_symbols() -> set[str]:
    """The C symbols the binding itself looks up (``_nvmlGetFunctionPointer("nvml...")``): the names a
    versioned read (nvmlDeviceGetMemoryInfo with nvmlMemory_v2 -> nvmlDeviceGetMemoryInfo_v2) reaches."""
    return set(re.findall(r'_nvmlGetFunctionPointer\(\s*"(nvml\w+)"', inspect.getsource(pynvml)))


def _str(node: ast.AST, names: dict[str, str]) -> str | None:
    """The NVML name an argument holds: a literal, a literal + suffix ("nvmlX" + _MIG_DEV), a
    seam key with its suffix ("nvmlX (MIG device)"), or a variable assigned one of those in the file."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _str(node.left, names)
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        m = NAME.match(node.value)
        return m.group(0) if m else None
    return None


@functools.lru_cache(maxsize=None)
def _scan() -> tuple[list[tuple[str, int]], set[str], set[str]]:
    """(called NVML function, positional arguments after the name) for every call through the seam --
    n.query / query_raw / q and each (name, (args)) pair of query_first --, the names passed to
    Nvml.const, and the names used as a seam ``key=``."""
    calls: list[tuple[str, int]] = []
    consts: set[str] = set()
    keys: set[str] = set()
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        names = {t.id: v for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name) and (v := _str(node.value, {}))}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            attr = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            for kw in node.keywords:
                if kw.arg == "key" and (k := _str(kw.value, names)):
                    keys.add(k)
            if attr == "const" and node.args and (c := _str(node.args[0], {})):
                consts.add(c)
            elif attr in SEAM_CALLS and node.args and (fn := _str(node.args[0], names)):
                calls.append((fn, len(node.args) - 1))
            elif attr == "query_first" and node.args and isinstance(node.args[0], ast.Tuple):
                for pair in node.args[0].elts:
                    if isinstance(pair, ast.Tuple) and len(pair.elts) == 2 and isinstance(pair.elts[1], ast.Tuple) \
                            and (fn := _str(pair.elts[0], names)):
                        calls.append((fn, len(pair.elts[1].elts)))
    return calls, consts, keys


def test_every_nvml_function_named_in_the_code_exists_in_pynvml():
    """Every "nvml..." string in the agent, the probes and the seam: a constant or structure version the
    binding defines (Nvml.const), a function it has (called through the seam), or -- only as a seam key
    or a fallback list -- a C symbol the binding's own wrappers look up."""
    names = set(re.findall(r'"(nvml[A-Z][A-Za-z0-9_]+)', _source()))
    calls, consts, keys = _scan()
    called = {fn for fn, _ in calls}
    assert len(called) > 30 and len(consts) >= 2 and keys   # the scan found them (a broken one would pass vacuously)
    assert "nvmlDeviceGetMemoryInfo_v2" in keys and "nvmlMemory_v2" in consts
    assert {"nvmlDeviceGetTemperatureV", "nvmlDeviceGetCurrentClocksEventReasons"} <= called   # via query_first
    assert names >= called | consts | keys
    symbols = _c_symbols()
    assert len(symbols) > 100
    missing_fn = sorted(n for n in called if not callable(getattr(pynvml, n, None)))
    assert not missing_fn, f"called but not a pynvml function: {missing_fn}"
    missing_const = sorted(n for n in consts if not hasattr(pynvml, n) or callable(getattr(pynvml, n)))
    assert not missing_const, f"not a pynvml constant: {missing_const}"
    rest = names - called - consts
    missing = sorted(n for n in rest if not callable(getattr(pynvml, n, None)) and n not in symbols)
    assert not missing, f"neither a pynvml function nor a C symbol pynvml looks up: {missing}"


def test_every_call_through_the_seam_passes_what_pynvml_takes():
    """Each call's positional arguments (handle first) lie between pynvml's required and all parameters."""
    calls, _, _ = _scan()
    wrong = []
    for fn, nargs in calls:
        if not callable(getattr(pynvml, fn, None)):
            wrong.append((fn, "not a pynvml function"))
            continue
        params = [p for p in inspect.signature(getattr(pynvml, fn)).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = sum(1 for p in params if p.default is inspect.Parameter.empty)
        if not required <= nargs <= len(params):
            wrong.append((fn, nargs, required, len(params)))
    assert len(calls) > 50 and not wrong, wrong


@pytest.mark.parametrize("fn,nargs", [
    ("nvmlDeviceGetHandleByUUID", 1), ("nvmlDeviceGetHandleByPciBusId", 1),
    ("nvmlDeviceGetCurrPcieLinkGeneration", 1), ("nvmlDeviceGetCurrPcieLinkWidth", 1),
    ("nvmlDeviceGetMaxPcieLinkGeneration", 1), ("nvmlDeviceGetMaxPcieLinkWidth", 1),
    ("nvmlDeviceGetPcieThroughput", 2), ("nvmlDeviceGetFieldValues", 2), ("nvmlDeviceGetClockInfo", 2),
    ("nvmlDeviceGetMaxClockInfo", 2), ("nvmlDeviceGetTotalEccErrors", 3), ("nvmlDeviceGetTemperature", 2),
    ("nvmlDeviceGetTemperatureV", 2), ("nvmlDeviceGetProcessUtilization", 2), ("nvmlDeviceRegisterEvents", 3),
    ("nvmlEventSetWait", 2), ("nvmlDeviceGetNvLinkState", 2), ("nvmlDeviceGetCurrentClocksEventReasons", 1),
    ("nvmlDeviceGetCurrentClocksThrottleReasons", 1), ("nvmlDeviceGetMigMode", 1),
    ("nvmlDeviceGetVirtualizationMode", 1), ("nvmlDeviceGetCpuAffinityWithinScope", 3),
    ("nvmlDeviceGetCpuAffinity", 2), ("nvmlDeviceGetMigDeviceHandleByIndex", 2),
])
def test_call_arity_matches_pynvml(fn, nargs):
    """The number of arguments the code passes (handle first) is what pynvml's function requires, at
    every call (n.query, query_raw, q, query_first's pairs; gpu=/report=/key= are keywords)."""
    params = inspect.signature(getattr(pynvml, fn)).parameters.values()
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert len(required) == nargs
    got = [n for f, n in _scan()[0] if f == fn]
    assert got, f"{fn} is not called through Nvml.query/query_raw/query_first"
    assert set(got) == {nargs}, (fn, got)


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
