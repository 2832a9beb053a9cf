"""What a failed step leaves behind: an ``analysis_incomplete`` condition (so a flag and a finding say which
step could not run, and why), a row of ``analysis_failures`` and an ``analysis_step_failed`` event; and the
evaluated rows that close those flags once the step runs again."""

from __future__ import annotations

import datetime as dt
import json
from typing import Mapping

from gpuagent.collector.analysis.steps import Step
from gpuagent.common.errors import first_line
from gpuagent.common.sql_rows import insert_rows

# A node id no host can have (parentheses are not allowed in host names): what the collector itself reports.
COLLECTOR_NODE = "(collector)"
INCOMPLETE_KIND = "analysis_incomplete"


def step_error(step: str, exc: BaseException) -> str:
    text = first_line(exc)
    prefix = f"analysis step {step} failed: "
    return text[len(prefix):] if text.startswith(prefix) else text


def record_step_conditions(con, ran: list[Step], failed: Mapping[str, str], skipped_kinds: set[str]) -> None:
    """An analysis_incomplete condition per failed step (it opens a flag, hence a finding) and an evaluated
    row per step that ran (its flag closes); and the kinds whose flags must not close as stale this pass."""
    for step, error in failed.items():
        con.execute("INSERT INTO _conditions VALUES (?, NULL, ?, ?, 'warning', NULL, NULL, NULL, 'none', ?, ?)", [
            COLLECTOR_NODE, INCOMPLETE_KIND, step, json.dumps({"step": step, "error": error}),
            f"analysis could not run step {step}: {error}; its flags are kept as they were and the next pass "
            f"tries again"])
    for step in ran:
        con.execute("INSERT INTO _evaluated VALUES (?, NULL, ?, ?)", [COLLECTOR_NODE, INCOMPLETE_KIND, step.sql_file])
    if "rollup" not in failed:
        con.execute("INSERT INTO _evaluated VALUES (?, NULL, ?, 'rollup')", [COLLECTOR_NODE, INCOMPLETE_KIND])
    con.execute("CREATE OR REPLACE TEMP TABLE _skipped_kinds (kind VARCHAR)")
    if skipped_kinds:
        insert_rows(con, "_skipped_kinds", [[k] for k in sorted(skipped_kinds)])


def record_failures(con, now: dt.datetime, failed: Mapping[str, str]) -> None:
    for step, error in failed.items():
        con.execute("INSERT INTO analysis_failures VALUES (?, ?, ?)", [now, step, error])
        con.execute("INSERT INTO events (ts, node_id, gpu, kind, message, value, attrs) "
                    "VALUES (?, ?, NULL, 'analysis_step_failed', ?, NULL, ?)",
                    [now, COLLECTOR_NODE, f"analysis could not run step {step}: {error}", json.dumps({"step": step})])

