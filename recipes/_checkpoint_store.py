"""Crash-safe, verified checkpoint folders: the part DCP leaves to you, shared by
recipes/sharded_checkpoint.py and recipes/job.py (through recipes/_job_checkpoint.py).

Copy with it: nothing (torch only); the recipes above import it.

Every save goes to ``.tmp-step_N/`` (``dcp.save``, or ``dcp.async_save`` in the background, plus
each rank's own small file when the caller has one); when all ranks are done, a manifest (the size
and sha256 of every file in the folder, and what the run was made with), an atomic rename to
``step_N/`` and then the ``latest`` pointer publish it. Before DCP reads anything, every file is
checked against the manifest. ``--resume-from latest`` (the job always) takes the newest
checkpoint that verifies: each one skipped on the way is one line on rank 0 naming its bad file,
and is set aside as ``.skipped-step_N/``; with none left, one line naming the folder and nothing
loaded, moved or started fresh. A checkpoint named explicitly is never swapped for another: a bad
file is refused with one line naming it. A ``step_N/`` without a manifest (written before
checkpoints were verified, or by another tool) cannot be verified: it is skipped like a damaged
one, never loaded unchecked.

Why a module of its own: a recipe's lesson (what a resume must carry; resharding; the loop) reads
top to bottom in its own file; this is the part a team swaps whole (object storage, another
manifest) without touching the loop. The leading underscore keeps it out of ``python -m
recipes``: it is the recipes' helper, not a recipe of its own.

Layout under the checkpoint folder::

    step_00000006/          a published checkpoint: DCP's .distcp files and .metadata, each
                            rank's rank_NNNNN.pt (where the caller has one), MANIFEST.json
    .tmp-step_00000009/     a write in progress, or one a crash cut short: never read, removed at
                            the next save
    .skipped-step_00000008/ a checkpoint that did not verify, kept for a look, never read
    latest                  the name of the newest published step, replaced atomically
    best.json               the step with the lowest validation loss (where the caller gives
                            one): kept when older ones are deleted
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
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


class CheckpointError(ValueError):
    """A checkpoint or path that cannot be used, in one line that names it and the fix."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files do not match its manifest (or that has none). ``problem`` says
    what, relative to the checkpoint's folder (``__1_0.distcp is missing``)."""

    def __init__(self, message: str, problem: str):
        super().__init__(message)
        self.problem = problem


MANIFEST, LATEST, BEST = "MANIFEST.json", "latest", "best.json"
TMP_PREFIX, SKIPPED_PREFIX = ".tmp-", ".skipped-"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_state_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


