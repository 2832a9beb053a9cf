"""Inline SVG plots for the fleet report, generated in Python so the HTML needs no plotting library.

Three kinds: box + strip (distribution per group), lines over time, and a heatmap (time buckets or a
named matrix such as node × node link rates). Every drawn data
mark carries ``class="mark"`` and a ``<title>`` tooltip, so the report test (and a reader hovering) can
see what was drawn. Empty inputs draw an explanatory text instead of an empty frame.
"""

from __future__ import annotations

import math
import zlib
from datetime import datetime, timezone
from html import escape

PALETTE = ("#3b6fb6", "#d9822b", "#2e9e6b", "#c4455b", "#7d5ba6", "#8c6d46", "#d16ba5", "#6b7b8c")
FONT = 'font-family="system-ui, sans-serif"'


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0, 1.0]
    if hi <= lo:
        hi = lo + (abs(lo) * 0.1 or 1.0)
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    start = math.floor(lo / step) * step
    ticks = []
    t = start
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    if len(ticks) < 2:
        ticks.append(ticks[-1] + step)
    if ticks[-1] < hi:
        ticks.append(ticks[-1] + step)
    return ticks


def tick_label(v: float) -> str:
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    if a >= 100 or v == int(v):
        return f"{v:.0f}"
    return f"{v:.3g}"


def _svg_open(kind: str, plot_id: str, width: int, height: int, title: str) -> list[str]:
    return [f'<svg class="plot plot-{kind}" data-plot="{escape(plot_id)}" xmlns="http://www.w3.org/2000/svg" '
            f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
            f'aria-label="{escape(title)}">',
            f'<text x="{width / 2:.0f}" y="16" text-anchor="middle" font-size="13" font-weight="600" {FONT}>'
            f'{escape(title)}</text>']


def _empty(kind: str, plot_id: str, width: int, height: int, title: str, why: str) -> str:
    parts = _svg_open(kind, plot_id, width, height, title)
    parts.append(f'<text class="empty" x="{width / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle" '
                 f'font-size="12" fill="#777" {FONT}>{escape(why)}</text></svg>')
    return "".join(parts)


def _quantile(sorted_vals: list[float], q: float) -> float:
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = q * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _y_axis(parts: list[str], ticks: list[float], y, x0: float, x1: float, label: str) -> None:
    for t in ticks:
        yy = y(t)
        parts.append(f'<line x1="{x0}" x2="{x1}" y1="{yy:.1f}" y2="{yy:.1f}" stroke="#e3e3e3"/>')
        parts.append(f'<text x="{x0 - 4}" y="{yy + 4:.1f}" text-anchor="end" font-size="10" fill="#555" {FONT}>'
                     f'{tick_label(t)}</text>')
    mid = (y(ticks[0]) + y(ticks[-1])) / 2
    parts.append(f'<text transform="translate(12 {mid:.0f}) rotate(-90)" text-anchor="middle" font-size="10" '
                 f'fill="#555" {FONT}>{escape(label)}</text>')


