"""The figures drawn from the code rather than from a measurement alone, for ``<!-- chart: KIND
-->``: pipeline schedules (measured timelines when the machine was idle, otherwise the schedule's
order computed here), what FSDP gathers and frees per unit, and tensor parallel's column/row split,
each to scale for the cookbook's tiny model."""

from __future__ import annotations

import json

from . import base
from . import svg as draw
from .base import MarkerError, escape, kib
from .results import result_extras
from .svg import CHART_WIDTH

# Pipeline timelines: every timeline a results file holds (extras.timeline_per_rank, and each row of
# extras.schedule_table), one rank per row; without measured timelines, the schedules' order for the
# measured pp_size and micro-batches, computed here (unit times: forward 1, backward 2).


def _timelines(extras: dict) -> list[tuple[str, list[list], bool]]:
    found = []
    for row in extras.get("schedule_table") or []:
        if isinstance(row, dict) and row.get("timeline_per_rank"):
            found.append((str(row.get("schedule")), row["timeline_per_rank"], True))
    if not found and extras.get("timeline_per_rank"):
        found.append((str(extras.get("schedule")), extras["timeline_per_rank"], True))
    return found


def simulated_schedule(name: str, pp: int, microbatches: int) -> list[list]:
    """[[kind, stage, microbatch, start, end], ...] per rank for GPipe or 1F1B, one stage per rank:
    each rank runs its actions in order, each as soon as the neighbour it waits on is done."""
    orders = []
    for rank in range(pp):
        if name == "gpipe":
            order = [("F", m) for m in range(microbatches)] + [
                ("B", m) for m in range(microbatches)
            ]
        else:  # 1F1B: warm-up forwards, then one forward one backward, then the last backwards
            warm = min(pp - rank - 1, microbatches)
            order = [("F", m) for m in range(warm)]
            f, b = warm, 0
            while b < microbatches:
                if f < microbatches:
                    order.append(("F", f))
                    f += 1
                order.append(("B", b))
                b += 1
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    clock, position = [0.0] * pp, [0] * pp
    timeline: list[list] = [[] for _ in range(pp)]
    progress = True
    while progress:
        progress = False
        for rank in range(pp):
            if position[rank] == len(orders[rank]):
                continue
            kind, m = orders[rank][position[rank]]
            need = (
                ("F", rank - 1, m)
                if kind == "F" and rank > 0
                else ("B", rank + 1, m)
                if kind == "B" and rank < pp - 1
                else ("F", rank, m)
                if kind == "B"
                else None
            )
            if need is not None and need not in done:
                continue
            start = max(clock[rank], done.get(need, 0.0) if need else 0.0)
            end = start + (1.0 if kind == "F" else 2.0)
            done[(kind, rank, m)] = clock[rank] = end
            timeline[rank].append([kind, rank, m, start, end])
            position[rank] += 1
            progress = True
    return timeline


def _timeline_svg(title: str, per_rank: list[list], unit: str) -> str:
    left, right, row_h = 70, 20, 26
    end = max((float(a[4]) for actions in per_rank for a in actions), default=1.0) or 1.0
    scale = (CHART_WIDTH - left - right) / end
    body, y = [], 4
    for rank, actions in enumerate(per_rank):
        body.append(draw.text(left - 8, y + 17, f"rank {rank}", anchor="end", size=11))
        body.append(draw.rect(left, y, end * scale, row_h - 4, "idle", f"rank {rank}: idle"))
        for action in actions:
            kind, stage, micro, start, stop = action[:5]
            x, w = left + float(start) * scale, (float(stop) - float(start)) * scale
            letter = str(kind)[:1].upper()
            cls = {"F": "c0", "B": "c1", "W": "c2"}.get(letter, "c3")
            body.append(
                draw.rect(
                    x,
                    y,
                    w,
                    row_h - 4,
                    cls,
                    f"rank {rank}: {kind} stage {stage} micro-batch {micro}, "
                    f"{float(start):.3g}-{float(stop):.3g} {unit}",
                )
            )
            if w > 16:
                body.append(
                    draw.text(
                        x + w / 2,
                        y + 15,
                        f"{letter}{micro}",
                        anchor="middle",
                        cls="t on-bar",
                        size=10,
                    )
                )
        y += row_h
    body.append(draw.text(left, y + 12, f"0 {unit}", size=10))
    body.append(draw.text(CHART_WIDTH - right, y + 12, f"{end:.3g} {unit}", anchor="end", size=10))
    return draw.svg(CHART_WIDTH, y + 18, body, title)


