"""The benchmark: the single-device speed ladder, then every training recipe against the bare loop.

    python scripts/bench.py        # a GPU: the 100m preset; CPU: the tiny one (CI runs this path)
    python scripts/bench.py --model small --steps 6 --out /tmp/bench.json

Part 1, the ladder (recipes.performance, one device): fp32 (TF32 off, torch's default) -> tf32 ->
bf16 autocast -> + fused AdamW -> + per-block torch.compile -> the same at twice the batch, and the
habits beside it (zero_grad to zeros, the math attention kernel, pinned-memory copies).

Part 2, every training recipe at world 1 with ``--precision auto`` (bf16 on a GPU) and its own
defaults otherwise, against the bare loop with the same precision, fused AdamW and batch: the
distance between a recipe and the bare loop is what the recipe's wrapper costs on one device.

Part 3, the gaps (``--parts gaps``): each place where a recipe was measured well behind the bare
loop, beside it at the batch where it showed: whole-step compile and CUDA graphs for the bare loop,
the sharded and tensor-parallel recipes at batch 32 eager and compiled, Lightning's Trainer,
activation checkpointing under compile. ``--parts profile`` writes the top host-side and device-side
entries of torch.profiler for the slowest of them (results/bench/<device>-profiles.txt).

Part 4, ``--parts titan`` (scripts/titan_bench.py): torchtitan's Llama trainer beside recipes.job
on one GPU, the same shapes and data (results/bench/<device>-titan.json); ``--dry-run`` on any
machine builds the configs and prints the runs. On a GPU machine without internet:
``bash scripts/gpu_setup.sh && PYTHONPATH=. python3 scripts/bench.py --parts titan``.

Every row is the median step time over the steps after the first (warm-up and compilation). MFU is
against the device's dense peak for the precision the row used; "MFU vs bf16 peak" puts every row on
the bf16 scale so the ladder reads as one line. It prints a markdown table and writes a JSON file
(device, torch version, date, rows) to results/bench/<device>.json (``--out`` to put it elsewhere);
the docs page of recipes.performance renders every file there.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import datetime
import gc
import inspect
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from recipes import (
    activation_checkpointing,
    amp,
    ddp_torchrun,
    fsdp,
    fsdp2,
    lightning_fabric,  # noqa: E402
    lightning_trainer,
    performance,
    pipeline_parallel,
    tensor_parallel,
    zero,
)
from recipes.core.errors import is_user_error  # noqa: E402
from recipes.core.observe import prove  # noqa: E402
from recipes.core.throughput import peak_flops  # noqa: E402

ON_GPU = torch.cuda.is_available() and os.environ.get("RECIPES_BACKEND") != "gloo"


def lightning_output_dir() -> str:
    """A temporary folder for the Lightning rows' logs and checkpoints, removed when the bench
    process exits (not when a process forked from it does): it used to stay in /tmp."""
    out, owner = tempfile.mkdtemp(prefix="bench-lightning-"), os.getpid()

    def remove() -> None:
        if os.getpid() == owner:
            shutil.rmtree(out, ignore_errors=True)

    atexit.register(remove)
    return out


def ladder(model: str, batch: int, steps: int, compile_backend: str) -> list[tuple[str, object]]:
    base = performance_config(
        model=model, global_batch_size=batch, steps=steps, compile_backend=compile_backend
    )
    fast = dataclasses.replace(base, precision="auto")
    return [
        (
            "fp32 (TF32 off), foreach AdamW",
            dataclasses.replace(base, precision="fp32", optimizer="foreach"),
        ),
        (
            "tf32 matmuls, foreach AdamW",
            dataclasses.replace(base, precision="tf32", optimizer="foreach"),
        ),
        ("bf16 autocast, foreach AdamW", dataclasses.replace(fast, optimizer="foreach")),
        ("bf16 + fused AdamW", fast),
        ("bf16 + fused + compile", dataclasses.replace(fast, compile=True)),
        (
            f"bf16 + fused + compile, batch {2 * batch}",
            dataclasses.replace(fast, compile=True, global_batch_size=2 * batch),
        ),
        ("bf16 + fused, zero_grad to zeros", dataclasses.replace(fast, zero_grad="zeros")),
        ("bf16 + fused, math attention", dataclasses.replace(fast, sdpa_backend="math")),
        ("bf16 + fused, pinned non_blocking copies", dataclasses.replace(fast, pin_memory=True)),
        ("bf16 + fused, for-loop AdamW", dataclasses.replace(fast, optimizer="for_loop")),
    ]


def recipes_at_world_1(
    model: str,
    batch: int,
    steps: int,
    compile_backend: str = "",
) -> list[tuple[str, object, object]]:
    """Every training recipe at world 1; with ``compile_backend``: those with --compile, compiled"""
    common = dict(model=model, global_batch_size=batch, steps=steps, precision="auto")
    out = lightning_output_dir()
    rows = [
        ("bare loop (performance)", proven, performance_config(**common)),
        ("ddp_torchrun", ddp_torchrun_proven, ddp_config(**common)),
        ("amp", proven, amp.AMPConfig(**common, device="auto" if ON_GPU else "cpu")),
        ("zero", proven, zero.ZeroConfig(**common, backend="auto" if ON_GPU else "gloo")),
        ("fsdp", proven, fsdp.FSDPConfig(**common, backend="auto" if ON_GPU else "gloo")),
        ("fsdp2", fsdp2_proven, fsdp2_config(**common)),
        ("fsdp2, no reshard", fsdp2_proven, fsdp2_config(**common, reshard_after_forward=False)),
        ("tensor_parallel", tensor_parallel_proven, tp_config(**common)),
        (
            "pipeline_parallel (1 stage)",
            proven,
            pipeline_parallel.PPConfig(**common, microbatches=1),
        ),
        (
            "lightning_trainer",
            proven,
            lightning_trainer.LightningConfig(**common, output_dir=out, logger="none"),
        ),
        ("lightning_fabric", proven, lightning_fabric.FabricConfig(**common)),
        (
            "checkpointing: none",
            proven,
            ac_config(**common, mode="none"),
        ),
        (
            "checkpointing: per_block",
            proven,
            ac_config(**common, mode="per_block"),
        ),
        (
            "checkpointing: op_selective",
            proven,
            ac_config(**common, mode="op_selective"),
        ),
    ]
    if not compile_backend:
        return rows
    # Compiling costs ~20 s a row on a GPU: the bare loop and the three wrappers it matters most
    # for.
    compiled = ("bare loop (performance)", "ddp_torchrun", "fsdp2", "tensor_parallel")
    return [
        (
            f"{label} + compile",
            train,
            dataclasses.replace(cfg, compile=True, compile_backend=compile_backend),
        )
        for label, train, cfg in rows
        if label in compiled
    ]


def gap_rows(model: str, batch: int, steps: int, compile_backend: str) -> dict[str, list]:
    """Issue 25's rows: each recipe where it was measured slow, beside the bare loop, at twice
    ``batch`` (64 on a GPU) and at ``batch`` (32), where the host shows."""
    common = dict(model=model, steps=steps, precision="auto")
    compiled = dict(compile=True, compile_backend=compile_backend)
    perf, ac = performance_config, ac_config
    out = lightning_output_dir()
    b64, b32 = dict(common, global_batch_size=2 * batch), dict(common, global_batch_size=batch)
    return {
        str(2 * batch): [
            ("bare loop", proven, perf(**b64)),
            ("bare loop + compile (blocks + loss)", proven, perf(**b64, **compiled)),
            (
                "bare loop + compile (whole model + loss)",
                proven,
                perf(**b64, **compiled, compile_scope="model"),
            ),
            (
                "bare loop + compile (whole model + loss), CUDA graphs",
                proven,
                perf(**b64, **compiled, compile_scope="model", compile_mode="reduce-overhead"),
            ),
            ("ddp_torchrun + compile", ddp_torchrun_proven, ddp_config(**b64, **compiled)),
            ("fsdp2 + compile", fsdp2_proven, fsdp2_config(**b64, **compiled)),
            (
                "tensor_parallel (compiled: its GPU default)",
                tensor_parallel_proven,
                tp_config(**b64, compile_backend=compile_backend),
            ),
            (
                "lightning_trainer",
                proven,
                lightning_trainer.LightningConfig(**b64, output_dir=out, logger="none"),
            ),
            ("lightning_fabric", proven, lightning_fabric.FabricConfig(**b64)),
            ("checkpointing: none + compile", proven, ac(**b64, **compiled, mode="none")),
            ("checkpointing: per_block + compile", proven, ac(**b64, **compiled, mode="per_block")),
            (
                "checkpointing: op_selective + compile",
                proven,
                ac(**b64, **compiled, mode="op_selective"),
            ),
        ],
        str(batch): [
            ("bare loop", proven, perf(**b32)),
            ("bare loop + compile (blocks + loss)", proven, perf(**b32, **compiled)),
            ("fsdp2", fsdp2_proven, fsdp2_config(**b32)),
            ("fsdp2 + compile", fsdp2_proven, fsdp2_config(**b32, **compiled)),
            (
                "fsdp2, no reshard + compile",
                fsdp2_proven,
                fsdp2_config(**b32, **compiled, reshard_after_forward=False),
            ),
            (
                "fsdp (classic)",
                proven,
                fsdp.FSDPConfig(**b32, backend="auto" if ON_GPU else "gloo"),
            ),
            ("tensor_parallel --eager", tensor_parallel_proven, tp_config(**b32, eager=True)),
            (
                "tensor_parallel (compiled: its GPU default)",
                tensor_parallel_proven,
                tp_config(**b32, compile_backend=compile_backend),
            ),
        ],
    }


class ProfilerSteps:
    """The observer a copyable recipe calls (``model_ready``, ``step_end``): ``profiler.step()``
    at each step's end, as StepMarks does for the recipes that log their steps."""

    def __init__(self, profiler):
        self.profiler = profiler

    def model_ready(self, model, optimizer) -> None:
        pass

    def step_end(self, step: int, loss: float) -> None:
        self.profiler.step()


