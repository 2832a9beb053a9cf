"""Decoding NVLink5 XIDs (144-150, Blackwell / GB200) the way NVIDIA's XID catalog says to.

The catalog puts these XIDs in its WORKFLOW_NVLINK5_ERR bucket: the line
``Xid (PCI:...): <xid>, <unit> <fatal vs nonfatal> <crosscontain> <injected> <link> (<intrInfo> <errorStatus> ...)``
must have its intrInfo and errorStatus decoded with the catalog's "Xid 144-150 Decode" sheet to know the
action. ``nvlink5_decode.csv`` beside this module holds that sheet's facts (per row: XID, unit, the intrInfo
bit pattern for drivers before R575 (v1) and from R575 (v2), the errorStatus bit, the data-center recovery
bucket, the severity, and the "Action 2" pattern and bucket of promotable errors), taken from the catalog's
downloadable spreadsheet (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, as of 2025-10).

Standard library only (gpuagent.common).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

XIDS = frozenset(range(144, 151))
# worst first: what the rules file's nvlink5_severity variants are called
SEVERITIES = ("fatal", "link_fatal", "xid_154_eval", "non_fatal")


@dataclass(frozen=True)
class Row:
    xid: int
    unit: str
    intrinfo: tuple[str, str]      # (v1, v2) 32-character bit patterns, most significant bit first, "-" any
    error_status: int | None       # a bit (matches a status with it set) or a value (matches it); None: any
    bucket: str
    severity: str                  # as the sheet writes it ("Fatal", "Link Fatal", "Non-fatal*", ...)
    action2: tuple[str, str]
    action2_bucket: str


@dataclass(frozen=True)
class Decoded:
    severity: str                  # one of SEVERITIES
    unit: str
    bucket: str                    # the catalog's recovery bucket for this error
    how: str                       # "catalog decode v2", "catalog decode v1" or "message word"


@lru_cache(maxsize=1)
def rows() -> tuple[Row, ...]:
    text = resources.files("gpuagent.common").joinpath("nvlink5_decode.csv").read_text()
    out = []
    for r in csv.DictReader(text.splitlines()):
        out.append(Row(int(r["xid"]), r["unit"], (r["intrinfo_v1"], r["intrinfo_v2"]),
                       _status(r["error_status"]), r["bucket"], r["severity"],
                       (r["action2_intrinfo_v1"], r["action2_intrinfo_v2"]), r["action2_bucket"]))
    return tuple(out)


def _status(text: str) -> int | None:
    """The sheet's Error Status cell: "" or "0x00000000/0xFFFFFFFF" mean any."""
    return None if not text or "/" in text else int(text, 16)


def _status_matches(want: int | None, status: int) -> bool:
    if want is None:
        return True
    if want and want & (want - 1) == 0:       # one bit
        return bool(status & want)
    return status == want


def _matches(pattern: str, value: int) -> bool:
    if not pattern:
        return False
    n = len(pattern)
    return all(c == "-" or int(c) == (value >> (n - 1 - i)) & 1 for i, c in enumerate(pattern))


def _severity(bucket: str, sheet_severity: str) -> str:
    if bucket == "RESET_GPU":
        return "link_fatal" if sheet_severity.lower().startswith("link fatal") else "fatal"
    if bucket == "XID_154_EVAL":
        return "xid_154_eval"
    return "non_fatal"


_HEX = re.compile(r"\((0x[0-9a-fA-F]+)\s+(0x[0-9a-fA-F]+)")
_WORD = re.compile(r"\b(Non-?fatal|Link\s+Fatal|Fatal)\b", re.I)


def decode(xid: int, message: str) -> Decoded | None:
    """The decoded severity of an NVLink5 XID line, None for another XID or a line with neither the two
    registers nor a severity word. The sheet's patterns for drivers from R575 (v2) are tried first, then
    those before it (v1); several errorStatus bits: the worst row among them."""
    if xid not in XIDS:
        return None
    m = _HEX.search(message)
    if m:
        intr, status = int(m.group(1), 16), int(m.group(2), 16)
        for version in (1, 0):            # index into Row.intrinfo: v2 first
            hits = [r for r in rows() if r.xid == xid and _matches(r.intrinfo[version], intr)
                    and _status_matches(r.error_status, status)]
            if hits:
                best = None
                for r in hits:
                    bucket = r.action2_bucket if _matches(r.action2[version], intr) else r.bucket
                    d = Decoded(_severity(bucket, r.severity), r.unit, bucket, f"catalog decode v{version + 1}")
                    if best is None or SEVERITIES.index(d.severity) < SEVERITIES.index(best.severity):
                        best = d
                return best
    w = _WORD.search(message)
    if w:
        word = w.group(1).lower().replace(" ", "")
        sev = "non_fatal" if word.startswith("non") else "link_fatal" if word.startswith("link") else "fatal"
        return Decoded(sev, "", "", "message word")
    return None