def chart_pipeline() -> str:
    """The measured timelines when the machine was idle enough for times to mean something (one
    chart per schedule, each caption naming its schedule, machine and load); otherwise GPipe's and
    1F1B's order computed for the measured shape, said to be computed."""
    path = base.RESULTS_DIR / "pipeline_parallel.json"
    if not path.exists():
        raise MarkerError("chart pipeline: no results/pipeline_parallel.json")
    data = json.loads(path.read_text())
    extras, machine = result_extras(data), data["machine"]
    load, cores = machine["load_average_1m"], machine.get("cpu_cores") or 1
    where = f"{escape(machine['description'])}, torch {escape(data['torch'])}"
    parts = []
    if load <= cores or machine.get("gpus"):
        for schedule, per_rank, _ in _timelines(extras):
            svg = _timeline_svg(f"Pipeline schedule {schedule}, measured", per_rank, "ms")
            ranks = len(per_rank)
            parts.append(
                draw.figure(
                    svg,
                    (
                        f"<strong>{escape(schedule)}</strong>, measured on {where} (load average "
                        f"{load:.1f} when the run started), {ranks} ranks: the last training "
                        "step's forward (F), backward (B) and weight-gradient (W) actions of each "
                        "rank, labelled with their micro-batch, in milliseconds; grey is idle, the "
                        "bubble. From results/pipeline_parallel.json "
                        f"(<code>{escape(data['command'])}</code>)."
                    ),
                    "pipeline",
                )
            )
    if not parts:
        pp, micro = int(extras["pp_size"]), int(extras["microbatches"])
        measured = ""
        if _timelines(extras):
            measured = (
                f" The measured timelines are in results/pipeline_parallel.json, but "
                f"they were taken under a load average of {load:.1f} on {cores} cores, "
                "so their times would show the other processes: not drawn."
            )
        for schedule in ("gpipe", "1f1b"):
            per_rank = simulated_schedule(schedule, pp, micro)
            end = max(a[4] for actions in per_rank for a in actions)
            busy = sum(a[4] - a[3] for actions in per_rank for a in actions)
            svg = _timeline_svg(f"Pipeline schedule {schedule}, {pp} ranks", per_rank, "time units")
            parts.append(
                draw.figure(
                    svg,
                    (
                        f"<strong>{schedule}</strong> on {pp} ranks with {micro} micro-batches "
                        "(the measured run's shape), computed from the schedule, not timed: "
                        "forward = 1 time unit, backward = 2, each rank running its actions in the "
                        f"schedule's order. Grey is the bubble: {1 - busy / (end * pp):.0%} of the "
                        f"ranks' time here.{measured if schedule == '1f1b' else ''}"
                    ),
                    "pipeline",
                )
            )
    return "\n".join(parts)


def _units_of_tiny() -> list[tuple[str, int]]:
    """(unit, parameter bytes) as FSDP wraps the cookbook's model: one unit per block, the rest in
    the root (embeddings, final norm, output)."""
    from recipes.core.workload import build_model

    model = build_model("tiny", seed=0)
    units = [
        (f"layers.{name}", sum(p.numel() * p.element_size() for p in block.parameters()))
        for name, block in model.layers.items()
    ]
    in_blocks = sum(b for _, b in units)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return [("root", total - in_blocks)] + units


