"""Run a copyable recipe measured by the harness, and print its result as JSON on rank 0.

    torchrun --standalone --nproc_per_node=2 -m recipes.core.prove ddp_torchrun
    python -m recipes.core.prove ddp_torchrun --steps 20        # a world of 1

The recipe's own command line (its ``make_parser()``) follows its name; its function runs with an
``Observer`` (``recipes.core.observe``), and the last stdout line is the ``RecipeResult`` as JSON:
what ``scripts/collect_results.py`` stores in results/. The recipe's own output (one line per step
from rank 0) comes first, unchanged.

It gives the recipe a robustness no recipe a user copies carries
(``recipes.core.world.recipe_world``): a join that never completes ends in one line within
``--timeout-s``; a survivor of a rank that died names it in one line ("error: rank 0: ... failed
because rank 1 (pid ...) is no longer running ...") and exits 1 without tearing the broken group
down; bad input, from argparse or the recipe's ``ValueError``, is one line and exit 2. Under
torchrun each of those lines also goes into torchrun's error file, which its "Root Cause" summary
prints.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn, TypeVar

from recipes.core.errors import exit_with, report_and_exit, write_torchrun_error_file
from recipes.core.log import current_rank, get_logger
from recipes.core.observe import prove
from recipes.core.world import JoinError, collective_in_frames, is_collective_failure

__all__ = ["PROVABLE", "main", "prove_command"]

C = TypeVar("C")

# The copyable recipes whose function takes an observer (model_ready, step_end), or that a probe
# measures from outside (recipes.core.observe.registry.PROBES: collectives trains nothing).
PROVABLE = (
    "ddp_torchrun",
    "single_gpu",
    "tensor_parallel",
    "fsdp2",
    "amp",
    "data_parallel",
    "zero",
    "hybrid_parallel",
    "ddp_spawn",
    "context_parallel",
    "activation_checkpointing",
    "meta_init",
    "sharded_checkpoint",
    "collectives",
    "hang_diagnosis",
    "grad_clipping",
    "sharded_accumulation",
    "profiling",
    "fsdp",
    "float8",
    "performance",
    "expert_parallel",
    "pipeline_parallel",
    "grad_accumulation",
    "hf_checkpoint",
    "finetune",
    "lightning_fabric",
    "lightning_trainer",
    "local_sgd",
    "comm_hooks",
    "ulysses",
    "activation_offload",
    "training_health",
)


def prove_command(command: str, name: str) -> str:
    """A recipe's command (``... -m recipes.NAME ...``) as the harness runs it."""
    return command.replace(f"-m recipes.{name}", f"-m recipes.core.prove {name}", 1)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in PROVABLE:
        given = repr(argv[0]) if argv else "no recipe"
        exit_with(
            f"python -m recipes.core.prove: {given}; name one of {', '.join(PROVABLE)} "
            "first, then its options",
            2,
        )
    name, options = argv[0], argv[1:]
    module = importlib.import_module(f"recipes.{name}")
    parser = module.make_parser()
    parser.prog = f"python -m recipes.core.prove {name}"
    function = getattr(module, "train", None) or module.run  # meta_init trains nothing: run
    config_cls = inspect.signature(function).parameters["cfg"].annotation
    if isinstance(config_cls, str):  # from __future__ import annotations
        config_cls = getattr(module, config_cls)
    args = parse_recording_errors(lambda: parser.parse_args(options))
    try:
        # a config that checks itself refuses here (hang_diagnosis: a skip past the last step)
        cfg = config_cls(**vars(args))
        # a bounded join, and a heartbeat that lets a survivor name the rank that died
        # (prove runs the recipe inside recipes.core.world.recipe_world)
        result = prove(function, cfg, name=name)
    except ValueError as exc:  # bad input: one line from each node's first process, exit 2
        write_torchrun_error_file(str(exc))
        # the first process of each node, as recipes/options.py prints: a node whose input
        # differs (a bad option on one node of a Slurm job) says so itself
        if int(os.environ.get("LOCAL_RANK", current_rank())) == 0:
            exit_with(str(exc), 2)
        raise SystemExit(2) from None
    except JoinError as exc:  # a store or a peer that never answered
        report_and_exit(str(exc), 1)
    except Exception as exc:  # a broken collective: one line naming the dead peer, exit 1
        record_unexpected(exc)  # anything else: torchrun's error file, then its traceback
        raise
    if current_rank() != 0:
        return
    if not result.losses:  # trained nothing (collectives), or stopped before a step ended
        print(result.to_json(), flush=True)
        return
    mfu = f"{100 * result.mfu:.1f}%" if result.mfu is not None else "n/a (no known peak)"
    get_logger("recipes").info(
        "done: %d steps on %d rank(s) (%s, %s, %s): loss %.4f -> %.4f, %.1f ms/step, "
        "%.0f tokens/s, MFU %s, peak memory %.0f MiB",
        len(result.losses),
        result.world_size,
        result.backend,
        result.device,
        result.precision,
        result.losses[0],
        result.losses[-1],
        result.seconds_per_step * 1e3,
        result.tokens_per_second,
        mfu,
        result.peak_memory_bytes / 2**20,
    )
    print(result.to_json(), flush=True)


def parse_recording_errors(parse: Callable[[], C]) -> C:
    """``parse()``; where argparse refuses the command line (it printed the line and exits), the
    line goes into torchrun's error file too (``python -m recipes.core.prove`` parses this way)."""
    captured = io.StringIO()
    try:
        with _tee_stderr(captured):
            return parse()
    except SystemExit as exc:  # a bad option or value: argparse printed the line; record it too
        if exc.code not in (0, None):
            lines = [line for line in captured.getvalue().splitlines() if "error:" in line]
            line = lines[-1].split("error: ", 1)[-1] if lines else f"bad command line ({exc.code})"
            write_torchrun_error_file(line)
        raise


@contextlib.contextmanager
def _tee_stderr(copy: io.StringIO) -> Iterator[None]:
    """What is written to stderr also goes into ``copy`` (argparse prints its errors itself)."""
    real = sys.stderr

    class Tee(io.TextIOBase):
        def write(self, text: str) -> int:
            copy.write(text)
            return real.write(text)

        def flush(self) -> None:
            real.flush()

    sys.stderr = Tee()
    try:
        yield
    finally:
        sys.stderr = real


def record_unexpected(exc: BaseException) -> None:
    """A failure that is not bad input: a broken collective ends the process with one line naming
    the peer; anything else goes into torchrun's error file, and the caller re-raises it."""
    if is_collective_failure(exc):
        _collective_failed(exc)
    write_torchrun_error_file(f"{type(exc).__name__}: {exc}")


def _collective_failed(exc: BaseException) -> NoReturn:
    """A collective broke: this rank's one line names the peer that died
    (``recipes.core.liveness``), then the process ends without tearing the broken group down."""
    first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    operation = collective_in_frames(frames[::-1]) or "a collective"
    cause = getattr(exc, "peer_report", None) or (
        "another rank probably exited or hung - see its error above"
    )
    report_and_exit(
        f"rank {current_rank()}: {operation} failed because {cause} "
        f"({first.strip()[:160]}); rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL for more",
        1,
        echo=True,
    )


if __name__ == "__main__":
    main()
