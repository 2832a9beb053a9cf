"""hardware_fault: the rules of common/hardware_faults.toml (node_faults, xid_rule) and the collector's
70_hardware_fault.sql step on SYNTHETIC rows in a real, migrated DuckDB file (a real analysis pass): one
test per fault class (right component, severity and action; clears when it clears), no false positives
(a healthy 8-GPU node, an application XID, counter resets, a link flap during a planned reboot, a PCIe link
downtrained while idle), NVML + kmsg XID deduplication, corroboration of a slow fabric link, the cost to a
job, and one finding per node fault."""

from __future__ import annotations

import datetime as dt
import json
import random

import duckdb
import pytest

from analysis_helpers import migrated_db, run  # noqa: F401 - the con fixture
from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.store import schema
from gpuagent.collector.views import report
from gpuagent.collector.views.compare import DbSource
from gpuagent.common import hardware_faults as hf
from gpuagent.sim import synthetic_rows as S

NOW = dt.datetime(2026, 1, 1, 12, 0)
START = NOW - dt.timedelta(minutes=55)
LATER = NOW + dt.timedelta(hours=1)

# (fault class, variant) -> (component, severity, rule whose action the flag must carry)
CASES = {
    ("xid", ""): ("xid", "critical", "xid_79"),
    ("ecc", ""): ("ecc", "warning", "ecc_uncorrected"),   # contained and offlined: a warning, not a drain
    ("ecc", "corrected"): ("ecc", "warning", "ecc_corrected_rate"),
    ("row_remap", ""): ("row_remap", "warning", "row_remap_pending"),
    ("row_remap", "failure"): ("row_remap", "critical", "row_remap_failure"),
    ("retired_pages", ""): ("retired_pages", "warning", "retired_pages_dbe"),
    ("nvlink", ""): ("nvlink", "critical", "nvlink_down"),
    ("nvlink", "crc"): ("nvlink", "warning", "nvlink_crc_flit"),
    ("pcie_link", ""): ("pcie_link", "warning", "pcie_gen_below_max"),
    ("pcie_link", "width"): ("pcie_link", "warning", "pcie_width_below_max"),
    ("clocks", ""): ("clocks", "warning", "clocks_hw_thermal"),
    ("clocks", "power_brake"): ("clocks", "warning", "clocks_hw_power_brake"),
    ("ib_port", ""): ("ib_port", "critical", "ib_port_not_active"),
    ("ib_port", "symbol"): ("ib_port", "warning", "ib_symbol_error"),
    ("eth_link", ""): ("eth_link", "warning", "eth_carrier_changes"),
    ("eth_link", "speed"): ("eth_link", "warning", "eth_speed_below_max"),
}
# Nodes that must raise no hardware flag.
QUIET = {"healthy": (None, ""), "app-xid": ("xid", "app"), "reset": ("reset", ""), "reboot": ("reboot", ""),
         "pcie-idle": ("pcie_link", "")}


def node_name(fault, variant):
    return "synthetic-hw-" + fault + (f"-{variant}" if variant else "")


def action_of(rule: str) -> str:
    if rule.startswith("xid_"):
        return hf.xid_rule(int(rule[4:])).action
    return next(r.action for r in hf.rules().rules if r.name == rule)


def hw_flags(con, state="open", where=""):
    cur = con.execute("SELECT node_id, gpu, component, severity, value, baseline_source, evidence, sentence "
                      f"FROM flags WHERE kind = 'hardware_fault' AND state = ? {where} ORDER BY node_id, gpu, component",
                      [state])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, r)) for r in cur.fetchall()]


