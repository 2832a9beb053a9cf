"""Steps that judge each node alone run in pieces of nodes (issue 27): the flags come out exactly as from one
piece. Real DuckDB files with SYNTHETIC rows: the same fleet is analysed once whole and once in pieces of 2."""

from __future__ import annotations

import datetime as dt
import json
import shutil

import duckdb
import pytest

from gpuagent.collector.analysis import analyzer as A
from gpuagent.collector.analysis import sql_files
from gpuagent.collector.analysis.steps import STEPS
from gpuagent.collector.store import schema
from gpuagent.sim import synthetic_rows as S

NOW = dt.datetime(2026, 1, 1, 12, 0)
NODES = [f"synthetic-p{i}" for i in range(7)]


def _fleet(con) -> None:
    """Seven nodes of 4 GPUs, each with its own mix of busy, idle-held, jobless and input-bound GPUs."""
    samples, jobs, steps = [], [], []
    for i, node in enumerate(NODES):
        S.add_node(con, node, virtualized=i % 2 == 1, gpu_count=4, pool="cloud-a" if i % 2 else "bm",
                   price_per_gpu_hour=2.0 + i)
        for m in range(60):
            t = NOW - dt.timedelta(minutes=60 - m, seconds=-5)
            idle_until, free_until = 15 + 5 * i, 10 + 4 * i
            util = {0: 92.0, 1: 2.0 if m < idle_until else 80.0, 2: 0.0 if m < free_until else 90.0,
                    3: 45.0 if i % 3 else 88.0}
            for g, u in util.items():
                samples.append((t, node, g, "gpu_util_percent", "", u))
            jobs += [(t, node, f"job-{i}-busy", 0, 92.0), (t, node, f"job-{i}-idle", 1, util[1]),
                     (t, node, f"job-{i}-input", 3, util[3])]
            if m >= free_until:
                jobs.append((t, node, f"job-{i}-late", 2, 90.0))
            steps.append((t, node, f"job-{i}-input", 3, 0.4, 0.5 if i % 3 else 0.02))
    S.add_samples(con, samples)
    S.add_job_samples(con, jobs)
    S.add_job_steps(con, steps)


def _pass(path, piece_nodes: int, fill=None, step_name: str = "utilization_gap",
          spread_sql: str = "SELECT count(DISTINCT hash(node_id) % {pieces}) FROM nodes", src=None):
    """One pass over a new file of ``fill``'s rows (or a copy of the file ``src``): (result, pieces of the
    step, how many pieces the rows really spread over, the open flags)."""
    if src is not None:
        shutil.copy(src, path)
    con = duckdb.connect(str(path))
    if src is None:
        schema.migrate(con)
        (fill or _fleet)(con)
    an = A.Analyzer(A.AnalyzerConfig(piece_nodes=piece_nodes))
    pieces = an.pieces(con, next(s for s in STEPS if s.name == step_name))
    result = an.run_pass(con, NOW)
    rows = con.execute("SELECT node_id, gpu, kind, component, severity, value, baseline, evidence, sentence "
                       "FROM flags WHERE state = 'open' ORDER BY ALL").fetchall()
    spread = con.execute(spread_sql.format(pieces=pieces)).fetchone()[0]
    con.close()
    return result, pieces, spread, rows


def test_utilization_gap_in_pieces_equals_one_pass_over_all(tmp_path):
    whole, one, _, expected = _pass(tmp_path / "whole.duckdb", piece_nodes=2000)
    # pieces of 1 node x the step's piece_scale of 3: the 7 nodes in 3 pieces
    split, three, spread, got = _pass(tmp_path / "pieces.duckdb", piece_nodes=1)
    assert (one, three) == (1, 3)
    assert spread >= 2, "the hash spreads the 7 nodes over more than one piece, so the pieces really split them"
    assert whole.failed == {} and split.failed == {}
    gaps = [r for r in expected if r[2] == "utilization_gap"]
    assert {r[0] for r in gaps} == set(NODES), "every node has a utilization gap to find"
    assert len(gaps) >= 2 * len(NODES)
    assert got == expected


