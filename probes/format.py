"""Readable rendering of a probe result (the CLI's and `python -m gpuagent.probes` without --json)."""

from __future__ import annotations

from typing import Any, Mapping


def _fmt(v: float) -> str:
    if v == 0 or 0.01 <= abs(v) < 1e6:
        return f"{v:,.3f}".rstrip("0").rstrip(".") if abs(v) < 100 else f"{v:,.1f}"
    return f"{v:.3g}"


def format_result(d: Mapping[str, Any]) -> str:
    lines = [f"probe   {d['probe']}", f"status  {d['status']}"]
    if d.get("reason"):
        lines.append(f"reason  {d['reason']}")
    started, ended = d.get("started_ns") or 0, d.get("ended_ns") or 0
    lines.append(f"time    {d.get('started_at', '')}  ({(ended - started) / 1e9:.2f} s)")
    if d.get("params"):
        lines.append("params  " + " ".join(f"{k}={v}" for k, v in sorted(d["params"].items())))
    per_gpu = d.get("per_gpu") or []
    if per_gpu:
        names = sorted({m for g in per_gpu for m in g.get("metrics", {})})
        head = ["metric"] + [f"gpu{g['gpu']}" for g in per_gpu]
        rows = [[m] + [_fmt(g["metrics"][m]) if m in g.get("metrics", {}) else "-" for g in per_gpu]
                for m in names]
        for g in per_gpu:
            if g.get("status", "ok") != "ok" or g.get("reason"):
                lines.append(f"gpu{g['gpu']}    {g.get('status', 'ok')}: {g.get('reason', '')}")
    else:
        head = ["metric", "value"]
        rows = [[m, _fmt(v)] for m, v in sorted(d.get("metrics", {}).items())]
    if rows:
        widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
        lines.append("")
        lines.append("  ".join([head[0].ljust(widths[0])] + [h.rjust(w) for h, w in zip(head[1:], widths[1:])]))
        for r in rows:
            lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
    env = d.get("env") or {}
    if env:
        lines.append("")
        lines.append("env     " + " ".join(f"{k}={v}" for k, v in sorted(env.items())))
    return "\n".join(lines)