def add(con, node, fault, variant, *, start=START, **kw):
    rows, events = S.hardware_rows(node, start=start, fault=fault, variant=variant, rng=random.Random(node), **kw)
    S.add_samples(con, rows)
    S.add_events(con, events)
    return rows, events


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Every fault class on its own node plus the quiet nodes; pass 1 at NOW, then a healthy hour and pass 2."""
    con = duckdb.connect(str(tmp_path_factory.mktemp("hw") / "collector.duckdb"))
    schema.migrate(con)
    made = {}
    for (fault, variant) in CASES:
        node = node_name(fault, variant)
        S.add_node(con, node, virtualized=False, gpu_count=2)
        made[node] = add(con, node, fault, variant, gpus=2)
    for name, (fault, variant) in QUIET.items():
        node = "synthetic-hw-quiet-" + name
        gpus = 8 if name == "healthy" else 2     # the healthy node is a whole 8-GPU node
        S.add_node(con, node, virtualized=False, gpu_count=gpus)
        made[node] = add(con, node, fault, variant, gpus=gpus, util=5.0 if name == "pcie-idle" else 90.0)
    # XID 13 twice, 20 minutes apart, on the same GPU: it may be the GPU's (NVSentinel: twice in 24 h).
    S.add_node(con, "synthetic-hw-app-repeat", virtualized=False, gpu_count=4)
    add(con, "synthetic-hw-app-repeat", None, "", gpus=4)
    S.add_events(con, [(NOW - dt.timedelta(minutes=m), "synthetic-hw-app-repeat", 2, "xid", "SYNTHETIC XID 13", 13,
                        {"xid": "13", "source": "nvml", "job_id": job}) for m, job in ((40, "job-a"), (20, "job-b"))])
    first = run(con, NOW)
    opened = hw_flags(con)
    findings = con.execute("SELECT node_id, components, gpus, severity, sentence FROM findings "
                           "WHERE kind = 'hardware_fault' AND state = 'open' ORDER BY node_id").fetchall()
    src = object.__new__(DbSource)     # the report's reader over this (writable) connection
    src.con = con
    html = report.render_report(src, window_s=3600)
    for node, gpus in con.execute("SELECT node_id, gpu_count FROM nodes").fetchall():
        add(con, node, None, "", start=NOW + dt.timedelta(minutes=5), gpus=gpus)
    second = run(con, LATER)
    yield {"con": con, "opened": opened, "findings": findings, "first": first, "second": second, "rows": made,
           "html": html}
    con.close()


@pytest.mark.parametrize("case", list(CASES), ids=["-".join(filter(None, c)) for c in CASES])
def test_each_fault_class_raises_its_flag_and_clears(fleet, case):
    component, severity, rule = CASES[case]
    node = node_name(*case)
    got = [f for f in fleet["opened"] if f["node_id"] == node]
    assert [(f["component"], f["severity"]) for f in got] == [(component, severity)], got
    f = got[0]
    ev = json.loads(f["evidence"])
    assert ev["faults"][0]["rule"] == rule and ev["action"] == action_of(rule)
    assert action_of(rule) in f["sentence"] and node in f["sentence"]
    assert f["baseline_source"] and ev["faults"][0]["source"] == f["baseline_source"]
    assert f["gpu"] == (None if component in ("ib_port", "eth_link") else 0)
    # The next hour is healthy (remap done by a reset, port ACTIVE again, counters still): the flag closes.
    con = fleet["con"]
    assert not hw_flags(con, where=f"AND node_id = '{node}'")
    assert len(hw_flags(con, "closed", where=f"AND node_id = '{node}'")) == 1


def test_no_false_positives_healthy_node_application_xid_resets_reboot_and_idle_pcie(fleet):
    quiet = [f for f in fleet["opened"] if "-quiet-" in f["node_id"]]
    assert quiet == []
    # the reset and reboot nodes did have counters go down / links flap: the rows are there, judged and quiet
    rows, events = fleet["rows"]["synthetic-hw-quiet-reboot"]
    assert any(e[3] == "agent_start" for e in events)
    downed = [r[5] for r in rows if r[3] == "ib_port_errors_total" and "link_downed" in r[4] and "mlx5_0" in r[4]]
    assert downed[-1] > downed[0]
    rows, _ = fleet["rows"]["synthetic-hw-quiet-reset"]
    corrected = [r[5] for r in rows if r[3] == "gpu_clock_event_duration_seconds_total" and r[2] == 0
                 and "sw_power_cap" in r[4]]
    assert min(b - a for a, b in zip(corrected, corrected[1:])) < 0


def test_application_xid_repeating_on_one_gpu_within_a_day_is_escalated(fleet):
    got = [f for f in fleet["opened"] if f["node_id"] == "synthetic-hw-app-repeat"]
    assert [(f["gpu"], f["component"], f["severity"]) for f in got] == [(2, "xid", "warning")]
    ev = json.loads(got[0]["evidence"])
    assert sorted(ev["faults"][0]["detail"]["jobs"]) == ["job-a", "job-b"] and ev["faults"][0]["detail"]["bursts"] == 2
    assert "2 times on this GPU within 24 h" in got[0]["sentence"]
    assert hf.xid_rule(13).repeat_action in got[0]["sentence"]


def test_nvml_and_kmsg_reports_of_one_xid_count_once(fleet):
    f = next(f for f in fleet["opened"] if f["node_id"] == node_name("xid", ""))
    detail = json.loads(f["evidence"])["faults"][0]["detail"]
    assert detail["reports"] == 1 and detail["raw_reports"] == 2 and sorted(detail["sources"]) == ["kmsg", "nvml"]
    assert len(json.loads(f["evidence"])["faults"]) == 1


def test_one_finding_per_node_fault(fleet):
    faulty = {node_name(*c) for c in CASES} | {"synthetic-hw-app-repeat"}
    assert sorted(r[0] for r in fleet["findings"]) == sorted(faulty)
    by_node = {r[0]: r for r in fleet["findings"]}
    assert by_node[node_name("ib_port", "")][1:4] == ("ib_port", None, "critical")
    assert by_node[node_name("row_remap", "")][1:4] == ("row_remap", "0", "warning")
    assert "hardware fault (critical, xid)" in by_node[node_name("xid", "")][4]
    assert fleet["second"].findings_closed >= len(faulty)


def test_the_report_has_a_health_section_with_each_fault_and_the_application_xids(fleet):
    html = fleet["html"]
    section = html[html.index("<section id='health'>"):html.index("<section id='summary'>")]
    assert section.count("<tr class='hw-fault'>") == len(fleet["opened"])
    assert f"{len(fleet['opened'])} open hardware faults (" in section
    assert "drain the node and reboot it" in section and "docs.nvidia.com/deploy/xid-errors" in section
    apps = section[section.index("id='app-xids'"):]
    assert "synthetic-hw-quiet-app-xid" in apps and "<td>13</td>" in apps


def test_sql_and_node_faults_agree_on_the_same_rows(fleet):
    """The collector's SQL and the node's node_faults() apply one rule set: same components and severities."""
    for node, (rows, events) in fleet["rows"].items():
        first, last = {}, {}
        for ts, _, gpu, metric, labels, value in sorted(rows, key=lambda r: r[0]):
            key = (metric, gpu, tuple(sorted(tuple(kv.split("=", 1)) for kv in labels.split(",") if kv)))
            first.setdefault(key, value)
            last[key] = value
        span = (max(r[0] for r in rows) - min(r[0] for r in rows)).total_seconds()
        evs = [{"kind": e[3], "gpu": e[2], "value": e[5], "attrs": e[6], "ts_ns": int(e[0].timestamp() * 1e9)}
               for e in events]
        if node.endswith("quiet-reset"):
            continue   # a mid-window reset: the node compares two readings; only the SQL sees the samples between
        now_ns = int(max(r[0] for r in rows).timestamp() * 1e9)
        py = sorted({(f.component, f.severity) for f in hf.node_faults(last, first, evs, span, now_ns)})
        sql = sorted({(f["component"], f["severity"]) for f in fleet["opened"] if f["node_id"] == node})
        assert py == sql, node


# ------------------------------------------------------------------------------ corroboration, job cost

@pytest.mark.parametrize("fault, variant, words", [
    ("ib_port", "symbol", "mlx5_0 port 1 symbol errors +"),
    ("eth_link", "", "eth0 carrier changes (link flaps) +4"),       # the link flapped
])
def test_a_slow_link_names_the_end_with_port_errors(con, fault, variant, words):
    import itertools  # noqa: PLC0415
    nodes = [f"p-n{i}" for i in range(4)]
    times = [NOW - dt.timedelta(minutes=10 * k + 1) for k in range(3)]
    for n in nodes:
        S.add_node(con, n, virtualized=False, pool="p")
    for a, b in itertools.combinations(nodes, 2):
        rate = 3.0 if {a, b} == {"p-n1", "p-n3"} else 9.4
        S.add_link_runs(con, a, b, [rate] * 3, times)
    add(con, "p-n3", fault, variant, gpus=1)
    add(con, "p-n1", None, "", background=False, gpus=1)
    run(con)
    link = con.execute("SELECT evidence, sentence FROM flags WHERE kind = 'network_degraded' AND component = 'link' "
                       "AND state = 'open'").fetchall()
    assert len(link) == 1
    ev, sentence = json.loads(link[0][0]), link[0][1]
    assert "Port errors at the p-n3 end (" in sentence and words in sentence, sentence
    assert "port  " not in sentence, sentence
    assert ev["endpoint_port_errors"]["p-n3"] and ev["endpoint_port_errors"].get("p-n1") is None


def test_a_fault_on_a_jobs_gpu_says_what_it_cost_the_job(con):
    node = "synthetic-hw-job"
    S.add_node(con, node, virtualized=False, gpu_count=1)
    rows, _ = add(con, node, "ecc", "", gpus=1)
    t0 = sorted({r[0] for r in rows})[6]          # the injection is at the middle sample
    ticks = [START + dt.timedelta(minutes=m) for m in range(0, 55, 5)]
    S.add_job_samples(con, [(t, node, "synthetic-job-7", 0, 95.0) for t in ticks])
    S.add_job_steps(con, [(t, node, "synthetic-job-7", 0, 0.5 if t < t0 else 0.8, 0.0) for t in ticks])
    run(con)
    (f,) = hw_flags(con)
    ev = json.loads(f["evidence"])
    assert ev["job"] == "synthetic-job-7" and ev["step_time_before_s"] == pytest.approx(0.5)
    assert ev["step_time_after_s"] == pytest.approx(0.8)
    assert "it cost job synthetic-job-7: step time 0.50 s before, 0.80 s after (+60 %)" in f["sentence"]


def test_a_fault_on_an_untracked_jobs_gpu_says_what_it_cost_its_progress(con):
    """No tracker, so no step times: the job's passive progress (job_progress_percent, its processes' GPU
    utilization here) before and after the fault's first sample says what it cost."""
    node = "synthetic-hw-job-passive"
    S.add_node(con, node, virtualized=False, gpu_count=1)
    rows, _ = add(con, node, "ecc", "", gpus=1)
    t0 = sorted({r[0] for r in rows})[6]
    ticks = [START + dt.timedelta(minutes=m) for m in range(0, 55, 5)]
    S.add_job_samples(con, [(t, node, "synthetic-job-8", 0, 95.0) for t in ticks])
    S.add_samples(con, [(t, node, None, "job_progress_percent", "job_id=synthetic-job-8,source=gpu_util",
                         90.0 if t < t0 else 45.0) for t in ticks])
    run(con)
    (f,) = hw_flags(con)
    ev = json.loads(f["evidence"])
    assert ev["job"] == "synthetic-job-8" and ev["step_time_before_s"] is None
    assert (ev["progress_before_percent"], ev["progress_after_percent"]) == (pytest.approx(90.0), pytest.approx(45.0))
    assert "it cost job synthetic-job-8: progress 90 % before, 45 % after" in f["sentence"]


