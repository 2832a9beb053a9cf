"""The systemd units pass `systemd-analyze verify` (offline), with ExecStart pointed at this install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import needs

ROOT = Path(__file__).resolve().parents[1]
UNITS = {"gpuagent.service": "gpuagent", "gpuagent-collector.service": "gpuagent-collector"}

pytestmark = needs("systemd-analyze")


def _unit_copy(tmp_path: Path, name: str, binary: str) -> Path:
    """The unit with /usr/local/bin/<binary> replaced by the console script of this environment, so
    verify checks a command that really exists (it fails on a missing ExecStart binary)."""
    exe = Path(sys.executable).parent / binary
    assert exe.exists(), f"{exe} missing: run `make install`"
    text = (ROOT / "packaging" / name).read_text()
    assert f"ExecStart=/usr/local/bin/{binary} " in text
    out = tmp_path / name
    out.write_text(text.replace(f"/usr/local/bin/{binary} ", f"{exe} "))
    return out


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_verifies_cleanly(tmp_path, name):
    unit = _unit_copy(tmp_path, name, UNITS[name])
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                         timeout=60)
    # verify exits 0 on unknown keys but prints them: any output is a finding.
    assert res.returncode == 0 and res.stderr.strip() == "" and res.stdout.strip() == "", res.stderr + res.stdout
    text = unit.read_text()
    for key in ("Type=notify", "WatchdogSec=", "NotifyAccess=main", "Restart=on-failure", "CPUQuota=",
                "MemoryMax=", "ProtectSystem=strict", "ReadWritePaths=", "NoNewPrivileges=yes"):
        assert key in text, f"{name} lacks {key}"


def test_verify_would_catch_a_typo(tmp_path):
    """The check above can fail: a misspelled key is reported."""
    unit = _unit_copy(tmp_path, "gpuagent.service", "gpuagent")
    unit.write_text(unit.read_text().replace("NoNewPrivileges=yes", "NoNewPrivilege=yes"))
    res = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True,
                         timeout=60)
    assert "Unknown key" in res.stderr


def test_collector_unit_reloads_with_sighup():
    """`systemctl reload` sends SIGHUP, which re-reads tokens and certificates (docs/COLLECTOR.md, Security)."""
    text = (ROOT / "packaging" / "gpuagent-collector.service").read_text()
    assert "\nExecReload=/bin/kill -HUP $MAINPID\n" in text


def test_agent_unit_allows_nvidia_devices_and_state_dir():
    text = (ROOT / "packaging" / "gpuagent.service").read_text()
    assert "DevicePolicy=closed" in text and "DeviceAllow=char-nvidia* rw" in text
    assert "ReadWritePaths=/var/lib/gpuagent" in text and "StateDirectory=gpuagent" in text
    assert "MALLOC_ARENA_MAX=2" in text


def test_example_configs_load():
    """packaging/agent.toml and collector.toml are valid for the code that reads them."""
    from gpuagent.agent.config import load_config
    from gpuagent.collector.analysis.analyzer import AnalyzerConfig
    from gpuagent.agent.config import AgentConfig, CollectorConfig
    cfg = load_config(str(ROOT / "packaging" / "agent.toml"), env={})
    assert cfg.interval_s == 1.0 and cfg.labels["pool"] == "a100-80g-cloud"
    # Both files say their uncommented non-example values are the built-in defaults: keep them so.
    assert cfg.collector == CollectorConfig()
    ref = AgentConfig()
    for key in ("interval_s", "batch_interval_s", "batch_max_samples", "state_dir", "spool_max_bytes", "log_level"):
        assert getattr(cfg, key) == getattr(ref, key), key
    assert AnalyzerConfig.from_toml(ROOT / "packaging" / "collector.toml") == AnalyzerConfig()
    import tomllib
    auth = tomllib.loads((ROOT / "packaging" / "collector.toml").read_text())["auth"]
    assert auth == {}, "the example [auth] keys stay commented out (no credentials by default)"