def _mesh(con) -> None:
    """Eight nodes in one pool, every pair probed 8 times: p-n3 is slow on every link (a bad node), the link
    p-n0/p-n5 is slow alone (a bad link) and p-n1/p-n6 swings between full rate and a third (link variance)."""
    nodes = [f"p-n{i}" for i in range(8)]
    for n in nodes:
        S.add_node(con, n, virtualized=False, pool="p")
    times = [NOW - dt.timedelta(minutes=5 * k + 1) for k in range(8)]
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            noise = [1 + 0.01 * ((i * 7 + k) % 5 - 2) for k in range(8)]
            if "p-n3" in (a, b):
                rates = [2.8 * x for x in noise]
            elif (a, b) == ("p-n0", "p-n5"):
                rates = [2.0 * x for x in noise]
            elif (a, b) == ("p-n1", "p-n6"):
                rates = [9.4 if k % 2 else 3.0 for k in range(8)]
            else:
                rates = [9.4 * x for x in noise]
            S.add_link_runs(con, a, b, rates, times)


def _network_pass(path, piece_nodes: int):
    return _pass(path, piece_nodes, _mesh, "network_links",
                 "SELECT count(DISTINCT hash(least(node_a, node_b)) % {pieces}) FROM link_results")


def test_network_links_in_pieces_equal_one_pass_over_all(tmp_path):
    whole, one, _, expected = _network_pass(tmp_path / "whole.duckdb", piece_nodes=2000)
    split, four, spread, got = _network_pass(tmp_path / "pieces.duckdb", piece_nodes=2)
    assert (one, four) == (1, 4)
    assert spread >= 3, "the links' lower ends spread over most of the 4 pieces, so the pieces really split them"
    assert whole.failed == {} and split.failed == {}
    found = {(r[2], r[3]) for r in expected}
    assert {("network_degraded", "node"), ("network_degraded", "link")} <= found, found
    assert any(r[2] == "noisy_neighbor_variance" for r in expected), "the swinging link's variance is found"
    assert any(r[2] == "network_degraded" and r[0] == "p-n3" for r in expected)
    assert _floats_to_12_digits(got) == _floats_to_12_digits(expected)


def _floats_to_12_digits(rows):
    """A standard deviation summed in another row order differs in the 17th digit, in the flag's columns and in
    its evidence (the pieces read the rows in another order); nothing else may differ."""
    def rounded(v):
        if isinstance(v, float):
            return float(f"{v:.12g}")
        if isinstance(v, dict):
            return {k: rounded(x) for k, x in v.items()}
        if isinstance(v, list):
            return [rounded(x) for x in v]
        if isinstance(v, str) and v.startswith("{"):
            return rounded(json.loads(v))
        return v
    return [tuple(rounded(v) for v in r) for r in rows]


def _samples(con) -> None:
    """Two nodes, two GPUs, 10 minutes at 5 s: 480 rows whose minutes the chunks below cut in the middle."""
    rows = []
    for node in ("synthetic-r0", "synthetic-r1"):
        S.add_node(con, node, virtualized=False, gpu_count=2, pool="bm")
        for s in range(0, 600, 5):
            t = NOW - dt.timedelta(seconds=600 - s)
            for g in range(2):
                rows.append((t, node, g, "gpu_util_percent", "", float((s * 7 + g * 13) % 101)))
                rows.append((t, node, g, "gpu_energy_joules_total", "", 1000.0 + s * 300 + g))
    S.add_samples(con, rows)


def _rollup(path, chunk_rows: int):
    con = duckdb.connect(str(path))
    schema.migrate(con)
    _samples(con)
    rows_in = A.Analyzer(A.AnalyzerConfig(rollup_chunk_rows=chunk_rows)).rollup(con)
    table = con.execute("SELECT * FROM samples_1m ORDER BY ALL").fetchall()
    con.close()
    return rows_in, table