# ------------------------------------------------------------------------------ the rules themselves

REQUIRED_XIDS = (13, 31, 43, 45, 46, 48, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 110, 119, 120, 136, 140, 143,
                 144, 145, 146, 147, 148, 149, 150, 151, 154, 155, 156, 158)


def test_xid_catalog_covers_the_required_xids_with_sources():
    for n in REQUIRED_XIDS:
        x = hf.xid_rule(n)
        assert x.listed and x.severity in hf.XID_SEVERITIES and x.action and x.source.startswith("https://"), n
        assert x.immediate and x.mnemonic and x.applies_to, n
    assert {n for n in REQUIRED_XIDS if hf.xid_rule(n).application} == {13, 31, 45, 68, 69}
    # the catalog's drain buckets (RESET_GPU, RESTART_BM, RESTART_VM, WORKFLOW_XID_48, WORKFLOW_NVLINK_ERR)
    assert {n for n in REQUIRED_XIDS if hf.xid_rule(n).severity == "critical"} == {
        46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, 151, 155, 156, 158}
    assert {n for n in REQUIRED_XIDS if hf.xid_rule(n).severity == "ignore"} == {43, 63, 92}
    # every row: the bucket it came from, mapped as the file's header says, unless `ours` says why not
    mapped = {"RESET_GPU": "critical", "RESTART_BM": "critical", "RESTART_VM": "critical", "RESTART_APP": "warning",
              "IGNORE": "ignore", "CONTACT_SUPPORT": "warning"}
    for x in hf.rules().xids.values():
        if x.immediate in mapped and not x.ours:
            assert x.severity == mapped[x.immediate], x
            assert x.application == (x.immediate == "RESTART_APP"), x
    unknown = hf.xid_rule(999)
    assert not unknown.listed and unknown.severity == "warning"
    for r in hf.rules().rules:
        assert r.component in hf.COMPONENTS and r.source and r.kind in hf.KINDS
    kinds = {r.name: r.kind for r in hf.rules().rules}
    assert kinds["ecc_uncorrected"] == "any_increment" and kinds["ecc_corrected_rate"] == "rate"


