"""``<!-- chart: KIND -->``: figures drawn at build time as inline SVG from results/*.json, never by
hand: model state per rank (memory), each recipe's loss against DDP's (loss), the GPU throughput
ladder (ladder), collective bandwidth (comm-busbw), the job's validation loss (job-loss); and, from
diagrams.py, the figures drawn from the code's shapes and schedules (pipeline, fsdp-units,
tp-split)."""

from __future__ import annotations

import json
import math
from typing import Any

from . import base, diagrams
from . import svg as draw
from .base import MarkerError, escape, kib
from .results import PART_LABELS, load_results, result_extras
from .svg import CHART_WIDTH

# The strategy each recipe measures, as memory_estimate's stages: the estimate drawn next to it.
ESTIMATE_STAGE = {
    "ddp_torchrun": "ddp",
    "zero": "zero1",
    "fsdp": "zero3",
    "fsdp2": "zero3",
    "sharded_accumulation": "zero3",
}
CHART_ORDER = ["ddp_torchrun", "zero", "fsdp", "fsdp2"]
MODEL_STATE_RECIPES = {*ESTIMATE_STAGE, "tensor_parallel", "finetune"}


def ordered(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: (CHART_ORDER.index(n) if n in CHART_ORDER else 99, n))


def model_state_rows() -> list[dict]:
    """Measured model-state bytes of rank 0 for every recipe whose result has memory_per_rank, with
    the ZeRO paper's estimate for the same model and world where the strategy has one."""
    from recipes.core.workload import build_model
    from recipes.memory_estimate import LAYOUTS, model_state_per_rank

    results = load_results()
    # The strategies that split the model state, on DDP's world size (a comparison "per rank"
    # holds only there); the other recipes that report memory_per_rank hold what DDP holds (one
    # process, ddp_spawn, context_parallel) or train nothing (meta_init).
    measured = {
        name: data
        for name, data in results.items()
        if name in MODEL_STATE_RECIPES and result_extras(data).get("memory_per_rank")
    }
    numel = sum(p.numel() for p in build_model("tiny", seed=0).parameters())
    rows = []
    for name in ordered(list(measured)):
        data = measured[name]
        per_rank = result_extras(data)["memory_per_rank"][0]
        world = data["result"]["world_size"]
        row = {"recipe": name, "world_size": world, "measured": per_rank, "estimated": None}
        if name in ESTIMATE_STAGE:
            estimate = model_state_per_rank(
                numel, world, ESTIMATE_STAGE[name], LAYOUTS["adam-fp32"]
            )
            row["estimated"] = {k: estimate["device"][k] for k in PART_LABELS}
            row["stage"] = ESTIMATE_STAGE[name]
        rows.append(row)
    return rows


def chart_memory() -> str:
    rows = model_state_rows()
    if not rows:
        raise MarkerError("chart memory: no results/*.json has memory_per_rank")
    bars = []
    for row in rows:
        bars.append((f"{row['recipe']} measured", row["measured"], ""))
        if row["estimated"]:
            bars.append((f"{row['recipe']} estimated", row["estimated"], " est"))
    top = max(sum(parts[k] for k in PART_LABELS) for _, parts, _ in bars)
    left, right, bar_h, gap = 170, 150, 18, 6
    scale = (CHART_WIDTH - left - right) / top
    body, y = [], 30
    for i, key in enumerate(PART_LABELS):  # legend
        body += [
            draw.rect(left + i * 150, 6, 12, 12, f"c{i}"),
            draw.text(left + i * 150 + 16, 16, PART_LABELS[key]),
        ]
    ddp_total = next(
        (sum(r["measured"][k] for k in PART_LABELS) for r in rows if r["recipe"] == "ddp_torchrun"),
        None,
    )
    for label, parts, suffix in bars:
        x = left
        body.append(draw.text(left - 8, y + 13, label, anchor="end"))
        for i, key in enumerate(PART_LABELS):
            w = parts[key] * scale
            body.append(
                draw.rect(
                    x,
                    y,
                    w,
                    bar_h,
                    f"c{i}{suffix.replace(' ', '-')}",
                    f"{label}: {PART_LABELS[key]} {kib(parts[key])}",
                )
            )
            x += w
        total = sum(parts[k] for k in PART_LABELS)
        note = kib(total) + (f" ({total / ddp_total:.2f} x DDP)" if ddp_total else "")
        body.append(draw.text(x + 6, y + 13, note))
        y += bar_h + gap
    svg = draw.svg(CHART_WIDTH, y + 8, body, "Model-state bytes per rank, measured and estimated")
    worlds = sorted({r["world_size"] for r in rows})
    caption = (
        f"Model-state bytes held by rank 0 (parameters, gradients, AdamW state; activations "
        f"not included), measured by <code>recipes.core.memory.model_state_bytes</code> "
        f"after the last step of each recipe's default command on "
        f"{', '.join(map(str, worlds))} CPU ranks (gloo, the cookbook's tiny model; "
        f"results/*.json: bytes, which the machine's load does not change), against the ZeRO "
        f"paper's estimate for fp32 AdamW (4 + 4 + 8 bytes per parameter; "
        f"<code>recipes.memory_estimate</code>). Measured optimizer state includes AdamW's "
        f"step counters; FSDP's includes the padding that makes each flat buffer divide."
    )
    return draw.figure(svg, caption, "memory") + "\n" + memory_table(rows)


