"""Bad input and failures as one line: what the harness prints, and what torchrun's summary shows.

``RecipeError`` is bad input a user can fix; ``is_user_error`` also counts the ``ValueError``
classes the recipes define beside the functions a user copies. ``report_and_exit`` prints one line
and writes it into torchrun's error file (``TORCHELASTIC_ERROR_FILE``, what ``@record`` would
write), so that torchrun's "Root Cause" summary names it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from typing import NoReturn

__all__ = [
    "RecipeError",
    "exit_with",
    "first_line",
    "is_user_error",
    "report_and_exit",
    "write_atomically",
    "write_torchrun_error_file",
]


class RecipeError(ValueError):
    """Bad input that the user can fix: the message is one line and names the fix."""


def is_user_error(exc: BaseException) -> bool:
    """Bad input the user can fix: a RecipeError, or a ValueError subclass that a recipe module
    defines beside the function a user copies (``ShardingError`` beside ``apply_fully_shard``...):
    those functions stand alone, so they cannot raise RecipeError. A recipe run as ``python -m
    recipes.X`` defines its classes in ``__main__``: its import name comes from ``__spec__``."""
    if isinstance(exc, RecipeError):
        return True
    if not isinstance(exc, ValueError):
        return False
    module_name = type(exc).__module__
    spec = getattr(sys.modules.get(module_name), "__spec__", None)
    return (getattr(spec, "name", None) or module_name).startswith("recipes.")


def exit_with(message: str, code: int = 2) -> NoReturn:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def report_and_exit(message: str, code: int, *, echo: bool = False) -> NoReturn:
    """One line on stderr, the same line in torchrun's error file, then exit without teardown.

    torchrun names as root cause the failure with the smallest timestamp, in whole seconds, ties
    going to the lowest local rank: ``echo=True`` (this rank failed because a peer died) stamps
    the failure one second later, so that the dead peer, not rank 0, is named.
    """
    print(f"error: {message}", file=sys.stderr, flush=True)
    write_torchrun_error_file(message, delay_s=1 if echo else 0)
    sys.stdout.flush()
    os._exit(code)  # skip teardown: a process group whose peer is gone can block or abort in it


def write_torchrun_error_file(message: str, *, delay_s: int = 0) -> None:
    """Without this file torchrun's summary says "To enable traceback see ..." instead."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    # The format torch.distributed.elastic reads (ProcessFailure._get_error_data): a plain-string
    # message with a top-level timestamp is printed as it is.
    data = {"message": message, "timestamp": str(int(time.time()) + delay_s)}
    with contextlib.suppress(OSError):
        write_atomically(path, json.dumps(data).encode())


def write_atomically(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0] if lines else ""