def k(metric, gpu=0, **labels):
    return (metric, gpu, tuple(sorted(labels.items())))


def test_node_faults_counters_fire_on_increase_never_on_reset():
    dbe = k("gpu_ecc_uncorrected_total")
    sbe = k("gpu_ecc_corrected_total")
    assert hf.node_faults({dbe: 2.0}, {dbe: 5.0}, [], 600) == []           # reset: lower than before
    assert hf.node_faults({dbe: 5.0}, None, [], 600) == []                   # no earlier reading: cannot judge
    (f,) = hf.node_faults({dbe: 6.0}, {dbe: 5.0}, [], 600)
    assert (f.component, f.severity, f.subject, f.gpu) == ("ecc", "warning", "GPU 0", 0)   # offlined: no drain
    assert f.action in f.sentence and f.evidence["increase"] == 1
    assert hf.node_faults({sbe: 11.0}, {sbe: 1.0}, [], 3600) == []           # 10/h: under the rate threshold
    (f,) = hf.node_faults({sbe: 501.0}, {sbe: 1.0}, [], 3600)
    assert f.severity == "warning" and f.rule == "ecc_corrected_rate"


def test_node_faults_states_links_and_load():
    port = k("ib_port_state", -1, device="mlx5_0", port="1", link_layer="InfiniBand")
    (f,) = hf.node_faults({port: 1.0}, None, [], 60)
    assert (f.component, f.subject, f.gpu, f.severity) == ("ib_port", "mlx5_0 port 1", -1, "critical")
    assert hf.node_faults({port: 4.0}, None, [], 60) == []
    gen = {k("gpu_pcie_link_gen"): 3.0, k("gpu_pcie_link_gen_max"): 5.0}
    assert hf.node_faults({**gen, k("gpu_util_percent"): 2.0}, None, [], 60) == []   # idle: power saving
    (f,) = hf.node_faults({**gen, k("gpu_util_percent"): 90.0}, None, [], 60)
    assert f.component == "pcie_link" and "3 of 5" in f.sentence
    down = k("ib_port_errors_total", -1, counter="link_downed", device="mlx5_0", port="1")
    now = 10_000 * 10**9
    boot = {"kind": "agent_start", "gpu": -1, "value": 0, "attrs": {}, "ts_ns": now - 300 * 10**9}
    assert hf.node_faults({down: 1.0}, {down: 0.0}, [boot], 600, now) == []       # a planned reboot's flap
    (f,) = hf.node_faults({down: 1.0}, {down: 0.0}, [], 600, now)
    assert f.rule == "ib_link_downed"
    # a port still down once links have trained (state_settle_s, 120 s) is a fault; right after, it may be training
    assert hf.node_faults({port: 1.0}, None, [dict(boot, ts_ns=now - 60 * 10**9)], 600, now) == []
    (f,) = hf.node_faults({port: 1.0}, None, [boot], 600, now)
    assert f.rule == "ib_port_not_active"
    # an agent restarted on a node up for a day is no reboot: it explains no flap
    restart = dict(boot, attrs={"boot_ns": str(now - 86400 * 10**9)})
    (f,) = hf.node_faults({down: 1.0}, {down: 0.0}, [restart], 600, now)
    assert f.rule == "ib_link_downed"
    assert hf.node_faults({down: 1.0}, {down: 0.0}, [dict(boot, attrs={"boot_ns": str(now - 400 * 10**9)})],
                          600, now) == []        # booted 100 s before the agent started: a reboot


