"""``python -m recipes.X`` for every recipe: parse the config, run, print the result as JSON on rank 0.

Errors a user can fix end in one line on stderr and a non-zero exit, never a hang or a deep traceback.
"""

from __future__ import annotations

import gc
import sys
import traceback
from typing import Callable, Sequence, TypeVar

import torch.distributed as dist

from recipes.core.config import RecipeError, exit_with, parse_config
from recipes.core.log import current_rank, get_logger
from recipes.core.result import RecipeResult
from recipes.core.world import RankError, collective_in_frames

C = TypeVar("C")


def run_cli(run: Callable[[C], RecipeResult | None], config_cls: type[C], doc: str | None,
            argv: Sequence[str] | None = None) -> None:
    description = (doc or "").strip().split("\n\n")[0] or None
    cfg = parse_config(config_cls, argv, description)
    try:
        result = run(cfg)
    except RecipeError as exc:
        # Every rank hits the same bad input: say it once, from rank 0, and exit non-zero everywhere.
        if current_rank() == 0:
            exit_with(str(exc), 2)
        raise SystemExit(2)
    except RankError as exc:  # a spawned world lost a rank: its traceback (if it raised), then one line
        if exc.remote_traceback:
            print(exc.remote_traceback, file=sys.stderr)
        exit_with(exc.args[0], 1)
    except dist.DistError as exc:
        _collective_failed(exc)
    except RuntimeError as exc:
        text = str(exc)
        if any(word in text for word in ("gloo", "Connection closed", "Connection reset", "Timed out", "NCCL",
                                             "mismatch between collectives")):
            _collective_failed(exc)
        raise
    # Free what the recipe built (modules and hooks that hold process groups, often in reference cycles)
    # now, while the interpreter is whole: freed during interpreter shutdown instead, a gloo group's
    # threads can abort the process ("terminate called without an active exception") after a good run.
    gc.collect()
    if result is not None and current_rank() == 0:
        if result.losses:
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


def _collective_failed(exc: BaseException) -> None:
    first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    frames = [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)][::-1]
    operation = collective_in_frames(frames) or "a collective"
    exit_with(
        f"rank {current_rank()}: {operation} failed ({first.strip()[:200]}); another rank probably exited or "
        "hung - see its error above; rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL for more",
        1,
    )
