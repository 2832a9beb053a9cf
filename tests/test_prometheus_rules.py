"""packaging/prometheus: the alert rules pass `promtool check rules`, every alert is unit-tested by
`promtool test rules` (tests/prometheus/alerts_test.yml) and the example scrape config is valid."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


from tools import needs

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "packaging" / "prometheus" / "alerts.yml"
SCRAPE = ROOT / "packaging" / "prometheus" / "scrape.yml"
ALERT_TESTS = ROOT / "tests" / "prometheus" / "alerts_test.yml"

pytestmark = needs("promtool")


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rules_check():
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 22 rules found" in r.stdout


def test_every_alert_has_a_unit_test_that_expects_it_to_fire():
    alerts = re.findall(r"^\s*- alert: (\S+)", ALERTS.read_text(), re.M)
    assert len(alerts) == len(set(alerts)) == 22
    tests = ALERT_TESTS.read_text()
    # Each alert has a case where it fires (exp_labels follows) and one where it must not (exp_alerts: []).
    fires = set(re.findall(r"alertname: (\S+)\n\s+exp_alerts:\n\s+- exp_labels", tests))
    quiet = set(re.findall(r"alertname: (\S+)\n\s+exp_alerts: \[\]", tests))
    assert set(alerts) <= fires, sorted(set(alerts) - fires)
    assert {"GpuagentAgentDown", "GpuagentAgentStale", "GpuagentSpoolDropping", "GpuagentNewXid",
            "GpuagentCollectorIngestStalled", "GpuagentVirtualizationOverheadWarning",
            "GpuagentHardwareFaultCritical", "GpuagentHardwareFaultWarning", "GpuagentRowRemapPending",
            "GpuagentRowRemapFailed", "GpuagentEccUncorrectable", "GpuagentNvlinkCrcErrors",
            "GpuagentHardwareFaultFindingWarning"} <= quiet
    r = promtool("test", "rules", ALERT_TESTS.name, cwd=ALERT_TESTS.parent)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_each_flag_kind_has_a_finding_alert_at_warning_and_critical():
    from gpuagent.collector.analysis.steps import CONDITIONS, STEPS
    # Steps that add components to a kind another step names (passive and link noisy-neighbour variance).
    extra_components = {"noisy_neighbor_passive": "noisy_neighbor_variance", "link_variance": "noisy_neighbor_variance",
                        "path_tomography": "network_degraded"}
    kinds = {extra_components.get(s.name, s.name) for s in STEPS if s.produces == CONDITIONS}
    assert kinds == {"virtualization_overhead", "noisy_neighbor_variance", "utilization_gap", "network_degraded",
                     "hardware_fault"}
    text = ALERTS.read_text()
    for kind in kinds:
        for sev in ("warning", "critical"):
            assert f'gpuagent_finding_open{{kind="{kind}", severity="{sev}"}}' in text, (kind, sev)


def test_alerts_name_only_what_gpuagent_exports():
    """Each metric in an alert expression is one the agent (agent/surface/exporter.py; counters get _total) or the
    collector (collector/views/metrics.py) exports, or Prometheus's own `up`."""
    exprs = re.findall(r"^\s*expr: (.+)$", ALERTS.read_text(), re.M)
    names = set()
    for e in exprs:
        e = re.sub(r"\{[^}]*\}|\[[^]]*\]|#.*$", "", e)
        names |= set(re.findall(r"\b(DCGM_FI_\w+|gpuagent_\w+|up)\b", e))
    agent = "".join((ROOT / "agent" / "surface" / f).read_text()      # the exporter's modules
                    for f in ("exporter.py", "dcgm_names.py", "dcgm_families.py", "gpuagent_families.py"))
    collector = (ROOT / "collector" / "views" / "metrics.py").read_text()
    assert {"up", "gpuagent_collector_last_ack_age_seconds", "gpuagent_collector_connected",
            "gpuagent_spool_dropped_batches_total", "DCGM_FI_DEV_XID_ERRORS", "gpuagent_finding_open",
            "gpuagent_hardware_fault", "DCGM_FI_DEV_ROW_REMAP_PENDING", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"} <= names
    unknown = [n for n in sorted(names - {"up"})
               if not any(f'"{base}"' in src for base in {n, re.sub(r"_total$", "", n)} for src in (agent, collector))]
    assert not unknown, unknown


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