def test_node_faults_xids_dedup_and_application_attribution():
    def xid(n, t_s, source, gpu=1, **attrs):
        return {"kind": "xid", "gpu": gpu, "value": n, "ts_ns": int(t_s * 1e9), "attrs": {"source": source, **attrs}}

    (f,) = hf.node_faults({}, None, [xid(79, 0, "nvml"), xid(79, 3, "kmsg")], 60)
    assert f.evidence["count"] == 1 and f.evidence["sources"] == ["kmsg", "nvml"] and f.severity == "critical"
    (f,) = hf.node_faults({}, None, [xid(79, 0, "nvml"), xid(79, 30, "kmsg")], 60)
    assert f.evidence["count"] == 2
    now = int(3 * 3600e9)
    # one burst (reports within application_burst_s) is the job's, whatever pids or jobs it names
    assert hf.node_faults({}, None, [xid(31, 0, "nvml", job_id="a"), xid(31, 50, "nvml", pid="77")], 60, now) == []
    # a second burst on the same GPU within 24 h is escalated, also when it is the same job restarted
    for second in ({"job_id": "a"}, {"pid": "4242"}, {"job_id": "b"}):
        (f,) = hf.node_faults({}, None, [xid(31, 0, "nvml", job_id="a"), xid(31, 3600, "nvml", **second)], 60, now)
        assert f.rule == "xid_31" and f.severity == "warning" and "2 times on this GPU" in f.sentence, second
        assert f.action == hf.xid_rule(31).repeat_action and "dcgmi diag" in f.action
    # ... but not when the first was more than 24 h before now
    assert hf.node_faults({}, None, [xid(31, -86400, "nvml"), xid(31, 3600, "nvml")], 60, now) == []
    (f,) = hf.node_faults({}, None, [{"kind": "gpu_lost", "gpu": 4, "value": 0, "ts_ns": 0, "attrs": {}}], 60)
    assert (f.component, f.severity, f.subject) == ("xid", "critical", "GPU 4")