def memory_table(rows: list[dict]) -> str:
    ddp = next((r for r in rows if r["recipe"] == "ddp_torchrun"), None)
    ddp_total = sum(ddp["measured"][k] for k in PART_LABELS) if ddp else None
    # One world size for every row (the usual case) goes above the table: a column fewer, so that
    # the table fits the column at 1280 px.
    worlds = {row["world_size"] for row in rows}
    ranks_column = len(worlds) > 1
    lines = [] if ranks_column else [f"Per rank of {worlds.pop()} ranks:", ""]
    lines += [
        "| Recipe |" + (" Ranks |" if ranks_column else "") + " Parameters | Gradients "
        "| Optimizer | Total per rank | vs DDP | Estimated total |",
        "|---|" + ("---|" if ranks_column else "") + "---|---|---|---|---|---|",
    ]
    for row in rows:
        m = row["measured"]
        total = sum(m[k] for k in PART_LABELS)
        est = row["estimated"]
        est_text = f"{kib(sum(est[k] for k in PART_LABELS))} ({row['stage']})" if est else ""
        vs = f"{total / ddp_total:.2f} x" if ddp_total else ""
        ranks = f" {row['world_size']} |" if ranks_column else ""
        lines.append(
            f"| [{row['recipe']}][] |{ranks} {kib(m['param_bytes'])} | "
            f"{kib(m['grad_bytes'])} | {kib(m['optimizer_bytes'])} | {kib(total)} | "
            f"{vs} | {est_text} |"
        )
    return "\n".join(lines) + "\n"


def loss_series() -> tuple[list[tuple[str, list[float]]], list[str]]:
    """(recipe, losses) of every result trained on the reference model and data (its first loss is
    ddp_torchrun's), and the names left out because they train something else."""
    results = load_results()
    reference = results.get("ddp_torchrun", {}).get("result", {}).get("losses") or []
    series, other = [], []
    for name in ordered(list(results)):
        losses = results[name]["result"].get("losses")
        if not isinstance(losses, list) or len(losses) < 2:
            continue
        if reference and abs(losses[0] - reference[0]) > 1e-3 * abs(reference[0]):
            other.append(name)
            continue
        series.append((name, [float(v) for v in losses]))
    return series, other


# Why a run's loss differs from DDP's by more than float rounding: what its default command trains.
LOSS_DIFFERENCE_REASONS = {
    "amp": "bf16 autocast rounds",
    "finetune": "LoRA: only adapters train",
    "sharded_accumulation": "ragged samples, 25 % padding",
    "grad_clipping": "SGD with clipping",
}
ROUNDING = 1e-5  # float32 summation order moves a loss near 4 by a few 1e-7


