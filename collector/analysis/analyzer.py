"""The analyzer: turns stored telemetry into flags (virtualization overhead, noisy neighbors, utilization gaps).

All logic is plain SQL in ``collector/analysis/sql/``, run on one DuckDB connection in the order of
``steps.STEPS``: incremental 1-minute rollups first (``rollups.py``), then one file per flag kind writing
*conditions*, then one step that opens, updates and closes rows of ``flags``. This module runs a pass: it
prepares parameters and the small lookup tables (the components of ``components.py`` with the thresholds of
``settings.py``, the reference baselines of ``reference.py``, declared baselines, prices), runs each step's
statements (``sql_files.py``) in a transaction of its own, and records a failed step (``failures.py``).

The collector's single-writer rule holds: inside the collector, a pass runs on the writer's connection
(``Writer.call``; each step is a transaction of its own); ``analyze_db`` runs a pass on a database file no collector
holds.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from gpuagent.collector.analysis import rollups, sql_files
from gpuagent.collector.analysis.components import COMPONENTS
from gpuagent.collector.analysis.errors import AnalyzerError
from gpuagent.collector.analysis.failures import record_failures, record_step_conditions, step_error
from gpuagent.collector.analysis.reference import load_reference
from gpuagent.collector.analysis.settings import AnalyzerConfig
from gpuagent.collector.analysis.sql_files import load_sql
from gpuagent.collector.analysis.steps import BASELINE, FINDINGS, FLAGS, STEPS, Step, pass_steps
from gpuagent.common import hardware_faults
from gpuagent.common.background import BackgroundThread
from gpuagent.common.errors import first_line
from gpuagent.common.sql_rows import insert_rows
from gpuagent.common.timeutil import utc_now

log = logging.getLogger("gpuagent.collector.analysis.analyzer")

def _hw_params() -> dict[str, Any]:
    """The hardware_fault step's scalar settings, from common/hardware_faults.toml."""
    rs = hardware_faults.rules()
    return {"hw_boot_kind": rs.reboot_event_kind, "hw_grace_s": rs.reboot_grace_s, "hw_settle_s": rs.reboot_state_settle_s, "hw_dedup_s": rs.dedup_window_s,
            "hw_app_count": rs.application_repeat_count, "hw_app_window_s": rs.application_repeat_window_s,
            "hw_app_burst_s": rs.application_burst_s, "hw_min_cover_s": rs.min_cover_s,
            "hw_xid_default_action": rs.xid_default.action, "hw_xid_default_severity": rs.xid_default.severity,
            "hw_xid_source": rs.xid_default.source}



# ----------------------------------------------------------------------------------------------- analyzer

@dataclass(frozen=True)
class PassResult:
    """What one analysis pass did; also written to analysis_runs."""

    now: dt.datetime
    rollup_rows_in: int
    rollup_s: float
    flags_s: float
    conditions: int
    opened: int
    updated: int
    closed: int
    step_s: Mapping[str, float] = field(default_factory=dict)   # seconds per analysis SQL file
    findings_opened: int = 0
    findings_closed: int = 0
    failed: Mapping[str, str] = field(default_factory=dict)     # step (SQL file, or 'rollup') -> why it failed

    @property
    def total_s(self) -> float:
        return self.rollup_s + self.flags_s

    def as_dict(self) -> dict[str, Any]:
        return {"now": self.now.isoformat(), "rollup_rows_in": self.rollup_rows_in,
                "rollup_s": round(self.rollup_s, 4), "flags_s": round(self.flags_s, 4),
                "total_s": round(self.total_s, 4), "conditions": self.conditions, "opened": self.opened,
                "updated": self.updated, "closed": self.closed,
                "findings_opened": self.findings_opened, "findings_closed": self.findings_closed,
                "step_s": {k: round(v, 4) for k, v in self.step_s.items()}, "failed_steps": dict(self.failed)}