def box_strip(plot_id: str, title: str, unit: str, groups: list[tuple[str, list[tuple[str, float]]]],
              width: int = 330, height: int = 230, note: str = "") -> str:
    """One box (p25–p75, median line, p10–p90 whiskers) plus jittered points per group.

    ``groups`` is [(group name, [(point label, value), ...]), ...]."""
    groups = [(g, [(lbl, v) for lbl, v in pts if v is not None and math.isfinite(v)]) for g, pts in groups]
    groups = [(g, pts) for g, pts in groups if pts]
    if not groups:
        return _empty("box", plot_id, width, height, title, "no runs in the window")
    vals = [v for _, pts in groups for _, v in pts]
    lo, hi = min(vals), max(vals)
    pad = (hi - lo) * 0.08 or abs(hi) * 0.05 or 1.0
    ticks = nice_ticks(max(0.0, lo - pad) if lo >= 0 else lo - pad, hi + pad)
    left, right, top, bottom = 52, 10, 26, 40
    pw, ph = width - left - right, height - top - bottom

    def y(v: float) -> float:
        return top + ph - (v - ticks[0]) / (ticks[-1] - ticks[0]) * ph

    parts = _svg_open("box", plot_id, width, height, title)
    _y_axis(parts, ticks, y, left, width - right, unit)
    slot = pw / len(groups)
    for i, (g, pts) in enumerate(groups):
        cx = left + slot * (i + 0.5)
        bw = min(46.0, slot * 0.5)
        s = sorted(v for _, v in pts)
        q10, q25, q50, q75, q90 = (_quantile(s, q) for q in (0.1, 0.25, 0.5, 0.75, 0.9))
        c = color(i)
        parts.append(f'<g class="group" data-group="{escape(g)}">')
        parts.append(f'<line class="mark whisker" x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(q90):.1f}" y2="{y(q10):.1f}" '
                     f'stroke="{c}" stroke-width="1.2"/>')
        parts.append(f'<rect class="mark box" x="{cx - bw / 2:.1f}" y="{y(q75):.1f}" width="{bw:.1f}" '
                     f'height="{max(1.0, y(q25) - y(q75)):.1f}" fill="{c}" fill-opacity="0.18" stroke="{c}">'
                     f'<title>{escape(g)}: median {tick_label(q50)} {escape(unit)}, p25–p75 '
                     f'{tick_label(q25)}–{tick_label(q75)}, p10–p90 {tick_label(q10)}–{tick_label(q90)}, '
                     f'{len(s)} nodes</title></rect>')
        parts.append(f'<line class="mark median" x1="{cx - bw / 2:.1f}" x2="{cx + bw / 2:.1f}" y1="{y(q50):.1f}" '
                     f'y2="{y(q50):.1f}" stroke="{c}" stroke-width="2.5"/>')
        for lbl, v in pts:
            jit = ((zlib.crc32(lbl.encode()) % 1000) / 1000.0 - 0.5) * bw * 1.3
            parts.append(f'<circle class="mark point" cx="{cx + jit:.1f}" cy="{y(v):.1f}" r="2.6" fill="{c}" '
                         f'fill-opacity="0.75"><title>{escape(lbl)}: {tick_label(v)} {escape(unit)}</title></circle>')
        parts.append("</g>")
        name = g if len(g) <= 14 else g[:13] + "…"
        parts.append(f'<text x="{cx:.1f}" y="{height - bottom + 14}" text-anchor="middle" font-size="10.5" '
                     f'{FONT}>{escape(name)}</text>')
        parts.append(f'<text x="{cx:.1f}" y="{height - bottom + 26}" text-anchor="middle" font-size="9" '
                     f'fill="#777" {FONT}>n={len(s)}</text>')
    if note:
        parts.append(f'<text x="{width - right}" y="{height - 3}" text-anchor="end" font-size="9" fill="#777" '
                     f'{FONT}>{escape(note)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _time_label(t: float, span: float) -> str:
    d = datetime.fromtimestamp(t, timezone.utc)
    return d.strftime("%m-%d %H:%M") if span > 86400 else d.strftime("%H:%M")


def lines(plot_id: str, title: str, ylabel: str, series: list[tuple[str, list[tuple[float, float]]]],
          reference: float | None = None, width: int = 700, height: int = 280) -> str:
    """Lines over time (x: epoch seconds), one per series, with an optional horizontal reference line."""
    series = [(n, sorted(p for p in pts if p[1] is not None and math.isfinite(p[1]))) for n, pts in series]
    series = [(n, pts) for n, pts in series if pts]
    if not series:
        return _empty("lines", plot_id, width, height, title, "nothing to show in the window")
    xs = [t for _, pts in series for t, _ in pts]
    ys = [v for _, pts in series for _, v in pts] + ([reference] if reference is not None else [])
    x0, x1 = min(xs), max(xs)
    if x1 <= x0:
        x1 = x0 + 60
    ticks = nice_ticks(min(0.0, min(ys)), max(ys) * 1.05)
    left, right, top, bottom = 52, 170, 26, 30
    pw, ph = width - left - right, height - top - bottom

    def x(t: float) -> float:
        return left + (t - x0) / (x1 - x0) * pw

    def y(v: float) -> float:
        return top + ph - (v - ticks[0]) / (ticks[-1] - ticks[0]) * ph

    parts = _svg_open("lines", plot_id, width, height, title)
    _y_axis(parts, ticks, y, left, left + pw, ylabel)
    for k in range(6):
        t = x0 + (x1 - x0) * k / 5
        parts.append(f'<text x="{x(t):.1f}" y="{height - bottom + 14}" text-anchor="middle" font-size="10" '
                     f'fill="#555" {FONT}>{_time_label(t, x1 - x0)}</text>')
    if reference is not None:
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(reference):.1f}" y2="{y(reference):.1f}" '
                     f'stroke="#333" stroke-dasharray="4 3" stroke-width="1"/>')
    for i, (name, pts) in enumerate(series):
        c = color(i)
        d = " ".join(f"{'M' if j == 0 else 'L'}{x(t):.1f},{y(v):.1f}" for j, (t, v) in enumerate(pts))
        parts.append(f'<g class="series" data-series="{escape(name)}">')
        parts.append(f'<path class="mark line" d="{d}" fill="none" stroke="{c}" stroke-width="1.6">'
                     f'<title>{escape(name)}</title></path>')
        if len(pts) <= 200:
            for t, v in pts:
                parts.append(f'<circle class="mark point" cx="{x(t):.1f}" cy="{y(v):.1f}" r="2" fill="{c}">'
                             f'<title>{escape(name)} {_time_label(t, 0)}: {tick_label(v)}</title></circle>')
        parts.append("</g>")
        ly = top + 6 + i * 16
        parts.append(f'<rect x="{left + pw + 12}" y="{ly}" width="10" height="10" fill="{c}"/>'
                     f'<text x="{left + pw + 26}" y="{ly + 9}" font-size="10.5" {FONT}>{escape(name[:26])}</text>')
    parts.append("</svg>")
    return "".join(parts)