def chart_loss() -> str:
    """Each run's largest difference from ddp_torchrun's loss, on a log scale, labelled directly:
    17 curves on one plot would lie on top of each other and hide the ones that do not."""
    series, other = loss_series()
    if len(series) < 2:
        raise MarkerError("chart loss: fewer than two results with losses on the reference run")
    reference = dict(series).get("ddp_torchrun")
    if reference is None:
        raise MarkerError("chart loss: results/ddp_torchrun.json has no losses")
    rows = []
    for name, losses in series:
        if name == "ddp_torchrun":
            continue
        steps = min(len(losses), len(reference))
        delta = max(abs(a - b) for a, b in zip(losses[:steps], reference[:steps]))
        rows.append((delta, name, steps))
    rows.sort()
    lo_exp, hi_exp = -8, -1  # 1e-8 .. 1e-1: float32 rounding up to a different training run
    left, right, top, bar_h, gap = 170, 230, 34, 16, 6
    plot_w = CHART_WIDTH - left - right

    def x_of(delta: float) -> float:
        if delta <= 0:
            return left
        e = min(max(math.log10(delta), lo_exp), hi_exp)
        return left + plot_w * (e - lo_exp) / (hi_exp - lo_exp)

    height = top + len(rows) * (bar_h + gap) + 4
    body = [f'<line x1="{left}" y1="{top - 4}" x2="{left}" y2="{height}" class="axis"/>']
    for e in range(lo_exp, hi_exp + 1):
        x = x_of(10.0**e)
        body += [
            f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height}" class="grid"/>',
            draw.text(x, top - 10, f"1e{e}", anchor="middle", size=11),
        ]
    x = x_of(ROUNDING)
    body.append(f'<line x1="{x:.1f}" y1="{top - 4}" x2="{x:.1f}" y2="{height}" class="limit"/>')
    y = top
    for delta, name, steps in rows:
        same = delta <= ROUNDING
        note = "identical" if delta == 0 else f"{delta:.0e}"
        if steps < len(reference):
            note += f", {steps} steps"
        if not same:
            note += f": {LOSS_DIFFERENCE_REASONS.get(name, 'trains something else')}"
        body.append(draw.text(left - 8, y + 12, name, anchor="end", size=12))
        if delta > 0:
            body.append(
                draw.rect(
                    left,
                    y,
                    x_of(delta) - left,
                    bar_h,
                    "c1" if same else "c0",
                    f"{name}: largest difference {delta:.3g}",
                )
            )
        body.append(draw.text(max(x_of(delta), left) + 6, y + 12, note, size=11))
        y += bar_h + gap
    svg = draw.svg(
        CHART_WIDTH, height, body, "Largest loss difference from ddp_torchrun, per recipe"
    )
    same = [n for d, n, _ in rows if d <= ROUNDING]
    dates = sorted({load_results()[n]["date"][:10] for _, n, _ in rows})
    caption = (
        "The largest difference, over the steps both ran, between each recipe's loss and "
        "ddp_torchrun's, each run with its default command on CPU (gloo, torch "
        f"{escape(load_results()['ddp_torchrun']['torch'])}; results/*.json, measured "
        f"{dates[0]} to {dates[-1]}), on a log scale. {len(same)} of {len(rows)} equal DDP "
        "to within float32 rounding (blue, left of the red line at 1e-5: a different "
        "summation order), most of them exactly; the orange ones train something else by "
        "default, named beside the bar."
    )
    if other:
        caption += (
            " Left out because they train another model or precision by default: "
            + ", ".join(other)
            + "."
        )
    return draw.figure(svg, caption, "loss")


def chart_ladder() -> str:
    # <device>.json: the benchmark; <device>-<recipe>.json: a recipe's own GPU runs (its page)
    files = [
        path
        for path in sorted((base.RESULTS_DIR / "bench").glob("*.json"))
        if "model" in json.loads(path.read_text())
    ]
    if not files:
        raise MarkerError("chart ladder: no results/bench/*.json (run python scripts/bench.py)")
    parts = []
    for path in files:
        data = json.loads(path.read_text())
        ladder = [r for r in data.get("ladder", []) if r.get("tokens_per_second")]
        if not ladder:
            continue
        # Tokens per second, not time per step: rows with another batch stay comparable.
        base_rate = ladder[0]["tokens_per_second"]
        top = max(r["tokens_per_second"] for r in ladder)
        left, right, bar_h, gap = 250, 190, 20, 8
        scale = (CHART_WIDTH - left - right) / top
        body, y = [], 8
        for row in ladder:
            rate = row["tokens_per_second"]
            w = rate * scale
            note = (
                f"{rate / 1e3:,.0f}k tokens/s, {rate / base_rate:.1f} x "
                f"({row['ms_per_step']:.1f} ms, batch {row.get('batch', '?')})"
            )
            body += [
                draw.text(left - 8, y + 14, row["label"], anchor="end", size=11),
                draw.rect(left, y, w, bar_h, "c0", f"{row['label']}: {note}"),
                draw.text(left + w + 6, y + 14, note, size=11),
            ]
            y += bar_h + gap
        title = f"{data['device']}, torch {data['torch']}"
        svg = draw.svg(CHART_WIDTH, y + 4, body, f"Training throughput, {title}")
        parts.append(
            draw.figure(
                svg,
                (
                    f"Training throughput on {escape(title)}, one device, model "
                    f"<code>{escape(data['model'])}</code>, measured {data['date'][:10]} by "
                    f"<code>python scripts/bench.py</code> (results/bench/{path.name}). Longer is "
                    f"faster; the factor is against the first row, plain fp32."
                ),
                "ladder",
            )
        )
    if not parts:
        raise MarkerError("chart ladder: no benchmark file has a ladder")
    return "\n".join(parts)


