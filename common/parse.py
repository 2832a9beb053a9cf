"""Parsers for values a user types (config files, environment variables, CLI flags)."""

from __future__ import annotations

from typing import Any

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
