"""Measure recipes on this machine and write results/<name>.json: the figures of the docs'
"Measured" sections.

    python scripts/collect_results.py                     # every recipe `python -m recipes` lists
    python scripts/collect_results.py ddp_torchrun fsdp   # some of them
    python scripts/collect_results.py ddp_torchrun \\
        --command "torchrun --standalone --nproc_per_node=4 -m recipes.ddp_torchrun"

A copyable recipe that prints no result of its own (ddp_torchrun: one line per step) runs under
the harness instead, with the same options: `-m recipes.ddp_torchrun` becomes
`-m recipes.core.prove ddp_torchrun`, which measures it from outside and prints the JSON line.

Each recipe runs the command its module docstring opens with (the one `python -m recipes` prints and
its page shows: the default config on a small world, e.g. `torchrun --standalone --nproc_per_node=2
-m recipes.X`), under a timeout, in a fresh temporary directory with the repository on PYTHONPATH: a
recipe that writes checkpoints or logs starts from nothing (no resuming an earlier run) and leaves
nothing behind. Its last stdout line is its result as JSON (printed on rank 0); this
script stores it with what is needed to judge and reproduce it: the command, the date, the torch and
Python versions, the machine (CPU model and cores, GPUs) and the load average when the run started
(times measured on a busy machine are slower).

A recipe that fails or prints no JSON leaves its previous results file untouched; the script reports
it and exits with status 1. Commit the files it writes; docs/hooks.py renders them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Variables a launcher sets for its workers: inherited by accident (running this under torchrun),
# they would make the recipe believe it is one rank of a bigger world.
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


def recipe_command(name: str) -> str:
    """The command a recipe's docstring opens with, as `python -m recipes` shows it."""
    from recipes.__main__ import describe

    return describe(name)[1]


def measured_command(name: str, command: str) -> str:
    """``command`` as it is measured: through the harness for a recipe it proves from outside."""
    from recipes.core.prove import PROVABLE, prove_command

    return prove_command(command, name) if name in PROVABLE else command


def runnable(command: str) -> list[str]:
    """The command as argv, run with this interpreter (torchrun as `python -m
    torch.distributed.run`)."""
    argv = shlex.split(command)
    if argv[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    raise SystemExit(
        f"error: cannot run {command!r}: expected a command starting with torchrun or python"
    )


def describe_machine(load_average_1m: float) -> dict:
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu_model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next(
                line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
            )
    except (OSError, StopIteration):
        pass
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    if gpus:
        description = f"{len(gpus)} x {gpus[0]}, {cores} CPU cores"
    else:
        description = f"CPU only, {cores} cores ({cpu_model})"
    return {
        "description": description,
        "cpu_model": cpu_model,
        "cpu_cores": cores,
        "gpus": gpus,
        "platform": platform.platform(),
        "load_average_1m": round(load_average_1m, 2),
    }


def measure(name: str, command: str, timeout_s: float) -> dict:
    """Run one recipe and return its record; a RuntimeError says why it failed."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    load_average_1m = os.getloadavg()[0]  # before the run: the load the run started under
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix=f"collect-{name}-") as workdir:
            proc = subprocess.run(
                runnable(command),
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"did not finish within {timeout_s:.0f}s") from None
    wall_seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"exited with code {proc.returncode}:\n{tail}")
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
        if not isinstance(result, dict):
            raise ValueError("not a JSON object")
    except (IndexError, ValueError) as exc:
        raise RuntimeError(f"its last stdout line is not a JSON result ({exc})") from None
    import torch  # only now: a failing recipe is reported without waiting for torch to import

    return {
        "recipe": name,
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": describe_machine(load_average_1m),
        "wall_seconds": round(wall_seconds, 2),
        "result": result,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="recipes to measure (default: all)")
    parser.add_argument(
        "--command", help="run this instead of the docstring's command (one recipe only)"
    )
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per recipe")
    parser.add_argument(
        "--out-dir", type=Path, default=REPO_ROOT / "results", help="where the JSON files go"
    )
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO_ROOT))
    from recipes.__main__ import recipe_modules

    known = recipe_modules()
    names = args.names or known
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"unknown recipe(s) {', '.join(unknown)}; known: {', '.join(known)}")
    if args.command and len(names) != 1:
        parser.error("--command needs exactly one recipe name")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in names:
        command = measured_command(name, args.command or recipe_command(name))
        print(f"{name}: {command}", flush=True)
        try:
            record = measure(name, command, args.timeout_s)
        except RuntimeError as exc:
            print(f"  FAILED: {exc}", flush=True)
            failed.append(name)
            continue
        path = args.out_dir / f"{name}.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        result = record["result"]
        figures = ", ".join(
            f"{k}={result[k]}"
            for k in ("world_size", "seconds_per_step", "peak_memory_bytes")
            if k in result
        )
        print(
            f"  wrote {path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path} "
            f"({figures or 'no standard figures'}) in {record['wall_seconds']:.0f}s",
            flush=True,
        )
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
