"""The Python half of scripts/gpu-check.sh: the dependency gate before it runs anything, and the verdict after.

Standard library only, and Python 3.8 syntax, because it runs on whatever Python the GPU machine's image
has, before anything is installed there. Two commands:

  deps     which of the check's dependencies the chosen Python lacks (or has too old); exit 0: ready,
           3: something missing that the wheel folder can supply (the script installs it, then asks
           again with --after-install), 2: REFUSED, with one sentence naming what is missing and how to
           provide it (and a summary JSON saying so, when --out is given).
  summary  one line per check (each gpu/nvml test with the figures it recorded, each probe, and each
           probe figure against its reference) with PASS or FAIL, a summary JSON, exit 0 only when
           every check passed. A check that could not run is a FAIL, never a pass.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import xml.etree.ElementTree as ET

# What the check needs besides torch: (import name, distribution). The minimum versions are read from
# pyproject.toml (the node profile and the test extra), so they cannot drift from the project's own.
MODULES = (("pytest", "pytest"), ("pytest_timeout", "pytest-timeout"), ("psutil", "psutil"),
           ("pynvml", "nvidia-ml-py"), ("grpc", "grpcio"), ("google.protobuf", "protobuf"),
           ("click", "click"))
SUMMARY_FILE = "gpu-check-summary.json"
PROBES = ("pcie", "gpu_compute", "collective")
# Plausible ranges for a probe figure against its reference. The raw PCIe rate ignores protocol
# overhead and the datasheet peak is at boost clock, so a figure above 100 % means the reference or the
# arithmetic is wrong; below the floor the measurement (or the machine) is broken, not just slow.
PCIE_PERCENT_RANGE = (25.0, 100.0)
BF16_PERCENT_RANGE = (25.0, 100.0)


def _version_tuple(text: str) -> tuple:
    """Leading numeric parts of a version ("2.13.0+cu128" -> (2, 13, 0)); enough for >= bounds."""
    out = []
    for part in re.split(r"[.+-]", text):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


def minimums(pyproject: str) -> dict:
    """distribution -> minimum version text from pyproject.toml's specifiers ("" when it gives none)."""
    try:
        with open(pyproject, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        text = ""
    out = {}
    for _, dist in MODULES:
        m = re.search(r'"' + re.escape(dist) + r'\s*>=\s*([0-9][0-9.]*)', text)
        out[dist] = m.group(1) if m else ""
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def check_modules(pyproject: str) -> list:
    """[(dist, spec, problem)] for each dependency that does not import or is older than the bound."""
    import importlib
    try:
        from importlib import metadata
    except ImportError:  # Python < 3.8
        metadata = None
    mins = minimums(pyproject)
    bad = []
    for mod, dist in MODULES:
        spec = f"{dist}>={mins[dist]}" if mins[dist] else dist
        try:
            module = importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001 - a broken install is as missing as an absent one
            bad.append((dist, spec, "not installed" if isinstance(exc, ModuleNotFoundError) else _first_line(exc)))
            continue
        version = ""
        if metadata is not None:
            try:
                version = metadata.version(dist)
            except Exception:  # noqa: BLE001 - e.g. a vendored copy without metadata
                version = ""
        version = version or str(getattr(module, "__version__", ""))
        if mins[dist] and version and _version_tuple(version) < _version_tuple(mins[dist]):
            bad.append((dist, spec, f"{version} is too old"))
        print(f"  {mod}: {dist} {version or '(version unknown)'}")
    return bad


def check_torch() -> dict:
    """What this Python's torch can do: {'problem': '' when it is a CUDA build that sees a GPU, ...}."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        why = "not installed" if isinstance(exc, ModuleNotFoundError) else _first_line(exc)
        return {"problem": f"torch ({why})", "cuda_available": 0, "gpu_count": 0}
    info = {"version": torch.__version__, "cuda": torch.version.cuda or "", "cuda_available": 0, "gpu_count": 0}
    if not torch.version.cuda:
        info["problem"] = (f"a CUDA build of torch (torch {torch.__version__} here is a CPU-only build: "
                           "torch.version.cuda is None)")
        return info
    try:
        info["cuda_available"] = int(bool(torch.cuda.is_available()))
        info["gpu_count"] = int(torch.cuda.device_count()) if info["cuda_available"] else 0
    except Exception as exc:  # noqa: BLE001
        info["problem"] = f"a working CUDA torch ({_first_line(exc)})"
        return info
    if not info["cuda_available"]:
        info["problem"] = (f"a GPU that torch sees (torch {torch.__version__}, CUDA {torch.version.cuda}: "
                           "torch.cuda.is_available() is False; is the driver older than this CUDA build?)")
        return info
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(info["gpu_count"]))
    print(f"  torch {torch.__version__} CUDA {torch.version.cuda}: {info['gpu_count']} GPU(s): {names}")
    info["problem"] = ""
    return info


def wheel_versions(folder: str) -> list:
    """The Python versions ("3.12") the wheel folder's MANIFEST.txt covers; [] when there is none."""
    try:
        with open(os.path.join(folder, "MANIFEST.txt"), encoding="utf-8") as f:
            return sorted({line.split()[0] for line in f if line.strip()}, key=_version_tuple)
    except OSError:
        return []


def _join(items: list) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def refusal(py: str, torch_problem: str, bad: list, wheels: str, install_error: str) -> str:
    """The one sentence that says what is missing for this Python and how to provide each part."""
    ver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    lacks = ([torch_problem] if torch_problem else []) + [f"{spec} ({why})" for _, spec, why in bad]
    how = []
    if torch_problem:
        how.append("the GPU image must bring a CUDA build of torch and a GPU it sees (or set PYTHON to a "
                   "Python that has both)")
    if bad:
        have = wheel_versions(wheels)
        if install_error:
            how.append(f"installing them from {wheels}/ failed ({install_error})")
        elif not have:
            how.append(f"the rest comes from {wheels}/, which holds no wheels here: run scripts/gpu-wheels.sh "
                       "on a machine with network and carry gpu-wheels with the working tree")
        elif ver not in have:
            how.append(f"{wheels}/ has wheels for Python {', '.join(have)} but not {ver}: rerun "
                       f"GPU_WHEELS_PYTHONS=\"{' '.join(have + [ver])}\" scripts/gpu-wheels.sh and carry it again")
        else:
            how.append(f"they are not among the wheels in {wheels}/ for Python {ver}: rerun scripts/gpu-wheels.sh")
    return f"REFUSED: {py} (Python {sys.version.split()[0]}) lacks {_join(lacks)}; {'; '.join(how)}."


def read_plan(path: str) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    except (OSError, TypeError):
        return []


def write_summary(out: str, doc: dict) -> None:
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, SUMMARY_FILE), "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)


