"""The analysis steps' SQL files: their statements, and running one with its named parameters.

Every statement of a pass (the rollups' and each step's) goes through ``run_statement``, so a profiler can
wrap that one function (benchmarks/analysis_scale.py).
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any, Mapping

from gpuagent.collector.analysis.errors import AnalyzerError
from gpuagent.collector.analysis.steps import STEPS, Step


def _sql_dir():
    return resources.files("gpuagent.collector.analysis").joinpath("sql")


def load_sql(steps: tuple[Step, ...] = STEPS) -> dict[str, list[str]]:
    """Statements of each step's SQL file, by step name."""
    out = {}
    for step in steps:
        entry = _sql_dir().joinpath(step.sql_file)
        if not entry.is_file():
            raise AnalyzerError(f"analysis SQL file {step.sql_file} is missing from the installed package")
        out[step.name] = split_sql(entry.read_text())
    return out


def split_sql(text: str) -> list[str]:
    """Statements of a SQL file: split at ';' that ends a line (comments stripped; no ';' in strings)."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("--")]
    out, cur = [], []
    for ln in lines:
        cur.append(ln)
        if ln.rstrip().endswith(";"):
            stmt = "\n".join(cur).strip()
            if stmt.rstrip(";").strip():
                out.append(stmt)
            cur = []
    if "\n".join(cur).strip():
        out.append("\n".join(cur).strip())
    return out


_PARAM = re.compile(r"\$([A-Za-z_][A-Za-z0-9_]*)")


def run_statement(con, stmt: str, params: Mapping[str, Any]):
    used = {name: params[name] for name in _PARAM.findall(stmt)}
    return con.execute(stmt, used) if used else con.execute(stmt)


_PIECE = re.compile(r"\$(pieces|piece)\b")


def piece_literals(stmt: str, piece: int, pieces: int) -> str:
    """A piece's statement with ``$piece`` and ``$pieces`` written in as integer literals: DuckDB pushes
    ``hash(node_id) % 15 = 3`` into the table scan, but not the same filter with parameters, and then every
    piece paid for the whole fleet's rows (a 200-node piece of 2,000 nodes: 3.9 s with parameters, 0.3 s
    with literals). Both are integers the analyzer computed, so nothing from outside enters the SQL text."""
    values = {"piece": int(piece), "pieces": int(pieces)}
    return _PIECE.sub(lambda m: str(values[m.group(1)]), stmt)