def lightning_profiler_steps(profiler):
    """ProfilerSteps for recipes/lightning_trainer.py, whose observer is a Callback on its Trainer:
    ``profiler.step()`` at the end of each optimizer step's last micro-batch."""
    import lightning as L

    class LightningProfilerSteps(ProfilerSteps, L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
                self.step_end(trainer.global_step - 1, float("nan"))

    return LightningProfilerSteps(profiler)


class StepMarks(logging.Handler):
    """Calls ``profiler.step()`` at each "step N loss ..." line a recipe logs: the profiler's
    schedule then counts the recipe's own steps, seen from outside."""

    def __init__(self, profiler):
        super().__init__()
        self.profiler = profiler

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("step "):
            self.profiler.step()


def profile(label: str, train, cfg, limit: int = 15) -> str:
    """torch.profiler over steps 3-5 of a run: the top entries by host time and by device time,
    and the count of each op per step (the host-bound question is how many, not how long)."""
    from torch.profiler import ProfilerActivity, schedule

    torch._dynamo.reset()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_GPU else [])
    active = 3
    with torch.profiler.profile(
        activities=activities, schedule=schedule(wait=2, warmup=1, active=active)
    ) as prof:
        handler = StepMarks(prof)
        loggers = [logging.getLogger(name) for name in ("recipes", f"recipes.{cfg_recipe(cfg)}")]
        for logger in loggers:
            logger.addHandler(handler)
        try:
            if "observer" in inspect.signature(train).parameters:  # a copyable recipe
                steps = (
                    lightning_profiler_steps
                    if cfg_recipe(cfg) == "lightning_trainer"
                    else ProfilerSteps
                )
                train(cfg, observer=steps(prof))
            else:
                train(cfg)
        finally:
            for logger in loggers:
                logger.removeHandler(handler)
    events = prof.key_averages()
    text = [f"## {label} (batch {cfg.global_batch_size}): {active} steps profiled\n"]
    text.append(
        events.table(sort_by="self_cpu_time_total", row_limit=limit, max_name_column_width=60)
    )
    if ON_GPU:
        text.append(
            events.table(sort_by="self_cuda_time_total", row_limit=limit, max_name_column_width=60)
        )
    return "\n".join(text)


