#!/usr/bin/env python3
"""Print docs/HEALTH.md's XID table from common/hardware_faults.toml (the one source): every XID NVIDIA's
catalog lists for A100/H100/B100/GB200, its two resolution buckets, what we do and why where we differ.
tests/test_hardware_fault_flags.py checks that docs/HEALTH.md holds exactly this table."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuagent.common import hardware_faults as hf  # noqa: E402

# How our severity follows the immediate bucket (common/hardware_faults.toml's XID header says the same).
_FROM_BUCKET = {"RESET_GPU": "critical", "RESTART_BM": "critical", "RESTART_VM": "critical",
                "CHECK_MECHANICALS": "critical", "WORKFLOW_XID_48": "critical", "WORKFLOW_NVLINK_ERR": "critical",
                "RESTART_APP": "job's", "WORKFLOW_XID_45": "job's", "IGNORE": "ignore",
                "CONTACT_SUPPORT": "warning", "CHECK_UVM": "warning", "UPDATE_SWFW": "warning",
                "WORKFLOW_NVLINK5_ERR": "by decode", "XID_154": "by action"}


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "/")


def table() -> str:
    rs = hf.rules()
    variants: dict[int, list[str]] = {}
    for v in rs.variants:
        for n in v.xids:
            variants.setdefault(n, []).append(f"{v.value}: {v.severity}")
    out = ["| XID | mnemonic | applies to | catalog: immediate | catalog: investigatory | ours | where we differ, and why |",
           "|---|---|---|---|---|---|---|"]
    for n, x in sorted(rs.xids.items()):
        ours = ("job's, escalated to warning on a repeat" if x.application else x.severity)
        if n in variants:
            ours += " (undecoded); " + ", ".join(variants[n])
        why = x.ours
        if not why and _FROM_BUCKET.get(x.immediate) not in (None, "by decode", "by action") and not x.application \
                and x.severity != _FROM_BUCKET[x.immediate]:
            why = "see common/hardware_faults.toml"
        out.append(f"| {n} | {_cell(x.mnemonic)} | {', '.join(x.applies_to)} | {_cell(x.immediate) or '(none)'} | "
                   f"{_cell(x.investigatory) or '(none)'} | {ours} | {_cell(why) or '—'} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table())
