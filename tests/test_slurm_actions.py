"""Drains from the collector ([actions], collector/actions/, issue 24 must-shows 3 and 4) on a real Slurm cluster.

Slurm is real: munged, slurmctld and five slurmd nodes, each in its own network namespace with its own
hostname (tests/slurm_cluster.py's NetnsSlurmCluster over the namespace testbed, scripts/netns_fleet.py),
and the real scontrol, which the collector's code reaches through a wrapper that runs it in the
controller's namespace. Findings come from the real analysis over SYNTHETIC hardware telemetry
(sim/synthetic_rows.py) in a real DuckDB file, or, for the rest, as findings rows written the way the
analysis writes them. The failing and hanging scontrol are stand-in scripts named so.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import time
import urllib.request

import duckdb
import pytest
from click.testing import CliRunner
from fabric_helpers import netns_testbed_or_skip
from gpuagent.collector import cli
from gpuagent.collector.actions.config import ActionsConfig, ActionsError
from gpuagent.collector.actions.engine import Actions, ConnectionDb, recent_actions
from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector import service as server
from gpuagent.collector.store import schema
from gpuagent.collector.views.metrics import CollectorMetrics
from gpuagent.sim import synthetic_rows as S
from prometheus_client import generate_latest
from slurm_cluster import NetnsSlurmCluster

POOL = "synthetic-gpu-pool"


def utcnow() -> dt.datetime:
    """Now in UTC, naive, as the collector stores times."""
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    nf = netns_testbed_or_skip()
    fleet = nf.Fleet.up(6)       # five slurmd nodes and the controller's namespace
    try:
        c = NetnsSlurmCluster(tmp_path_factory.mktemp("slurm-actions"), fleet)
        try:
            yield c.start()
        finally:
            c.stop()
    finally:
        fleet.down()


@pytest.fixture(autouse=True)
def slurm(cluster, monkeypatch):
    """Each test starts with every node undrained; scontrol (ours and gpuagent's) reads this cluster's conf."""
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    yield cluster
    for n in cluster.nodes:
        if "DRAIN" in show(cluster, n)[0]:
            cluster.run("scontrol", "update", f"NodeName={n}", "State=UNDRAIN", check=False)


def show(cluster, node) -> tuple[str, str]:
    """(State, Reason without its [user@time] stamp) as scontrol shows them."""
    line = cluster.run("scontrol", "show", "node", "-o", node)
    state = line.split("State=", 1)[1].split()[0]
    reason = line.split("Reason=", 1)[1].rsplit(" [", 1)[0].strip() if "Reason=" in line else ""
    return state, reason


def undrained(cluster, node) -> bool:
    """Not drained and no Reason (right after a RESUME Slurm may show IDLE+NOT_RESPONDING until its next ping)."""
    state, reason = show(cluster, node)
    return "DRAIN" not in state and reason == ""


def db_with_nodes(path, names, fqdn=True):
    """A migrated collector database whose nodes have these Slurm names as (fully qualified) hostnames."""
    con = duckdb.connect(str(path))
    schema.migrate(con)
    for i, name in enumerate(names):
        node_id = f"node-{i}-{name}"
        S.add_node(con, node_id, virtualized=False, gpu_count=2, pool=POOL)
        con.execute("UPDATE nodes SET hostname = ? WHERE node_id = ?",
                    [f"{name}.cluster.example" if fqdn else name, node_id])
    return con


def node_of(con, name):
    return con.execute("SELECT node_id FROM nodes WHERE split_part(hostname, '.', 1) = ?", [name]).fetchone()[0]


def add_finding(con, name, kind="hardware_fault", severity="critical", sentence=None):
    """A node finding as 95_findings.sql writes it."""
    node = node_of(con, name)
    now = utcnow()
    return con.execute(
        "INSERT INTO findings (finding_key, scope, kind, node_id, pool, severity, state, first_seen, last_seen, "
        "flags, nodes, sentence) VALUES (?, 'node', ?, ?, ?, ?, 'open', ?, ?, 1, 1, ?) RETURNING finding_id",
        [f"node|{kind}|{node}", kind, node, POOL, severity, now, now,
         sentence or f"hardware fault ({severity}, xid) on {node}: XID 79 on GPU 0"]).fetchone()[0]


def close_finding(con, fid):
    con.execute("UPDATE findings SET state = 'closed', closed_at = now() WHERE finding_id = ?", [fid])


def actions_rows(con):
    return [(r["action"], r["slurm_node"], r["outcome"]) for r in reversed(recent_actions(con))]


def enforce(cluster, **kw) -> ActionsConfig:
    return ActionsConfig(enabled=True, mode="enforce", **{
        "max_nodes": 5, "max_pool_percent": 100.0, "max_drains_per_hour": 10,
        "scontrol": str(cluster.scontrol_wrapper), **kw})


def fault_rows(con, node_id, start, fault="xid"):
    rows, events = S.hardware_rows(node_id, start=start, fault=fault, gpus=2, rng=random.Random(node_id))
    S.add_samples(con, rows)
    S.add_events(con, events)


def seed_live_fault(handle, slurm_node):
    """A node named slurm_node with an XID 79 in the last hour, written through a live collector's writer."""
    def seed(c):
        S.add_node(c, "node-live", virtualized=False, gpu_count=2, pool=POOL)
        c.execute("UPDATE nodes SET hostname = ? WHERE node_id = 'node-live'", [slurm_node])
        fault_rows(c, "node-live", utcnow() - dt.timedelta(minutes=55))
    handle.writer.call(seed).result()


def write_config(tmp_path, text):
    path = tmp_path / "collector.toml"
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------------------------------ config

def test_config_is_off_and_dry_run_by_default_and_bad_values_are_one_sentence(tmp_path):
    cfg = ActionsConfig.from_toml(write_config(tmp_path, "[analyzer]\ninterval = \"1m\"\n"))
    assert (cfg.enabled, cfg.mode) == (False, "dry-run")
    assert cfg.action_for("hardware_fault", "critical") == "drain"
    assert cfg.action_for("hardware_fault", "warning") == cfg.action_for("utilization_gap", "critical") == "alert"
    on = ActionsConfig.from_mapping({"enabled": True, "policy": {"network_degraded": "drain"}, "max_nodes": 3,
                                     "scontrol_timeout": "2s"})
    assert (on.mode, on.max_nodes, on.scontrol_timeout_s) == ("dry-run", 3, 2.0)
    assert on.action_for("network_degraded", "warning") == "drain"
    assert on.action_for("hardware_fault", "critical") == "alert"      # a policy table replaces the default
    for table, words in (({"mode": "yes"}, "actions.mode must be"), ({"max_nodes": -1}, "actions.max_nodes"),
                         ({"max_pool_percent": 150}, "from 0 to 100"), ({"policy": {"hw.critical": "drain"}},
                                                                        "finding kind"),
                         ({"policy": {"hardware_fault": "reboot"}}, "\"drain\" or \"alert\""),
                         ({"scontrol_timeout": "forever"}, "duration"), ({"drian": 1}, "unknown key actions.drian"),
                         ({"slurmrestd_url": "http://x:6820"}, "not supported yet")):
        with pytest.raises(ActionsError, match=words) as err:
            ActionsConfig.from_mapping(table)
        assert "\n" not in str(err.value)
    # The collector's own commands read [actions] beside the other tables and refuse a bad one in one line.
    db = tmp_path / "c.duckdb"
    db_with_nodes(db, ["vm"]).close()
    res = CliRunner().invoke(cli.main, ["analyze", "--db", str(db), "--config",
                                        write_config(tmp_path, "[actions]\nenabled = true\nmode = \"on\"\n")])
    assert res.exit_code == 1 and res.output.strip().splitlines() == [
        "Error: actions.mode must be \"dry-run\" or \"enforce\", not 'on'"]
    res = CliRunner().invoke(cli.main, ["serve", "--db", str(tmp_path / "s.duckdb"), "--config",
                                        write_config(tmp_path, "[actions]\nenabled = true\nmax_nodes = \"two\"\n")])
    assert res.exit_code == 1 and res.output.strip().splitlines() == [
        "Error: actions.max_nodes must be a whole number of 0 or more, not 'two'"]
    assert not (tmp_path / "s.duckdb").exists()


# ------------------------------------------------------------------------------------ dry-run and enforce

def test_dry_run_changes_nothing_in_slurm_and_records_the_would_be_drain(cluster, tmp_path):
    """The real analysis finds the XID 79 on the node; `analyze --db` prints the would-be drain."""
    db = tmp_path / "c.duckdb"
    con = db_with_nodes(db, [cluster.node])
    fault_rows(con, node_of(con, cluster.node), utcnow() - dt.timedelta(minutes=55))
    con.close()
    cfg = write_config(tmp_path, "[actions]\nenabled = true\nmax_pool_percent = 100\n")
    res = CliRunner().invoke(cli.main, ["analyze", "--db", str(db), "--config", cfg])
    assert res.exit_code == 0, res.output
    line = next(x for x in res.output.splitlines() if x.startswith("action "))
    assert line.startswith(f"action drain {cluster.node} [dry-run] dry-run finding ")
    assert "hardware fault (critical, xid)" in line
    assert undrained(cluster, cluster.node)
    con = duckdb.connect(str(db))
    row, alert = sorted(recent_actions(con), key=lambda r: r["action"] != "drain")
    assert (row["action"], row["mode"], row["outcome"], row["kind"], row["severity"]) == (
        "drain", "dry-run", "dry-run", "hardware_fault", "critical")
    # The same data shows an idle GPU too: the default policy only alerts on it.
    assert (alert["action"], alert["outcome"], alert["kind"]) == ("alert", "recorded", "utilization_gap")
    assert row["command"] == (f"scontrol update NodeName={cluster.node} State=DRAIN "
                              f"'Reason={row['reason']}'")
    assert row["reason"].startswith("gpuagent: hardware fault (critical, xid)")
    # Who decided it, and under which policy entry.
    assert row["actor"].startswith("gpuagent-collector on ") and " as " in row["actor"]
    assert (row["rule"], alert["rule"]) == ("hardware_fault.critical = drain", "default alert")
    # The next pass decides nothing again: one row per finding and mode.
    assert Actions(ActionsConfig(enabled=True)).run_once(ConnectionDb(con)) == []
    con.close()
    # The report lists the would-be drain in its Actions section.
    html = tmp_path / "r.html"
    res = CliRunner().invoke(cli.main, ["report", "--db", str(db), "--out", str(html)])
    assert res.exit_code == 0, res.output
    section = html.read_text().split("<section id='actions'>", 1)[1].split("</section>", 1)[0]
    assert "actions-table" in section and f"<td>{cluster.node}</td><td>drain</td><td>dry-run</td>" in section


def test_enforce_drains_with_the_findings_sentence_and_resumes_when_it_closes(cluster, tmp_path):
    db = tmp_path / "c.duckdb"
    con = db_with_nodes(db, [cluster.node])
    node = node_of(con, cluster.node)
    start = utcnow() - dt.timedelta(minutes=55)
    fault_rows(con, node, start)
    con.close()
    cfg = write_config(tmp_path, "[actions]\nenabled = true\nmode = \"enforce\"\nmax_pool_percent = 100\n"
                                 f"scontrol = \"{cluster.scontrol_wrapper}\"\n")
    res = CliRunner().invoke(cli.main, ["analyze", "--db", str(db), "--config", cfg])
    assert res.exit_code == 0, res.output
    assert f"action drain {cluster.node} [enforce] ok finding " in res.output
    con = duckdb.connect(str(db))
    sentence = con.execute("SELECT sentence FROM findings WHERE state = 'open' AND kind = 'hardware_fault'"
                           ).fetchone()[0]
    state, reason = show(cluster, cluster.node)
    assert "DRAIN" in state and reason == "gpuagent: " + sentence
    # A healthy hour later the finding closes (the real analysis) and gpuagent resumes the node it drained.
    fault_rows(con, node, start + dt.timedelta(minutes=60), fault=None)
    run = A.Analyzer().run_pass
    run(con, utcnow() + dt.timedelta(minutes=65))
    assert con.execute("SELECT state FROM findings WHERE kind = 'hardware_fault'").fetchall() == [("closed",)]
    rows = Actions(ActionsConfig.from_toml(cfg)).run_once(ConnectionDb(con))
    assert [(r["action"], r["outcome"]) for r in rows] == [("resume", "ok")]
    assert undrained(cluster, cluster.node)
    assert [r for r in actions_rows(con) if r[0] != "alert"] == [("drain", cluster.node, "ok"),
                                                                ("resume", cluster.node, "ok")]
    con.close()


def test_a_node_drained_by_hand_is_never_resumed(cluster, tmp_path):
    con = db_with_nodes(tmp_path / "c.duckdb", [cluster.node])
    cluster.run("scontrol", "update", f"NodeName={cluster.node}", "State=DRAIN", "Reason=fan replacement, ticket 7")
    actions = Actions(enforce(cluster))
    fid = add_finding(con, cluster.node)
    (row,) = actions.run_once(ConnectionDb(con))
    assert (row["action"], row["outcome"]) == ("drain", "skipped-manual")
    assert "fan replacement, ticket 7" in row["detail"]
    close_finding(con, fid)
    assert actions.run_once(ConnectionDb(con)) == []
    state, reason = show(cluster, cluster.node)
    assert "DRAIN" in state and reason == "fan replacement, ticket 7"


@pytest.mark.parametrize("change", ["new reason", "resumed and drained again alike"])
def test_a_node_whose_state_someone_changed_after_gpuagent_drained_it_is_not_resumed(cluster, tmp_path, change):
    con = db_with_nodes(tmp_path / "c.duckdb", [cluster.node])
    actions = Actions(enforce(cluster))
    fid = add_finding(con, cluster.node)
    (drain,) = actions.run_once(ConnectionDb(con))
    assert drain["outcome"] == "ok" and show(cluster, cluster.node)[1] == drain["reason"]
    name = f"NodeName={cluster.node}"
    if change == "new reason":
        cluster.run("scontrol", "update", name, "State=DRAIN", "Reason=investigating, ticket 42")
        kept = "investigating, ticket 42"
    else:      # same text, but set by someone else later: Slurm's time stamp on the Reason differs
        cluster.run("scontrol", "update", name, "State=RESUME")
        time.sleep(1.1)
        cluster.run("scontrol", "update", name, "State=DRAIN", f"Reason={drain['reason']}")
        kept = drain["reason"]
    close_finding(con, fid)
    (resume,) = actions.run_once(ConnectionDb(con))
    assert (resume["action"], resume["outcome"]) == ("resume", "skipped-manual")
    state, reason = show(cluster, cluster.node)
    assert "DRAIN" in state and reason == kept
    assert actions.run_once(ConnectionDb(con)) == []     # released: never tried again


# ------------------------------------------------------------------------------------------- the breaker

@pytest.mark.parametrize("bound, drained, words", [
    ({"max_nodes": 2}, 2, "max_nodes = 2"),
    ({"max_pool_percent": 20.0}, 1, "max_pool_percent = 20"),
    ({"max_drains_per_hour": 3}, 3, "max_drains_per_hour = 3"),
])
def test_the_breaker_drains_no_more_than_the_bound_and_the_rest_become_alerts(cluster, tmp_path, bound, drained,
                                                                              words):
    """Five slurmd nodes of one pool faulted at once."""
    con = db_with_nodes(tmp_path / "c.duckdb", cluster.nodes)
    for n in cluster.nodes:
        add_finding(con, n)
    rows = Actions(enforce(cluster, **bound)).run_once(ConnectionDb(con))
    ok = [r["slurm_node"] for r in rows if (r["action"], r["outcome"]) == ("drain", "ok")]
    held = [r for r in rows if r["outcome"] == "skipped-breaker"]
    assert len(ok) == drained and len(held) == 5 - drained
    assert all(r["action"] == "alert" and words in r["detail"] for r in held)
    in_slurm = [n for n in cluster.nodes if show(cluster, n)[1].startswith("gpuagent: ")]
    assert sorted(in_slurm) == sorted(ok)
    text = generate_latest(CollectorMetrics(_NoIngest(), con.cursor, lambda: 0).registry).decode()
    assert f'gpuagent_collector_nodes_drained{{mode="enforce"}} {float(drained)}' in text
    assert (f'gpuagent_collector_actions_total{{action="alert",mode="enforce",outcome="skipped-breaker"}} '
            f"{float(5 - drained)}") in text


class _NoIngest:
    """Stands in for the writer's ingest counters in /metrics (not under test here; no collector runs)."""
    def __init__(self):
        self.stats: dict = {}
        self.closed_reason = None      # the database is open

    def queue_depth(self) -> int:
        return 0


def test_drains_of_the_last_hour_count_even_after_their_resume(cluster, tmp_path):
    con = db_with_nodes(tmp_path / "c.duckdb", cluster.nodes[:2])
    actions = Actions(enforce(cluster, max_drains_per_hour=1))
    fid = add_finding(con, cluster.node)
    assert [r["outcome"] for r in actions.run_once(ConnectionDb(con))] == ["ok"]
    close_finding(con, fid)
    assert [r["outcome"] for r in actions.run_once(ConnectionDb(con))] == ["ok"]          # the resume
    add_finding(con, cluster.nodes[1])
    (row,) = actions.run_once(ConnectionDb(con))
    assert row["outcome"] == "skipped-breaker" and "1 drains in the last hour" in row["detail"]
    assert "DRAIN" not in show(cluster, cluster.nodes[1])[0]


# ------------------------------------------------------------------------------- scontrol failing, hanging

def test_a_failing_scontrol_is_one_recorded_failed_action(cluster, tmp_path):
    fake = tmp_path / "failing-scontrol"      # a stand-in: the real one is not asked
    fake.write_text("#!/bin/sh\necho 'slurm_update error: Access/permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    con = db_with_nodes(tmp_path / "c.duckdb", [cluster.node])
    add_finding(con, cluster.node)
    actions = Actions(enforce(cluster, scontrol=str(fake)))
    (row,) = actions.run_once(ConnectionDb(con))
    assert (row["action"], row["outcome"]) == ("drain", "failed")
    assert row["detail"] == f"{fake} exited 1: slurm_update error: Access/permission denied"
    assert actions.run_once(ConnectionDb(con)) == []
    assert undrained(cluster, cluster.node)


def test_a_hanging_scontrol_never_delays_the_analysis_pass(cluster, tmp_path):
    fake = tmp_path / "hanging-scontrol"      # a stand-in that never answers
    fake.write_text("#!/bin/sh\nsleep 60\n")
    fake.chmod(0o755)
    timeout = 5.0
    cfg = enforce(cluster, scontrol=str(fake), scontrol_timeout_s=timeout)
    handle = server.start_collector(tmp_path / "live.duckdb", analyzer_config=A.AnalyzerConfig(interval_s=3600),
                                    actions_config=cfg, metrics_listen="127.0.0.1:0")
    try:
        seed_live_fault(handle, cluster.node)
        def decided():
            return [r for r in handle.writer.call(recent_actions).result() if r["kind"] == "hardware_fault"]
        # The actions thread starts scontrol only after the pass has committed; had the pass waited for it, the
        # failed action (scontrol killed after `timeout`) would be there when the pass returns. Not a timing
        # bound on the pass, which a loaded machine can stretch.
        handle.analyzer.run_once()
        assert decided() == [], "the pass returned only after scontrol was given up on"
        handle.analyzer.run_once()     # a second pass while scontrol hangs: it returns too, folded into one run
        assert decided() == []
        assert handle.actions.wait_idle(4 * timeout + 10)
        rows = decided()
        assert [(r["action"], r["outcome"]) for r in rows] == [("drain", "failed")]
        assert rows[0]["detail"] == f"{fake} did not answer within {timeout:g} s and was killed"
        assert rows[0]["duration_s"] >= timeout
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{handle.metrics.port}/metrics", timeout=10).read().decode()
        assert 'gpuagent_collector_actions_total{action="drain",mode="enforce",outcome="failed"} 1.0' in scrape
        assert 'gpuagent_collector_nodes_drained{mode="enforce"} 0.0' in scrape
    finally:
        handle.stop()
    assert undrained(cluster, cluster.node)


def test_analyze_against_a_live_collector_prints_the_actions_its_pass_led_to(cluster, tmp_path):
    """`analyze --target`: the actions run on the collector's own thread; the call waits for them (only the call,
    not the pass) and prints one line each. With --wait-actions 0 it prints none and they still run."""
    cfg = ActionsConfig(enabled=True, max_nodes=5, max_pool_percent=100.0, scontrol=str(cluster.scontrol_wrapper))
    handle = server.start_collector(tmp_path / "live.duckdb", analyzer_config=A.AnalyzerConfig(interval_s=3600),
                                    actions_config=cfg)
    try:
        seed_live_fault(handle, cluster.node)
        target = f"127.0.0.1:{handle.port}"
        res = CliRunner().invoke(cli.main, ["analyze", "--target", target, "--wait-actions", "0"])
        assert res.exit_code == 0, res.output
        assert not [x for x in res.output.splitlines() if x.startswith("action ")], res.output
        assert handle.actions.wait_idle(30)
        drains = [r for r in handle.writer.call(recent_actions).result() if r["action"] == "drain"]
        assert [(r["slurm_node"], r["outcome"]) for r in drains] == [(cluster.node, "dry-run")]   # it ran anyway

        def seed_second(c):   # a second node's fault: the next pass has a new drain to decide
            S.add_node(c, "node-live-2", virtualized=False, gpu_count=2, pool=POOL)
            c.execute("UPDATE nodes SET hostname = ? WHERE node_id = 'node-live-2'", [cluster.nodes[1]])
            fault_rows(c, "node-live-2", utcnow() - dt.timedelta(minutes=55))
        handle.writer.call(seed_second).result()
        res = CliRunner().invoke(cli.main, ["analyze", "--target", target])
        assert res.exit_code == 0, res.output
        lines = [x for x in res.output.splitlines() if x.startswith("action ")]
        assert any(x.startswith(f"action drain {cluster.nodes[1]} [dry-run] dry-run finding ") for x in lines), \
            res.output
        assert not any(f" {cluster.node} " in x for x in lines), "an earlier pass's action was printed again"
        res = CliRunner().invoke(cli.main, ["analyze", "--target", target, "--format", "json"])
        assert res.exit_code == 0, res.output
        out = json.loads(res.output)
        assert out["actions"] == [] and out["actions_pending"] is False      # nothing new to decide
        for zero in ("0s", "0.0", "0m"):
            res = CliRunner().invoke(cli.main, ["analyze", "--target", target, "--wait-actions", zero])
            assert res.exit_code == 0, (zero, res.output)
        res = CliRunner().invoke(cli.main, ["analyze", "--target", target, "--wait-actions", "5m"])
        assert res.exit_code != 0 and "--wait-actions must be from 0 to 2m, not '5m'" in res.output
    finally:
        handle.stop()
    assert undrained(cluster, cluster.node)


def test_action_times_are_utc_on_a_host_that_is_not(cluster, tmp_path, monkeypatch):
    """The actions table keeps naive UTC; a host in another zone must not shift the rows (astimezone() read the
    naive UTC clock as local time: nine hours off in Tokyo)."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    try:
        con = db_with_nodes(tmp_path / "c.duckdb", [cluster.node])
        add_finding(con, cluster.node)
        (row,) = Actions(ActionsConfig(enabled=True, max_pool_percent=100.0)).run_once(ConnectionDb(con))
        assert abs((row["ts"] - utcnow()).total_seconds()) < 60, row["ts"]
        con.close()
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


def test_a_nodes_slurm_node_label_names_it_where_its_hostname_does_not(cluster, tmp_path):
    con = db_with_nodes(tmp_path / "c.duckdb", [cluster.node])
    node = node_of(con, cluster.node)
    con.execute("UPDATE nodes SET hostname = 'host-not-in-slurm.example', labels = MAP {'slurm_node': ?} "
                "WHERE node_id = ?", [cluster.node, node])
    con.execute("INSERT INTO findings (finding_key, scope, kind, node_id, pool, severity, state, first_seen, "
                "last_seen, flags, nodes, sentence) VALUES ('k', 'node', 'hardware_fault', ?, ?, 'critical', 'open', "
                "now(), now(), 1, 1, 'hardware fault (critical, xid) on it: XID 79 on GPU 0')", [node, POOL])
    rows = Actions(enforce(cluster)).run_once(ConnectionDb(con))
    assert [(r["action"], r["slurm_node"], r["outcome"]) for r in rows] == [("drain", cluster.node, "ok")]
    assert "DRAIN" in show(cluster, cluster.node)[0]
    con.close()


def test_a_finding_the_breaker_held_back_is_drained_once_there_is_room(cluster, tmp_path):
    """max_nodes = 1 with two faulted nodes: the second is alerted (skipped-breaker), passes while the first
    stays drained write nothing more, and once the first's finding closes and it is resumed, the second is
    drained in the same run."""
    first, second = cluster.nodes[:2]
    con = db_with_nodes(tmp_path / "c.duckdb", [first, second])
    actions = Actions(enforce(cluster, max_nodes=1))
    fid = add_finding(con, first)
    add_finding(con, second)
    rows = actions.run_once(ConnectionDb(con))
    assert [(r["action"], r["slurm_node"], r["outcome"]) for r in rows] == [
        ("drain", first, "ok"), ("alert", second, "skipped-breaker")]
    assert actions.run_once(ConnectionDb(con)) == []          # still held back: no new row
    assert "DRAIN" not in show(cluster, second)[0]
    close_finding(con, fid)
    rows = actions.run_once(ConnectionDb(con))
    assert [(r["action"], r["slurm_node"], r["outcome"]) for r in rows] == [
        ("resume", first, "ok"), ("drain", second, "ok")]
    assert "DRAIN" in show(cluster, second)[0] and undrained(cluster, first)
    assert actions.run_once(ConnectionDb(con)) == []
    con.close()
