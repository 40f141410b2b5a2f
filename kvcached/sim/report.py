"""The simulator's outputs: a text table, and an SVG plot of hit rate against cache size with
one line per policy, a block-hit panel and a prefix-hit panel per workload (plain SVG written
here: no plotting library)."""

from __future__ import annotations

import math
from typing import Sequence

from kvcached.sim.replay import Result

__all__ = ["table", "svg"]

COLORS = {"lru": "#d62728", "clock": "#ff7f0e", "arc": "#1f77b4", "s3fifo": "#2ca02c", "belady": "#000000"}
_OTHER = ("#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _size(n: int, unique: int) -> str:
    return f"{n} ({n / unique:.1%})" if unique else str(n)


def _against_min(rates: list[float], optimum: list[float]) -> str:
    """The mean hit rate over the sizes as a share of Belady's."""
    return f"{sum(rates) / sum(optimum):.2f}x" if sum(optimum) > 0 else "-"


def _header(r: Result) -> str:
    about = f"{r.accesses} block accesses, {r.unique} distinct"
    if r.span_ms is not None:
        rate = f", {r.requests / r.span_ms * 1000:.1f} requests/s" if r.span_ms > 0 else ""
        about = f"{r.requests} requests over {r.span_ms / 1000:.1f} s{rate}; {about}"
    return f"{r.workload}: {about}; hit rate by cache size (blocks)"


def table(results: Sequence[Result]) -> str:
    """Hit rate per workload, policy and cache size (blocks, and the share of the workload's
    distinct blocks): block hits, then prefix hits where replayed; the last column is the mean
    over the sizes against Belady's MIN of the same count."""
    lines = []
    for r in results:
        lines.append(_header(r))
        cells = [_size(n, r.unique) for n in r.sizes]
        width = max(12, *(len(c) + 2 for c in cells))
        label = 14
        blocks = [("block hits", r.hit_rate)] + ([("prefix hits", r.prefix_hit_rate)] if r.prefix_hit_rate else [])
        for title, rates in blocks:
            lines.append("  " + title.ljust(label) + "".join(c.rjust(width) for c in cells) + "vs MIN".rjust(9))
            for name, row in rates.items():
                ratio = "" if name == "belady" else _against_min(row, rates["belady"]).rjust(9)
                lines.append("  " + ("  " + name).ljust(label) + "".join(f"{x:.3f}".rjust(width) for x in row) + ratio)
        lines.append("")
    return "\n".join(lines)


def svg(results: Sequence[Result], title: str = "kvcached policies: hit rate against cache size",
        x_label: str = "cache size (share of distinct blocks)", x_tick: str = "{:.1%}") -> str:
    """An SVG document: per workload a panel of block hits and, where replayed, one of prefix
    hits; x = cache size as a share of the workload's ``unique`` blocks (log scale; ``x_label``
    names it, ``x_tick`` formats a share), y = hit rate; Belady's MIN dashed."""
    panels = [(r, f"{r.workload}: {kind}", rates) for r in results
              for kind, rates in (("block hits", r.hit_rate), ("prefix hits", r.prefix_hit_rate)) if rates]
    cols = 2 if any(r.prefix_hit_rate for r in results) else 3
    pw, ph, margin = 320, 220, 48
    rows = math.ceil(len(panels) / cols)
    width, height = cols * (pw + margin) + margin, rows * (ph + margin + 24) + margin + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{margin}" y="24" font-size="15">{_escape(title)}</text>']
    names = [n for n in results[0].hit_rate] if results else []
    for i, name in enumerate(names):      # legend
        x = margin + i * 95
        out.append(f'<line x1="{x}" y1="38" x2="{x + 22}" y2="38" stroke="{_color(name, i)}" stroke-width="2"'
                   f'{_dash(name)}/><text x="{x + 26}" y="42">{_escape(name)}</text>')
    for k, (r, heading, rates) in enumerate(panels):
        x0 = margin + (k % cols) * (pw + margin)
        y0 = 60 + (k // cols) * (ph + margin + 24)
        out += _panel(r, heading, rates, x0, y0, pw, ph, names, x_label, x_tick)
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _panel(r: Result, heading: str, rates: dict[str, list[float]], x0: float, y0: float, pw: float, ph: float,
           names: list[str], x_label: str, x_tick: str) -> list[str]:
    fractions = [n / r.unique if r.unique else 1.0 for n in r.sizes]
    lo, hi = math.log10(min(fractions)), math.log10(max(fractions))
    span = (hi - lo) or 1.0

    def px(f: float) -> float:
        return x0 + (math.log10(f) - lo) / span * pw

    def py(rate: float) -> float:
        return y0 + ph - rate * ph

    out = [f'<text x="{x0}" y="{y0 - 8}" font-size="13">{_escape(heading)}</text>',
           f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for rate in (0.25, 0.5, 0.75, 1.0):
        out.append(f'<line x1="{x0}" y1="{py(rate):.1f}" x2="{x0 + pw}" y2="{py(rate):.1f}" stroke="#eee"/>'
                   f'<text x="{x0 - 30}" y="{py(rate) + 4:.1f}">{rate:.2f}</text>')
    for f in fractions:
        out.append(f'<text x="{px(f) - 12:.1f}" y="{y0 + ph + 14}">{x_tick.format(f)}</text>')
    for i, name in enumerate(names):
        if name not in rates:
            continue
        points = " ".join(f"{px(f):.1f},{py(rate):.1f}" for f, rate in zip(fractions, rates[name]))
        out.append(f'<polyline points="{points}" fill="none" stroke="{_color(name, i)}" stroke-width="2"'
                   f'{_dash(name)}/>')
    out.append(f'<text x="{x0 + pw / 2 - 60}" y="{y0 + ph + 30}">{_escape(x_label)}</text>')
    return out


def _color(name: str, i: int) -> str:
    return COLORS.get(name, _OTHER[i % len(_OTHER)])


def _dash(name: str) -> str:
    return ' stroke-dasharray="5,3"' if name == "belady" else ""


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
