"""Steps that judge each node alone run in pieces of nodes (issue 27): the flags come out exactly as from one
piece. Real DuckDB files with SYNTHETIC rows: the same fleet is analysed once whole and once in pieces of 2."""

from __future__ import annotations

import datetime as dt

import duckdb
import pytest

from gpuagent.collector.analysis import analyzer as A
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


def _pass(path, piece_nodes: int):
    con = duckdb.connect(str(path))
    schema.migrate(con)
    _fleet(con)
    an = A.Analyzer(A.AnalyzerConfig(piece_nodes=piece_nodes))
    step = next(s for s in STEPS if s.name == "utilization_gap")
    pieces = an.pieces(con, step)
    result = an.run_pass(con, NOW)
    rows = con.execute("SELECT node_id, gpu, kind, component, severity, value, evidence, sentence FROM flags "
                       "WHERE state = 'open' ORDER BY ALL").fetchall()
    spread = con.execute(f"SELECT count(DISTINCT hash(node_id) % {pieces}) FROM nodes").fetchone()[0]
    con.close()
    return result, pieces, spread, rows


def test_utilization_gap_in_pieces_of_two_nodes_equals_one_pass_over_all(tmp_path):
    whole, one, _, expected = _pass(tmp_path / "whole.duckdb", piece_nodes=2000)
    split, four, spread, got = _pass(tmp_path / "pieces.duckdb", piece_nodes=2)
    assert (one, four) == (1, 4)
    assert spread >= 3, "the hash spreads the 7 nodes over most of the 4 pieces, so the pieces really split them"
    assert whole.failed == {} and split.failed == {}
    gaps = [r for r in expected if r[2] == "utilization_gap"]
    assert {r[0] for r in gaps} == set(NODES), "every node has a utilization gap to find"
    assert len(gaps) >= 2 * len(NODES)
    assert got == expected


def test_piece_nodes_below_one_is_refused():
    with pytest.raises(A.AnalyzerError, match="piece_nodes must be at least 1"):
        A.AnalyzerConfig.from_mapping({"analyzer": {"piece_nodes": 0}})