def ddp_torchrun_proven(cfg):
    """recipes.ddp_torchrun returns its losses only: the harness measures it from outside."""
    return prove(ddp_torchrun.train, cfg, name="ddp_torchrun")


def proven(cfg):
    """A copyable recipe (the config's module) returns its losses only: the harness measures it."""
    name = cfg_recipe(cfg)
    return prove(sys.modules[f"recipes.{name}"].train, cfg, name=name)


def ddp_config(**fields) -> ddp_torchrun.DDPConfig:
    """ddp_torchrun picks NCCL whenever CUDA is there: --device cpu says gloo to it directly."""
    return ddp_torchrun.DDPConfig(**fields, backend="auto" if ON_GPU else "gloo")


def tensor_parallel_proven(cfg):
    """recipes.tensor_parallel returns its losses only: the harness measures it from outside."""
    return prove(tensor_parallel.train, cfg, name="tensor_parallel")


def tp_config(**fields) -> tensor_parallel.TPConfig:
    """As ``ddp_config``: gloo said directly where the GPU is not to be used."""
    return tensor_parallel.TPConfig(**fields, backend="auto" if ON_GPU else "gloo")


def fsdp2_proven(cfg):
    """recipes.fsdp2 returns its losses only: the harness measures it from outside."""
    return prove(fsdp2.train, cfg, name="fsdp2")


