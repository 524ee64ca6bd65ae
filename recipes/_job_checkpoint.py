"""Crash-safe, resumable checkpoints for recipes/job.py: the model and optimizer through
torch.distributed.checkpoint (DCP, sharded, re-shardable onto another world size), and each rank's
own state (its data position, its RNG states) in a small file of its own.

Copy with it: nothing (torch and numpy only); recipes/job.py imports it.

Why a module of its own: the job's loop reads top to bottom in one file; this is the one part a
team swaps whole (async_save, object storage) without touching the loop. The leading underscore
keeps it out of ``python -m recipes``: it is the job's, not a recipe of its own.

Layout under ``<out_dir>/checkpoints``::

    step_00000020/        a published checkpoint: DCP's .distcp files and .metadata,
        rank_00000.pt     each rank's state (written to .tmp, then renamed),
        meta.json         written last by rank 0: step, world size, validation loss
    tmp-step_00000030/    a write in progress, or one a crash cut short: never read, and removed
                          at the next start
    best.json             the step with the lowest validation loss: kept when older ones go
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

PUBLISHED = re.compile(r"step_(\d{8})")


# --8<-- [start:find]
def published(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first. Complete = renamed from its
    tmp- folder after every rank wrote, with meta.json inside: a folder that a crash cut short
    is a tmp- folder, never one of these."""
    found = []
    for path in root.glob("step_*"):
        match = PUBLISHED.fullmatch(path.name)
        if match and (path / "meta.json").exists():
            found.append((int(match[1]), path))
    return sorted(found)


def latest(root: Path) -> Path | None:
    """Rank 0 looks, every rank gets its answer: ranks listing a folder while another rank
    changes it could disagree on which checkpoint to load."""
    choice = [str(published(root)[-1][1]) if published(root) else None]
    if dist.get_rank() == 0:
        for partial in root.glob("tmp-step_*"):  # a crash's leftovers, from before this start
            shutil.rmtree(partial, ignore_errors=True)
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


# --8<-- [end:find]


# --8<-- [start:save]
def save(
    root: Path, step: int, model, optimizer, rank_state: dict, *, val_loss: float | None, keep: int
) -> Path:
    """Write step ``step`` on every rank (a collective), publish it with one rename, keep the
    last ``keep`` and the best by validation loss. Returns the published folder."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tmp, final = root / f"tmp-step_{step:08d}", root / f"step_{step:08d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    # get_state_dict: parameter names without DDP's "module." or FSDP's wrappers, DTensor shards
    # as they are (each rank writes its own), the optimizer's state keyed by those names.
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(tmp))
    write_atomically(tmp / f"rank_{rank:05d}.pt", rank_state)
    dist.barrier()  # every rank's files are in tmp
    if rank == 0:
        meta = {"step": step, "world_size": world_size, "val_loss": val_loss}
        write_atomically(tmp / "meta.json", meta)
        if final.exists():  # a run restarted from an older checkpoint writes this step again
            shutil.rmtree(final)
        os.rename(tmp, final)  # atomic: the checkpoint appears whole, or not at all
        update_best(root, step, val_loss)
        prune(root, keep)
    dist.barrier()  # no rank reads or writes the folder before it is published
    return final


def write_atomically(path: Path, obj) -> None:
    """Write ``path.tmp``, flush it to disk, rename: a reader sees the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if path.suffix == ".json":
            f.write(json.dumps(obj, indent=1).encode())
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def update_best(root: Path, step: int, val_loss: float | None) -> None:
    best = root / "best.json"
    old = json.loads(best.read_text()) if best.exists() else None
    if val_loss is not None and (old is None or val_loss < old["val_loss"]):
        write_atomically(best, {"step": step, "val_loss": val_loss, "path": f"step_{step:08d}"})


def prune(root: Path, keep: int) -> None:
    """Remove all but the last ``keep`` checkpoints, never the best one."""
    best = root / "best.json"
    best_step = json.loads(best.read_text())["step"] if best.exists() else None
    checkpoints = published(root)
    for step, path in checkpoints[: max(len(checkpoints) - keep, 0)]:
        if step != best_step:
            shutil.rmtree(path)


# --8<-- [end:save]


# --8<-- [start:load]
def load(path: Path, model, optimizer) -> dict:
    """Load ``path`` into the model and optimizer (re-sharded onto this world, whatever world
    wrote it); returns this rank's own state and the checkpoint's meta.json.

    On the world size that wrote it, ``rank`` is this rank's own file; on another world size the
    per-rank states mean nothing (``same_world`` is False) and rank 0's file gives what every
    rank shares: the step, the scheduler and the global data position."""
    # The templates DCP loads into: this rank's shards, in this world's layout. For a fresh
    # optimizer get_state_dict first creates its state (AdamW's moments), so there is a place to
    # load them into.
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    meta = json.loads((path / "meta.json").read_text())
    same_world = meta["world_size"] == dist.get_world_size()
    own = path / f"rank_{dist.get_rank() if same_world else 0:05d}.pt"
    return {
        "meta": meta,
        "same_world": same_world,
        "rank": torch.load(own, weights_only=True),
    }  # weights_only: tensors, plain values


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