def test_a_malformed_rules_file_is_one_sentence():
    with pytest.raises(hf.RulesError, match=r"\[\[rule\]\] x has kind 'sometimes'; expected one of"):
        hf.load_rules('[[rule]]\nname = "x"\ncomponent = "ecc"\nmetric = "m"\nkind = "sometimes"\n', "f.toml")
    with pytest.raises(hf.RulesError, match="is not valid TOML"):
        hf.load_rules("[[rule]\n", "f.toml")
    with pytest.raises(hf.RulesError, match="is a rate rule without a positive threshold_per_hour"):
        hf.load_rules('[[rule]]\nname = "x"\ncomponent = "ecc"\nmetric = "m"\nkind = "rate"\nseverity = "warning"\n'
                      'action = "a"\nsource = "s"\n', "f.toml")


def test_the_dcgm_named_alerts_use_the_shared_thresholds():
    """packaging/prometheus/alerts.yml restates two thresholds of common/hardware_faults.toml: they agree."""
    from pathlib import Path  # noqa: PLC0415
    text = (Path(__file__).resolve().parents[1] / "packaging" / "prometheus" / "alerts.yml").read_text()
    rules = {r.name: r for r in hf.rules().rules}
    crc = rules["nvlink_crc_flit"].threshold_per_hour
    assert f"* 3600 >= {crc:g}\n" in text and f"reach the {crc:g}/h threshold" in text
    assert rules["ecc_uncorrected"].kind == "any_increment" and "increase(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL[10m]) > 0" in text
    app = sorted(n for n, x in hf.rules().xids.items() if x.application or x.severity == "ignore")
    assert "!= 0 " + " ".join(f"!= {n}" for n in app) + " and changes(" in text


