"""Helpers for the tests of the agent's /metrics (agent/surface/exporter.py): a reader of the Prometheus text
format that keeps dcgm-exporter's counter names as written (prometheus_client's parser renames a
counter's samples to <name>_total), the lints `promtool check metrics` reports for dcgm-exporter's own
names, and an agent subprocess over an NVML emulator node (SYNTHETIC) that the test scripts while it runs."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from agent_helpers import ROOT, agent_env, free_port

MIB = 2 ** 20
_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

# Lints `promtool check metrics` (Prometheus 2.42) reports for dcgm-exporter's own names and labels, which
# dashboards select on as they are (the same output from dcgm-exporter itself): camelCase labels
# (modelName), a counter named without _total (the five CSV counters), and "COUNTER" in
# DCGM_FI_DEV_PCIE_REPLAY_COUNTER. Nothing else may be reported, and nothing for a gpuagent_* name.
DCGM_NAME_LINTS = (r"DCGM_FI_\w+ label names should be written in 'snake_case' not 'camelCase'",
                   r'DCGM_FI_\w+ counter metrics should have "_total" suffix',
                   r"DCGM_FI_DEV_PCIE_REPLAY_COUNTER metric name should not include type 'counter'",
                   # DCGM's clock-event fields end in _NS (dcgm_fields.h 1420-1424)
                   r"DCGM_FI_DEV_CLOCKS_EVENT_REASON_\w+_NS metric names should not contain abbreviated units")


def parse_exposition(text: str) -> tuple[dict[str, list[tuple[dict[str, str], float]]], dict[str, str]]:
    """(samples by metric name as written, TYPE by family name) of a text-format (0.0.4) exposition."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m.group(2) or "")}
        samples.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return samples, types


def ticks(agent, emu, n: int = 3, advance_s: float = 10.0) -> None:
    """``n`` ticks of an in-process Agent, the emulated clock moved ``advance_s`` before each, and at least
    GPM's minimum interval of real time between them (GPM samples closer together are not compared)."""
    from conftest import wait_for

    from gpuagent.common import nvml as nvml_module
    gap = getattr(nvml_module, "GPM_MIN_INTERVAL_S", 0.0) + 0.02
    last = None
    for _ in range(n):
        if last is not None:
            wait_for(lambda: time.monotonic() - last >= gap, timeout=5, interval=0.02, what="GPM's sample spacing")
        emu.advance(advance_s)
        last = time.monotonic()
        agent.tick()


def scrape(port: int, accept: str = "text/plain") -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def per_gpu(samples, name: str) -> dict[int, float]:
    """name's value per GPU, for the series that are not per MIG GPU instance."""
    return {int(lab["gpu"]): v for lab, v in samples.get(name, []) if "GPU_I_ID" not in lab}


def per_instance(samples, name: str) -> dict[tuple[int, int], float]:
    return {(int(lab["gpu"]), int(lab["GPU_I_ID"])): v for lab, v in samples.get(name, []) if "GPU_I_ID" in lab}


def promtool_problems(text: str) -> list[str]:
    out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    return [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]


def not_dcgm_lints(problems: list[str]) -> list[str]:
    return [p for p in problems if not any(re.fullmatch(d, p) for d in DCGM_NAME_LINTS)]


class EmulatedAgent:
    """The real `gpuagent run` (real pynvml) over an NVML emulator node (gpuagent.sim.nvml_emulator;
    SYNTHETIC), with [exporter] on an ephemeral port. The test scripts the node through ``emu`` while the
    agent runs (XIDs, processes)."""

    def __init__(self, tmp_path: Path, emu, interval: float = 0.25, exporter: str = "", name: str = "agent") -> None:
        self.emu = emu
        self.dir = tmp_path / name
        self.dir.mkdir()
        self.port = free_port()
        self.state = self.dir / "state"
        cfg = self.dir / "agent.toml"
        cfg.write_text(f'[probes]\nenabled = false\n[exporter]\nlisten = "127.0.0.1:{self.port}"\n{exporter}\n')
        self.log_path = self.dir / "agent.log"
        self._log = open(self.log_path, "ab")
        env = emu.env(agent_env(self.dir, GPUAGENT_CONFIG=str(cfg)))
        self.proc = subprocess.Popen([sys.executable, "-m", "gpuagent.agent.cli", "run",
                                      "--collector", f"127.0.0.1:{free_port()}", "--state-dir", str(self.state),
                                      "--interval", str(interval), "--batch-interval", "1"],
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def scrape(self, accept: str = "text/plain") -> str:
        return scrape(self.port, accept)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> int:
        from agent_helpers import stop
        try:
            return stop(self.proc)
        finally:
            self._log.close()
