"""packaging/prometheus: the alert rules pass `promtool check rules`, every alert is unit-tested by
`promtool test rules` (tests/prometheus/alerts_test.yml) and the example scrape config is valid."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "packaging" / "prometheus" / "alerts.yml"
SCRAPE = ROOT / "packaging" / "prometheus" / "scrape.yml"
ALERT_TESTS = ROOT / "tests" / "prometheus" / "alerts_test.yml"

pytestmark = pytest.mark.skipif(shutil.which("promtool") is None,
                                reason="promtool not installed (Debian package prometheus, see .ci/run)")


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rules_check():
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 12 rules found" in r.stdout


def test_every_alert_has_a_unit_test_that_expects_it_to_fire():
    alerts = re.findall(r"^\s*- alert: (\S+)", ALERTS.read_text(), re.M)
    assert len(alerts) == len(set(alerts)) == 12
    tests = ALERT_TESTS.read_text()
    # Each alert has a case where it fires (exp_labels follows) and one where it must not (exp_alerts: []).
    fires = set(re.findall(r"alertname: (\S+)\n\s+exp_alerts:\n\s+- exp_labels", tests))
    quiet = set(re.findall(r"alertname: (\S+)\n\s+exp_alerts: \[\]", tests))
    assert set(alerts) <= fires, sorted(set(alerts) - fires)
    assert {"GpuagentAgentDown", "GpuagentAgentStale", "GpuagentSpoolDropping", "GpuagentNewXid",
            "GpuagentCollectorIngestStalled", "GpuagentVirtualizationOverheadWarning"} <= quiet
    r = promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_a_broken_expectation_fails_the_unit_tests(tmp_path):
    # The unit tests can fail: expecting the XID alert on the GPU that had none is reported.
    broken = ALERT_TESTS.read_text().replace(f"../../packaging/prometheus/alerts.yml", str(ALERTS))
    broken = broken.replace('gpu: "3", UUID: GPU-abc', 'gpu: "0", UUID: GPU-def', 1)
    (tmp_path / "alerts_test.yml").write_text(broken)
    r = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert r.returncode != 0 and "GpuagentNewXid" in r.stdout + r.stderr


def test_example_scrape_config_is_valid(tmp_path):
    token = tmp_path / "collector.token"
    token.write_text("secret\n")
    text = SCRAPE.read_text().replace("/etc/prometheus/gpuagent-alerts.yml", str(ALERTS))
    text = text.replace("/etc/prometheus/gpuagent-collector.token", str(token))
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(text)
    r = promtool("check", "config", str(cfg))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "credentials_file" in SCRAPE.read_text() and "9402" in SCRAPE.read_text()