def test_the_simulator_sends_hardware_series_and_fault_events_over_the_protocol():
    """gpuagent-sim's NodeSim (real Batch bytes): an inject_hw_* node carries the hardware series, healthy
    except its one fault from one moment on; XID 79 comes from NVML and again from kmsg 2 s later."""
    import numpy as np  # noqa: PLC0415

    from gpuagent.proto import pb  # noqa: PLC0415
    from gpuagent.sim.data import NS, NodeSim, SimTiming  # noqa: PLC0415
    from gpuagent.sim.fleet import NodeSpec, ScenarioError, validate  # noqa: PLC0415

    timing = SimTiming(start_ns=0, end_ns=3600 * NS, interval_s=60.0)
    ts = np.arange(0, 3600 * NS, 60 * NS)

    def sim(**inject):
        return NodeSim(validate(NodeSpec(index=2, hostname="synthetic-x", pool="p", virtualized=False,
                                         inject=inject)), timing, seed=1)

    remap = sim(hw_row_remap=1)
    values = remap.samples(ts)
    col = {(m, g, tuple(sorted(lab.items()))): i for i, (m, g, lab) in enumerate(remap.series)}
    pending = values[:, col[("gpu_remapped_rows_pending", 2, ())]]
    assert pending[0] == 0 and pending[-1] == 1 and set(pending) == {0.0, 1.0}
    assert not values[:, col[("gpu_remapped_rows_pending", 1, ())]].any()        # only the injected GPU
    assert (values[:, col[("ib_port_state", -1, (("device", "mlx5_0"), ("link_layer", "InfiniBand"),
                                                  ("port", "1")))]] == 4).all()
    assert len(sim().series) < len(remap.series) == len(sim(hw_series=1).series)   # no hw_ key: no series
    batch = pb.Batch.FromString(sim(hw_xid=1).encode("n", 1, (0, 3600 * NS), 0, first=True).data)
    xids = [(e.value, e.attrs["source"]) for e in batch.events if e.kind == "xid"]
    assert xids == [(79.0, "nvml"), (79.0, "kmsg")]
    with pytest.raises(ScenarioError, match="hw_ecc must be 0 .none., 1 or 2"):
        validate(NodeSpec(index=0, hostname="h", pool="p", virtualized=False, inject={"hw_ecc": 3}))