# --8<-- [start:save]
@dataclass
class PendingSave:
    """A checkpoint whose shards may still be being written; ``finish()`` waits and publishes it."""

    root: str
    step: int
    group: dist.ProcessGroup | None
    keep_last: int
    made_with: dict[str, Any] = field(default_factory=dict)  # see load_checkpoint
    val_loss: float | None = None  # the lowest is kept past keep_last (best.json)
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
    state: dict[str, Any],
    step: int,
    *,
    group: dist.ProcessGroup | None,
    async_save: bool = False,
    keep_last: int = 0,
    made_with: dict[str, Any] | None = None,
    val_loss: float | None = None,
    rank_state: dict[str, Any] | None = None,
    async_kwargs: dict[str, Any] | None = None,
) -> PendingSave:
    """Write ``state`` (what ``dcp.save`` takes: state dicts, ``Stateful`` objects) into
    ``root/.tmp-step_N``, and ``rank_state`` (this rank's own values: a data position, RNG
    states) into ``rank_NNNNN.pt`` beside it; ``finish()`` on the result publishes it.
    ``made_with`` (what a resume must repeat) goes into the manifest; ``async_kwargs`` (from
    async_options) choose the background writer; ``keep_last=0`` keeps every checkpoint."""
    pending = PendingSave(root, step, group, keep_last, dict(made_with or {}), val_loss)
    final_dir = os.path.join(root, step_dir_name(step))
    if os.path.exists(final_dir):  # every rank sees it (shared filesystem): all raise, none hangs
        raise CheckpointError(
            f"{final_dir} already exists: a checkpoint is never written over; "
            "resume from it or use another checkpoint folder"
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
            state, checkpoint_id=pending.tmp_dir, process_group=group, **(async_kwargs or {})
        )
        pending.future = getattr(future, "upload_completion", future)  # newer torch: a response
    else:
        dcp.save(state, checkpoint_id=pending.tmp_dir, process_group=group)
    if rank_state is not None:
        os.makedirs(pending.tmp_dir, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(rank_state, buffer)
        path = os.path.join(pending.tmp_dir, rank_state_name(dist.get_rank(group)))
        write_durably(path, buffer.getvalue())
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
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    files = [sorted(os.listdir(pending.tmp_dir)) if rank == 0 else None]
    dist.broadcast_object_list(files, src=first_rank(group), group=group)
    mine = {  # every file of the folder, DCP's and each rank's own; the hashing is split
        name: file_entry(os.path.join(pending.tmp_dir, name)) for name in files[0][rank::world_size]
    }
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    final_dir = os.path.join(pending.root, step_dir_name(pending.step))
    if rank == 0:
        manifest = {
            "step": pending.step,
            "world_size": dist.get_world_size(),
            "made_with": pending.made_with,
            "val_loss": pending.val_loss,
            "files": dict(sorted(kv for part in gathered for kv in part.items())),
        }
        write_durably(os.path.join(pending.tmp_dir, MANIFEST), json.dumps(manifest, indent=1))
        os.rename(pending.tmp_dir, final_dir)  # atomic: the checkpoint appears whole or not at all
        fsync_dir(pending.root)
        write_durably(os.path.join(pending.root, LATEST), step_dir_name(pending.step))
        best_step = update_best(pending.root, pending.step, pending.val_loss)
        if pending.keep_last > 0:
            for step in published_steps(pending.root)[: -pending.keep_last]:
                if step != best_step:
                    shutil.rmtree(os.path.join(pending.root, step_dir_name(step)))
    dist.barrier(group=group)  # nobody reads 'latest' before it names the new checkpoint
    return final_dir


def update_best(root: str, step: int, val_loss: float | None) -> int | None:
    """Record ``step`` in best.json if its validation loss is the lowest yet; the best step."""
    path = os.path.join(root, BEST)
    best = None
    if os.path.exists(path):
        with open(path) as f:
            best = json.load(f)
    if val_loss is not None and (best is None or val_loss < best["val_loss"]):
        best = {"step": step, "val_loss": val_loss, "path": step_dir_name(step)}
        write_durably(path, json.dumps(best, indent=1))
    return best["step"] if best else None


def write_durably(path: str, data: str | bytes) -> None:
    """Write to a temporary name, fsync, rename over ``path``: readers see the old or the new file,
    whole."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
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
    """A file's manifest entry: its size and sha256 (the size alone misses a flipped byte)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def step_dirs(root: str | os.PathLike) -> list[int]:
    """Steps of every ``step_N`` folder in ``root``, with a manifest or not, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(root)) if m)


def published_steps(root: str | os.PathLike) -> list[int]:
    """Steps of the published checkpoints in ``root`` (with a manifest), oldest first."""
    return [
        s for s in step_dirs(root) if os.path.exists(os.path.join(root, step_dir_name(s), MANIFEST))
    ]


# --8<-- [start:find]
def resume_checkpoint(
    resume_from: str, checkpoint_dir: str, *, group: dist.ProcessGroup | None = None
) -> tuple[str, dict[str, Any]] | None:
    """The verified checkpoint to resume from and its manifest, or None to start fresh.

    ``latest``: the newest ``step_N`` that verifies. Every rank checks the same folders in the same
    order (rank 0's listing) and gets the same verdicts (verify_checkpoint gathers them), so all
    choose the same step. A collective when a world exists; works without one too."""
    if not resume_from:
        return None
    if resume_from != "latest":  # named by the user: verified, refused by name, never swapped
        path = find_checkpoint(resume_from, checkpoint_dir)
        return path, verify_checkpoint(path, group)
    find_checkpoint("latest", checkpoint_dir)  # refuses a foreign pointer; says why newest wins
    steps = [step_dirs(checkpoint_dir)[::-1] if rank_of(group) == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(steps, src=first_rank(group), group=group)
    skipped: list[tuple[str, str]] = []
    for step in steps[0]:
        path = os.path.join(checkpoint_dir, step_dir_name(step))
        try:
            manifest = verify_checkpoint(path, group)
        except DamagedCheckpoint as exc:
            skipped.append((step_dir_name(step), exc.problem))
            continue
        if rank_of(group) == 0 and skipped:
            # The pointer first: a crash before the moves leaves it naming a good checkpoint.
            write_durably(os.path.join(checkpoint_dir, LATEST), step_dir_name(step))
            for name, problem in skipped:
                aside = os.path.join(checkpoint_dir, SKIPPED_PREFIX + name)
                shutil.rmtree(aside, ignore_errors=True)  # the same step skipped once before
                os.rename(os.path.join(checkpoint_dir, name), aside)
                say(
                    f"skipped checkpoint {name} in {checkpoint_dir}: {problem}; set aside as "
                    f"{SKIPPED_PREFIX}{name}; resuming from {step_dir_name(step)}"
                )
        if dist.is_initialized() and skipped:
            dist.barrier(group=group)  # nobody lists the folder while rank 0 moves things in it
        return path, manifest
    if skipped:  # nothing moved: every relaunch refuses alike, none starts fresh over the run
        name, problem = skipped[0]
        more = f" ({len(skipped) - 1} older one(s) too)" if len(skipped) > 1 else ""
        raise CheckpointError(
            f"no checkpoint in {checkpoint_dir} verifies: {name}: {problem}{more}; restore a good "
            f"step_* folder there, or move {checkpoint_dir} away to start fresh"
        )
    return None  # the first run of a job that always resumes from the latest


def find_checkpoint(resume_from: str, checkpoint_dir: str) -> str | None:
    """The directory ``resume_from`` names, unverified: a step_* path, or for ``latest`` the newest
    published one (None if there is none). Refuses a missing path or a foreign ``latest`` file."""
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
    state: dict[str, Any],
    *,
    group: dist.ProcessGroup | None,
    made_with: dict[str, Any] | None = None,
    manifest: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Verify (unless ``manifest`` comes from resume_checkpoint, which did), compare ``made_with``
    with the manifest's, then read into ``state`` in place (DCP loads into the tensors and
    ``Stateful`` objects that already exist, resharding). Returns the manifest."""
    if manifest is None:
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
        dcp.load(state, checkpoint_id=path, process_group=group)
    return manifest


def load_rank_state(
    path: str, manifest: dict[str, Any], group: dist.ProcessGroup | None = None
) -> tuple[dict[str, Any], bool]:
    """This rank's own file and True on the world size that wrote it; on another world size the
    per-rank values mean nothing, and rank 0's file (what every rank shares) and False."""
    same_world = manifest["world_size"] == dist.get_world_size(group)
    own = rank_state_name(dist.get_rank(group) if same_world else 0)
    with dcp_errors_in_one_line(path):  # verified: only a file altered with its manifest fails
        return torch.load(os.path.join(path, own), weights_only=True), same_world


def verify_checkpoint(
    path: str | os.PathLike, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Check every file against the manifest written at publish time, naming the first bad one
    (DamagedCheckpoint). Works without a world too. In a world, the hashing is split over the
    ranks and every rank raises the same error. Returns the manifest."""
    manifest, problem = read_manifest(path)
    names = sorted(manifest["files"]) if manifest else []
    rank, world_size = rank_of(group), dist.get_world_size(group) if dist.is_initialized() else 1
    problems = {
        name: file_problem(os.path.join(path, name), manifest["files"][name])
        for name in names[rank::world_size]
    }
    if world_size > 1:  # the manifest's problem too: no rank goes on alone if one cannot read it
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (problem, problems), group=group)
        problem = next((p for p, _ in gathered if p), None)
        problems = {name: bad for _, part in gathered for name, bad in part.items()}
    if problem:
        raise DamagedCheckpoint(
            f"{path} cannot be verified: {problem}; resume from a published step_* directory, "
            "e.g. --resume-from latest",
            problem,
        )
    bad = [name for name in names if problems[name]]
    if bad:
        more = f" ({len(bad) - 1} more bad file(s))" if len(bad) > 1 else ""
        raise DamagedCheckpoint(
            f"checkpoint file {os.path.join(path, bad[0])} {problems[bad[0]]}{more}; resume from "
            "another checkpoint",
            f"{bad[0]} {problems[bad[0]]}{more}",
        )
    return manifest


# --8<-- [end:load]


def read_manifest(path: str | os.PathLike) -> tuple[dict[str, Any] | None, str | None]:
    """(the manifest, None), or (None, what is wrong with it)."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):  # publish() writes it before the rename: never ours
        return None, (
            f"{MANIFEST} is missing (a folder never published, or one written before "
            "checkpoints were verified)"
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return None, f"{MANIFEST} is unreadable ({type(exc).__name__}: {str(exc)[:80]})"
    if ".metadata" not in files:
        return None, f"{MANIFEST} lists no .metadata file (not a DCP checkpoint)"
    return manifest, None


def file_problem(path: str, expected: dict[str, Any]) -> str | None:
    """What is wrong with one file, after its name, or None."""
    if not os.path.exists(path):
        return "is missing"
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return f"is truncated or overwritten: {size} bytes, the manifest says {expected['bytes']}"
    if file_entry(path)["sha256"] != expected["sha256"]:
        return "is corrupt: its sha256 differs from the manifest's"
    return None


@contextlib.contextmanager
def dcp_errors_in_one_line(path: str) -> Iterator[None]:
    """Around ``dcp.load`` of a verified checkpoint: any failure becomes one CheckpointError line.

    The sizes and sha256 matched, so the files were altered together with the manifest, or not
    written by this code: DCP then fails anywhere (UnicodeDecodeError in torch.load, "metadata is
    None", a CheckpointException wrapping every rank's). dcp.load also logs a warning with a full
    traceback on the ROOT logger whenever .metadata cannot be read; those are dropped meanwhile.
    Not a fallback: the model may be half loaded by then.
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
            f"{path} matches its {MANIFEST} but cannot be loaded "
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


def rank_of(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def first_rank(group: dist.ProcessGroup | None) -> int:
    """The global rank of ``group``'s rank 0: what ``broadcast_object_list``'s ``src`` takes."""
    return dist.get_global_rank(group or dist.group.WORLD, 0)


def say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)
