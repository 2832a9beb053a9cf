"""Parsers for values a user types (config files, environment variables, CLI flags), and the one text form
of a fabric run's settings that every side writes."""

from __future__ import annotations

from typing import Any, Mapping

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})


def parse_bool(value: Any) -> bool | None:
    """True/False for a bool or one of the words above (any case); None when it is neither.

    Callers turn None into their own one-sentence error naming the key, so this never raises.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    s = str(value).strip().lower()
    if s in TRUE_WORDS:
        return True
    if s in FALSE_WORDS:
        return False
    return None


def settings_key(params: Mapping[str, Any]) -> str:
    """A fabric run's settings as canonical ``k=v,...`` text, keys sorted. Both ends of a run (agent/probing/fabric.py),
    the collector's own skipped rows (collector/fabric/coordinator.py) and the simulator write it to
    link_results / group_results ``params_key``, where equal text means comparable runs: so one function."""
    return ",".join(f"{k}={params[k]}" for k in sorted(params))
