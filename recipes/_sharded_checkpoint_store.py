"""Crash-safe checkpoint folders for recipes/sharded_checkpoint.py: the part DCP leaves to you.

Copy with it: nothing (torch only); recipes/sharded_checkpoint.py imports it.

Every save goes to ``.tmp-step_N/`` (``dcp.save``, or ``dcp.async_save`` in the background); when
all ranks are done, a manifest (size and sha256 of every file, and what the run was made with), an
atomic rename to ``step_N/`` and then the ``latest`` pointer publish it. A load finds the newest
published step, verifies every file against the manifest first and refuses a missing, truncated or
altered file with one line naming it, before DCP reads anything.

Why a module of its own: the recipe's lesson (what a resume must carry: model, optimizer, data
position, RNG streams; resharding; the export) reads top to bottom in one file; this is the part a
team swaps whole (object storage, another manifest) without touching the loop. The leading
underscore keeps it out of ``python -m recipes``: it is the recipe's, not a recipe of its own.

Layout under ``--checkpoint-dir``::

    step_00000006/        a published checkpoint: DCP's .distcp files, .metadata, MANIFEST.json
    .tmp-step_00000009/   a write in progress, or one a crash cut short: never read, removed at
                          the next save
    latest                the name of the newest published step, replaced atomically
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful


class CheckpointError(ValueError):
    """A checkpoint or path that cannot be used, in one line that names it and the fix."""


MANIFEST, LATEST, TMP_PREFIX = "MANIFEST.json", "latest", ".tmp-"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# --8<-- [start:save]
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


def save_checkpoint(
    root: str,
    app: Stateful,
    step: int,
    *,
    group: dist.ProcessGroup | None,
    async_save: bool = False,
    keep_last: int = 0,
    made_with: dict[str, Any] | None = None,
    async_kwargs: dict[str, Any] | None = None,
) -> PendingSave:
    """Write every rank's shard into ``root/.tmp-step_N``; ``finish()`` on the result publishes
    it. ``made_with`` (what a resume must repeat) goes into the manifest; ``async_kwargs`` (from
    async_options) choose the background writer."""
    pending = PendingSave(root, step, group, keep_last, dict(made_with or {}))
    final_dir = os.path.join(root, step_dir_name(step))
    if os.path.exists(final_dir):  # every rank sees it (shared filesystem): all raise, none hangs
        raise CheckpointError(
            f"{final_dir} already exists: a checkpoint is never written over; "
            "resume from it or use another --checkpoint-dir"
        )
    if dist.get_rank() == 0:  # the remains of saves that died part-way: never published, never read
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(root, name))
    dist.barrier(group=group)  # nobody writes into .tmp-* before rank 0 has cleared it
    if async_save:
        # The state is copied to host memory before async_save returns, so training may change the
        # parameters right away; the write runs in the background, with collectives on `group`
        # only (a background process gets a gloo world of its own, set up through `group`).
        future = dcp.async_save(
            {"app": app}, checkpoint_id=pending.tmp_dir, process_group=group, **(async_kwargs or {})
        )
        pending.future = getattr(future, "upload_completion", future)  # newer torch: a response
    else:
        dcp.save({"app": app}, checkpoint_id=pending.tmp_dir, process_group=group)
    return pending


def async_options(mode: str, device: torch.device) -> dict[str, Any]:
    """dcp.async_save's keywords for ``--async-mode``. "process": each rank starts one background
    process on its first async save (its own gloo world, set up through ``group``), which then
    writes every checkpoint: the write no longer competes with training for the GIL."""
    if mode == "thread":
        return {}  # dcp.async_save's default: a thread, and a stager it owns and closes
    from torch.distributed.checkpoint import state_dict_saver

    kind = getattr(getattr(state_dict_saver, "AsyncCheckpointerType", None), "PROCESS", None)
    if kind is None:  # checked, not assumed: older torch lacks it
        raise CheckpointError(
            f"--async-mode process needs dcp's AsyncCheckpointerType.PROCESS, "
            f"which torch {torch.__version__} lacks; use --async-mode thread"
        )
    options: dict[str, Any] = {"async_checkpointer_type": kind}
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:  # older torch: DCP stages into plain host memory itself
        return options
    if "async_stager" not in inspect.signature(dcp.async_save).parameters:
        return options
    # Staged into shared memory: the copy handed to the background process is not pickled through
    # its pipe; pinned memory and non-blocking copies only help a device-to-host copy. The caller
    # owns this stager and closes it after the last save.
    cuda = device.type == "cuda"
    options["async_stager"] = DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=True,
            use_async_staging=False,
            use_non_blocking_copy=cuda,
        )
    )
    return options


# --8<-- [end:save]


# --8<-- [start:publish]
def publish(pending: PendingSave) -> str:
    """Manifest, then one rename, then the ``latest`` pointer: a crash at any point leaves the last
    good checkpoint loadable and ``latest`` naming a complete one (or one behind: see
    find_checkpoint). Every rank calls it once its writes have returned."""
    group = pending.group
    dist.barrier(group=group)  # every rank's writes have returned: .metadata and all shards exist
    files = sorted(os.listdir(pending.tmp_dir))
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    mine = {
        name: file_entry(os.path.join(pending.tmp_dir, name))  # the hashing is split
        for name in files[rank::world_size]
    }
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    final_dir = os.path.join(pending.root, step_dir_name(pending.step))
    if rank == 0:
        manifest = {
            "step": pending.step,
            "world_size": dist.get_world_size(),
            "made_with": pending.made_with,
            "files": dict(sorted(kv for part in gathered for kv in part.items())),
        }
        write_durably(os.path.join(pending.tmp_dir, MANIFEST), json.dumps(manifest, indent=1))
        os.rename(pending.tmp_dir, final_dir)  # atomic: the checkpoint appears whole or not at all
        fsync_dir(pending.root)
        write_durably(os.path.join(pending.root, LATEST), step_dir_name(pending.step))
        if pending.keep_last > 0:
            for step in published_steps(pending.root)[: -pending.keep_last]:
                shutil.rmtree(os.path.join(pending.root, step_dir_name(step)))
    dist.barrier(group=group)  # nobody reads 'latest' before it names the new checkpoint
    return final_dir


def write_durably(path: str, text: str) -> None:
    """Write to a temporary name, fsync, rename over ``path``: readers see the old or the new file,
    whole."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the rename itself durable, not only the file contents
    finally:
        os.close(fd)