# <!-- chart: comm-busbw -->: comm_bench's bus bandwidth against the message size, one line per
# collective.
OP_LABELS = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
}


def _size(num_bytes: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g}{unit}"
    return f"{num_bytes:g}"


def chart_comm_busbw() -> str:
    """busbw (log scale) against size (log scale) for every op in results/comm_bench.json."""
    data = json.loads((base.RESULTS_DIR / "comm_bench.json").read_text())
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
    plot_w = CHART_WIDTH - left - right

    def xy(size: float, value: float) -> tuple[float, float]:
        x = left + plot_w * (math.log2(size) - x_lo) / max(x_hi - x_lo, 1)
        y = top + height * (y_hi - math.log10(value)) / (y_hi - y_lo)
        return x, y

    body = [
        f'<line x1="{left}" y1="{top + height}" x2="{left + plot_w}" y2="{top + height}" '
        f'class="axis"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + height}" class="axis"/>',
    ]
    for decade in range(y_lo, y_hi + 1):  # one label per power of ten
        y = xy(min(sizes), 10.0**decade)[1]
        body.append(draw.text(left - 6, y + 4, f"{10.0**decade:g}", anchor="end", size=11))
    step = max(1, math.ceil((x_hi - x_lo) / 8))  # at most ~9 size labels
    for power in range(int(x_lo), int(x_hi) + 1, step):
        body.append(
            draw.text(
                xy(2**power, 10.0**y_lo)[0],
                top + height + 16,
                _size(2**power),
                anchor="middle",
                size=11,
            )
        )
    body.append(
        draw.text(
            left + plot_w / 2,
            top + height + 32,
            "message size (bytes, nccl-tests' size: the whole buffer)",
            anchor="middle",
        )
    )
    body.append(
        draw.text(14, top + height / 2, "busbw GB/s", anchor="middle", size=11).replace(
            "<text ", f'<text transform="rotate(-90 14 {top + height / 2})" ', 1
        )
    )
    for i, (op, points) in enumerate(series.items()):
        cls = f"s{i % 8}"
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in points))
        label = OP_LABELS.get(op, op)
        body.append(
            f'<polyline points="{line}" class="line {cls}"><title>{escape(label)}'
            "</title></polyline>"
        )
        for s, v in points:
            x, y = xy(s, v)
            body.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" class="dot {cls}">'
                f"<title>{escape(label)} {_size(s)}B: {v:.3g} GB/s</title></circle>"
            )
        ly = top + 4 + i * 16
        best = max(v for _, v in points)
        body += [
            f'<line x1="{left + plot_w + 14}" y1="{ly}" x2="{left + plot_w + 34}" '
            f'y2="{ly}" class="line {cls}"/>',
            draw.text(left + plot_w + 40, ly + 4, f"{label} (max {best:.3g} GB/s)", size=11),
        ]
    where = (
        f"{result['world_size']} ranks, {result['backend']} on {result['device']}, "
        f"{result.get('dtype', '')}, {machine['description']}, load average "
        f"{machine['load_average_1m']:.1f}"
    )
    drawn = draw.svg(
        CHART_WIDTH, top + height + 40, body, f"Bus bandwidth per collective and size, {where}"
    )
    caption = (
        f"Bus bandwidth (nccl-tests' busbw, GB/s, log scale) of each collective against "
        f"the message size, measured by <code>{escape(data['command'])}</code> on "
        f"{escape(where)}, torch {escape(data['torch'])}, {data['date'][:10]} "
        "(results/comm_bench.json). On CPU gloo this is two processes copying through "
        "the host's memory and TCP loopback, and a busy machine makes it noisy: read it "
        "for the shape (latency-bound at small sizes, rising toward a plateau), then run "
        "the same command on your GPUs and compare the plateau with the link's figure."
    )
    return draw.figure(drawn, caption, "comm-busbw")


