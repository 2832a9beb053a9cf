"""The analysis steps, in the order a pass runs them: one SQL file in ``collector/analysis/sql/`` each.

The analyzer walks ``STEPS`` and nothing else decides what runs: adding a flag kind is one SQL file that
inserts into ``_conditions`` and ``_evaluated`` plus one ``Step(..., CONDITIONS, ...)`` line before the
``FLAGS`` step. The ``FINDINGS`` step then groups the open flags into one finding per cause.
"""

from __future__ import annotations

from dataclasses import dataclass

# What a step produces, which also says when the analyzer runs it.
ROLLUP = "rollup"          # merges newly appended raw rows of ``source`` into its 1-minute table
CONTEXT = "context"        # temp tables every later step of the pass reads
BASELINE = "baseline"      # fleet_baselines; only run when the stored baselines are stale
CONDITIONS = "conditions"  # rows of _conditions (and _evaluated) for one flag kind
FLAGS = "flags"            # turns _conditions into opened, updated and closed rows of flags
FINDINGS = "findings"      # groups the open flags into findings (one per cause); runs after FLAGS
PRODUCES = (ROLLUP, CONTEXT, BASELINE, CONDITIONS, FLAGS, FINDINGS)


@dataclass(frozen=True)
class Step:
    """One analysis SQL file and what the analyzer needs to know to run it and read its result."""

    name: str
    sql_file: str
    produces: str
    temp_tables: tuple[str, ...] = ()   # created by the SQL; dropped at the end of the pass
    source: str | None = None           # ROLLUP: the raw table read by rowid window
    counts: tuple[str, ...] = ()        # result columns whose row counts the pass reports, read by name
    kind: str | None = None             # CONDITIONS: the flag kind it evaluates (kept open when the step fails)
    also_kinds: tuple[str, ...] = ()    # CONDITIONS: other kinds it writes, kept open alike
    # The analyzer runs the step in pieces of at most AnalyzerConfig.piece_nodes nodes, one after another, so
    # its memory follows the piece, not the fleet. Its SQL keeps a piece's rows with
    # ``hash(<node id>) % $pieces = $piece`` wherever it reads rows, and the analyzer drops its temp tables
    # before the first piece.
    #   CONDITIONS: the step judges each node from that node's rows alone (plus the pass's context tables);
    #     only INSERTs into _conditions and _evaluated outlive a piece (its temp tables are rebuilt by the next).
    #   CONTEXT: each piece appends its rows to the step's tables (CREATE TEMP TABLE IF NOT EXISTS ... LIMIT 0,
    #     then INSERT), so the tables come out as from one statement over all nodes.
    by_node: bool = False
    # A by_node step whose pieces each scan a large stored table runs in pieces of piece_scale x piece_nodes
    # nodes: fewer scans, in exchange for more memory a piece (measured for 50_ in docs/FLAGS.md).
    piece_scale: int = 1
    # ROLLUP: the source is a queue (samples_summary): every row in it is new, and the rollup deletes what it
    # merged, in the same transaction, instead of keeping a watermark
    queue: bool = False
    # ROLLUP: after its own SQL (which fills that step's delta table), run the other statements of this step
    merge_like: str | None = None

    def __post_init__(self) -> None:
        if self.produces not in PRODUCES:
            raise ValueError(f"step {self.name}: produces must be one of {', '.join(PRODUCES)}")
        if (self.produces == ROLLUP) != (self.source is not None):
            raise ValueError(f"step {self.name}: a source table goes with rollup steps and only with them")
        if (self.produces == CONDITIONS) != (self.kind is not None):
            raise ValueError(f"step {self.name}: a flag kind goes with conditions steps and only with them")
        if self.also_kinds and self.kind is None:
            raise ValueError(f"step {self.name}: also_kinds go with a conditions step's kind")
        if self.by_node and self.produces not in (CONDITIONS, CONTEXT):
            raise ValueError(f"step {self.name}: only conditions and context steps run in pieces of nodes")