# --8<-- [end:publish]


def file_entry(path: str) -> dict[str, Any]:
    """A file's manifest entry: its size and sha256."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def published_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the published checkpoints in ``root`` (with a manifest), oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(
        int(m.group(1))
        for m in map(STEP_DIR.match, os.listdir(root))
        if m and os.path.exists(os.path.join(root, m.group(0), MANIFEST))
    )


# --8<-- [start:find]
def find_checkpoint(resume_from: str, checkpoint_dir: str) -> str | None:
    """The directory to resume from, or None to start fresh."""
    if not resume_from:
        return None
    if resume_from != "latest":
        if not os.path.isdir(resume_from):
            raise CheckpointError(f"--resume-from {resume_from}: no such checkpoint directory")
        return resume_from
    pointer = os.path.join(checkpoint_dir, LATEST)
    pointed = read_pointer(pointer) if os.path.exists(pointer) else None
    newest = published_steps(checkpoint_dir)[-1:]
    # publish() renames step_N into place before it replaces 'latest': a crash in between leaves a
    # complete step_N that 'latest' does not name yet (or no 'latest' at all, on the first save).
    # That step_N is the newest work; it is verified on load like any other.
    if newest and (pointed is None or newest[0] > int(STEP_DIR.match(pointed).group(1))):
        path = os.path.join(checkpoint_dir, step_dir_name(newest[0]))
        say(
            f"resuming from {path}, the newest published checkpoint: "
            f"{f'{pointer} names {pointed}' if pointed else f'{pointer} does not exist'} (a run "
            f"that stopped between publishing it and updating {LATEST})"
        )
        return path
    if pointed is None:
        return None  # the first run of a job that always says --resume-from latest
    path = os.path.join(checkpoint_dir, pointed)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"{pointer} names {path}, which does not exist; pass --resume-from <a step_* directory>"
        )
    return path


def read_pointer(pointer: str) -> str:
    """The step_* name that the 'latest' file holds; anything else is refused, naming it."""
    with open(pointer) as f:
        name = f.read().strip()
    if not STEP_DIR.match(name):  # publish() writes it whole (write_durably): not written by us
        what = "is empty" if not name else f"holds {name[:40]!r}, not a step_NNNNNNNN name"
        raise CheckpointError(
            f"{pointer} {what}; delete it to resume from the newest published "
            "checkpoint, or pass --resume-from <a step_* directory>"
        )
    return name


# --8<-- [end:find]


# --8<-- [start:load]
def load_checkpoint(
    path: str,
    app: Stateful,
    *,
    group: dist.ProcessGroup | None,
    made_with: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Verify, compare ``made_with`` with the manifest's, then read into the model and optimizer
    that already exist (DCP loads in place, resharding). Returns the manifest."""
    manifest = verify_checkpoint(path, group)
    # Before dcp.load: another --model fails inside DCP with size-mismatch tracebacks (or aborts
    # the process), and another batch size loads "fine" and then reads other data.
    saved = manifest.get("made_with", {})
    for name, value in (made_with or {}).items():
        if name in saved and saved[name] != value:
            other = (
                "start the new model in another --checkpoint-dir"
                if name == "model"
                else "the resumed run reads other data"
            )
            raise CheckpointError(
                f"{path} was trained with {name}={saved[name]}; resume with the "
                f"same --{name.replace('_', '-')}, or {other}"
            )
    with dcp_errors_in_one_line(path):
        dcp.load({"app": app}, checkpoint_id=path, process_group=group)
    return manifest


