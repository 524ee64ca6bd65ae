"""The job's checkpoints (recipes/job.py): the model and optimizer through
torch.distributed.checkpoint (DCP, sharded, re-shardable onto another world size), and each rank's
own state (its data position, its RNG states) in a small file of its own, in the crash-safe,
verified folders of recipes/_checkpoint_store.py.

Copy with it: recipes/_checkpoint_store.py (torch and numpy only); recipes/job.py imports it.

Why a module of its own: the job's loop reads top to bottom in one file; this is the one part a
team swaps whole (async_save, object storage) without touching the loop. The leading underscore
keeps it out of ``python -m recipes``: it is the job's, not a recipe of its own.

Layout under ``<out_dir>/checkpoints`` (recipes/_checkpoint_store.py has the whole of it)::

    step_00000020/        a published checkpoint: DCP's .distcp files and .metadata, each rank's
                          rank_00000.pt, MANIFEST.json (size and sha256 of every file, the world
                          size, the validation loss), written last by rank 0 before the rename
    .tmp-step_00000030/   a write in progress, or one a crash cut short: never read
    .skipped-step_00000024/  a checkpoint that did not verify on a restart: set aside, never read
    best.json             the step with the lowest validation loss: kept when older ones go

A restart resumes from the newest checkpoint that verifies: one that does not (a shard cut short
by a crash, a rank's file overwritten) is skipped with one line naming its file. A checkpoint
written before checkpoints had a manifest cannot be verified and is skipped the same way; with
none left the job stops with one line naming the folder, rather than start over.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import recipes._checkpoint_store as store


# --8<-- [start:find]
def latest(root: Path) -> tuple[str, dict] | None:
    """The newest checkpoint that verifies and its manifest, the same on every rank (a
    collective), or None to start fresh. Raises ``store.CheckpointError`` when checkpoints exist
    and none verifies."""
    return store.resume_checkpoint("latest", str(root))


# --8<-- [end:find]


# --8<-- [start:save]
def save(
    root: Path, step: int, model, optimizer, rank_state: dict, *, val_loss: float | None, keep: int
) -> Path:
    """Write step ``step`` on every rank (a collective), publish it with one rename, keep the
    last ``keep`` and the best by validation loss. Returns the published folder."""
    # get_state_dict: parameter names without DDP's "module." or FSDP's wrappers, DTensor shards
    # as they are (each rank writes its own), the optimizer's state keyed by those names.
    model_state, optim_state = get_state_dict(model, optimizer)
    pending = store.save_checkpoint(
        str(root),
        {"model": model_state, "optim": optim_state},
        step,
        group=None,
        keep_last=keep,
        val_loss=val_loss,
        rank_state=rank_state,  # rank_NNNNN.pt: in the manifest like every file of the folder
    )
    return Path(pending.finish())


# --8<-- [end:save]


# --8<-- [start:load]
def load(found: tuple[str, dict], model, optimizer) -> dict:
    """Load the checkpoint ``latest`` found (verified) into the model and optimizer (re-sharded
    onto this world, whatever world wrote it); returns this rank's own state and the manifest.

    On the world size that wrote it, ``rank`` is this rank's own file; on another world size the
    per-rank states mean nothing (``same_world`` is False) and rank 0's file gives what every
    rank shares: the step, the scheduler and the global data position."""
    path, manifest = found
    # The templates DCP loads into: this rank's shards, in this world's layout. For a fresh
    # optimizer get_state_dict first creates its state (AdamW's moments), so there is a place to
    # load them into.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    store.load_checkpoint(path, state, group=None, manifest=manifest)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    own, same_world = store.load_rank_state(path, manifest)  # weights_only: tensors, values
    return {"meta": manifest, "same_world": same_world, "rank": own}


# --8<-- [end:load]


# --8<-- [start:rng]
def rng_states() -> dict:
    """Every generator a step may draw from (dropout, a random crop, a shuffle in user code)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached],
        "python": random.getstate(),
    }


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"]:
        torch.cuda.set_rng_state_all(states["cuda"])
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))


# --8<-- [end:rng]
