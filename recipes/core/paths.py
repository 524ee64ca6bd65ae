"""Path options checked before any work: a file where a folder is expected (or the reverse), a path
that does not exist, a folder that cannot be written. Without these a run trains first and fails at
its first write, in a traceback (``FileExistsError`` from ``makedirs``) or, under torchrun, in a
barrier or timeout message from the ranks that waited for the one that failed.

Each ``*_problem`` function returns one line that names the option, the path and the fix, or None.
``refuse`` raises the first problem that any rank found, on every rank, so that ``run_cli`` prints
it once (rank 0) and every rank exits 2 together: a rank that looks alone and leaves would hang the
others in their next collective. Writing is tried (a temporary file), not guessed from the mode
bits, which say nothing to root or on a read-only filesystem; nothing is created.
"""

from __future__ import annotations

import os
import tempfile

import torch.distributed as dist

from recipes.core.config import RecipeError

__all__ = ["output_dir_problem", "output_file_problem", "input_dir_problem", "input_file_problem",
           "refuse"]


def _unwritable(path: str) -> str | None:
    """Why a file or folder could not be created at ``path`` (in its nearest existing parent)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):  # what makedirs would create goes in here: try that
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, so nothing can be created under it"
    try:
        with tempfile.NamedTemporaryFile(dir=existing):
            return None
    except OSError as exc:
        return f"cannot write in {existing} ({exc.strerror or exc})"


def output_dir_problem(path: str, flag: str) -> str | None:
    """A folder the run creates if missing and writes into."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag} {path} is a file; name a directory (created if missing)"
    why = _unwritable(path)
    return f"{flag} {path}: {why}; name a directory you can write to" if why else None


def output_file_problem(path: str, flag: str) -> str | None:
    """A file the run writes (its folder is created if missing)."""
    if os.path.isdir(path):
        return f"{flag} {path} is a directory; name a file, e.g. {os.path.join(path, 'model.pt')}"
    why = _unwritable(os.path.dirname(os.path.abspath(path)))
    return f"{flag} {path}: {why}; name a file in a directory you can write to" if why else None


def input_dir_problem(path: str, flag: str, what: str) -> str | None:
    """A folder the run reads; ``what`` says what it should be ("the folder save_pretrained
    wrote")."""
    if not os.path.exists(path):
        return f"{flag} {path} does not exist; pass {what}"
    if not os.path.isdir(path):
        return f"{flag} {path} is a file, not a directory; pass {what}"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{flag} {path} cannot be read by this user; pass {what} that you can read"
    return None


def input_file_problem(path: str, flag: str, what: str) -> str | None:
    """A file the run reads; ``what`` says what it should be ("a .ckpt file")."""
    if not os.path.exists(path):
        return f"{flag} {path} does not exist; pass {what}"
    if os.path.isdir(path):
        return f"{flag} {path} is a directory, not a file; pass {what}"
    if not os.access(path, os.R_OK):
        return f"{flag} {path} cannot be read by this user; pass {what} that you can read"
    return None


def refuse(*problems: str | None) -> None:
    """Raise the first problem that this rank or any other found (one gather of short strings
    when a world exists); every rank raises the same RecipeError, or none does."""
    mine = next((p for p in problems if p), None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        mine = next((p for p in everyone if p), None)
    if mine:
        raise RecipeError(mine)
