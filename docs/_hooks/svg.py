"""The drawing helpers every chart and diagram uses, in one place: inline SVG whose colours come
from CSS classes (docs/assets/extra.css), so that they follow the light and dark palettes, and
whose text uses the page's own colour."""

from __future__ import annotations

import math
import re

from .base import escape

CHART_WIDTH = 760


def figure(svg: str, caption: str, kind: str) -> str:
    # One line of raw HTML: Markdown leaves a block-level element alone; the caption is
    # Markdown-free.
    return (
        f'<figure class="recipe-chart" data-chart="{kind}">{svg}'
        f"<figcaption>{caption}</figcaption></figure>\n"
    )


MIN_TEXT_PX = 9.5  # a chart never shrinks below this: on a phone its figure scrolls instead


def svg(width: int, height: int, body: list[str], label: str) -> str:
    # The SVG shrinks with the column (max-width: 100%) down to the width at which its smallest
    # text is MIN_TEXT_PX; narrower, its figure scrolls sideways (overflow-x: auto in extra.css).
    sizes = [float(m) for m in re.findall(r'font-size="([0-9.]+)"', "".join(body))] or [12.0]
    min_width = min(width, math.ceil(width * MIN_TEXT_PX / min(sizes)))
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" style="min-width: {min_width}px" role="img" '
        f'aria-label="{attr(label)}">'
        f"<title>{escape(label)}</title>{''.join(body)}</svg>"
    )


def attr(text: str) -> str:
    return escape(text).replace('"', "&quot;")


def text(
    x: float, y: float, text: str, *, anchor: str = "start", cls: str = "t", size: int = 12
) -> str:
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" class="{cls}" '
        f'font-size="{size}">{escape(text)}</text>'
    )


def rect(x: float, y: float, w: float, h: float, cls: str, title: str = "") -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0):.1f}" height="{h:.1f}" '
        f'class="{cls}">{tip}</rect>'
    )