class Analyzer:
    """Runs analysis passes on a connection that may write (the writer's)."""

    def __init__(self, config: AnalyzerConfig | None = None,
                 baselines_loader: Callable[[Any, dt.datetime], int] | None = None):
        """``baselines_loader(con, now)``, when given, fills fleet_baselines (and the class noise medians,
        _nn_fleet_lake) in place of the baseline step: a shard of a larger fleet takes what needs the whole
        fleet from the lake (collector/lake/fleet.py)."""
        self.config = config or AnalyzerConfig()
        self.baselines_loader = baselines_loader
        self.reference = load_reference(self.config.reference_path)
        try:
            hardware_faults.rules()
        except hardware_faults.RulesError as exc:
            raise AnalyzerError(str(exc).rstrip(".")) from None
        self.sql = load_sql()
        # Which steps' temp tables each step's SQL names, worked out from the SQL files: a table name is a
        # whole word of the SQL. (One regex search per table and step cost 0.14 CPU-s per Analyzer, and tests
        # and the CLI make hundreds; the words of each step once cost a few ms.)
        tables = {t for st in STEPS for t in st.temp_tables}
        self._reads = {st.name: tables & set(re.findall(r"\w+", "\n".join(self.sql[st.name]))) for st in STEPS}

    def _needs_failed(self, step: Step, failed: Mapping[str, str]) -> tuple[str, str] | None:
        """(table, step file) when the step reads a temp table of an earlier step that failed this pass."""
        for earlier in STEPS[:STEPS.index(step)]:
            if earlier.sql_file in failed:
                for t in earlier.temp_tables:
                    if t in self._reads[step.name]:
                        return t, earlier.sql_file
        return None

    def _done_with(self, step: Step) -> tuple[str, ...]:
        """The step's temp tables that no later step's SQL names: dropped as soon as the step is done, so a
        pass holds (in memory, or spilled) only what is still to be read, not every step's intermediates."""
        later = set().union(*(self._reads[st.name] for st in STEPS[STEPS.index(step) + 1:]))
        return tuple(t for t in step.temp_tables if t not in later)

    # -- rollups -----------------------------------------------------------------------------------------

    def rollup(self, con) -> int:
        """Bring samples_1m and job_samples_1m up to date; returns the raw rows read (rollups.py)."""
        return rollups.rollup(con, self.sql, self.config.rollup_chunk_rows)

    # -- flags -------------------------------------------------------------------------------------------

    def _lookup_tables(self, con) -> None:
        cfg = self.config
        con.execute("""CREATE OR REPLACE TEMP TABLE _components (kind VARCHAR, component VARCHAR, probe VARCHAR,
            metric VARCHAR, better VARCHAR, per_gpu BOOLEAN, threshold DOUBLE, critical DOUBLE, label VARCHAR,
            unit VARCHAR, unit_label VARCHAR, advice VARCHAR)""")
        rows = []
        for c in COMPONENTS:
            thr = float(cfg.thresholds.get(f"{c.kind}.{c.component}", c.threshold))
            crit = max(c.critical, thr)
            rows.append([c.kind, c.component, c.probe, c.metric, c.better, c.per_gpu, thr, crit, c.label,
                         c.unit, c.unit_label, c.advice])
        insert_rows(con, "_components", rows)
        con.execute("""CREATE OR REPLACE TEMP TABLE _ref_baselines (component VARCHAR, gpu_model_like VARCHAR,
            pcie_gen INTEGER, pcie_width INTEGER, params_like VARCHAR, value DOUBLE, unit VARCHAR, basis VARCHAR,
            source VARCHAR, link_mbits INTEGER)""")
        if self.reference:
            insert_rows(con, "_ref_baselines", [
                [r["component"], r.get("gpu_model_like"), r.get("pcie_gen"), r.get("pcie_width"),
                 r.get("params_like"), float(r["value"]), r["unit"], r["basis"], r["source"], r.get("link_mbits")]
                for r in self.reference])
        con.execute("""CREATE OR REPLACE TEMP TABLE _declared_baselines (component VARCHAR, gpu_model_like VARCHAR,
            params_like VARCHAR, value DOUBLE, note VARCHAR)""")
        if cfg.declared:
            insert_rows(con, "_declared_baselines", [
                [d.component, d.gpu_model_like, d.params_like, d.value, d.note] for d in cfg.declared])
        # hardware_fault (70_hardware_fault.sql): the rules of common/hardware_faults.toml, the node's too.
        con.execute("""CREATE OR REPLACE TEMP TABLE _hw_rules (name VARCHAR, component VARCHAR, metric VARCHAR,
            kind VARCHAR, severity VARCHAR, action VARCHAR, source VARCHAR, sentence VARCHAR, label_key VARCHAR,
            label_value VARCHAR, op VARCHAR, value DOUBLE, threshold_per_hour DOUBLE, threshold_share DOUBLE, max_metric VARCHAR,
            load_metric VARCHAR, load_min DOUBLE, reboot_explains BOOLEAN, also_metric VARCHAR, also_op VARCHAR,
            also_value DOUBLE)""")
        insert_rows(con, "_hw_rules", [list(r.values()) for r in hardware_faults.rule_rows()])
        con.execute("""CREATE OR REPLACE TEMP TABLE _hw_xids (kind VARCHAR, xid INTEGER, component VARCHAR,
            severity VARCHAR, application BOOLEAN, description VARCHAR, action VARCHAR, source VARCHAR,
            attr_key VARCHAR, attr_value VARCHAR, immediate VARCHAR, investigatory VARCHAR, repeat_action VARCHAR)""")
        insert_rows(con, "_hw_xids", [list(r.values()) for r in hardware_faults.xid_rows()])
        con.execute("CREATE OR REPLACE TEMP TABLE _pool_prices (pool VARCHAR, price_per_gpu_hour DOUBLE)")
        if cfg.pool_prices:
            insert_rows(con, "_pool_prices", list(cfg.pool_prices.items()))
        # The whole fleet's noise medians per class, for a shard: the lake loader fills it (collector/lake/fleet.py).
        con.execute("""CREATE OR REPLACE TEMP TABLE _nn_fleet_lake (component VARCHAR, peer_key VARCHAR,
            fleet_cv DOUBLE, nodes BIGINT)""")
        con.execute("""CREATE OR REPLACE TEMP TABLE _conditions (node_id VARCHAR, gpu SMALLINT, kind VARCHAR,
            component VARCHAR, severity VARCHAR, value DOUBLE, unit VARCHAR, baseline DOUBLE,
            baseline_source VARCHAR, evidence VARCHAR, sentence VARCHAR)""")
        con.execute("""CREATE OR REPLACE TEMP TABLE _evaluated (node_id VARCHAR, gpu SMALLINT, kind VARCHAR,
            component VARCHAR)""")
        con.execute("""CREATE OR REPLACE TEMP MACRO _fmt(x) AS CASE WHEN x IS NULL THEN 'n/a'
            WHEN abs(x) >= 100 THEN printf('%.0f', x) WHEN abs(x) >= 1 THEN printf('%.1f', x)
            ELSE printf('%.2f', x) END""")
        con.execute("""CREATE OR REPLACE TEMP MACRO _holds(op, a, b) AS CASE op WHEN 'eq' THEN a = b
            WHEN 'ne' THEN a <> b WHEN 'lt' THEN a < b WHEN 'ge' THEN a >= b WHEN 'gt' THEN a > b END""")
        con.execute("""CREATE OR REPLACE TEMP MACRO _num(x) AS CASE WHEN x IS NOT NULL AND x = round(x)
            THEN printf('%.0f', x) ELSE _fmt(x) END""")
        con.execute("""CREATE OR REPLACE TEMP MACRO _hours(h) AS CASE WHEN h >= 1 AND h = round(h) THEN printf('%.0f h', h)
            WHEN h >= 1 THEN printf('%.1f h', h) ELSE printf('%.0f min', h * 60) END""")

    def _baselines_stale(self, con, now: dt.datetime) -> bool:
        """Fleet baselines are recomputed when older than baseline_refresh (or computed for a later time)."""
        last = con.execute("SELECT max(computed_at) FROM fleet_baselines").fetchone()[0]
        return (last is None or last > now
                or (now - last).total_seconds() >= self.config.baseline_refresh_s)

    def params(self, now: dt.datetime) -> dict[str, Any]:
        cfg = self.config
        return {
            "now": now,
            "window_start": now - dt.timedelta(seconds=cfg.window_s),
            "probe_window_start": now - dt.timedelta(seconds=cfg.probe_window_s),
            "lookback_start": now - dt.timedelta(seconds=cfg.baseline_lookback_s),
            "hw_app_start": now - dt.timedelta(seconds=hardware_faults.rules().application_repeat_window_s),
            "window_hours": cfg.window_s / 3600.0, "probe_window_hours": round(cfg.probe_window_s / 3600.0, 3),
            "min_baseline_nodes": cfg.min_baseline_nodes,
            "theoretical_threshold": cfg.theoretical_threshold_percent, "vo_z": cfg.significance_z,
            "vo_min_runs": cfg.vo_min_runs,
            "min_runs": cfg.min_runs, "noise_k": cfg.noise_k, "min_fleet_nodes": cfg.min_fleet_nodes,
            "corr_steal": cfg.corroboration_steal_percent, "corr_psi": cfg.corroboration_psi_percent,
            "neighbour_cpu": cfg.neighbour_cpu_percent, "neighbour_io": cfg.neighbour_io_mb_per_s,
            "neighbour_net": cfg.neighbour_net_mb_per_s, "net_slowdown": cfg.neighbour_net_slowdown,
            "job_warmup_s": cfg.job_warmup_s,
            "job_winddown_s": cfg.job_winddown_s, "psi_rise": cfg.corroboration_psi_percent / 2,
            "min_minutes": cfg.min_minutes, "idle_util": cfg.idle_util_percent,
            "input_util": cfg.input_bound_util_percent, "data_wait": cfg.data_wait_fraction,
            "iowait": cfg.iowait_percent, "cpu_busy": cfg.cpu_busy_percent, "gap_fraction": cfg.gap_fraction,
            "pool_fraction": cfg.pool_finding_fraction, "pool_min_nodes": cfg.pool_finding_min_nodes,
            "fabric_runs": cfg.fabric_runs, "fabric_slow_fraction": cfg.fabric_slow_fraction,
            "fabric_min_links": cfg.fabric_min_links,
            "path_window_start": now - dt.timedelta(seconds=cfg.path_window_s),
            "path_min_reporters": cfg.path_min_reporters, "path_link_reports": cfg.path_link_reports, "path_loss_floor": cfg.path_loss_floor,
            "path_late_factor": cfg.path_late_factor, "path_late_floor_us": cfg.path_late_floor_us,
            **_hw_params(),
        }

    def run_pass(self, con, now: dt.datetime | None = None) -> PassResult:
        """One pass: rollups, then every flag kind, then the flags table and findings.

        Each step runs in a transaction of its own (call with none open). A step that fails is rolled back
        alone and the other kinds still run: its open flags stay as they were, the failure is kept in
        analysis_failures, as an ``analysis_step_failed`` event and as an ``analysis_incomplete`` flag
        (so a finding says which step could not run, and why), and the next pass tries it again. Only a
        failure of the final step (flags, findings) fails the pass, after recording it."""
        now = now or utc_now()
        failed: dict[str, str] = {}
        t0 = time.perf_counter()
        try:
            rows_in = run_in_transaction(con, self.rollup)
        except Exception as exc:  # noqa: BLE001 - recorded; the flag steps read the rollups as they are
            rows_in = 0
            failed["rollup"] = step_error("rollup", exc)
        t1 = time.perf_counter()
        # The nodes are counted once a pass: every by_node step's pieces come from that one count.
        params = {**self.params(now), "node_pieces": self.node_pieces(con)}
        self._lookup_tables(con)
        counts: dict[str, int] = {}
        step_s: dict[str, float] = {}
        skipped_kinds: set[str] = set()
        ran: list[Step] = []
        final: list[Step] = []
        for step in pass_steps():
            if step.produces in (FLAGS, FINDINGS):
                final.append(step)
                continue
            if step.produces == BASELINE and self.baselines_loader is None and not self._baselines_stale(con, now):
                continue
            ts = time.perf_counter()
            try:
                needs = self._needs_failed(step, failed)
                if needs:
                    raise AnalyzerError(f"not run: it reads {needs[0]} of {needs[1]}, which failed this pass")
                if step.produces == BASELINE and self.baselines_loader is not None:
                    run_in_transaction(con, lambda c: self.baselines_loader(c, now))
                    step_s["fleet_baselines (lake)"] = time.perf_counter() - ts
                    ran.append(step)        # it stands in for the step: a failure of it closes when it runs
                    continue
                counts.update(run_in_transaction(con, lambda c, st=step: self._run_step(c, st, params)))
                ran.append(step)
                for table in self._done_with(step):
                    con.execute(f"DROP TABLE IF EXISTS {table}")
            except Exception as exc:  # noqa: BLE001 - this step alone is rolled back; the others go on
                failed[step.sql_file] = step_error(step.sql_file, exc)
                if step.kind:
                    skipped_kinds.update((step.kind, *step.also_kinds))
                log.error("analysis step %s failed (rolled back; the other steps go on): %s", step.sql_file,
                          failed[step.sql_file])
            step_s[step.sql_file] = time.perf_counter() - ts

        current = [final[0].sql_file]      # the final step running, for the failure's name

        def finish(c) -> int:
            record_step_conditions(c, ran, failed, skipped_kinds)
            for step in final:
                current[0] = step.sql_file
                ts = time.perf_counter()
                counts.update(self._run_step(c, step, params))
                step_s[step.sql_file] = time.perf_counter() - ts
            n = c.execute("SELECT count(*) FROM _conditions").fetchone()[0]
            record_failures(c, now, failed)
            return int(n)

        try:
            conditions = run_in_transaction(con, finish)
        except Exception as exc:
            failed[current[0]] = step_error(current[0], exc)
            run_in_transaction(con, lambda c: record_failures(c, now, failed))
            raise AnalyzerError(f"analysis pass could not update the flags: {first_line(exc)}") from exc
        t2 = time.perf_counter()
        result = PassResult(now, rows_in, t1 - t0, t2 - t1, conditions,
                            counts.get("opened", 0), counts.get("updated", 0), counts.get("closed", 0), step_s,
                            counts.get("findings_opened", 0), counts.get("findings_closed", 0), failed)
        con.execute("INSERT INTO analysis_runs VALUES (?,?,?,?,?,?,?,?,?,?,?)", [
            now, utc_now(), self.config.window_s, rows_in, result.rollup_s, result.flags_s, result.conditions,
            result.opened, result.updated, result.closed, len(failed)])
        # Temp tables live as long as the connection, which inside the collector is the writer's: free them.
        for table in (*(t for step in STEPS for t in step.temp_tables), "_skipped_kinds"):
            con.execute(f"DROP TABLE IF EXISTS {table}")
        return result

    def pieces(self, con, step: Step, node_pieces: int | None = None) -> int:
        """How many pieces of nodes the step runs in (1 unless it is by_node)."""
        if not step.by_node:
            return 1
        return math.ceil((node_pieces or self.node_pieces(con)) / step.piece_scale)

    def node_pieces(self, con) -> int:
        """How many pieces of nodes the by_node steps run in: 1, or enough that none has over piece_nodes."""
        nodes = con.execute("SELECT count(*) FROM nodes").fetchone()[0]
        return max(1, math.ceil(nodes / self.config.piece_nodes))

    def _run_step(self, con, step: Step, params: Mapping[str, Any]) -> dict[str, int]:
        """Run one step's statements (once per piece of nodes for a by_node step); returns the row counts of
        the result columns it declares."""
        counts: dict[str, int] = {}
        pieces = self.pieces(con, step, params.get("node_pieces"))
        if step.by_node:
            # A context step's pieces append to its tables (CREATE TEMP TABLE IF NOT EXISTS, then INSERT):
            # start from none, whatever an earlier pass that stopped short left behind.
            for table in step.temp_tables:
                con.execute(f"DROP TABLE IF EXISTS {table}")
        once, each = sql_files.once_and_each_piece(self.sql[step.name])   # load_sql: only by_node steps part them
        runs = [(None, stmt) for stmt in once] + [(piece, stmt) for piece in range(pieces) for stmt in each]
        for piece, stmt in runs:
            try:
                text = sql_files.piece_literals(stmt, piece, pieces) if step.by_node else stmt
                res = sql_files.run_statement(con, text, params)
            except Exception as exc:  # a bug in our SQL: name the file so it can be found
                where = ("before the pieces: " if piece is None
                         else f"piece {piece + 1} of {pieces} of the nodes: " if pieces > 1 else "")
                raise AnalyzerError(f"analysis step {step.sql_file} failed: {where}{exc}") from exc
            column = res.description[0][0] if res.description else None
            if column in step.counts:
                counts[column] = len(res.fetchall())
        missing = [name for name in step.counts if name not in counts]
        if missing:
            raise AnalyzerError(f"analysis step {step.sql_file} returned no {missing[0]!r} column")
        return counts