def test_docs_health_holds_the_xid_table_the_rules_print():
    """docs/HEALTH.md's XID table is scripts/xid_table.py's output from the rules file, row for row."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    root = Path(__file__).resolve().parents[1]
    table = subprocess.run([sys.executable, str(root / "scripts" / "xid_table.py")], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert table in (root / "docs" / "HEALTH.md").read_text()
    assert table.count("\n") - 1 == len(hf.rules().xids) >= 100


def test_catalog_variants_limits_and_unlisted_xids_agree_between_sql_and_node(con):
    """The rules added from NVIDIA's catalog and DCGM, judged by the collector's SQL and the node's code on the
    same rows: XID 154 by its decoded action, the catalog's IGNORE bucket, an unlisted XID, the retired-page
    limits (a total over causes; DBE pages with new ones this week), NVML's recovery action, a Fatal and a
    Non-fatal SXid, and an NVLink5 XID decoded Non-fatal."""
    node, t0, t1 = "synthetic-hw-catalog", NOW - dt.timedelta(minutes=10), NOW - dt.timedelta(minutes=1)
    S.add_node(con, node, virtualized=False, gpu_count=8)
    series = [(3, "gpu_retired_pages_total", "cause=single_bit_ecc", 40, 40),
              (3, "gpu_retired_pages_total", "cause=double_bit_ecc", 23, 23),
              (3, "gpu_retired_pages_past_week", "cause=double_bit_ecc", 5, 5),
              (4, "gpu_recovery_action", "", 0, 4)] + [(g, "gpu_recovery_action", "", 0, 0) for g in (0, 1, 2, 5, 6, 7)]
    S.add_samples(con, [(t, node, g, m, lab, float(v)) for g, m, lab, v0, v1 in series for t, v in ((t0, v0), (t1, v1))])
    kmsg = lambda n, **a: {"xid": str(n), "source": "kmsg", **a}  # noqa: E731
    events = [(t1, node, 0, "xid", "SYNTHETIC XID 154", 154, kmsg(154, recovery_action="node_reboot_required")),
              (t1, node, 1, "xid", "SYNTHETIC XID 63", 63, kmsg(63)),
              (t1, node, 2, "xid", "SYNTHETIC XID 999", 999, kmsg(999)),
              (t1, node, 6, "xid", "SYNTHETIC XID 145", 145, kmsg(145, nvlink5_severity="non_fatal")),
              (t1, node, -1, "sxid", "SYNTHETIC SXid 12028", 12028, {"source": "kmsg", "device": "nvidia-nvswitch1", "fatal": "1"}),
              (t1, node, -1, "sxid", "SYNTHETIC SXid 22013", 22013, {"source": "kmsg", "device": "nvidia-nvswitch2", "fatal": "0"})]
    S.add_events(con, events)
    run(con, NOW)
    got = hw_flags(con, where=f"AND node_id = '{node}'")
    sql = {(f["gpu"], f["component"]): (f["severity"], {x["rule"] for x in json.loads(f["evidence"])["faults"]})
           for f in got}
    assert sql == {
        (0, "xid"): ("critical", {"xid_154"}),
        (2, "xid"): ("warning", {"xid_999"}),
        (3, "retired_pages"): ("critical", {"retired_pages_limit", "retired_pages_dbe_recent"}),
        (4, "xid"): ("critical", {"recovery_drain_and_reset"}),
        (None, "nvlink"): ("critical", {"sxid"}),
    }, sql
    sentences = {(f["gpu"], f["component"]): f["sentence"] for f in got}
    assert "Node Reboot Required" in sentences[(0, "xid")]
    assert "not in our copy of NVIDIA's XID catalog" in sentences[(2, "xid")]
    assert "nvidia-nvswitch2" in sentences[(None, "nvlink")] and "Fatal" in sentences[(None, "nvlink")]
    # the node's code on the same rows
    key = lambda m, g, lab: (m, g, tuple(sorted(tuple(kv.split("=", 1)) for kv in lab.split(",") if kv)))  # noqa: E731
    latest = {key(m, g, lab): float(v1) for g, m, lab, _v0, v1 in series}
    previous = {key(m, g, lab): float(v0) for g, m, lab, v0, _v1 in series}
    evs = [{"kind": e[3], "gpu": e[2], "value": e[5], "attrs": e[6], "ts_ns": int(e[0].timestamp() * 1e9)} for e in events]
    py = hf.node_faults(latest, previous, evs, 540, int(t1.timestamp() * 1e9))
    node_side = {}
    for f in py:
        key = (f.gpu if f.gpu >= 0 else None, f.component)
        sev, rules = node_side.get(key, ("warning", set()))
        node_side[key] = ("critical" if "critical" in (sev, f.severity) else "warning", rules | {f.rule})
    assert node_side == sql