STEPS: tuple[Step, ...] = (
    Step("rollup_samples", "10_rollup_samples.sql", ROLLUP,
         temp_tables=("_delta_samples", "_merged_samples"), source="samples"),
    Step("rollup_job_samples", "11_rollup_job_samples.sql", ROLLUP,
         temp_tables=("_delta_jobs", "_merged_jobs"), source="job_samples"),
    Step("rollup_summaries", "12_rollup_summaries.sql", ROLLUP,
         temp_tables=("_delta_samples",), source="samples_summary", queue=True,
         merge_like="rollup_samples"),
    Step("node_class", "20_node_class.sql", CONTEXT,
         temp_tables=("_node_class", "_ok_metrics", "_pressure")),
    Step("fleet_baselines", "25_fleet_baselines.sql", BASELINE),
    Step("virtualization_overhead", "30_virtualization_overhead.sql", CONDITIONS, kind="virtualization_overhead",
         also_kinds=("no_baseline",), by_node=True,
         temp_tables=("_vo_runs", "_vo_values", "_vo_pooled", "_vo_fleet", "_vo_ref", "_vo_declared", "_vo", "_vo_scored")),
    Step("noisy_neighbor_variance", "40_noisy_neighbor_variance.sql", CONDITIONS, kind="noisy_neighbor_variance",
         temp_tables=("_nn_points", "_nn_series", "_nn_fleet_local", "_nn_fleet", "_nn")),
    Step("noisy_neighbor_passive", "41_noisy_neighbor_passive.sql", CONDITIONS, kind="noisy_neighbor_variance",
         temp_tables=("_pc_ticks", "_pc_named", "_pc_series", "_pc_episodes", "_pc")),
    Step("utilization_gap", "50_utilization_gap.sql", CONDITIONS, kind="utilization_gap", by_node=True, piece_scale=3,
         temp_tables=("_ug_wait", "_ug", "_ug_dw", "_ug_scored", "_ug_cond")),
    # in pieces of links (each with its lower node id): the per-link window and medians of 30,000 nodes'
    # sweeps did not fit 512 MB in one statement
    Step("network_links", "59_network_links.sql", CONTEXT, by_node=True,
         temp_tables=("_nd_runs", "_nd_links", "_nd_runs_piece", "_nd_links_piece")),
    Step("network_degraded", "60_network_degraded.sql", CONDITIONS, kind="network_degraded",
         temp_tables=("_nd_ends", "_nd_pool", "_nd_ref", "_nd_slow", "_nd_peers",
                      "_nd_node", "_nd_bad_nodes", "_nd_bad_pairs", "_nd_counts")),
    # the cheap layer's summaries and suspect paths (path probes): the node or link that explains them
    Step("path_tomography", "62_path_tomography.sql", CONDITIONS, kind="network_degraded",
         temp_tables=("_pt_runs", "_pt_summary", "_pt_node", "_pt_pool", "_pt_own", "_pt_reports", "_pt_suspects",
                      "_pt_named", "_pt_bad_nodes")),
    # after network_links: reads its _nd_runs
    Step("link_variance", "61_link_variance.sql", CONDITIONS, kind="noisy_neighbor_variance",
         temp_tables=("_lv_links", "_lv_pool", "_lv_net", "_lv")),
    # after network_degraded: adds endpoint port errors to its link conditions; rules: common/hardware_faults.toml
    Step("hardware_fault", "70_hardware_fault.sql", CONDITIONS, kind="hardware_fault",
         temp_tables=("_hw_samples", "_hw_boots", "_hw_series", "_hw_latest", "_hw_load", "_hw_faults", "_hw_events",
                      "_hw_cost", "_hw", "_hw_port_noise", "_hw_link_corr")),
    Step("apply_flags", "90_apply_flags.sql", FLAGS, counts=("updated", "opened", "closed")),
    Step("findings", "95_findings.sql", FINDINGS,
         temp_tables=("_fd_flags", "_fd_pool_nodes", "_fd_pools", "_fd_members", "_fd", "_fd_scored"),
         counts=("findings_updated", "findings_opened", "findings_closed")),
)


def rollup_steps() -> tuple[Step, ...]:
    return tuple(s for s in STEPS if s.produces == ROLLUP)


def pass_steps() -> tuple[Step, ...]:
    """The steps after the rollups, in order."""
    return tuple(s for s in STEPS if s.produces != ROLLUP)
