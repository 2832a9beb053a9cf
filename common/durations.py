"""Durations as people write them ("90s", "5m", "1h", "2d" or a number of seconds), read one way everywhere.

The collector's config ([analyzer], [lake], [storage], [actions]) and its commands (`analyze --window`,
`lake export --grace`) take the same spelling, so the parser lives one floor down with its own error;
callers add the section and key to the sentence.
"""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|min|h|d)?\s*$")
_UNIT_S = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


class DurationError(ValueError):
    """A duration that cannot be read or is not positive; the message is one sentence."""


def parse_duration(text: str | float | int) -> float:
    """'90s', '5m', '1h', '2d' or a number of seconds -> seconds."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _DURATION.match(str(text))
        if not m:
            raise DurationError(f"cannot read duration {text!r}: use a number of seconds or e.g. 90s, 5m, 1h, 2d")
        value = float(m.group(1)) * _UNIT_S[m.group(2)]
    if value <= 0:
        raise DurationError(f"duration {text!r} must be positive")
    return value
