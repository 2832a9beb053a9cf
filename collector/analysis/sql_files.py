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


# In a step that runs in pieces of nodes (Step.by_node), this line parts the statements that run once per
# pass, before the pieces, from those that run for each piece. A statement above it reads what the step needs
# once and keeps each row's piece (``hash(node_id) % $pieces AS piece``); the pieces then filter that integer.
# Each piece reading (and hashing) the whole input made a pass's scans grow with the square of the fleet.
EACH_PIECE = "-- each piece of nodes:"


def load_sql(steps: tuple[Step, ...] = STEPS) -> dict[str, list[str]]:
    """Statements of each step's SQL file, by step name (EACH_PIECE stays in the list where it stood)."""
    out = {}
    for step in steps:
        entry = _sql_dir().joinpath(step.sql_file)
        if not entry.is_file():
            raise AnalyzerError(f"analysis SQL file {step.sql_file} is missing from the installed package")
        out[step.name] = split_sql(entry.read_text())
        marks = out[step.name].count(EACH_PIECE)
        if marks and (not step.by_node or marks > 1):
            raise AnalyzerError(f"analysis SQL file {step.sql_file}: '{EACH_PIECE}' goes once, and only in a step "
                                "that runs in pieces of nodes")
    return out


def once_and_each_piece(statements: list[str]) -> tuple[list[str], list[str]]:
    """A by_node step's statements that run once before the pieces, and those that run for each piece."""
    if EACH_PIECE not in statements:
        return [], statements
    at = statements.index(EACH_PIECE)
    return statements[:at], statements[at + 1:]


def split_sql(text: str) -> list[str]:
    """Statements of a SQL file: split at ';' that ends a line (comments stripped; no ';' in strings);
    the EACH_PIECE line is kept as a statement of its own."""
    out, cur = [], []
    for ln in text.splitlines():
        if ln.strip() == EACH_PIECE:
            if "\n".join(cur).strip():
                raise AnalyzerError(f"'{EACH_PIECE}' inside a statement: it goes between statements")
            out.append(EACH_PIECE)
            continue
        if ln.lstrip().startswith("--"):
            continue
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


def piece_literals(stmt: str, piece: int | None, pieces: int) -> str:
    """A piece's statement with ``$piece`` and ``$pieces`` written in as integer literals: DuckDB pushes
    ``hash(node_id) % 15 = 3`` into the table scan, but not the same filter with parameters, and then every
    piece paid for the whole fleet's rows (a 200-node piece of 2,000 nodes: 3.9 s with parameters, 0.3 s
    with literals). Both are integers the analyzer computed, so nothing from outside enters the SQL text."""
    values = {"piece": None if piece is None else int(piece), "pieces": int(pieces)}

    def literal(m: re.Match) -> str:
        if values[m.group(1)] is None:     # a statement that runs once, before the pieces
            raise AnalyzerError("$piece in a statement above the pieces: only $pieces is known there")
        return str(values[m.group(1)])
    return _PIECE.sub(literal, stmt)