def cmd_deps(a: argparse.Namespace) -> int:
    py = a.python or sys.executable
    print(f"== dependencies of {py} (Python {sys.version.split()[0]})")
    bad = check_modules(a.pyproject)
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if bad and not a.after_install and version in wheel_versions(a.wheels):
        # the script installs these, then asks again: torch (seconds to import) is looked at then, once,
        # with the installed packages in front of it (they must not break it)
        torch_info = {"problem": "", "cuda_available": 0, "gpu_count": 0}
    else:
        torch_info = check_torch()
    state = {"PY_VERSION": version, "CUDA_AVAILABLE": torch_info["cuda_available"],
             "GPU_COUNT": torch_info["gpu_count"], "TORCH_VERSION": torch_info.get("version", ""),
             "MISSING_SPECS": " ".join(spec for _, spec, _ in bad)}
    if a.state:
        with open(a.state, "w", encoding="utf-8") as f:
            f.writelines(f"{k}={shlex.quote(str(v))}\n" for k, v in state.items())
    if bad and not a.after_install and version in wheel_versions(a.wheels):
        print(f"  missing here, in {a.wheels}/: {state['MISSING_SPECS']}")
        return 3
    if not bad and not torch_info["problem"]:
        return 0
    sentence = refusal(py, torch_info["problem"], bad, a.wheels, a.install_error)
    print(sentence)
    write_summary(a.out, {"verdict": "REFUSED", "reason": sentence, "python": py, "plan": read_plan(a.plan),
                          "checks": [], "note": "nothing ran: the figures are filled only on a GPU machine"})
    return 2


# ---------------------------------------------------------------------------------------- summary
def _junit_cases(path: str) -> list:
    """[{id, outcome (passed/failed/skipped), message, time_s, properties}] from pytest's junit xml."""
    root = ET.parse(path).getroot()
    cases = []
    for tc in root.iter("testcase"):
        classname, name = tc.get("classname", ""), tc.get("name", "")
        file_ = tc.get("file") or (classname.replace(".", "/") + ".py" if classname else "")
        outcome, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", child.get("message", "") or (child.text or "").strip()[:300]
            elif child.tag == "skipped" and outcome == "passed":
                outcome, message = "skipped", child.get("message", "")
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        cases.append({"id": f"{file_}::{name}" if file_ else name, "outcome": outcome, "message": message,
                      "time_s": float(tc.get("time") or 0), "properties": props})
    return cases