def chart_fsdp_units(world_size: int = 2) -> str:
    units = _units_of_tiny()
    blocks = [u for u in units if u[0] != "root"]
    phases = (
        ["forward root"]
        + [f"forward {n}" for n, _ in blocks]
        + [f"backward {n}" for n, _ in reversed(blocks)]
        + ["backward root"]
    )
    left, cell_w, row_h = 110, (CHART_WIDTH - 110 - 10) / len(phases), 24
    body, y = [], 4
    for i, phase in enumerate(phases):
        kind, _, name = phase.partition(" ")
        body.append(draw.text(left + (i + 0.5) * cell_w, y + 12, kind, anchor="middle", size=10))
        body.append(draw.text(left + (i + 0.5) * cell_w, y + 24, name, anchor="middle", size=10))
    y += 32
    held = []
    for unit, _nbytes in units:
        body.append(draw.text(left - 8, y + 16, unit, anchor="end", size=11))
        for i, phase in enumerate(phases):
            _, _, name = phase.partition(" ")
            # The root stays gathered from its forward to its backward (fully_shard does not
            # reshard the root after forward: it is needed again at once); a block is gathered for
            # its own forward and again for its own backward, then freed to its shard.
            gathered = name == unit or (unit == "root")
            cls = "c0" if gathered else "shard"
            state = "gathered (full)" if gathered else f"sharded (1/{world_size})"
            body.append(
                draw.rect(
                    left + i * cell_w + 1,
                    y,
                    cell_w - 2,
                    row_h - 4,
                    cls,
                    f"{unit} during {phase}: {state}",
                )
            )
        y += row_h
    for i, phase in enumerate(phases):
        _, _, name = phase.partition(" ")
        nbytes = sum(b if (n == name or n == "root") else b / world_size for n, b in units)
        held.append(nbytes)
        body.append(
            draw.text(left + (i + 0.5) * cell_w, y + 14, kib(nbytes), anchor="middle", size=10)
        )
    body.append(draw.text(left - 8, y + 14, "params held", anchor="end", size=11))
    svg = draw.svg(CHART_WIDTH, y + 22, body, "What FSDP gathers and frees per unit")
    full = sum(b for _, b in units)
    caption = (
        f"One training step of the cookbook's tiny model under FSDP on {world_size} ranks, "
        f"one unit per block plus the root: a unit's parameters are all-gathered (orange) "
        f"just before its forward and again before its backward, and freed back to this "
        f"rank's 1/{world_size} shard (grey) right after; gradients are reduce-scattered "
        f"as each backward ends. The bottom row is the parameter bytes a rank holds: at "
        f"most {kib(max(held))} instead of {kib(full)} for the whole model. Sizes from "
        f'the model\'s own parameters (<code>build_model("tiny")</code>).'
    )
    return draw.figure(svg, caption, "fsdp-units")


def chart_tp_split(tp: int = 2) -> str:
    from recipes.core.workload import MODEL_PRESETS

    cfg = MODEL_PRESETS["tiny"]
    dim, hidden = cfg.dim, cfg.mlp_ratio * cfg.dim
    body = []
    s = 1.3  # px per feature
    y0 = 30

    def matrix(x: float, y: float, rows: int, cols: int, split: str, label: str) -> float:
        w, h = cols * s, rows * s
        for r in range(tp):
            if split == "col":
                rect = (x + r * w / tp, y, w / tp, h)
            elif split == "row":
                rect = (x, y + r * h / tp, w, h / tp)
            else:
                rect = (x, y, w, h)
            body.append(
                draw.rect(
                    *rect,
                    f"c{r}" if split != "none" else "shard",
                    f"{label}: rank {r}'s part" if split != "none" else label,
                )
            )
            if split == "none":
                break
        body.append(draw.text(x + w / 2, y - 8, label, anchor="middle", size=11))
        return x + w

    x = 10
    x = matrix(x, y0, 16, dim, "none", f"x [tokens, {dim}]") + 14
    body.append(draw.text(x, y0 + 20, "@", size=14))
    x = matrix(x + 16, y0, dim, hidden, "col", f"w_in [{dim}, {hidden}] columns") + 14
    body.append(draw.text(x, y0 + 20, "=", size=14))
    x = matrix(x + 16, y0, 16, hidden, "col", f"h [tokens, {hidden // tp}] per rank") + 10
    body.append(draw.text(x, y0 + 20, "GELU, @", size=12))
    x = matrix(x + 52, y0, hidden, dim, "row", f"w_out [{hidden}, {dim}] rows") + 14
    body.append(draw.text(x, y0 + 20, "=", size=14))
    matrix(x + 16, y0, 16, dim, "none", "sum of partials")
    body.append(draw.text(x + 16, y0 + 16 * s + 16, "all-reduce", size=11))
    legend_y = y0 + hidden * s + 16
    for r in range(tp):
        body += [
            draw.rect(10 + r * 110, legend_y, 12, 12, f"c{r}"),
            draw.text(28 + r * 110, legend_y + 10, f"rank {r}", size=11),
        ]
    svg = draw.svg(CHART_WIDTH, legend_y + 20, body, "Tensor parallel: column then row split")
    caption = (
        f"The MLP of one block with tensor parallelism over {tp} ranks, to scale for the "
        f"cookbook's tiny model (dim {dim}, hidden {hidden}): <code>ColwiseParallel</code> "
        f"gives each rank a block of w_in's output columns, so each computes its own slice of "
        f"h with no communication and applies GELU to it; <code>RowwiseParallel</code> gives "
        f"each rank the matching rows of w_out, so each produces a partial sum of the full "
        f"output, and one all-reduce adds them. Attention splits the same way: wq, wk, wv by "
        f"columns (whole heads per rank), wo by rows."
    )
    return draw.figure(svg, caption, "tp-split")