# ----------------------------------------------------------------------------------------------- entry points

def run_in_transaction(con, fn: Callable[[Any], Any]):
    """Run fn(con) inside one transaction on a connection this code owns (no collector running)."""
    con.execute("BEGIN TRANSACTION")
    try:
        out = fn(con)
    except BaseException:
        con.execute("ROLLBACK")
        raise
    con.execute("COMMIT")
    return out


def analyze_db(path: str | Path, config: AnalyzerConfig | None = None,
               now: dt.datetime | None = None,
               baselines_loader: Callable[[Any, dt.datetime], int] | None = None,
               memory_limit: str | None = None) -> PassResult:
    """One pass directly on a database file (the collector must be stopped: DuckDB allows one writer).

    The file is opened and migrated the way the collector opens it, so the pass runs as it would there: at
    the collector's memory limit unless ``memory_limit`` says otherwise (DuckDB's own default is 80 % of
    the machine's memory: a 30,000-node pass grew to 16 GB with it).
    """
    from gpuagent.collector.store import db  # noqa: PLC0415 - the collector extra

    path = Path(path)
    if not path.exists():   # open_database would create it
        raise AnalyzerError(f"database {path} does not exist")
    try:
        con = db.open_database(path, memory_limit or db.DEFAULT_MEMORY_LIMIT)
    except db.DatabaseError as exc:
        raise AnalyzerError(f"{exc}{_LIVE_HINT}") from None
    try:
        analyzer = Analyzer(config, baselines_loader)
        return analyzer.run_pass(con, now)
    finally:
        con.close()