def _check(checks: list, name: str, ok: bool, figure: str) -> None:
    checks.append({"check": name, "status": "PASS" if ok else "FAIL", "figure": figure})


def _in(value: float, rng: tuple) -> bool:
    return rng[0] <= value <= rng[1]


def checks_from_tests(checks: list, a: argparse.Namespace, gpu_here: bool) -> dict:
    """One check per gpu/nvml test; a skipped one fails when a GPU is there (CUDA or nvidia-smi works)."""
    path = os.path.join(a.out, "pytest-gpu.xml")
    tally = {"passed": 0, "failed": 0, "skipped": 0, "skip_reasons": []}
    try:
        cases = _junit_cases(path)
    except (OSError, ET.ParseError) as exc:
        _check(checks, "gpu/nvml tests", False, f"no test report ({_first_line(exc)}); pytest exit {a.test_rc}"
               + (", timed out" if a.test_rc in (124, 137) else ""))
        return tally
    for c in cases:
        tally[c["outcome"]] += 1
        figures = ", ".join(f"{k} {v}" for k, v in c["properties"].items())
        if c["outcome"] == "skipped":   # never a pass: a skipped test checked nothing
            tally["skip_reasons"].append(f"{c['id']}: {c['message']}")
            if gpu_here:
                why = "skipped while " + ("CUDA is available" if a.cuda_available else "nvidia-smi lists GPUs")
            else:
                why = "skipped, and neither CUDA nor nvidia-smi works here, so nothing was checked"
            _check(checks, c["id"], False, f"{why}: {c['message']}")
        elif c["outcome"] == "failed":   # the figures recorded before the failure help read it
            _check(checks, c["id"], False, (c["message"].splitlines() or ["failed"])[0][:300]
                   + (f" | {figures}" if figures else ""))
        else:
            _check(checks, c["id"], True, figures or f"passed in {c['time_s']:.1f} s")
    if not cases:
        _check(checks, "gpu/nvml tests", False, f"zero tests ran (pytest exit {a.test_rc})")
    elif a.test_rc not in (0, 1):   # 1: some test failed (already a FAIL above); else pytest itself broke
        _check(checks, "gpu/nvml tests", False, f"pytest exit {a.test_rc}"
               + (" (timed out: the report is partial)" if a.test_rc in (124, 137) else ""))
    return tally


def _load_probe(out: str, name: str):
    try:
        with open(os.path.join(out, f"probe-{name}.json"), encoding="utf-8") as f:
            d = json.load(f)
        if not isinstance(d, dict) or "status" not in d:
            raise ValueError("not a probe result")
        return d, ""
    except (OSError, ValueError) as exc:
        return None, _first_line(exc)


