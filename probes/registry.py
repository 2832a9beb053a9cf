"""The probe registry: every probe by name, with its default parameters and the platform it needs.

Each probe is one module of this package that defines ``SPEC`` (a ``ProbeSpec``) and ``run(params)``
returning a ``ProbeResult``. Probe modules import torch only inside ``run``, so reading the registry
(``gpuagent probe list``, the agent's scheduler) never loads torch or CUDA.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from gpuagent.common.parse import parse_bool

PLATFORMS = ("any", "cuda", "multi-gpu")
# The resources a probe disturbs; the scheduler gates on them ("gpu": no job on the GPUs,
# "disk": the target disk is quiet).
RESOURCES = ("gpu", "disk", "cpu")

# One module per probe, in listing order.
PROBE_MODULES = ("host", "storage", "collective", "pcie", "gpu_compute")
# Probes with two ends that only the fabric coordinator starts, on both nodes at once (agent/probing/fabric.py):
# get(), parse_params() and the runner know them; names() and specs(), which the scheduler, its config
# and `gpuagent probe list` read, leave them out, since one node alone cannot run them.
PAIR_PROBE_MODULES = ("rdma_pair",)


class ParamError(ValueError):
    """A parameter that the probe does not know or cannot parse; the message is one sentence."""


@dataclass(frozen=True)
class ProbeSpec:
    name: str
    description: str
    platform: str                      # any | cuda | multi-gpu
    defaults: Mapping[str, Any]
    resources: frozenset[str] = frozenset()
    timeout_s: float = 120.0           # the runner's default timeout
    interval_s: float = 3600.0         # the scheduler's default interval
    param_help: Mapping[str, str] = field(default_factory=dict)
    # Allowed range of numeric parameters, (lowest, highest), either None for open; checked in
    # parse_params so a bad value is refused before anything runs, in one sentence.
    limits: Mapping[str, tuple[float | None, float | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"probe {self.name}: platform must be one of {PLATFORMS}")
        unknown = set(self.resources) - set(RESOURCES)
        if unknown:
            raise ValueError(f"probe {self.name}: unknown resources {sorted(unknown)}")
        stray = set(self.limits) - set(self.defaults)
        if stray:
            raise ValueError(f"probe {self.name}: limits for unknown parameters {sorted(stray)}")


def _load() -> dict[str, tuple[ProbeSpec, str]]:
    out = {}
    for mod_name in PROBE_MODULES + PAIR_PROBE_MODULES:
        mod = importlib.import_module(f"gpuagent.probes.{mod_name}")
        spec = mod.SPEC
        out[spec.name] = (spec, mod.__name__)
    return out


_CACHE: dict[str, tuple[ProbeSpec, str]] | None = None


def _registry() -> dict[str, tuple[ProbeSpec, str]]:
    global _CACHE
    if _CACHE is None:
        _CACHE = _load()
    return _CACHE


def names() -> list[str]:
    """The probes one node runs on its own (scheduled, listed), in listing order."""
    return [name for name, (_s, mod) in _registry().items() if mod.rsplit(".", 1)[-1] in PROBE_MODULES]


def specs() -> list[ProbeSpec]:
    return [get(name) for name in names()]


def get(name: str) -> ProbeSpec:
    reg = _registry()
    if name not in reg:
        raise ParamError(f"no probe named {name!r} (known: {', '.join(reg)})")
    return reg[name][0]


def run_function(name: str) -> Callable[[dict[str, Any]], Any]:
    get(name)
    return importlib.import_module(_registry()[name][1]).run


def _coerce(name: str, key: str, default: Any, value: Any) -> Any:
    if not isinstance(value, str):
        if isinstance(default, bool) or isinstance(value, type(default)):
            return value
        if isinstance(default, float) and isinstance(value, int):
            return float(value)
        value = str(value)
    text = value.strip()
    try:
        if isinstance(default, bool):
            flag = parse_bool(text)
            if flag is None:
                raise ValueError
            return flag
        if isinstance(default, int):
            return int(text, 0)
        if isinstance(default, float):
            return float(text)
    except ValueError:
        kind = {bool: "a boolean (1/0, true/false)", int: "an integer", float: "a number"}[type(default)]
        raise ParamError(f"parameter {key} of probe {name} expects {kind}, got {value!r}") from None
    return text


def parse_params(name: str, given: Mapping[str, Any] | Iterable[str] | None = None) -> dict[str, Any]:
    """Defaults overlaid with ``given`` (a mapping or ``k=v`` strings), each coerced to its default's type."""
    spec = get(name)
    pairs: dict[str, Any] = {}
    if given is None:
        given = {}
    if isinstance(given, Mapping):
        pairs = dict(given)
    else:
        for item in given:
            if "=" not in item:
                raise ParamError(f"parameter {item!r} must look like key=value")
            k, v = item.split("=", 1)
            pairs[k.strip()] = v
    params = dict(spec.defaults)
    for k, v in pairs.items():
        if k not in spec.defaults:
            raise ParamError(f"unknown parameter {k!r} for probe {name} "
                             f"(known: {', '.join(sorted(spec.defaults)) or 'none'})")
        params[k] = _coerce(name, k, spec.defaults[k], v)
        _check_limit(spec, k, params[k])
    return params


def _check_limit(spec: ProbeSpec, key: str, value: Any) -> None:
    lo, hi = spec.limits.get(key, (None, None))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            want = f"between {lo:g} and {hi:g}"
        elif lo is not None:
            want = f"at least {lo:g}"
        else:
            want = f"at most {hi:g}"
        raise ParamError(f"parameter {key} of probe {spec.name} must be {want}, got {value:g}")


def params_as_args(params: Mapping[str, Any]) -> list[str]:
    """``--param k=v`` arguments for ``python -m gpuagent.probes``."""
    args: list[str] = []
    for k, v in params.items():
        if isinstance(v, bool):
            v = int(v)
        args += ["--param", f"{k}={v}"]
    return args
