"""``python -m recipes.X`` for every recipe: parse the config, run, print the result as JSON on
rank 0.

Errors a user can fix end in one line on stderr and a non-zero exit, never a hang or a deep
traceback. Under torchrun the same line goes into the error file torchrun reads (what
``torch.distributed.elastic.multiprocessing.errors.record`` writes for an exception), so that its
"Root Cause" summary shows it, with the worker's own exit code (2 for bad input).
"""

from __future__ import annotations

import contextlib
import io
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn, TypeVar

from recipes.core.config import exit_with, is_user_error, parse_config
from recipes.core.log import current_rank, get_logger
from recipes.core.result import RecipeResult
from recipes.core.world import (
    JoinError,
    RankError,
    collective_in_frames,
    is_collective_failure,
    release_ended_groups,
    report_and_exit,
    write_torchrun_error_file,
)

C = TypeVar("C")


def run_cli(
    run: Callable[[C], RecipeResult | None],
    config_cls: type[C],
    doc: str | None,
    argv: Sequence[str] | None = None,
) -> None:
    description = (doc or "").strip().split("\n\n")[0] or None
    cfg = parse_recording_errors(lambda: parse_config(config_cls, argv, description))
    try:
        result = run(cfg)
    except ValueError as exc:
        # RecipeError, or a ValueError class a recipe defines beside a function a user copies
        # (apply_fully_shard's ShardingError...); any other ValueError is a bug: its traceback.
        if not is_user_error(exc):
            record_unexpected(exc)
            raise
        # Every rank hits the same bad input: say it once, from rank 0, and exit non-zero
        # everywhere. Every rank writes the error file: torchrun may name any of them.
        write_torchrun_error_file(str(exc))
        if current_rank() == 0:
            exit_with(str(exc), 2)
        raise SystemExit(2) from None
    except JoinError as exc:
        report_and_exit(str(exc), 1)
    except RankError as exc:  # a spawned world lost a rank: its traceback (if it raised), one line
        if exc.remote_traceback:
            print(exc.remote_traceback, file=sys.stderr)
        write_torchrun_error_file(exc.args[0])
        exit_with(exc.args[0], 1)
    except Exception as exc:
        record_unexpected(exc)
        raise
    release_ended_groups()  # the run's models are gone: free them, then their process groups
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
    """A collective broke: this rank's one line names the peer that died (see world.Liveness),
    then the process ends without tearing the broken group down."""
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
