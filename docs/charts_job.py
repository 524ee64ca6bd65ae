"""The job chart: validation loss (and the training loss of every step) against the step, drawn as
inline SVG from results/job.json at build time (docs/hooks.py's ``<!-- chart: job-loss -->``
calls it with its own SVG helpers, so that it looks like the other charts)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable


def chart_job_loss(results_dir: Path, *, svg: Callable, text: Callable, figure: Callable,
                   escape: Callable, width: int = 760) -> str:
    data = json.loads((results_dir / "job.json").read_text())
    result, machine, cfg = data["result"], data["machine"], data["result"]["config"]
    val = [(int(step), float(loss)) for step, loss in result["val_losses"]]
    first = result.get("first_step", 1)
    train = [(first + i, float(loss)) for i, loss in enumerate(result["losses"])]
    if len(val) < 2:
        raise ValueError("results/job.json has fewer than two validation losses")
    steps = [s for s, _ in train + val]
    values = [v for _, v in train + val]
    x_hi = max(steps)
    y_lo, y_hi = math.floor(min(values) * 2) / 2, math.ceil(max(values) * 2) / 2
    left, right, top, height = 60, 200, 16, 260
    plot_w = width - left - right

    def xy(step: float, value: float) -> tuple[float, float]:
        return (left + plot_w * step / max(x_hi, 1),
                top + height * (y_hi - value) / max(y_hi - y_lo, 1e-9))

    body = [f'<line x1="{left}" y1="{top + height}" x2="{left + plot_w}" y2="{top + height}" '
            'class="axis"/>',
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + height}" class="axis"/>']
    tick = 0.5 if y_hi - y_lo <= 4 else 1.0
    value = y_lo
    while value <= y_hi + 1e-9:
        body.append(text(left - 6, xy(0, value)[1] + 4, f"{value:g}", anchor="end", size=11))
        value += tick
    for i in range(6):
        step = round(x_hi * i / 5)
        body.append(text(xy(step, y_lo)[0], top + height + 16, str(step), anchor="middle",
                         size=11))
    body.append(text(left + plot_w / 2, top + height + 32, "optimizer step", anchor="middle"))
    body.append(text(14, top + height / 2, "loss (nats/token)", anchor="middle", size=11)
                .replace("<text ", f'<text transform="rotate(-90 14 {top + height / 2})" ', 1))
    for i, (label, points, dots) in enumerate((("training loss (each step)", train, False),
                                               ("validation loss", val, True))):
        cls = f"s{i % 8}"
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in points))
        body.append(f'<polyline points="{line}" class="line {cls}"><title>{escape(label)}'
                    "</title></polyline>")
        if dots:
            for s, v in points:
                x, y = xy(s, v)
                body.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" class="dot {cls}">'
                            f"<title>step {s}: validation loss {v:.3f}</title></circle>")
        ly = top + 4 + i * 16
        body += [f'<line x1="{left + plot_w + 14}" y1="{ly}" x2="{left + plot_w + 34}" '
                 f'y2="{ly}" class="line {cls}"/>',
                 text(left + plot_w + 40, ly + 4, label, size=11)]
    where = (f"{cfg['model']} model, {cfg['parallelism']} on {result['world_size']} rank(s), "
             f"{cfg['precision']}, {machine['description']}")
    drawn = svg(width, top + height + 40, body,
                f"Validation loss of the job from {val[0][1]:.2f} to {val[-1][1]:.2f}, {where}")
    caption = (f"Loss against the optimizer step, measured by <code>{escape(data['command'])}"
               f"</code> on {escape(where)} (load average {machine['load_average_1m']:.1f}), "
               f"torch {escape(data['torch'])}, {data['date'][:10]} (results/job.json): "
               f"validation loss over {cfg['eval_windows']} held-out windows of "
               f"{cfg['seq_len']} tokens every {cfg['eval_every']} steps, from "
               f"{val[0][1]:.3f} before the first step to {val[-1][1]:.3f} after step "
               f"{val[-1][0]}; the training loss is each step's global batch of "
               f"{cfg['global_batch_size']} windows.")
    return figure(drawn, caption, "job-loss")