# store.db words why a file cannot be opened; what to do instead is this command's to say.
_LIVE_HINT = "; a database held by a running collector is analysed with `gpuagent-collector analyze --target HOST:PORT`"


def open_flags_in(path: str | Path, limit: int = 1000) -> list[dict[str, Any]]:
    """Open flags of a database file no collector holds (read-only)."""
    from gpuagent.collector.store import db  # noqa: PLC0415

    try:
        con = db.open_readonly(path)
    except db.DatabaseError as exc:
        raise AnalyzerError(f"{exc}{_LIVE_HINT}") from None
    try:
        return open_flags(con, limit)
    finally:
        con.close()


def open_flags(con, limit: int = 1000) -> list[dict[str, Any]]:
    """Open flags, worst first, as dicts (for the CLI and the RPC)."""
    cur = con.execute("SELECT * FROM v_open_flags LIMIT ?", [limit])
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


def open_findings_in(path: str | Path, limit: int = 1000) -> list[dict[str, Any]]:
    """Open findings of a database file no collector holds (read-only)."""
    from gpuagent.collector.store import db  # noqa: PLC0415

    try:
        con = db.open_readonly(path)
    except db.DatabaseError as exc:
        raise AnalyzerError(f"{exc}{_LIVE_HINT}") from None
    try:
        return open_findings(con, limit)
    finally:
        con.close()


