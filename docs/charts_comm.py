"""The comm_bench chart: bus bandwidth against message size, one line per collective, drawn as
inline SVG from results/comm_bench.json at build time (docs/hooks.py's ``<!-- chart: comm-busbw
-->`` calls it with its own SVG helpers, so that it looks like the other charts)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

OP_LABELS = {"all_reduce": "all-reduce", "all_gather": "all-gather",
             "reduce_scatter": "reduce-scatter", "all_to_all": "all-to-all"}


def _size(num_bytes: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g}{unit}"
    return f"{num_bytes:g}"


def chart_comm_busbw(results_dir: Path, *, svg: Callable, text: Callable, figure: Callable,
                     escape: Callable, width: int = 760) -> str:
    """busbw (log scale) against size (log scale) for every op in the results file."""
    data = json.loads((results_dir / "comm_bench.json").read_text())
    result, machine = data["result"], data["machine"]
    series: dict[str, list[tuple[int, float]]] = {}
    for row in result["rows"]:
        if row["busbw_gb_per_s"] > 0:  # a world of one moves nothing: no point on a log scale
            series.setdefault(row["op"], []).append((row["size_bytes"], row["busbw_gb_per_s"]))
    if not series:
        raise ValueError("results/comm_bench.json has no row with a positive busbw")
    sizes = [s for points in series.values() for s, _ in points]
    values = [v for points in series.values() for _, v in points]
    x_lo, x_hi = math.log2(min(sizes)), math.log2(max(sizes))
    y_lo, y_hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    y_hi = max(y_hi, y_lo + 1)
    left, right, top, height = 70, 210, 16, 260
    plot_w = width - left - right

    def xy(size: float, value: float) -> tuple[float, float]:
        x = left + plot_w * (math.log2(size) - x_lo) / max(x_hi - x_lo, 1)
        y = top + height * (y_hi - math.log10(value)) / (y_hi - y_lo)
        return x, y

    body = [f'<line x1="{left}" y1="{top + height}" x2="{left + plot_w}" y2="{top + height}" '
            f'class="axis"/>',
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + height}" class="axis"/>']
    for decade in range(y_lo, y_hi + 1):  # one label per power of ten
        y = xy(min(sizes), 10.0 ** decade)[1]
        body.append(text(left - 6, y + 4, f"{10.0 ** decade:g}", anchor="end", size=11))
    step = max(1, math.ceil((x_hi - x_lo) / 8))  # at most ~9 size labels
    for power in range(int(x_lo), int(x_hi) + 1, step):
        body.append(text(xy(2**power, 10.0 ** y_lo)[0], top + height + 16, _size(2**power),
                         anchor="middle", size=11))
    body.append(text(left + plot_w / 2, top + height + 32, "message size (bytes, nccl-tests' "
                     "size: the whole buffer)", anchor="middle"))
    body.append(text(14, top + height / 2, "busbw GB/s", anchor="middle", size=11)
                .replace("<text ", f'<text transform="rotate(-90 14 {top + height / 2})" ', 1))
    for i, (op, points) in enumerate(series.items()):
        cls = f"s{i % 8}"
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in points))
        label = OP_LABELS.get(op, op)
        body.append(f'<polyline points="{line}" class="line {cls}"><title>{escape(label)}'
                    "</title></polyline>")
        for s, v in points:
            x, y = xy(s, v)
            body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" class="dot {cls}">'
                        f"<title>{escape(label)} {_size(s)}B: {v:.3g} GB/s</title></circle>")
        ly = top + 4 + i * 16
        best = max(v for _, v in points)
        body += [f'<line x1="{left + plot_w + 14}" y1="{ly}" x2="{left + plot_w + 34}" '
                 f'y2="{ly}" class="line {cls}"/>',
                 text(left + plot_w + 40, ly + 4, f"{label} (max {best:.3g} GB/s)", size=11)]
    where = (f"{result['world_size']} ranks, {result['backend']} on {result['device']}, "
             f"{result.get('dtype', '')}, {machine['description']}, load average "
             f"{machine['load_average_1m']:.1f}")
    drawn = svg(width, top + height + 40, body, f"Bus bandwidth per collective and size, {where}")
    caption = (f"Bus bandwidth (nccl-tests' busbw, GB/s, log scale) of each collective against "
               f"the message size, measured by <code>{escape(data['command'])}</code> on "
               f"{escape(where)}, torch {escape(data['torch'])}, {data['date'][:10]} "
               "(results/comm_bench.json). On CPU gloo this is two processes copying through "
               "the host's memory and TCP loopback, and a busy machine makes it noisy: read it "
               "for the shape (latency-bound at small sizes, rising toward a plateau), then run "
               "the same command on your GPUs and compare the plateau with the link's figure.")
    return figure(drawn, caption, "comm-busbw")