def performance_config(**fields) -> performance.PerformanceConfig:
    """performance runs on one device, no process group: --device cpu says cpu to it directly."""
    return performance.PerformanceConfig(**fields, device="auto" if ON_GPU else "cpu")


def fsdp2_config(**fields) -> fsdp2.FSDP2Config:
    """fsdp2 joins through recipes.dist_setup, which picks NCCL whenever CUDA is there."""
    return fsdp2.FSDP2Config(**fields, backend="auto" if ON_GPU else "gloo")


def ac_config(**fields) -> activation_checkpointing.ACConfig:
    """activation_checkpointing trains on one device: cuda where the GPU runs are, else cpu."""
    return activation_checkpointing.ACConfig(**fields, device="auto" if ON_GPU else "cpu")


def cfg_recipe(cfg) -> str:
    return type(cfg).__module__.split(".")[-1]


def measure(label: str, train, cfg) -> dict:
    # Each row compiles afresh: Dynamo's cache would otherwise carry the last row's shapes over
    # and compile this row's batch size as a dynamic shape (slower kernels than a static one).
    torch._dynamo.reset()
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {
        "label": label,
        "recipe": type(cfg).__module__.split(".")[-1],
        "batch": cfg.global_batch_size,
    }
    try:
        result = train(cfg)
    except Exception as exc:  # noqa: BLE001 - one broken row must not lose the others' numbers
        if is_user_error(exc):  # this machine cannot run the row (tf32 on CPU, pinned memory...)
            return {**row, "skipped": str(exc)}
        traceback.print_exc()
        return {**row, "failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    bf16_peak = peak_flops(torch.device("cuda", 0), "bf16") if ON_GPU else None
    extras = result.extras
    return {
        **row,
        "precision": result.precision,
        "ms_per_step": 1e3 * result.seconds_per_step,
        "tokens_per_second": result.tokens_per_second,
        "model_tflops": result.model_tflops,
        "mfu": result.mfu,
        "mfu_vs_bf16_peak": result.model_tflops * 1e12 / bf16_peak if bf16_peak else None,
        "peak_memory_gib": result.peak_memory_bytes / 2**30,
        "saved_bytes": extras.get("saved_bytes"),
        "sdpa_backend_ran": extras.get("sdpa_backend_ran"),
        "final_loss": result.losses[-1],
    }


def table(rows: list[dict], baseline_ms: float | None, *, compact: bool = False) -> str:
    """Markdown rows. ``compact`` (the docs column): no batch column, one MFU (vs the bf16 peak)."""

    def pct(value):
        return f"{100 * value:.1f}%" if value is not None else "n/a"

    columns = [
        "run",
        "batch",
        "ms/step",
        "vs bare",
        "tokens/s",
        "MFU",
        "MFU vs bf16 peak",
        "peak GiB",
        "note",
    ]
    if compact:
        columns = ["run", "ms/step", "vs bare", "tokens/s", "MFU (bf16 peak)", "GiB", "note"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if "ms_per_step" not in row:
            cells = {
                "run": row["label"],
                "batch": row["batch"],
                "note": row.get("skipped") or row.get("failed"),
            }
            lines.append("| " + " | ".join(str(cells.get(c, "")) for c in columns) + " |")
            continue
        note = []
        if row.get("sdpa_backend_ran"):
            note.append(f"attention: {row['sdpa_backend_ran']}")
        if row.get("saved_bytes"):
            note.append(f"saved for backward {row['saved_bytes'] / 2**20:.0f} MiB")
        cells = {
            "run": row["label"],
            "batch": str(row["batch"]),
            "ms/step": f"{row['ms_per_step']:.1f}",
            "vs bare": f"{row['ms_per_step'] / baseline_ms - 1:+.1%}" if baseline_ms else "",
            "tokens/s": f"{row['tokens_per_second']:,.0f}",
            "MFU": pct(row["mfu"]),
            "MFU vs bf16 peak": pct(row["mfu_vs_bf16_peak"]),
            "MFU (bf16 peak)": pct(row["mfu_vs_bf16_peak"]),
            "peak GiB": f"{row['peak_memory_gib']:.2f}",
            "GiB": f"{row['peak_memory_gib']:.1f}",
            "note": "; ".join(note),
        }
        lines.append("| " + " | ".join(cells[c] for c in columns) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    global ON_GPU
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="100m" if ON_GPU else "tiny", choices=["tiny", "small", "100m"]
    )
    parser.add_argument(
        "--batch", type=int, default=32 if ON_GPU else 8, help="global batch (sequences)"
    )
    parser.add_argument("--steps", type=int, default=20 if ON_GPU else 4)
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu"],
        help="cpu: measure the CPU also where a GPU is (every recipe joins a gloo world)",
    )
    parser.add_argument(
        "--parts",
        default="ladder,recipes,compiled",
        help="any of ladder, recipes, compiled, gaps, profile, titan (comma-separated)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="titan: build the configs and print the runs, train nothing (any machine)",
    )
    parser.add_argument(
        "--out", default="", help="JSON output; default results/bench/<device>.json"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated label prefixes (titan: shapes): only those rows"
    )
    args = parser.parse_args(argv)
    if args.device == "cpu":  # every row's config then names gloo (or the CPU) instead of auto
        os.environ["RECIPES_BACKEND"], ON_GPU = "gloo", False
    if args.steps < 2 or args.batch < 1:
        parser.exit(2, "error: --steps must be >= 2 (the first is warm-up) and --batch >= 1\n")
    device = (
        torch.cuda.get_device_name(0) if ON_GPU else f"CPU ({platform.processor() or 'unknown'})"
    )
    compile_backend = "inductor" if ON_GPU else "aot_eager"  # no C++ compiler needed on CPU
    parts = set(args.parts.split(","))
    prefixes = [p for p in args.only.split(",") if p]

    if args.dry_run and "titan" not in parts:
        parser.exit(2, "error: --dry-run is for --parts titan\n")
    if "titan" in parts:  # its own runs (torchrun children) and its own file
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import titan_bench

        shapes = [s for s in titan_bench.SHAPES if not prefixes or s.startswith(tuple(prefixes))]
        code = titan_bench.run(shapes=shapes, out=args.out, dry_run=args.dry_run)
        parts.discard("titan")
        if code or not parts:
            return code

    def chosen(rows):
        return [row for row in rows if not prefixes or any(row[0].startswith(p) for p in prefixes)]

    slug = "".join(c if c.isalnum() else "-" for c in device.lower()).strip("-")
    path = args.out or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "results",
        "bench",
        f"{slug}.json",
    )
    # The parts not run this time keep their rows from the last run on this device (one file a
    # device); each part says when it was measured, and with which torch.
    previous = {}
    if os.path.exists(path):
        with open(path) as file:
            previous = json.load(file)
    report = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "steps": args.steps,
        "ladder": [],
        "recipes": {},
    }
    print(f"# bench on {device}, torch {torch.__version__}, model {args.model}\n", flush=True)
    measured_at = {part: report["date"] + ", torch " + torch.__version__ for part in parts}
    for key in ("ladder", "recipes", "gaps", "notes"):
        if key in previous:  # replaced below by the parts that run now
            report[key] = previous[key]
    earlier = previous.get("measured") or (
        {part: f"{previous['date']}, torch {previous['torch']}" for part in ("ladder", "recipes")}
        if previous
        else {}
    )
    report["measured"] = {**earlier, **measured_at}
    if {"recipes", "compiled"} & parts:
        report["recipes"] = {}
    if "ladder" in parts:
        report["ladder"] = [
            measure(label, proven, cfg)
            for label, cfg in chosen(ladder(args.model, args.batch, args.steps, compile_backend))
        ]
        print(table(report["ladder"], report["ladder"][0].get("ms_per_step")), "\n", flush=True)
    if "recipes" in parts:
        for batch in (2 * args.batch, args.batch):
            rows = [
                measure(label, train, cfg)
                for label, train, cfg in chosen(recipes_at_world_1(args.model, batch, args.steps))
            ]
            report["recipes"][str(batch)] = rows
            print(f"## every recipe at world 1, batch {batch}, against the bare loop\n")
            print(table(rows, rows[0].get("ms_per_step")), "\n", flush=True)
    if "compiled" in parts:
        batch = 2 * args.batch  # compiled: the batch where the ladder's compile row is fastest
        rows = [
            measure(label, train, cfg)
            for label, train, cfg in chosen(
                recipes_at_world_1(args.model, batch, args.steps, compile_backend)
            )
        ]
        report["recipes"][f"{batch} compiled"] = rows
        print(f"## the recipes with --compile at world 1, batch {batch}\n")
        print(table(rows, rows[0].get("ms_per_step") if rows else None), "\n", flush=True)
    if "gaps" in parts:
        report["gaps"] = {}
        for batch, rows in gap_rows(args.model, args.batch, args.steps, compile_backend).items():
            measured = [measure(label, train, cfg) for label, train, cfg in chosen(rows)]
            report["gaps"][batch] = measured
            print(f"## the gaps, batch {batch}\n")
            print(
                table(measured, measured[0].get("ms_per_step") if measured else None),
                "\n",
                flush=True,
            )
            write(path, report)
    if "profile" in parts:
        batch32 = dict(model=args.model, steps=7, precision="auto", global_batch_size=args.batch)
        batch64 = dict(batch32, global_batch_size=2 * batch32["global_batch_size"])
        out = lightning_output_dir()
        runs = [
            ("bare loop", performance.train, performance_config(**batch32)),
            ("fsdp2", fsdp2.train, fsdp2_config(**batch32)),
            (
                "fsdp2 + compile",
                fsdp2.train,
                fsdp2_config(**batch32, compile=True, compile_backend=compile_backend),
            ),
            ("bare loop", performance.train, performance_config(**batch64)),
            (
                "lightning_trainer",
                lightning_trainer.train,
                lightning_trainer.LightningConfig(**batch64, output_dir=out, logger="none"),
            ),
        ]
        texts = []
        for label, train, cfg in chosen(runs):
            try:
                texts.append(profile(label, train, cfg))
            except Exception as exc:  # noqa: BLE001 - keep the other profiles
                traceback.print_exc()
                texts.append(f"## {label}: failed: {type(exc).__name__}: {exc}")
            print(texts[-1][:3000], flush=True)
        profiles = path[: -len(".json")] + "-profiles.txt"
        with open(profiles, "w") as file:
            file.write(
                f"# torch.profiler on {device}, torch {torch.__version__}, "
                f"{report['date']}\n\n" + "\n\n".join(texts) + "\n"
            )
        print(f"wrote {profiles}")
    write(path, report)
    return 0


def write(path: str, report: dict) -> None:
    with open(path, "w") as file:
        json.dump(report, file, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
