"""The reference baselines (collector/analysis/baselines.toml, or [analyzer] reference_path): theoretical or
measured values per component and hardware class, every row citing its source and basis."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Any

from gpuagent.collector.analysis.components import BASELINE_COMPONENTS
from gpuagent.collector.analysis.errors import AnalyzerError


def load_reference(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The reference baseline rows (collector/analysis/baselines.toml); every row must cite its source."""
    if path is None:
        text = resources.files("gpuagent.collector.analysis").joinpath("baselines.toml").read_text()
        where = "collector/analysis/baselines.toml"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise AnalyzerError(f"cannot read reference baselines {path}: {exc.strerror}") from None
        where = str(path)
    try:
        rows = tomllib.loads(text).get("row", [])
    except tomllib.TOMLDecodeError as exc:
        raise AnalyzerError(f"{where} is not valid TOML: {exc}") from None
    out = []
    for i, row in enumerate(rows):
        for key in ("component", "value", "unit", "basis", "source"):
            if key not in row:
                raise AnalyzerError(f"{where} row {i + 1} lacks {key!r} (every row cites its source and basis)")
        if row["basis"] not in ("theoretical", "measured", "definition"):
            raise AnalyzerError(f"{where} row {i + 1}: basis must be theoretical, measured or definition")
        if row["component"] not in BASELINE_COMPONENTS:
            raise AnalyzerError(f"{where} row {i + 1}: unknown component {row['component']!r} "
                                f"(one of {', '.join(sorted(BASELINE_COMPONENTS))})")
        speed = row.get("link_mbits")
        if speed is not None and (isinstance(speed, bool) or not isinstance(speed, int) or speed <= 0):
            raise AnalyzerError(f"{where} row {i + 1}: link_mbits must be a line rate in whole Mbit/s "
                                f"(100 GbE = 100000), got {speed!r}")
        out.append(row)
    return out