def test_rollup_in_chunks_of_seven_rows_equals_one_chunk(tmp_path):
    n_one, one = _rollup(tmp_path / "one.duckdb", 5_000_000)
    n_small, small = _rollup(tmp_path / "chunks.duckdb", 7)
    assert n_one == n_small >= 480
    assert len(one) == 2 * 2 * 2 * 10, "a row per node, GPU, metric and minute"
    assert small == one


@pytest.mark.parametrize("key", ["piece_nodes", "rollup_chunk_rows"])
def test_pieces_and_chunks_below_one_are_refused(key):
    with pytest.raises(A.AnalyzerError, match=f"^\\[analyzer\\] {key} must be at least 1, got 0$"):
        A.AnalyzerConfig.from_mapping({"analyzer": {key: 0}})


def test_a_pieces_statement_gets_its_piece_as_literals_and_keeps_other_parameters():
    stmt = "SELECT * FROM t WHERE hash(node_id) % $pieces = $piece AND x = $piece_nodes AND ts <= $now"
    assert sql_files.piece_literals(stmt, 3, 15) == ("SELECT * FROM t WHERE hash(node_id) % 15 = 3 AND x = $piece_nodes "
                                              "AND ts <= $now")


def test_virtualization_overhead_in_pieces_equals_one_pass_over_all(tmp_path):
    """30_virtualization_overhead.sql judges each node's probe runs against the stored fleet baselines: in
    pieces of 5 nodes of a 42-node SYNTHETIC fleet (every 7th cloud node's probes 20 % low) the flags are the
    same as in one piece. One file, copied, so both passes read the same (random) probe values."""
    src = tmp_path / "fleet.duckdb"
    con = duckdb.connect(str(src))
    schema.migrate(con)
    start = NOW - dt.timedelta(hours=1)
    S.add_synthetic_fleet(con, 42, 2, start)
    S.fill_fleet_probe_rows(con, nodes=42, gpus=2, start=start, first_s=0, seconds=3600)
    con.close()
    whole, one, _, all_expected = _pass(tmp_path / "whole.duckdb", 2000, step_name="virtualization_overhead", src=src)
    split, nine, spread, all_got = _pass(tmp_path / "pieces.duckdb", 5, step_name="virtualization_overhead", src=src)
    assert (one, nine) == (1, 9) and spread >= 7
    assert whole.failed == {} and split.failed == {}
    expected, got = ([r for r in rows if r[2] == "virtualization_overhead"] for rows in (all_expected, all_got))
    flagged = {r[0] for r in expected if r[4] in ("warning", "critical")}
    assert flagged == {f"synthetic-{n:05d}" for n in range(42) if n % 2 == 1 and n % 7 == 0}, flagged
    assert _floats_to_12_digits(got) == _floats_to_12_digits(expected)


def test_statements_above_the_pieces_line_run_once_and_may_not_name_a_piece():
    text = ("CREATE TEMP TABLE a AS SELECT hash(n) % $pieces AS piece FROM t;\n"
            f"{sql_files.EACH_PIECE}\n-- a comment\nSELECT * FROM a WHERE piece = $piece;\n")
    once, each = sql_files.once_and_each_piece(sql_files.split_sql(text))
    assert once == ["CREATE TEMP TABLE a AS SELECT hash(n) % $pieces AS piece FROM t;"]
    assert each == ["SELECT * FROM a WHERE piece = $piece;"]
    assert sql_files.piece_literals(once[0], None, 6) == "CREATE TEMP TABLE a AS SELECT hash(n) % 6 AS piece FROM t;"
    with pytest.raises(A.AnalyzerError, match=r"^\$piece in a statement above the pieces"):
        sql_files.piece_literals(each[0], None, 6)
    with pytest.raises(A.AnalyzerError, match="inside a statement"):
        sql_files.split_sql(f"SELECT 1\n{sql_files.EACH_PIECE}\nFROM t;")
    assert sql_files.once_and_each_piece(["SELECT 1;"]) == ([], ["SELECT 1;"])
