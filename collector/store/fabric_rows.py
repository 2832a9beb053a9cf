"""The link and group rows of one commit: fabric probe runs kept again as ``link_results`` and ``group_results``.

The writer (store/writer.py) runs these INSERTs inside the commit that stores the probe rows, from the
same registered Arrow views, so a fabric run's link or group row is stored exactly when its probe row is.
"""

from __future__ import annotations


# Fabric runs (params carry node_a and node_b, set by the agent's fabric client) are also kept as link rows.
LINK_METRICS = ("send_gbits_per_s", "recv_gbits_per_s", "rtt_p50_us", "rtt_p99_us",   # net_pair
                "write_gbits_per_s", "lat_typical_us",                               # rdma_pair
                "loss_ratio", "train_gbits_per_s")                                   # path_probe suspects


def _metrics_by_run(metrics_view: str | None, names, where: str = "") -> str:
    """One row per probe run with the named metrics as columns, from the commit's metrics (NULLs without)."""
    if metrics_view is None:
        return "SELECT NULL::VARCHAR AS node_id, NULL::VARCHAR AS probe, NULL::VARCHAR AS params_key, " \
               "NULL::TIMESTAMP AS started_at, " + ", ".join(f"NULL::DOUBLE AS {n}" for n in names)
    return ("SELECT node_id, probe, params_key, started_at, "
            + ", ".join(f"max(value) FILTER (WHERE metric = '{n}') AS {n}" for n in names)
            + f" FROM {metrics_view} {where} GROUP BY ALL")


def link_results_sql(results_view: str, metrics_view: str | None) -> str:
    """INSERT INTO link_results from one commit's probe rows (and their metrics, when the commit has any)."""
    metrics = _metrics_by_run(metrics_view, LINK_METRICS)
    return f"""
INSERT INTO link_results (pair_id, node_a, node_b, probe, params_key, {", ".join(LINK_METRICS)}, started_at,
                          ended_at, status, reason, reported_by, nic_speed_mbits)
SELECT json_extract_string(r.params, '$.pair_id'), json_extract_string(r.params, '$.node_a'),
       json_extract_string(r.params, '$.node_b'), r.probe, json_extract_string(r.params, '$.link_params'),
       {", ".join("m." + n for n in LINK_METRICS)}, r.started_at, r.ended_at, r.status, r.reason, r.node_id,
       -- anything but a positive whole number of Mbit/s is an unknown rate
       CASE WHEN try_cast(json_extract_string(r.env, '$.nic_speed_mbits') AS INTEGER) > 0
            THEN try_cast(json_extract_string(r.env, '$.nic_speed_mbits') AS INTEGER) END
FROM {results_view} r
LEFT JOIN ({metrics}) m ON m.node_id = r.node_id AND m.probe = r.probe AND m.started_at = r.started_at
     AND m.params_key IS NOT DISTINCT FROM r.params_key
WHERE json_extract_string(r.params, '$.node_a') IS NOT NULL
  AND json_extract_string(r.params, '$.node_b') IS NOT NULL"""


# Group runs (params carry group_id and members, set by the agent's fabric client) are kept as group rows.
GROUP_METRICS = {"busbw_gbps": "busbw_gbytes_per_s", "algbw_gbps": "algbw_gbytes_per_s",
                 "small_msg_latency_us": "small_msg_latency_us"}


def group_results_sql(results_view: str, metrics_view: str | None) -> str:
    """INSERT INTO group_results from one commit's collective rows that a fabric group round scheduled."""
    metrics = _metrics_by_run(metrics_view, GROUP_METRICS, "WHERE probe = 'collective'")
    members = "json_extract_string(r.params, '$.members')"
    return f"""
INSERT INTO group_results (group_id, members, group_size, node_rank, probe, params_key, backend, world_size,
                           {", ".join(GROUP_METRICS.values())}, largest_bytes, started_at, ended_at, status,
                           reason, reported_by)
SELECT json_extract_string(r.params, '$.group_id'), {members}, len(string_split({members}, ',')),
       try_cast(json_extract_string(r.params, '$.node_rank') AS INTEGER), r.probe,
       json_extract_string(r.params, '$.group_params'), json_extract_string(r.env, '$.backend'),
       try_cast(json_extract_string(r.env, '$.world_size') AS INTEGER),
       {", ".join("m." + n for n in GROUP_METRICS)},
       try_cast(json_extract_string(r.env, '$.largest_bytes') AS BIGINT), r.started_at, r.ended_at, r.status,
       r.reason, r.node_id
FROM {results_view} r
LEFT JOIN ({metrics}) m ON m.node_id = r.node_id AND m.probe = r.probe AND m.started_at = r.started_at
     AND m.params_key IS NOT DISTINCT FROM r.params_key
WHERE r.probe = 'collective' AND {members} IS NOT NULL AND json_extract_string(r.params, '$.group_id') IS NOT NULL"""