def checks_from_probes(checks: list, a: argparse.Namespace, gpu_here: bool) -> None:
    """Each probe once, then its figures against their references (link rate, datasheet peak)."""
    try:
        from gpuagent.common.gpu_peaks import dense_bf16_peak
    except Exception as exc:  # noqa: BLE001
        dense_bf16_peak = None
        peak_error = _first_line(exc)
    for name in PROBES:
        d, err = _load_probe(a.out, name)
        if d is None:
            _check(checks, f"probe {name}", False, f"no result ({err}; see gpu-check.log)")
            continue
        status, reason = d.get("status"), d.get("reason") or ""
        if name == "collective" and status == "skipped" and a.gpu_count < 2 and "only one GPU" in reason:
            _check(checks, "probe collective", True, f"skipped as it must on {a.gpu_count} GPU: {reason}")
            continue
        if status != "ok":
            _check(checks, f"probe {name}", False, f"{status}: {reason}"
                   + (" (while a GPU is there)" if status == "skipped" and gpu_here else ""))
            continue
        if name == "collective":
            m, e = d.get("metrics", {}), d.get("env", {})
            nccl = e.get("backend") == "nccl" or not a.cuda_available   # with CUDA, gloo would dodge the GPUs
            _check(checks, "probe collective", nccl, f"{e.get('backend')} world {e.get('world_size')}: busbw "
                   f"{m.get('busbw_gbps', 0):.2f} GB/s, small-message latency {m.get('small_msg_latency_us', 0):.1f} us")
            continue
        per_gpu = d.get("per_gpu") or []
        if not per_gpu:
            _check(checks, f"probe {name}", False, "ok but measured no GPU")
        for g in per_gpu:
            i, m, e = g.get("gpu"), g.get("metrics") or {}, g.get("env") or {}
            if g.get("status") != "ok":
                _check(checks, f"probe {name} gpu{i}", False, f"{g.get('status')}: {g.get('reason')}")
                continue
            if name == "pcie":
                theo = e.get("theoretical_gbps")
                link = f"gen{e.get('link_gen', '?')} x{e.get('link_width', '?')}"
                if not theo:
                    _check(checks, f"pcie gpu{i} vs link", False, f"H2D {m.get('h2d_gbps', 0):.2f} GB/s, but NVML "
                           f"gave no link generation/width ({link}): nothing to compare with")
                    continue
                for k in ("h2d", "d2h"):
                    v = float(m.get(f"{k}_gbps", 0))
                    pct = 100.0 * v / float(theo)
                    _check(checks, f"pcie gpu{i} {k.upper()} vs link", _in(pct, PCIE_PERCENT_RANGE),
                           f"{v:.2f} GB/s = {pct:.1f} % of {float(theo):.2f} GB/s ({link}; PASS in "
                           f"{PCIE_PERCENT_RANGE[0]:.0f}-{PCIE_PERCENT_RANGE[1]:.0f} %)")
            else:
                device = str(e.get("device", ""))
                bf16 = float(m.get("bf16_tflops", 0))
                peak = dense_bf16_peak(device) if dense_bf16_peak else None
                extra = f"; fp32 {float(m.get('fp32_tflops', 0)):.1f} TFLOP/s, launch+sync " \
                        f"{float(m.get('sync_latency_us', 0)):.1f} us"
                if peak is None:
                    why = (f"common/gpu_peaks.py has no dense bf16 peak for {device!r}" if dense_bf16_peak
                           else f"common/gpu_peaks.py does not import ({peak_error})")
                    _check(checks, f"gpu_compute gpu{i} bf16 vs peak", False, f"{bf16:.1f} TFLOP/s, but {why}")
                    continue
                model, tflops = peak
                pct = 100.0 * bf16 / tflops
                _check(checks, f"gpu_compute gpu{i} bf16 vs peak", _in(pct, BF16_PERCENT_RANGE),
                       f"{bf16:.1f} TFLOP/s = {pct:.1f} % of {model}'s dense {tflops:g} (PASS in "
                       f"{BF16_PERCENT_RANGE[0]:.0f}-{BF16_PERCENT_RANGE[1]:.0f} %){extra}")


def cmd_summary(a: argparse.Namespace) -> int:
    gpu_here = bool(a.cuda_available or a.smi_gpus > 0)
    checks: list = []
    tally = checks_from_tests(checks, a, gpu_here)
    checks_from_probes(checks, a, gpu_here)
    failed = [c for c in checks if c["status"] != "PASS"]
    verdict = "PASS" if checks and not failed else "FAIL"
    width = max(len(c["check"]) for c in checks) if checks else 0
    print(f"== summary: {len(checks) - len(failed)} of {len(checks)} checks passed")
    for c in checks:
        print(f"{c['status']}  {c['check']:<{width}}  {c['figure']}")
    reason = "every check passed" if verdict == "PASS" else f"{len(failed)} check(s) failed: " + \
        "; ".join(c["check"] for c in failed)
    print(f"== verdict: {verdict} ({reason})")
    write_summary(a.out, {"verdict": verdict, "reason": reason, "python": a.python, "plan": read_plan(a.plan),
                          "checks": checks, "tests": tally, "elapsed_s": a.elapsed,
                          "facts": {"cuda_available": a.cuda_available, "gpu_count": a.gpu_count,
                                    "nvidia_smi_gpus": a.smi_gpus, "pytest_exit": a.test_rc}})
    return 0 if verdict == "PASS" else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.py", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("deps", help="is the chosen Python ready for the GPU check?")
    d.add_argument("--pyproject", default="pyproject.toml")
    d.add_argument("--wheels", default="gpu-wheels")
    d.add_argument("--state", default="", help="write shell assignments (PY_VERSION, MISSING_SPECS, ...) here")
    d.add_argument("--after-install", action="store_true", help="the wheels were installed: decide now")
    d.add_argument("--install-error", default="")
    d.add_argument("--python", default="", help="the name to show for this Python")
    d.add_argument("--out", default="")
    d.add_argument("--plan", default="")
    s = sub.add_parser("summary", help="one line per check and the verdict")
    s.add_argument("--out", required=True)
    s.add_argument("--test-rc", type=int, required=True)
    s.add_argument("--cuda-available", type=int, default=0)
    s.add_argument("--gpu-count", type=int, default=0)
    s.add_argument("--smi-gpus", type=int, default=0)
    s.add_argument("--python", default="")
    s.add_argument("--plan", default="")
    s.add_argument("--elapsed", type=float, default=0.0)
    a = ap.parse_args(argv)
    return cmd_deps(a) if a.cmd == "deps" else cmd_summary(a)


if __name__ == "__main__":
    sys.exit(main())