# Utilization colour ramp: red (idle) -> amber -> green (busy). Stops chosen for this report.
_RAMP = ((0.0, (200, 50, 45)), (0.5, (245, 200, 90)), (1.0, (40, 150, 90)))


def ramp(frac: float) -> str:
    f = min(1.0, max(0.0, frac))
    for (a, ca), (b, cb) in zip(_RAMP, _RAMP[1:]):
        if f <= b:
            u = (f - a) / (b - a)
            r, g, bl = (round(ca[k] + (cb[k] - ca[k]) * u) for k in range(3))
            return f"#{r:02x}{g:02x}{bl:02x}"
    return "#%02x%02x%02x" % _RAMP[-1][1]


def heatmap(plot_id: str, title: str, rows: list[str], cols: list[float], values: list[list[float | None]],
            bucket_s: float, vmax: float = 100.0, unit: str = "%", width: int = 760,
            col_labels: list[str] | None = None, empty: str = "no GPU utilization samples in the window",
            missing: str = "no data") -> str:
    """Rows × columns cells coloured by value (0..vmax, red to green); None cells stay grey.

    Columns are time buckets (epoch seconds, ``bucket_s`` wide) unless ``col_labels`` names them (a matrix,
    e.g. node × node); then the names are written above the columns and in each cell's tooltip."""
    if not rows or not cols:
        return _empty("heatmap", plot_id, width, 120, title, empty)
    named = col_labels is not None
    top = 26 + (min(90, 6 * max(len(n[:16]) for n in col_labels)) if named else 0)
    left, right, bottom = 96, 60 if unit == "%" else 90, 34 if not named else 12
    cell_h = max(6.0, min(16.0, 520.0 / len(rows)))
    height = int(top + cell_h * len(rows) + bottom)
    pw = width - left - right
    cw = pw / len(cols)
    parts = _svg_open("heatmap", plot_id, width, height, title)
    span = cols[-1] - cols[0] + bucket_s if not named else 0
    fmt = (lambda v: f"{v:.0f} {unit}") if vmax >= 50 else (lambda v: f"{tick_label(v)} {unit}")
    for i, name in enumerate(rows):
        yy = top + i * cell_h
        if cell_h >= 8 or i % 2 == 0:
            parts.append(f'<text x="{left - 4}" y="{yy + cell_h * 0.75:.1f}" text-anchor="end" '
                         f'font-size="{min(10.0, cell_h * 0.8):.1f}" {FONT}>{escape(name[:16])}</text>')
        for j, t in enumerate(cols):
            v = values[i][j]
            fill = "#e6e6e6" if v is None else ramp(v / vmax)
            where = f"{name} × {col_labels[j]}" if named else f"{name} {_time_label(t, span)}"
            tip = f"{where}: " + (missing if v is None else fmt(v))
            cls = "cell" if v is None else "mark cell"
            parts.append(f'<rect class="{cls}" x="{left + j * cw:.1f}" y="{yy:.1f}" width="{cw + 0.3:.1f}" '
                         f'height="{cell_h + 0.3:.1f}" fill="{fill}"><title>{escape(tip)}</title></rect>')
    if named:
        fs = min(10.0, max(5.0, cw * 0.8))
        for j, name in enumerate(col_labels):
            x = left + (j + 0.6) * cw
            parts.append(f'<text class="col-label" transform="translate({x:.1f} {top - 4}) rotate(-60)" '
                         f'font-size="{fs:.1f}" {FONT}>{escape(name[:16])}</text>')
    else:
        step = max(1, math.ceil(len(cols) / 8))
        for j in range(0, len(cols), step):
            parts.append(f'<text x="{left + j * cw:.1f}" y="{height - bottom + 13}" font-size="10" fill="#555" '
                         f'{FONT}>{_time_label(cols[j], span)}</text>')
    lx = left + pw + 14
    for k in range(11):
        parts.append(f'<rect x="{lx}" y="{top + (10 - k) * 12}" width="14" height="12" fill="{ramp(k / 10)}"/>')
    u = escape(unit if unit == "%" else " " + unit)
    parts.append(f'<text x="{lx + 18}" y="{top + 9}" font-size="9" {FONT}>{vmax:g}{u}</text>'
                 f'<text x="{lx + 18}" y="{top + 130}" font-size="9" {FONT}>0{u}</text>')
    parts.append("</svg>")
    return "".join(parts)