def verify_checkpoint(
    path: str | os.PathLike, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Check every file against the manifest written at publish time, naming the first bad one.
    Works without a world too. In a world, the hashing is split over the ranks and every rank
    raises the same error. Returns the manifest."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        raise CheckpointError(
            f"{path} is not a complete checkpoint: {MANIFEST} is missing (a save "
            "that did not finish?); resume from a published step_* directory, "
            "e.g. --resume-from latest"
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        expected = manifest["files"]
    except (ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{manifest_path} is unreadable ({exc}); the checkpoint cannot be verified"
        ) from None
    if ".metadata" not in expected:
        raise CheckpointError(
            f"{manifest_path} lists no .metadata file; this is not a DCP checkpoint"
        )
    names = sorted(expected)
    rank, world_size = (
        (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    )
    problems = {
        name: file_problem(os.path.join(path, name), expected[name])
        for name in names[rank::world_size]
    }
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, problems, group=group)
        problems = {name: problem for part in gathered for name, problem in part.items()}
    bad = [problems[name] for name in names if problems[name]]
    if bad:
        more = f" ({len(bad) - 1} more bad file(s))" if len(bad) > 1 else ""
        raise CheckpointError(f"{bad[0]}{more}; resume from another checkpoint")
    return manifest


# --8<-- [end:load]


def file_problem(path: str, expected: dict[str, Any]) -> str | None:
    if not os.path.exists(path):
        return f"checkpoint file {path} is missing"
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return (
            f"checkpoint file {path} is truncated or overwritten: {size} bytes, "
            f"the manifest says {expected['bytes']}"
        )
    if file_entry(path)["sha256"] != expected["sha256"]:
        return f"checkpoint file {path} is corrupt: its sha256 differs from the manifest's"
    return None


@contextlib.contextmanager
def dcp_errors_in_one_line(path: str) -> Iterator[None]:
    """Around ``dcp.load`` of a verified checkpoint: any failure becomes one CheckpointError line.

    The sizes and sha256 matched, so the files were altered together with the manifest, or not
    written by this code: DCP then fails anywhere (UnicodeDecodeError in torch.load, "metadata is
    None", a CheckpointException wrapping every rank's). dcp.load also logs a warning with a full
    traceback on the ROOT logger whenever .metadata cannot be read; those are dropped meanwhile.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    dcp_dir = os.path.dirname(dcp.__file__)

    def not_from_dcp(record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(dcp_dir) or record.levelno >= logging.ERROR

    logging.getLogger().addFilter(not_from_dcp)
    try:
        yield
    # Pitfall: CheckpointException is a BaseException: `except Exception` alone lets it through.
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        if isinstance(exc, CheckpointException) and exc.failures:
            exc = min(exc.failures.items())[1][0]  # {rank: (exception, traceback)}: lowest rank's
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(
            f"{path} matches its {MANIFEST} but DCP cannot load it "
            f"({type(exc).__name__}: {first_line}); resume from another "
            "checkpoint"
        ) from None
    finally:
        logging.getLogger().removeFilter(not_from_dcp)


def unwritable(directory: str) -> str | None:
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


def say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