def chart_job_loss() -> str:
    """The job's validation loss (and the training loss of every step) against the step, from
    results/job.json."""
    data = json.loads((base.RESULTS_DIR / "job.json").read_text())
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
    plot_w = CHART_WIDTH - left - right

    def xy(step: float, value: float) -> tuple[float, float]:
        return (
            left + plot_w * step / max(x_hi, 1),
            top + height * (y_hi - value) / max(y_hi - y_lo, 1e-9),
        )

    body = [
        f'<line x1="{left}" y1="{top + height}" x2="{left + plot_w}" y2="{top + height}" '
        'class="axis"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + height}" class="axis"/>',
    ]
    tick = 0.5 if y_hi - y_lo <= 4 else 1.0
    value = y_lo
    while value <= y_hi + 1e-9:
        body.append(draw.text(left - 6, xy(0, value)[1] + 4, f"{value:g}", anchor="end", size=11))
        value += tick
    for i in range(6):
        step = round(x_hi * i / 5)
        body.append(
            draw.text(xy(step, y_lo)[0], top + height + 16, str(step), anchor="middle", size=11)
        )
    body.append(draw.text(left + plot_w / 2, top + height + 32, "optimizer step", anchor="middle"))
    body.append(
        draw.text(14, top + height / 2, "loss (nats/token)", anchor="middle", size=11).replace(
            "<text ", f'<text transform="rotate(-90 14 {top + height / 2})" ', 1
        )
    )
    for i, (label, points, dots) in enumerate(
        (("training loss (each step)", train, False), ("validation loss", val, True))
    ):
        cls = f"s{i % 8}"
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in points))
        body.append(
            f'<polyline points="{line}" class="line {cls}"><title>{escape(label)}'
            "</title></polyline>"
        )
        if dots:
            for s, v in points:
                x, y = xy(s, v)
                body.append(
                    f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" class="dot {cls}">'
                    f"<title>step {s}: validation loss {v:.3f}</title></circle>"
                )
        ly = top + 4 + i * 16
        body += [
            f'<line x1="{left + plot_w + 14}" y1="{ly}" x2="{left + plot_w + 34}" '
            f'y2="{ly}" class="line {cls}"/>',
            draw.text(left + plot_w + 40, ly + 4, label, size=11),
        ]
    where = (
        f"{cfg['model']} model, {cfg['parallelism']} on {result['world_size']} rank(s), "
        f"{cfg['precision']}, {machine['description']}"
    )
    drawn = draw.svg(
        CHART_WIDTH,
        top + height + 40,
        body,
        f"Validation loss of the job from {val[0][1]:.2f} to {val[-1][1]:.2f}, {where}",
    )
    caption = (
        f"Loss against the optimizer step, measured by <code>{escape(data['command'])}"
        f"</code> on {escape(where)} (load average {machine['load_average_1m']:.1f}), "
        f"torch {escape(data['torch'])}, {data['date'][:10]} (results/job.json): "
        f"validation loss over {cfg['eval_windows']} held-out windows of "
        f"{cfg['seq_len']} tokens every {cfg['eval_every']} steps, from "
        f"{val[0][1]:.3f} before the first step to {val[-1][1]:.3f} after step "
        f"{val[-1][0]}; the training loss is each step's global batch of "
        f"{cfg['global_batch_size']} windows."
    )
    return draw.figure(drawn, caption, "job-loss")


CHARTS = {
    "memory": chart_memory,
    "loss": chart_loss,
    "ladder": chart_ladder,
    "pipeline": diagrams.chart_pipeline,
    "fsdp-units": diagrams.chart_fsdp_units,
    "tp-split": diagrams.chart_tp_split,
    "comm-busbw": chart_comm_busbw,
    "job-loss": chart_job_loss,
}


def render_chart(kind: str, **_: Any) -> str:
    if kind not in CHARTS:
        raise MarkerError(f"chart: unknown kind {kind!r}; one of {', '.join(CHARTS)}")
    try:
        return CHARTS[kind]()
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
        raise MarkerError(
            f"chart {kind}: the data cannot be drawn ({type(exc).__name__}: {exc})"
        ) from None
