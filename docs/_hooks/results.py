"""``<!-- results: X -->``: the "Measured" section of recipe X, from results/X.json (written by
scripts/collect_results.py) and the GPU benchmark's rows for it; ``<!-- bench -->``: every GPU
benchmark (results/bench/*.json, written by scripts/bench.py) as its own tables."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable
from typing import Any

from . import base
from .base import REPO_ROOT, MarkerError, escape, kib, number

# The parts of a rank's model state, as results' memory_per_rank holds them, with their labels.
PART_LABELS = {
    "param_bytes": "parameters",
    "grad_bytes": "gradients",
    "optimizer_bytes": "optimizer state",
}


def render_results(name: str, **_: Any) -> str:
    if not re.fullmatch(r"[a-z0-9_]+", name or ""):
        raise MarkerError(f"results: expected a recipe name, got {name!r}")
    path = base.RESULTS_DIR / f"{name}.json"
    if not path.exists():
        return (
            f'!!! note "Not measured yet"\n    Run `python scripts/collect_results.py {name}` '
            "to measure it "
            f"and commit `results/{name}.json`; the figures then appear here.\n"
        )
    try:
        return _gpu_runs(name) + results_markdown(json.loads(path.read_text()), name)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise MarkerError(
            f"results: results/{name}.json is not a results file ({type(exc).__name__}: {exc}); "
            f"rerun python scripts/collect_results.py {name}"
        ) from None


def _gpu_runs(name: str) -> str:
    """A recipe's own GPU runs, from results/bench/<device>-<name>.json (the job's): device, torch
    and date first, then one row per run."""
    parts = []
    for path in sorted((base.RESULTS_DIR / "bench").glob(f"*-{name}.json")):
        data = json.loads(path.read_text())
        rows = [
            "| run | ms/step | tokens/s | MFU (bf16 peak) | waiting for data |",
            "|---|---|---|---|---|",
        ]
        for run, record in data["runs"].items():
            result = record["result"]
            rows.append(
                f"| `{run}` | {1e3 * result['seconds_per_step']:.1f} | "
                f"{result['tokens_per_second']:,.0f} | {100 * result['mfu']:.1f}% | "
                f"{100 * result['data_wait_fraction']:.2f}% |"
            )
        parts.append(
            f"**On one {data['device']}** (torch {data['torch']}, {data['date']}): "
            f"{escape(data['what'])}.\n\n" + "\n".join(rows) + "\n\n"
        )
    return "".join(parts)


# The fields of RecipeResult that get a row of their own; any other field of the result gets a plain
# row.
_SHOWN = {
    "recipe",
    "world_size",
    "backend",
    "device",
    "seconds_per_step",
    "peak_memory_bytes",
    "losses",
    "param_checksum",
    "extras",
}


def results_markdown(data: dict, name: str) -> str:
    """The "Measured" section for one results file (see scripts/collect_results.py for its fields).

    What the recipe is about, with units: model-state bytes per rank against DDP (not the process's
    resident memory, which is mostly Python and torch on CPU), per-op and per-rank figures as real
    tables, the GPU benchmark's row for this recipe with its device and torch version. CPU times are
    shown only when the machine was not overloaded (load average at most its cores); temporary
    paths, empty values and None are left out.
    """
    result, machine = data["result"], data["machine"]
    load, cores = machine["load_average_1m"], machine.get("cpu_cores") or 1
    on_gpu = bool(machine.get("gpus")) or str(result.get("device", "")).startswith("cuda")
    timing_ok = on_gpu or load <= cores
    rows = [("Machine", f"{machine['description']}; load average {load:.1f} when the run started")]
    if {"world_size", "backend", "device"} <= result.keys():
        rows.append(
            (
                "World",
                f"{result['world_size']} rank(s), backend `{result['backend']}`, "
                f"device `{result['device']}`",
            )
        )
    elif "world_size" in result:
        rows.append(("World size", str(result["world_size"])))
    losses = result.get("losses") or []
    # A CPU time taken while other jobs held the cores measures them, not the recipe: such a row is
    # left out (never a row that says why it is empty); the GPU table below has the real figure.
    if "seconds_per_step" in result and losses and timing_ok:
        rows.append(
            (
                "Time per step",
                f"{_milliseconds(result['seconds_per_step'])} "
                "(rank 0, median over the steps after the first)",
            )
        )
    extras = {
        **{k: v for k, v in result.items() if k not in _SHOWN},
        **(result.get("extras") or {}),
    }
    memory = extras.pop("memory_per_rank", None)
    if memory:
        parts = memory[0]
        total = sum(parts.get(k, 0) for k in PART_LABELS)
        ddp = _ddp_model_state()
        versus = ""
        if ddp and name != "ddp_torchrun":
            versus = f", {total / ddp:.2f} x DDP's {kib(ddp)}"
        rows.append(
            (
                "Model state per rank",
                f"{kib(total)} on rank 0{versus}: parameters "
                f"{kib(parts['param_bytes'])}, gradients {kib(parts['grad_bytes'])}, "
                f"optimizer {kib(parts['optimizer_bytes'])} "
                "(`recipes.core.memory.model_state_bytes`)",
            )
        )
    if "peak_memory_bytes" in result and on_gpu:
        rows.append(
            (
                "Peak memory per rank",
                _memory(result["peak_memory_bytes"], str(result.get("device", ""))),
            )
        )
    if losses:
        rows.append(
            (
                "Loss",
                f"{number(losses[0])} at the first step, {number(losses[-1])} "
                f"after {len(losses)} steps",
            )
        )
    if not timing_ok:  # the same for every timing in the extras and in their tables
        extras = _without_timings(extras)
    tables = []
    special = SPECIAL_TABLES.get(name)
    if special:
        tables.append(special(result))
        extras = {k: v for k, v in extras.items() if k not in ("layouts", "rows")}
    for key, value in _figures(extras):
        if isinstance(value, str) and value.startswith("|"):
            tables.append(f"**`{key}`**\n\n{value}")
        else:
            raw = extras.get(key)
            if key.endswith("bytes") and isinstance(raw, (int, float)):
                value = kib(raw)
            rows.append((f"`{key}`", escape(value)))
    date = datetime.datetime.fromisoformat(data["date"]).strftime("%Y-%m-%d")
    rows += [
        ("Command", f"`{data['command']}`"),
        (
            "Measured",
            f"{date}, torch {data['torch']}, Python {data['python']}, "
            f"{data['wall_seconds']:.0f} s for the whole command",
        ),
    ]
    table = "| Figure | Value |\n|---|---|\n" + "\n".join(
        f"| {k} | {v.replace('|', chr(92) + '|')} |" for k, v in rows
    )
    # The GPU figure first, where one exists: it is the one that measures speed.
    gpu = _bench_rows(name)
    parts_md = [gpu, table, *tables] if gpu else [table, *tables]
    return "\n\n".join(parts_md) + (
        f"\n\nReproduce them with `python scripts/collect_results.py {name}`.\n"
    )


TIMING_KEY = re.compile(
    r"(_ms\b|_ms_|_us\b|seconds|per_second|_per_s\b|tflops|^mfu$|"
    r"idle_fraction_measured|timeline)"
)


def _without_timings(value: Any) -> Any:
    """The extras without a timing anywhere in them (keys named like TIMING_KEY, in records too)."""
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if not TIMING_KEY.search(str(k))}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def _memory_estimate_table(result: dict) -> str:
    """memory_estimate's whole table: one row per optimizer layout and strategy, in GB."""
    from recipes.memory_estimate import STAGES

    lines = [
        f"**Per rank, {result['params']:.4g} parameters on {result['world_size']} ranks** "
        "(GB = 10^9 bytes; offload moves the sharded parts to the host):",
        "",
        "| Optimizer | Strategy | Parameters | Gradients | Optimizer state | On the GPU "
        "| On the host |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        device, host = row["device"], row["host"]
        label = STAGES[row["stage"]].label + (" + offload" if row["offload"] else "")
        lines.append(
            f"| {row['optimizer']} | {escape(label)} | "
            f"{device['param_bytes'] / 1e9:,.2f} | {device['grad_bytes'] / 1e9:,.2f} | "
            f"{device['optimizer_bytes'] / 1e9:,.2f} | "
            f"**{device['total_bytes'] / 1e9:,.2f}** | {host['total_bytes'] / 1e9:,.2f} |"
        )
    return "\n".join(lines)


SPECIAL_TABLES: dict[str, Callable[[dict], str]] = {"memory_estimate": _memory_estimate_table}


def _ddp_model_state() -> float | None:
    path = base.RESULTS_DIR / "ddp_torchrun.json"
    try:
        per_rank = json.loads(path.read_text())["result"]["extras"]["memory_per_rank"][0]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    return sum(per_rank.get(k, 0) for k in PART_LABELS)


def _useless(value: Any) -> bool:
    """None, empty, or a path into a temporary directory: nothing a reader can use."""
    if value is None or value == "" or value == [] or value == {}:
        return True
    if isinstance(value, str):
        return value.startswith(("/tmp/", "/var/folders/")) or "/tmp/" in value
    if isinstance(value, list):
        return all(_useless(v) for v in value)
    return False


def _figures(extras: dict) -> list[tuple[str, str]]:
    """(name, text or markdown table) for each extra worth showing: dicts of scalars that share
    their keys become one table (collectives' op -> status and op -> ms), lists of records become
    tables, the rest a value."""
    shown = {k: v for k, v in extras.items() if not _useless(v)}
    out: list[tuple[str, str]] = []
    scalar_dicts = {
        k: v
        for k, v in shown.items()
        if isinstance(v, dict)
        and len(v) > 3
        and all(not isinstance(x, (dict, list)) for x in v.values())
    }
    if scalar_dicts:
        keys = list(dict.fromkeys(k for d in scalar_dicts.values() for k in d))
        head = "| | " + " | ".join(f"`{k}`" for k in scalar_dicts) + " |"
        lines = [head, "|---" * (len(scalar_dicts) + 1) + "|"]
        for key in keys:
            cells = [_cell(d.get(key, "")) for d in scalar_dicts.values()]
            lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
        out.append((" and ".join(scalar_dicts), "\n".join(lines)))
    for key, value in shown.items():
        if key in scalar_dicts:
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out.append((key, _records_table(value)))
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            out.append((key, _records_table([{"": k, **v} for k, v in value.items()])))
        elif not _raw_list(value):
            out.append((key, number(value)))
    return out


def _raw_list(value: Any) -> bool:
    """A list too long or too deep to read in a table cell (a timeline, every step's value): it
    stays in the results file, and a chart or a scalar on the page shows it."""
    if isinstance(value, dict):
        return any(_raw_list(v) for v in value.values())
    if not isinstance(value, (list, tuple)):
        return False
    return (
        len(value) > 8
        or len(number(value)) > 80
        or any(isinstance(v, (list, tuple)) and _raw_list(v) for v in value)
    )


def _records_table(records: list[dict]) -> str:
    flat = []
    for record in records:
        row = {}
        for key, value in record.items():
            if isinstance(value, dict):
                row.update({f"{key}.{k}": v for k, v in value.items()})
            elif not _useless(value) or key == "":
                row[key] = value
        flat.append(row)
    columns = [
        c
        for c in dict.fromkeys(k for row in flat for k in row)
        if not any(_raw_list(row.get(c)) for row in flat)
    ]
    lines = [
        "| " + " | ".join(f"`{c}`" if c else "" for c in columns) + " |",
        "|---" * len(columns) + "|",
    ]
    for row in flat[:60]:
        lines.append("| " + " | ".join(_cell(row.get(c, ""), c) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value: Any, column: str = "") -> str:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if is_number and column.endswith("bytes"):
        if value < 1024:
            return f"{value:g} B"
        return kib(value) if value < 2**30 else f"{value / 1e9:,.2f} GB"
    return escape(number(value)).replace("|", "\\|")


def _bench_rows(name: str) -> str:
    """This recipe's rows in every GPU benchmark (results/bench/*.json), with the device."""
    parts = []
    for path in sorted((base.RESULTS_DIR / "bench").glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        rows = [
            ("recipes", row)
            for batch, group in (data.get("recipes") or {}).items()
            for row in group
            if row.get("recipe") == name and row.get("ms_per_step")
        ]
        rows += [
            ("ladder", row)
            for row in data.get("ladder") or []
            if row.get("recipe") == name and row.get("ms_per_step")
        ]
        if not rows:
            continue
        measured = data.get("measured") or {}
        dates = sorted({str(measured.get(part, data["date"]))[:10] for part, _ in rows})
        lines = [
            "| Run | Global batch | Precision | Time per step | Tokens/s | MFU (bf16 peak) "
            "| Peak memory |",
            "|---|---|---|---|---|---|---|",
        ]
        for _, row in rows:
            mfu = row.get("mfu_vs_bf16_peak")
            lines.append(
                f"| {escape(row['label'])} | {row.get('batch', '')} | "
                f"{row.get('precision', '')} | {row['ms_per_step']:.1f} ms | "
                f"{row.get('tokens_per_second', 0):,.0f} | "
                f"{'' if mfu is None else f'{mfu:.0%}'} | "
                f"{row.get('peak_memory_gib', 0):.1f} GiB |"
            )
        # Every benchmark row is a world of 1: say what that measures, so that a DDP or FSDP row is
        # not read as a multi-GPU figure.
        parts.append(
            f"**On a GPU: {escape(data['device'])}, torch {data['torch']}**, model "
            f"`{data['model']}`, measured {' and '.join(dates)} by "
            f"`python scripts/bench.py`. One process on one GPU (a world of 1): what "
            "this recipe's code costs against the bare loop, with nothing to "
            "communicate; multi-GPU speed is not measured here. All rows: "
            "[Performance](performance.md).\n\n" + "\n".join(lines)
        )
    return "\n\n".join(parts)


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _memory(num_bytes: int, device: str) -> str:
    text = f"{num_bytes / 2**20:,.0f} MiB"
    if device.startswith("cuda"):
        return text + " (rank 0: `torch.cuda.max_memory_allocated`)"
    return (
        text
        + " (rank 0; on CPU this is the process's peak resident set, Python and torch included)"
    )


# <!-- bench -->: every results/bench/*.json that scripts/bench.py wrote on a GPU, as its own
# tables.
def render_bench(which: str | None = None, **__: Any) -> str:
    import importlib.util

    if which == "titan":
        return render_titan()
    if which:
        raise MarkerError(f"bench: expected no argument or 'titan', got {which!r}")
    spec = importlib.util.spec_from_file_location("bench", REPO_ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    # <device>.json: the benchmark; <device>-<recipe>.json: a recipe's own GPU runs (its page)
    files = [
        path
        for path in sorted((base.RESULTS_DIR / "bench").glob("*.json"))
        if "model" in json.loads(path.read_text())
    ]
    if not files:
        return (
            '!!! note "Not measured on a GPU yet"\n    Run `python scripts/bench.py` on a GPU '
            "and commit "
            "the `results/bench/<device>.json` it writes; the tables then appear here.\n"
        )
    parts = []
    for path in files:
        data = json.loads(path.read_text())
        parts.append(
            f"### {data['device']}, torch {data['torch']}, model `{data['model']}`\n\n"
            f"Measured {data['date'][:10]} by `python scripts/bench.py` "
            f"({data['steps']} steps a row, the median after the first). "
            f"{escape(data.get('notes', ''))}\n"
        )
        if data.get("ladder"):
            parts.append(
                f"**The ladder** (one device, `recipes.performance`, global batch "
                f"{data['ladder'][0]['batch']} unless the row says otherwise); *vs bare* is "
                "against the first row. MFU is against the "
                "dense bf16 peak for every row, so the ladder reads on one scale (the JSON also "
                "has it against each precision's own peak):\n\n"
                + bench.table(data["ladder"], data["ladder"][0].get("ms_per_step"), compact=True)
            )
        for batch, rows in data.get("gaps", {}).items():
            parts.append(
                f"**The gaps at global batch {batch}** (measured "
                f"{data.get('measured', {}).get('gaps', data['date'])[:10]}): each place a "
                "recipe was measured behind the bare loop, beside it; *vs bare* is against the "
                "first row, the eager bare loop. `python scripts/bench.py --parts gaps,profile` "
                "measures them and writes the profiler's top entries to "
                "`results/bench/<device>-profiles.txt`:\n\n"
                + bench.table(rows, rows[0].get("ms_per_step"), compact=True)
            )
        for batch, rows in data.get("recipes", {}).items():
            parts.append(
                f"**Every recipe at world 1, global batch {batch}**; *vs bare* is against the "
                "bare loop with the same precision, fused AdamW and batch:\n\n"
                + bench.table(rows, rows[0].get("ms_per_step"), compact=True)
            )
    return "\n\n".join(parts) + "\n"


# <!-- bench: titan -->: torchtitan's trainer beside recipes.job, from every
# results/bench/<device>-titan.json (scripts/titan_bench.py writes them; its table() renders).
def render_titan() -> str:
    import importlib.util

    files = sorted((base.RESULTS_DIR / "bench").glob("*-titan.json"))
    if not files:
        return (
            '!!! note "Not yet measured: needs a GPU"\n    On a GPU machine, '
            "`bash scripts/gpu_setup.sh && PYTHONPATH=. python3 scripts/bench.py --parts titan` "
            "trains both and writes `results/bench/<device>-titan.json`; the table then "
            "appears here.\n"
        )
    path = REPO_ROOT / "scripts" / "titan_bench.py"
    spec = importlib.util.spec_from_file_location("titan_bench", path)
    titan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(titan)  # type: ignore[union-attr]
    parts = []
    for path in files:
        data = json.loads(path.read_text())
        parts.append(
            f"**On one {escape(data['device'])}**, torch {data['torch']}, torchtitan "
            f"{data['torchtitan']}, {data['date'][:10]} (results/bench/{path.name}): "
            f"{escape(data['what'])}. MFU: {escape(data['flop_formula'])}, over the dense bf16 "
            "peak; torchtitan's own MFU (its formula and peak) beside it.\n\n" + titan.table(data)
        )
    return "\n\n".join(parts) + "\n"


# What the charts read too: every results file, and a result's extras with its other fields.
def load_results() -> dict[str, dict]:
    out = {}
    for path in sorted(base.RESULTS_DIR.glob("*.json")):
        try:
            out[path.stem] = json.loads(path.read_text())
        except ValueError:
            continue
    return out


def result_extras(data: dict) -> dict:
    result = data["result"]
    return {**{k: v for k, v in result.items() if k not in _SHOWN}, **(result.get("extras") or {})}
