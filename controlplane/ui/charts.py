"""Server-rendered SVG line charts: no script, no inline style (the console's CSP allows
none), presentation attributes only. Each chart has a text title and label for screen readers;
pages put the numbers in a table beside it where they matter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from markupsafe import Markup, escape

PALETTE = ("#0b5cad", "#b42318", "#176c2f", "#8a5300", "#6639ba", "#0e7490")


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[tuple[datetime, float]]


@dataclass(frozen=True)
class Threshold:
    """A horizontal line (a gate's limit, a rule's threshold)."""

    label: str
    value: float


def _ts(value: datetime) -> float:
    """Seconds since the epoch; the database's naive datetimes are UTC."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    return value.timestamp()


def _nice(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 1:
        return f"{value:.1f}"
    return f"{value:.3g}"


def line_chart(
    title: str,
    series: Sequence[Series],
    *,
    unit: str = "",
    thresholds: Sequence[Threshold] = (),
    width: int = 640,
    height: int = 220,
    y_min: float | None = 0.0,
) -> Markup:
    """An ``<svg>`` line chart of ``series`` over time; an empty-state message without data."""
    points = [p for s in series for p in s.points if math.isfinite(p[1])]
    if not points:
        return Markup('<p class="empty">{}: no data yet.</p>').format(title)
    legend_rows = (len(series) + 2) // 3
    left, right, top, bottom = 56, 12, 26 + 14 * legend_rows, 28
    height += 14 * legend_rows
    xs = [_ts(p[0]) for p in points]
    ys = [p[1] for p in points] + [t.value for t in thresholds]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x1 = x0 + 1
    lo = min(ys) if y_min is None else min(y_min, min(ys))
    hi = max(ys)
    if hi == lo:
        hi = lo + 1
    plot_w, plot_h = width - left - right, height - top - bottom

    def sx(t: float) -> float:
        return left + (t - x0) / (x1 - x0) * plot_w

    def sy(v: float) -> float:
        return top + (1 - (v - lo) / (hi - lo)) * plot_h

    parts = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        f'<text x="{left}" y="14">{escape(title)}{" (" + escape(unit) + ")" if unit else ""}</text>',
        f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#8c959f"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#8c959f"/>',
    ]
    for value in (lo, (lo + hi) / 2, hi):
        y = sy(value)
        parts.append(
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{_nice(value)}</text>'
        )
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" stroke="#eef1f4"/>'
        )
    start = datetime.fromtimestamp(x0, tz=timezone.utc).strftime("%H:%M UTC")
    end = datetime.fromtimestamp(x1, tz=timezone.utc).strftime("%H:%M UTC")
    parts.append(f'<text x="{left}" y="{height - 8}">{start}</text>')
    parts.append(f'<text x="{left + plot_w}" y="{height - 8}" text-anchor="end">{end}</text>')
    for t in thresholds:
        y = sy(t.value)
        parts.append(
            f'<line x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}" '
            f'stroke="#b42318" stroke-dasharray="4 3"/>'
        )
        parts.append(
            f'<text x="{left + plot_w - 4}" y="{y - 4:.1f}" text-anchor="end">'
            f"{escape(t.label)} {_nice(t.value)}</text>"
        )
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        pts = [(sx(_ts(t)), sy(v)) for t, v in s.points if math.isfinite(v)]
        if len(pts) == 1:
            x, y = pts[0]
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')
        elif pts:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            parts.append(
                f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>'
            )
        lx = left + (i % 3) * 190
        ly = 34 + (i // 3) * 14
        parts.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="3" fill="{colour}"/>')
        parts.append(f'<text x="{lx + 14}" y="{ly - 4}">{escape(s.name)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
