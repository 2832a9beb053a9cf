"""``[actions]`` of the collector config: what a finding does to Slurm, and the circuit breaker around it.

Off by default; on, dry-run by default (the collector records what it would have done). docs/ACTIONS.md.
``collector/config.py`` hands it the [actions] table; its error is one of collector.toml's errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gpuagent.collector.config_file import CollectorConfigError, read_toml
from gpuagent.common.durations import DurationError, parse_duration

MODES = ("dry-run", "enforce")
ACTIONS = ("drain", "alert")
SEVERITIES = ("critical", "warning", "info")
# Flag kinds the analysis writes (collector/analysis/sql/*); a policy key naming another kind is a typo.
KINDS = ("virtualization_overhead", "noisy_neighbor_variance", "utilization_gap", "network_degraded",
         "hardware_fault")
DEFAULT_POLICY = {"hardware_fault.critical": "drain"}   # everything else: alert
KEYS = ("enabled", "mode", "policy", "max_nodes", "max_pool_percent", "max_drains_per_hour", "scontrol",
        "scontrol_timeout", "slurmrestd_url", "reason_prefix")


class ActionsError(CollectorConfigError):
    """A bad [actions] setting; the message is one sentence."""


@dataclass(frozen=True)
class ActionsConfig:
    enabled: bool = False
    mode: str = "dry-run"
    policy: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_POLICY))
    max_nodes: int = 1                 # nodes drained by gpuagent at once (the whole collector)
    max_pool_percent: float = 10.0     # of a pool's nodes drained by gpuagent at once
    max_drains_per_hour: int = 2
    scontrol: str = "scontrol"
    scontrol_timeout_s: float = 10.0
    reason_prefix: str = "gpuagent: "

    @property
    def enforce(self) -> bool:
        return self.mode == "enforce"

    def action_for(self, kind: str, severity: str) -> str:
        """The policy's action for a finding: ``kind.severity`` first, then ``kind``, else alert."""
        return self.rule_for(kind, severity)[0]

    def rule_for(self, kind: str, severity: str) -> tuple[str, str]:
        """The action and the policy entry that chose it, as the ``actions.rule`` column says it."""
        for key in (f"{kind}.{severity}", kind):
            if key in self.policy:
                return self.policy[key], f"{key} = {self.policy[key]}"
        return "alert", "default alert"

    @classmethod
    def from_mapping(cls, table: Any) -> "ActionsConfig":
        if not isinstance(table, Mapping):
            raise ActionsError("[actions] in the collector config must be a table")
        extra = sorted(set(table) - set(KEYS))
        if extra:
            raise ActionsError(f"unknown key actions.{extra[0]} (known: {', '.join(KEYS)})")
        if table.get("slurmrestd_url"):
            raise ActionsError("actions.slurmrestd_url is not supported yet: leave it unset, the collector drains "
                               "through scontrol")
        kw: dict[str, Any] = {}
        if "enabled" in table:
            if not isinstance(table["enabled"], bool):
                raise ActionsError(f"actions.enabled must be true or false, not {table['enabled']!r}")
            kw["enabled"] = table["enabled"]
        if "mode" in table:
            if table["mode"] not in MODES:
                raise ActionsError(f"actions.mode must be \"dry-run\" or \"enforce\", not {table['mode']!r}")
            kw["mode"] = table["mode"]
        for key in ("max_nodes", "max_drains_per_hour"):
            if key in table:
                v = table[key]
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise ActionsError(f"actions.{key} must be a whole number of 0 or more, not {v!r}")
                kw[key] = v
        if "max_pool_percent" in table:
            v = table["max_pool_percent"]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 100:
                raise ActionsError(f"actions.max_pool_percent must be a number from 0 to 100, not {v!r}")
            kw["max_pool_percent"] = float(v)
        for key, what in (("scontrol", "the scontrol program (a name on PATH or a path)"),
                          ("reason_prefix", "a non-empty string such as \"gpuagent: \"")):
            if key in table:
                if not isinstance(table[key], str) or not table[key].strip():
                    raise ActionsError(f"actions.{key} must be {what}")
                kw[key] = table[key]
        if "scontrol_timeout" in table:
            kw["scontrol_timeout_s"] = _duration(table["scontrol_timeout"])
        if "policy" in table:
            kw["policy"] = _policy(table["policy"])
        return cls(**kw)

    @classmethod
    def from_toml(cls, path: str | Path) -> "ActionsConfig":
        """[actions] of a collector config file; the defaults (off) when it has none (collector/config.py
        reads every section)."""
        return cls.from_document(read_toml(path))

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> "ActionsConfig":
        """[actions] of a parsed collector config; the defaults (off) when it has none."""
        return cls.from_mapping(doc["actions"]) if "actions" in doc else cls()


def _duration(value: Any) -> float:
    try:
        seconds = parse_duration(value)
    except DurationError:
        seconds = -1.0
    if isinstance(value, bool) or not 0 < seconds <= 600:
        raise ActionsError(f"actions.scontrol_timeout must be a duration from 1ms to 10m such as \"10s\", "
                           f"not {value!r}")
    return seconds


def _policy(table: Any) -> dict[str, str]:
    if not isinstance(table, Mapping):
        raise ActionsError("actions.policy must be a table like { \"hardware_fault.critical\" = \"drain\" }")
    out = {}
    for key, action in table.items():
        kind, _, severity = str(key).partition(".")
        if kind not in KINDS or (severity and severity not in SEVERITIES):
            raise ActionsError(f"actions.policy key {key!r} must be a finding kind ({', '.join(KINDS)}), "
                               f"optionally with .critical, .warning or .info")
        if action not in ACTIONS:
            raise ActionsError(f"actions.policy.{key} must be \"drain\" or \"alert\", not {action!r}")
        out[str(key)] = action
    return out
