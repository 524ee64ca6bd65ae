"""Crash-safe publishing of checkpoint directories: the part torch.distributed.checkpoint leaves to
you.

DCP writes shards straight into the directory it is given and ``.metadata`` last, so a save that
dies part-way leaves a half-written directory, and saving over the last good checkpoint destroys it.
Here:

- every save is written into ``root/.tmp-step_N/`` (``begin_save`` clears the remains of dead
  saves);
- ``publish`` (every rank calls it once the writes are done) writes a manifest (size and sha256 of
  every file, hashed by all ranks in parallel, plus what the run was made with), renames the
  directory to ``step_N/`` (atomic on one filesystem), replaces the ``latest`` pointer file (atomic
  too) and prunes;
- ``find_checkpoint`` turns ``--resume-from`` into a directory, taking the newest published
  ``step_N`` when a crash between the rename and the pointer left ``latest`` behind;
- ``verify_checkpoint`` checks every file against the manifest before anything is loaded, and
  ``check_made_with`` compares the recorded settings: both refuse with one line naming the file.

The checkpoint directory must be on a filesystem every rank sees (as DCP itself requires). Used by
recipes/sharded_checkpoint.py; nothing here knows a model or an optimizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from recipes.core.config import RecipeError
from recipes.core.log import get_logger

__all__ = ["MANIFEST", "LATEST", "TMP_PREFIX", "STEP_DIR", "step_dir_name", "PendingSave",
           "begin_save", "publish", "published_steps", "published_bytes", "find_checkpoint",
           "verify_checkpoint", "check_made_with", "file_entry", "path_problem",
           "refuse_bad_paths", "dcp_errors_in_one_line"]

log = get_logger(__name__)

MANIFEST = "MANIFEST.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --8<-- [start:publish]
@dataclass
class PendingSave:
    """A checkpoint whose shards may still be being written; ``finish()`` waits and publishes it."""

    root: str
    step: int
    group: dist.ProcessGroup | None
    keep_last: int
    made_with: dict[str, Any] = field(default_factory=dict)  # see check_made_with
    future: Any = None  # a concurrent.futures.Future of the writes; None for a blocking save

    @property
    def tmp_dir(self) -> str:
        return os.path.join(self.root, TMP_PREFIX + step_dir_name(self.step))

    def finish(self) -> str:
        if self.future is not None:
            self.future.result()  # re-raises here if this rank's background write failed
            self.future = None
        return publish(self)


def begin_save(pending: PendingSave) -> str:
    """Every rank: refuse to write over a published checkpoint, clear the remains of saves that died
    part-way (never published, never read), and return the directory to write into."""
    final_dir = os.path.join(pending.root, step_dir_name(pending.step))
    if os.path.exists(final_dir):  # every rank sees it (shared filesystem): all raise, none hangs
        raise RecipeError(f"{final_dir} already exists: a checkpoint is never written over; "
                          "resume from it or use another --checkpoint-dir")
    if dist.get_rank() == 0:
        os.makedirs(pending.root, exist_ok=True)
        for name in os.listdir(pending.root):
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(pending.root, name))
    dist.barrier(group=pending.group)  # nobody writes into .tmp-* before rank 0 has cleared it
    return pending.tmp_dir


def publish(pending: PendingSave) -> str:
    """Manifest, then one rename, then the ``latest`` pointer: a crash at any point leaves the last
    good checkpoint loadable and ``latest`` naming a complete one (or one behind: see
    find_checkpoint)."""
    rank, group = dist.get_rank(), pending.group
    dist.barrier(group=group)  # every rank's writes have returned: .metadata and all shards exist
    files = sorted(os.listdir(pending.tmp_dir))
    entries = _gather_file_entries(pending.tmp_dir, files, group)  # hashing is split over the ranks
    final_dir = os.path.join(pending.root, step_dir_name(pending.step))
    if rank == 0:
        manifest = {"step": pending.step, "world_size": dist.get_world_size(),
                    "made_with": pending.made_with, "files": entries}
        _write_durably(os.path.join(pending.tmp_dir, MANIFEST),
                       json.dumps(manifest, indent=1).encode())
        os.rename(pending.tmp_dir, final_dir)  # atomic: the checkpoint appears whole or not at all
        _fsync_dir(pending.root)
        _write_durably(os.path.join(pending.root, LATEST), step_dir_name(pending.step).encode())
        _prune(pending.root, pending.keep_last)
    dist.barrier(group=group)  # nobody reads 'latest' before it names the new checkpoint
    return final_dir
# --8<-- [end:publish]


def _gather_file_entries(directory: str, files: list[str],
                         group: dist.ProcessGroup | None) -> dict[str, dict]:
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    mine = {name: file_entry(os.path.join(directory, name)) for name in files[rank::world_size]}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    return dict(sorted((name, entry) for part in gathered for name, entry in part.items()))


def file_entry(path: str) -> dict[str, Any]:
    """A file's manifest entry: its size and sha256."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def _write_durably(path: str, data: bytes) -> None:
    """Write to a temporary name, fsync, rename over ``path``: readers see the old or the new file,
    whole."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the rename itself durable, not only the file contents
    finally:
        os.close(fd)


def published_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the published checkpoints in ``root`` (with a manifest), oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(root))
                  if m and os.path.exists(os.path.join(root, m.group(0), MANIFEST)))


def published_bytes(root: str, step: int) -> int:
    """All files of a published checkpoint, in bytes, as its manifest lists them."""
    with open(os.path.join(root, step_dir_name(step), MANIFEST)) as f:
        return sum(entry["bytes"] for entry in json.load(f)["files"].values())


def _prune(root: str, keep_last: int) -> None:
    if keep_last > 0:
        for step in published_steps(root)[:-keep_last]:
            shutil.rmtree(os.path.join(root, step_dir_name(step)))


# --8<-- [start:find]
def find_checkpoint(resume_from: str, checkpoint_dir: str) -> str | None:
    """The directory to resume from, or None to start fresh."""
    if not resume_from:
        return None
    if resume_from == "latest":
        pointer = os.path.join(checkpoint_dir, LATEST)
        pointed = _read_pointer(pointer) if os.path.exists(pointer) else None
        newest = published_steps(checkpoint_dir)[-1:]
        # publish() renames step_N into place before it replaces 'latest': a crash in between leaves
        # a complete step_N that 'latest' does not name yet (or no 'latest' at all, on the first
        # save). That step_N is the newest work; it is verified on load like any other.
        if newest and (pointed is None or newest[0] > int(STEP_DIR.match(pointed).group(1))):
            path = os.path.join(checkpoint_dir, step_dir_name(newest[0]))
            log.info("resuming from %s, the newest published checkpoint: %s (a run that stopped "
                     "between publishing it and updating %s)", path,
                     f"{pointer} names {pointed}" if pointed else f"{pointer} does not exist",
                     LATEST)
            return path
        if pointed is None:
            return None  # the first run of a job that always says --resume-from latest
        path = os.path.join(checkpoint_dir, pointed)
        if not os.path.isdir(path):
            raise RecipeError(f"{pointer} names {path}, which does not exist; "
                              "pass --resume-from <a step_* directory>")
        return path
    if not os.path.isdir(resume_from):
        raise RecipeError(f"--resume-from {resume_from}: no such checkpoint directory")
    return resume_from
# --8<-- [end:find]


def _read_pointer(pointer: str) -> str:
    """The step_* name that the 'latest' file holds; anything else: a RecipeError naming it."""
    with open(pointer) as f:
        name = f.read().strip()
    if not STEP_DIR.match(name):  # publish() writes it whole (_write_durably): not written by us
        what = "is empty" if not name else f"holds {name[:40]!r}, not a step_NNNNNNNN name"
        raise RecipeError(f"{pointer} {what}; delete it to resume from the newest published "
                          "checkpoint, or pass --resume-from <a step_* directory>")
    return name


# --8<-- [start:verify]
def verify_checkpoint(path: str | os.PathLike,
                      group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Check every file against the manifest written at publish time; RecipeError naming the first
    bad one. Works without a world too (a world of 1). In a world, the hashing is split over the
    ranks and every rank raises the same error. Returns the manifest."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        raise RecipeError(f"{path} is not a complete checkpoint: {MANIFEST} is missing (a save "
                          "that did not finish?); resume from a published step_* directory, e.g. "
                          "--resume-from latest")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        expected = manifest["files"]
    except (ValueError, KeyError) as exc:
        raise RecipeError(f"{manifest_path} is unreadable ({exc}); "
                          "the checkpoint cannot be verified") from None
    if ".metadata" not in expected:
        raise RecipeError(f"{manifest_path} lists no .metadata file; this is not a DCP checkpoint")
    names = sorted(expected)
    rank, world_size = ((dist.get_rank(group), dist.get_world_size(group))
                        if dist.is_initialized() else (0, 1))
    problems = {name: _file_problem(os.path.join(path, name), expected[name])
                for name in names[rank::world_size]}
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, problems, group=group)
        problems = {name: problem for part in gathered for name, problem in part.items()}
    bad = [problems[name] for name in names if problems[name]]
    if bad:
        more = f" ({len(bad) - 1} more bad file(s))" if len(bad) > 1 else ""
        raise RecipeError(f"{bad[0]}{more}; resume from another checkpoint")
    return manifest


def check_made_with(path: str, manifest: dict[str, Any], made_with: dict[str, Any]) -> None:
    """Refuse a resume whose settings differ from those the manifest recorded. Call it before
    loading: another --model fails inside DCP with size-mismatch tracebacks (or aborts the
    process), and another batch size loads "fine" and then reads other data."""
    saved = manifest.get("made_with", {})  # absent from checkpoints written before it was recorded
    for name, value in made_with.items():
        if name in saved and saved[name] != value:
            flag = "--" + name.replace("_", "-")
            other = ("start the new model in another --checkpoint-dir" if name == "model"
                     else "the resumed run reads other data")
            raise RecipeError(f"{path} was trained with {name}={saved[name]}; resume with the same "
                              f"{flag}, or {other}")
# --8<-- [end:verify]


def _file_problem(path: str, expected: dict[str, Any]) -> str | None:
    if not os.path.exists(path):
        return f"checkpoint file {path} is missing"
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return (f"checkpoint file {path} is truncated or overwritten: {size} bytes, "
                f"the manifest says {expected['bytes']}")
    if file_entry(path)["sha256"] != expected["sha256"]:
        return f"checkpoint file {path} is corrupt: its sha256 differs from the manifest's"
    return None


@contextlib.contextmanager
def dcp_errors_in_one_line(path: str) -> Iterator[None]:
    """Around ``dcp.load`` of a verified checkpoint: any failure becomes one RecipeError line.

    The sizes and sha256 matched, so the files were altered together with the manifest, or not
    written by this code: DCP then fails anywhere (UnicodeDecodeError in torch.load, "metadata is
    None", a CheckpointException wrapping every rank's). dcp.load also logs a warning with a full
    traceback on the ROOT logger whenever .metadata cannot be read (it then tries per-rank
    metadata); those would reach stderr all the same, so they are dropped while it runs.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    dcp_dir = os.path.dirname(dcp.__file__)

    def not_from_dcp(record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(dcp_dir) or record.levelno >= logging.ERROR

    root = logging.getLogger()
    root.addFilter(not_from_dcp)
    try:
        yield
    except RecipeError:
        raise
    # CheckpointException is a BaseException: `except Exception` alone lets it through.
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        if isinstance(exc, CheckpointException) and exc.failures:
            exc = min(exc.failures.items())[1][0]  # {rank: (exception, traceback)}: lowest rank's
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        raise RecipeError(f"{path} matches its {MANIFEST} but DCP cannot load it "
                          f"({type(exc).__name__}: {first_line}); resume from another checkpoint"
                          ) from None
    finally:
        root.removeFilter(not_from_dcp)


def refuse_bad_paths(checkpoint_dir: str, *, saving: bool, init_from: str = "",
                     export_to: str = "", group: dist.ProcessGroup | None = None) -> None:
    """path_problem, asked before training. Rank 0 looks (only it reads --init-from and writes
    --export-to); every rank raises."""
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problem = [path_problem(checkpoint_dir, saving=saving, init_from=init_from,
                            export_to=export_to) if rank == 0 else None]
    if world_size > 1:
        dist.broadcast_object_list(problem, src=0, group=group)
    if problem[0]:
        raise RecipeError(problem[0])


def path_problem(checkpoint_dir: str, *, saving: bool, init_from: str = "",
                 export_to: str = "") -> str | None:
    """What is wrong with a path that would otherwise fail only after training, or None: a file
    named as --checkpoint-dir, one that cannot be created or written (when ``saving``), an
    --export-to that cannot be written, a missing --init-from. Writing is tried (a temporary
    file), not guessed from modes; nothing is created: a directory that does not exist yet is
    tried in its nearest parent."""
    if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
        return f"--checkpoint-dir {checkpoint_dir} is a file; name a directory"
    if saving and (why := _unwritable(checkpoint_dir)):
        return f"--checkpoint-dir {checkpoint_dir}: {why}; name a directory you can write to"
    if init_from and not os.path.isfile(init_from):
        return (f"--init-from {init_from}: no such file; name a full state_dict file "
                "(as --export-to writes one), or drop --init-from")
    if export_to and os.path.isdir(export_to):
        return f"--export-to {export_to} is a directory; name a file, e.g. {export_to}/model.pt"
    if export_to and (why := _unwritable(os.path.dirname(os.path.abspath(export_to)))):
        return f"--export-to {export_to}: {why}; name a file in a directory you can write to"
    return None


def _unwritable(directory: str) -> str | None:
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):  # what makedirs would create goes in here: try that
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=existing):
            return None
    except OSError as exc:
        return f"cannot write in {existing} ({exc.strerror or exc})"