FINDINGS_SQL = "SELECT * FROM v_open_findings LIMIT {limit}"


def open_findings(con, limit: int = 1000) -> list[dict[str, Any]]:
    """Open findings, worst first, as dicts."""
    cur = con.execute(FINDINGS_SQL.format(limit=int(limit)))
    cols = [d[0] for d in cur.description]
    return [dict(zip(cols, row)) for row in cur.fetchall()]


class AnalyzerThread:
    """Runs a pass every ``interval_s`` through ``submit`` (a transaction on the writer) until stopped."""

    def __init__(self, analyzer: Analyzer, submit: Callable[[Callable[[Any], Any]], Any],
                 on_error: Callable[[BaseException], None] | None = None):
        self.analyzer = analyzer
        self._submit = submit
        self._on_error = on_error
        self._worker = BackgroundThread("analyzer", self._loop)
        self._stop = self._worker.stopping
        self.last: PassResult | None = None
        self.last_error: str | None = None
        self.passes = 0

    def start(self) -> "AnalyzerThread":
        self._worker.start()
        return self

    def run_once(self) -> PassResult:
        result = self._submit(self.analyzer.run_pass)
        self.last, self.passes = result, self.passes + 1
        return result

    def _loop(self) -> None:
        while not self._stop.wait(self.analyzer.config.interval_s):
            try:
                self.run_once()
                self.last_error = None
            except Exception as exc:  # keep analysing next interval; the collector keeps ingesting
                self.last_error = str(exc)
                if self._on_error:
                    self._on_error(exc)

    def stop(self, timeout: float = 30.0) -> None:
        self._worker.stop(timeout)


def with_window(config: AnalyzerConfig, window_s: float) -> AnalyzerConfig:
    """An on-demand pass over one window: samples and probe runs alike (`analyze --window`)."""
    return replace(config, window_s=window_s, probe_window_s=window_s)


def dumps(obj: Any) -> str:
    return json.dumps(obj, default=str, sort_keys=True)
