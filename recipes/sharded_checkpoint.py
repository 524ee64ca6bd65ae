"""Sharded checkpoints with torch.distributed.checkpoint (DCP): resume on any world size, export, crash-safe.

    torchrun --standalone --nproc_per_node=2 -m recipes.sharded_checkpoint --steps 3
    torchrun --standalone --nproc_per_node=4 -m recipes.sharded_checkpoint --steps 6  # resumes step 3 on 4 ranks
    python -m recipes.sharded_checkpoint --steps 9 --export-to model.pt              # ... and on 1, then exports

Every rank writes only the shard it holds (``dcp.save``), in parallel, and a load reads what each rank of
the NEW world needs, whatever world wrote it: a checkpoint from 2 ranks resumes on 1, 3 or 4, from FSDP
into fully_shard or DDP. What a resumed run needs is one ``Stateful`` (``AppState``): model, optimizer,
the data position (epoch and batches done in it) and every rank's RNG state. A run resumed at step k
gives the same losses as one that never stopped (tests/test_sharded_checkpoint.py asserts it for DDP,
FSDP and fully_shard, and after resharding to 1, 3 and 4 ranks).

Crash safety, the part DCP leaves to you: DCP writes shards straight into the directory it is given and
``.metadata`` last, so a save that dies part-way leaves a half-written directory, and saving over the last
good checkpoint destroys it. Here every save goes to ``.tmp-step_N/`` beside the target; when all ranks
are done, rank 0 writes a manifest (name, size, sha256 of every file), renames the directory to
``step_N/`` (atomic on one filesystem) and then replaces the ``latest`` pointer file (atomic too). A load
verifies the manifest first and refuses a missing, truncated or altered file with a one-line error that
names it. The checkpoint directory must be on a filesystem every rank sees (as DCP itself requires).
A run that died between the rename and the pointer left ``latest`` behind: ``--resume-from latest``
takes the newest published ``step_N`` then. The manifest also records what a resume must repeat
(``--model``, the global batch, the epoch size, the seed), compared before anything is loaded.

``--async-save`` overlaps writing with training (``dcp.async_save``: the state is copied to host memory,
then written by a background thread); the next save first waits for the previous one and publishes it.
``--export-to`` writes one full ``state_dict`` file on rank 0 for single-device inference
(``torch.load(..., weights_only=True)`` into a plain model), and ``--init-from`` is the path back: rank 0
reads such a file and every rank gets its shard. Offline, without a world:
``python -m torch.distributed.checkpoint.format_utils dcp_to_torch step_N/ model.pt`` converts a whole
checkpoint (optimizer included) to one torch.save file.
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
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, make_result, mean_over_ranks
from recipes.core.state import full_state_on_rank0
from recipes.core.speed import autocast, make_adamw, setup_precision
from recipes.core.throughput import Workload
from recipes.core.workload import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset
from recipes.core.world import World, join_world
from recipes.fsdp import apply_fsdp, fsdp_mixed_precision
from recipes.fsdp2 import apply_fully_shard, mixed_precision_policy

log = get_logger(__name__)

MANIFEST = "MANIFEST.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


@dataclass
class CheckpointConfig(TrainConfig):
    strategy: Literal["ddp", "fsdp", "fsdp2"] = opt(
        "fsdp2", "ddp (replicated), fsdp (classic FullyShardedDataParallel) or fsdp2 (fully_shard); a checkpoint "
        "saved with one loads into any other")
    checkpoint_dir: str = opt("checkpoints/sharded_checkpoint", "where step_NNNNNNNN/ checkpoints and the 'latest' pointer live")
    save_every: int = opt(3, "save every N steps and after the last one; 0 = never save", ge=0)
    resume_from: str = opt("latest", "'latest' = the checkpoint 'latest' names in --checkpoint-dir (start fresh if "
                                     "there is none yet: the same command starts and resumes a job); a step_* "
                                     "directory; or '' = always start fresh")
    async_save: bool = opt(False, "write checkpoints in the background (dcp.async_save) while training goes on")
    keep_last: int = opt(
        2, "published checkpoints to keep; older ones are deleted (0 = keep all)", ge=0)
    export_to: str = opt("", "after training, rank 0 writes the full model state_dict to this file (for inference)")
    init_from: str = opt("", "when starting fresh, load the model from this full state_dict file (e.g. an --export-to "
                             "file): rank 0 reads it, every rank gets its part")
    batches_per_epoch: int = opt(
        4, "global batches per epoch of the synthetic data; 4 makes 6 steps cross an epoch "
        "boundary, so a resume must restore the epoch, not only the step", ge=1)


def parallelize(
    model: nn.Module, strategy: str, world: World, precision: str = "fp32"
) -> nn.Module:
    """The model as each strategy wraps it (recipes.fsdp / recipes.fsdp2), in ``precision``: the
    FSDPs' own mixed-precision policies; DDP autocasts in the loop. The checkpoint code is the same
    for all."""
    if strategy == "ddp":
        return DDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    if strategy == "fsdp":
        return apply_fsdp(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device=world.device,
                          mixed_precision=fsdp_mixed_precision(precision))
    return apply_fully_shard(model, init_device_mesh(world.device.type, (world.world_size,)),
                             block_types=(Block,), mp_policy=mixed_precision_policy(precision))


# --8<-- [start:app_state]
class AppState(Stateful):
    """Everything a resumed run needs. DCP calls ``state_dict()`` on every rank when saving, and
    ``state_dict()`` (for the shapes to read into) then ``load_state_dict()`` when loading."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, global_batch_size: int,
                 batches_per_epoch: int, group: dist.ProcessGroup | None = None):
        self.model, self.optimizer, self.group = model, optimizer, group
        # The data position, in world-size-free units: global step s reads the same samples on any world
        # size, so (epoch, global batches done in it) means the same thing to a resharded run, as long as
        # the global batch and the epoch are the same size (checked on resume).
        self.progress = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "global_batch_size": global_batch_size,
                         "batches_per_epoch": batches_per_epoch}

    def state_dict(self) -> dict[str, Any]:
        # get_state_dict: one call for DDP, FSDP and fully_shard. Names come without "module." or
        # "_fsdp_wrapped_module." prefixes, and sharded tensors stay sharded (DTensor / ShardedTensor),
        # so each rank writes only its part and any other wrapping can read it back.
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "progress": dict(self.progress),
                "rng": gather_rng_states(self.group)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.progress = dict(state["progress"])
        restore_rng_state(state["rng"])


def gather_rng_states(group: dist.ProcessGroup | None) -> dict[str, list[str]]:
    """Every rank's RNG states, so that dropout masks or random augmentations continue, not restart.

    Gathered into lists that are the same on every rank: DCP stores a value that every rank has once,
    and a per-rank key would be missing for the extra ranks of a larger world. A list of strings is one
    value to DCP (a list of tensors would be split into per-rank keys again) and loads with
    ``weights_only=True`` (bytes would not). "cuda" is always there, empty on a CPU world, so that a GPU
    world can load a CPU world's checkpoint.
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    local = (torch.get_rng_state().numpy().tobytes().hex(), torch.cuda.get_rng_state().numpy().tobytes().hex() if cuda else "")
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, local, group=group)
    return {"cpu": [cpu for cpu, _ in states], "cuda": [cuda for _, cuda in states]}


def restore_rng_state(states: dict[str, list[str]]) -> None:
    # Same world size: each rank continues its own stream. Resharded: rank r takes saved rank r mod N's
    # (per-rank streams of a different world size cannot be continued; this keeps them deterministic).
    index = dist.get_rank() % len(states["cpu"])
    torch.set_rng_state(torch.frombuffer(bytearray.fromhex(states["cpu"][index]), dtype=torch.uint8))
    if states["cuda"][index] and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray.fromhex(states["cuda"][index]), dtype=torch.uint8))
# --8<-- [end:app_state]


# --8<-- [start:data_position]
class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start part-way into an epoch, without reading the skipped batches.

    Global batch b of an epoch is positions [b*G, (b+1)*G) of the epoch's shuffled order, dealt round-robin,
    whatever the world size; skipping b batches = skipping b * per_rank_batch_size of this rank's indices.
    (torchdata's StatefulDataLoader does the same for real pipelines with workers.)
    """

    def __init__(self, dataset: Dataset, *, per_rank_batch_size: int, **kwargs: Any):
        super().__init__(dataset, shuffle=True, drop_last=True, **kwargs)
        self.per_rank_batch_size = per_rank_batch_size
        self.skip_batches = 0  # applies to the next epoch iterated, then resets

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.skip_batches * self.per_rank_batch_size:]
        self.skip_batches = 0
        return iter(indices)


def steps_from(loader: DataLoader, sampler: ResumableSampler, progress: dict[str, int],
               num_steps: int) -> Iterator[tuple[int, Any, dict[str, int]]]:
    """Yield ``(step, batch, progress after this batch)`` from the saved position up to ``num_steps``."""
    step, epoch, batch_in_epoch = progress["step"], progress["epoch"], progress["batch_in_epoch"]
    sampler.skip_batches = batch_in_epoch
    while step < num_steps:
        sampler.set_epoch(epoch)  # Pitfall: restore the epoch too, or the resumed epoch reshuffles differently
        for batch in loader:
            if step == num_steps:
                return
            batch_in_epoch += 1
            step += 1
            yield step - 1, batch, {**progress, "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch}
        epoch, batch_in_epoch = epoch + 1, 0
# --8<-- [end:data_position]


# --8<-- [start:save]
@dataclass
class PendingSave:
    """A checkpoint whose shards may still be being written; ``finish()`` waits and publishes it."""

    root: str
    step: int
    group: dist.ProcessGroup | None
    keep_last: int
    made_with: dict[str, Any] = field(default_factory=dict)  # see load_checkpoint
    future: Any = None  # dcp.async_save's future; None for a blocking save
    tmp_dir: str = field(init=False)

    def __post_init__(self) -> None:
        self.tmp_dir = os.path.join(self.root, TMP_PREFIX + step_dir_name(self.step))

    def finish(self) -> str:
        if self.future is not None:
            self.future.result()  # re-raises here if this rank's background write failed
        return publish(self)


def save_checkpoint(root: str, app: AppState, step: int, *, group: dist.ProcessGroup | None,
                    async_save: bool = False, keep_last: int = 0,
                    made_with: dict[str, Any] | None = None) -> PendingSave:
    """Write every rank's shard into ``root/.tmp-step_N``; ``finish()`` on the result publishes it.
    ``made_with`` (what a resume must repeat) goes into the manifest: see load_checkpoint."""
    final_dir = os.path.join(root, step_dir_name(step))
    if os.path.exists(final_dir):  # every rank sees it (shared filesystem): all raise, none hangs
        raise RecipeError(f"{final_dir} already exists: a checkpoint is never written over; "
                          "resume from it or use another --checkpoint-dir")
    pending = PendingSave(root, step, group, keep_last, dict(made_with or {}))
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):  # the remains of saves that died part-way: never published, never read
            if name.startswith(TMP_PREFIX):
                shutil.rmtree(os.path.join(root, name))
    dist.barrier(group=group)  # nobody writes into .tmp-* before rank 0 has cleared it
    if async_save:
        # The state is copied to host memory before async_save returns, so training may change the
        # parameters right away; the write runs in a thread, with collectives on `group` only.
        future = dcp.async_save({"app": app}, checkpoint_id=pending.tmp_dir, process_group=group)
        pending.future = getattr(future, "upload_completion", future)  # newer torch returns a response object
    else:
        dcp.save({"app": app}, checkpoint_id=pending.tmp_dir, process_group=group)
    return pending


def publish(pending: PendingSave) -> str:
    """Manifest, then one rename, then the ``latest`` pointer: a crash at any point leaves the last good
    checkpoint loadable and ``latest`` naming a complete one."""
    rank, group = dist.get_rank(), pending.group
    dist.barrier(group=group)  # every rank's dcp.save has returned, so .metadata and all shards exist
    files = sorted(os.listdir(pending.tmp_dir))
    entries = _gather_file_entries(pending.tmp_dir, files, group)  # hashing is split over the ranks
    final_dir = os.path.join(pending.root, step_dir_name(pending.step))
    if rank == 0:
        manifest = {"step": pending.step, "world_size": dist.get_world_size(),
                    "made_with": pending.made_with, "files": entries}
        _write_durably(os.path.join(pending.tmp_dir, MANIFEST), json.dumps(manifest, indent=1).encode())
        os.rename(pending.tmp_dir, final_dir)  # atomic: the checkpoint appears whole or not at all
        _fsync_dir(pending.root)
        _write_durably(os.path.join(pending.root, LATEST), step_dir_name(pending.step).encode())
        _prune(pending.root, pending.keep_last)
    dist.barrier(group=group)  # nobody reads 'latest' before it names the new checkpoint
    return final_dir
# --8<-- [end:save]


def _gather_file_entries(directory: str, files: list[str], group: dist.ProcessGroup | None) -> dict[str, dict]:
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    mine = {name: _file_entry(os.path.join(directory, name)) for name in files[rank::world_size]}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine, group=group)
    return dict(sorted((name, entry) for part in gathered for name, entry in part.items()))


def _file_entry(path: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def _write_durably(path: str, data: bytes) -> None:
    """Write to a temporary name, fsync, rename over ``path``: readers see the old or the new file, whole."""
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


def published_steps(root: str) -> list[int]:
    """Steps of the published checkpoints in ``root`` (a directory with a manifest), oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(root))
                  if m and os.path.exists(os.path.join(root, m.group(0), MANIFEST)))


def _prune(root: str, keep_last: int) -> None:
    if keep_last > 0:
        for step in published_steps(root)[:-keep_last]:
            shutil.rmtree(os.path.join(root, step_dir_name(step)))


# --8<-- [start:load]
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
            raise RecipeError(f"{pointer} names {path}, which does not exist; pass --resume-from <a step_* directory>")
        return path
    if not os.path.isdir(resume_from):
        raise RecipeError(f"--resume-from {resume_from}: no such checkpoint directory")
    return resume_from


def _read_pointer(pointer: str) -> str:
    """The step_* name that the 'latest' file holds; anything else: a RecipeError naming it."""
    with open(pointer) as f:
        name = f.read().strip()
    if not STEP_DIR.match(name):  # publish() writes it whole (_write_durably): not written by us
        what = "is empty" if not name else f"holds {name[:40]!r}, not a step_NNNNNNNN name"
        raise RecipeError(f"{pointer} {what}; delete it to resume from the newest published "
                          "checkpoint, or pass --resume-from <a step_* directory>")
    return name


def verify_checkpoint(path: str, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Check every file against the manifest written at publish time; RecipeError naming the first bad one.

    Works without a world too (a world of 1). In a world, the hashing is split over the ranks and every
    rank raises the same error.
    """
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        raise RecipeError(f"{path} is not a complete checkpoint: {MANIFEST} is missing (a save that did not "
                          "finish?); resume from a published step_* directory, e.g. --resume-from latest")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        expected = manifest["files"]
    except (ValueError, KeyError) as exc:
        raise RecipeError(f"{manifest_path} is unreadable ({exc}); the checkpoint cannot be verified") from None
    if ".metadata" not in expected:
        raise RecipeError(f"{manifest_path} lists no .metadata file; this is not a DCP checkpoint")
    names = sorted(expected)
    rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    problems = {name: _file_problem(os.path.join(path, name), expected[name]) for name in names[rank::world_size]}
    if world_size > 1:
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, problems, group=group)
        problems = {name: problem for part in gathered for name, problem in part.items()}
    bad = [problems[name] for name in names if problems[name]]
    if bad:
        more = f" ({len(bad) - 1} more bad file(s))" if len(bad) > 1 else ""
        raise RecipeError(f"{bad[0]}{more}; resume from another checkpoint")
    return manifest


def _file_problem(path: str, expected: dict[str, Any]) -> str | None:
    if not os.path.exists(path):
        return f"checkpoint file {path} is missing"
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        return f"checkpoint file {path} is truncated or overwritten: {size} bytes, the manifest says {expected['bytes']}"
    if _file_entry(path)["sha256"] != expected["sha256"]:
        return f"checkpoint file {path} is corrupt: its sha256 differs from the manifest's"
    return None


def load_checkpoint(path: str, app: AppState, *, group: dist.ProcessGroup | None,
                    made_with: dict[str, Any] | None = None) -> dict[str, Any]:
    """Verify, compare ``made_with`` with the manifest's, then read into the model and optimizer
    that already exist (DCP loads in place, resharding)."""
    manifest = verify_checkpoint(path, group)
    # Before dcp.load, not after: another --model fails inside DCP with size-mismatch tracebacks (or
    # aborts the process), and another batch size loads "fine" and then reads other data.
    saved = manifest.get("made_with", {})  # absent from checkpoints written before it was recorded
    for name, value in (made_with or {}).items():
        if name in saved and saved[name] != value:
            flag = "--" + name.replace("_", "-")
            other = ("start the new model in another --checkpoint-dir" if name == "model"
                     else "the resumed run reads other data")
            raise RecipeError(f"{path} was trained with {name}={saved[name]}; resume with the same "
                              f"{flag}, or {other}")
    try:
        with _quiet_dcp_fallback_warnings():
            dcp.load({"app": app}, checkpoint_id=path, process_group=group)
    except RecipeError:
        raise
    # CheckpointException is a BaseException: `except Exception` alone lets it through.
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        # The sizes and sha256 matched, so the files were altered together with the manifest, or
        # not written by this recipe: DCP then fails anywhere (UnicodeDecodeError in torch.load,
        # "metadata is None", a CheckpointException wrapping every rank's). One line, no traceback.
        if isinstance(exc, CheckpointException) and exc.failures:
            exc = min(exc.failures.items())[1][0]  # {rank: (exception, traceback)}: lowest rank's
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        raise RecipeError(f"{path} matches its {MANIFEST} but DCP cannot load it "
                          f"({type(exc).__name__}: {first_line}); resume from another checkpoint"
                          ) from None
    return manifest
# --8<-- [end:load]


@contextlib.contextmanager
def _quiet_dcp_fallback_warnings() -> Iterator[None]:
    """dcp.load logs a warning with a full traceback on the ROOT logger whenever .metadata cannot be
    read (it then tries per-rank metadata). The failure, if it is one, is re-raised as one line;
    those tracebacks would reach stderr all the same, so they are dropped while dcp.load runs."""
    dcp_dir = os.path.dirname(dcp.__file__)

    def not_from_dcp(record: logging.LogRecord) -> bool:
        return not record.pathname.startswith(dcp_dir) or record.levelno >= logging.ERROR

    root = logging.getLogger()
    root.addFilter(not_from_dcp)
    try:
        yield
    finally:
        root.removeFilter(not_from_dcp)


# --8<-- [start:export]
def export_full_state_dict(model: nn.Module, path: str) -> None:
    """One ``state_dict`` file for single-device inference, written by rank 0; every rank must call it."""
    state, _ = full_state_on_rank0(model)  # every rank calls it: it all-gathers
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier()


def load_full_state_dict(model: nn.Module, path: str) -> None:
    """The path back: rank 0 reads a full ``state_dict`` file and each rank receives the part it holds."""
    # Only rank 0 touches the file (one read, not N); weights_only: a pickle from disk must not run code.
    state = torch.load(path, map_location="cpu", weights_only=True) if dist.get_rank() == 0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
# --8<-- [end:export]


def path_problem(cfg: CheckpointConfig) -> str | None:
    """What is wrong with a path that would otherwise fail only after training, or None: a file
    named as --checkpoint-dir, one that cannot be created or written, an --export-to that cannot be
    written, a missing --init-from. Writing is tried (a temporary file), not guessed from modes;
    nothing is created: a directory that does not exist yet is tried in its nearest parent."""
    ckpt_dir, export_to = cfg.checkpoint_dir, cfg.export_to
    if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
        return f"--checkpoint-dir {ckpt_dir} is a file; name a directory"
    if cfg.save_every and (why := _unwritable(ckpt_dir)):
        return f"--checkpoint-dir {ckpt_dir}: {why}; name a directory you can write to"
    if cfg.init_from and not os.path.isfile(cfg.init_from):
        return (f"--init-from {cfg.init_from}: no such file; name a full state_dict file "
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


def _refuse_bad_paths(cfg: CheckpointConfig, world: World, group: dist.ProcessGroup) -> None:
    """Rank 0 looks (only it reads --init-from and writes --export-to); every rank raises."""
    problem = [path_problem(cfg) if world.rank == 0 else None]
    if world.world_size > 1:
        dist.broadcast_object_list(problem, src=0, group=group)
    if problem[0]:
        raise RecipeError(problem[0])


# --8<-- [start:train]
def train(cfg: CheckpointConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        per_rank_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size)
        # Checkpoint I/O gets a gloo group of its own: async_save runs its collectives in a background
        # thread, and two threads must not issue collectives on one group (they can interleave); DCP's
        # async_save also needs a CPU-capable group when training runs on NCCL.
        group = dist.new_group(backend="gloo")
        try:
            return _train(cfg, world, per_rank_batch, group)
        finally:
            dist.destroy_process_group(group)


def _train(cfg: CheckpointConfig, world: World, per_rank_batch: int, group: dist.ProcessGroup) -> RecipeResult:
    precision = setup_precision(cfg.precision, world.device)
    if precision == "fp16":
        raise RecipeError(
            "sharded_checkpoint does not checkpoint a loss scaler; use --precision bf16 "
            "(no scaler needed) or fp32"
        )
    _refuse_bad_paths(cfg, world, group)  # now, not after training: see path_problem
    model = parallelize(
        build_model(cfg.model, seed=cfg.seed, device=world.device), cfg.strategy, world, precision
    )
    optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=world.device)
    # DDP computes in bf16 under autocast; the FSDPs' policies already do (autocast on top: none).
    compute_dtype = precision if cfg.strategy == "ddp" else "fp32"
    app = AppState(model, optimizer, global_batch_size=cfg.global_batch_size,
                   batches_per_epoch=cfg.batches_per_epoch, group=group)

    # What a resume must repeat to continue the same run; saved in each manifest, compared on load
    # before anything is read. The seed too: it decides the synthetic data and the shuffle order.
    made_with = {"model": cfg.model, "global_batch_size": cfg.global_batch_size,
                 "batches_per_epoch": cfg.batches_per_epoch, "seed": cfg.seed}
    resume_dir, saved_by = find_checkpoint(cfg.resume_from, cfg.checkpoint_dir), None
    if resume_dir is not None:
        saved_by = load_checkpoint(resume_dir, app, group=group, made_with=made_with)["world_size"]
        for name in ("global_batch_size", "batches_per_epoch"):  # checkpoints without made_with
            if app.progress[name] != getattr(cfg, name):
                raise RecipeError(f"{resume_dir} was trained with {name}={app.progress[name]}; resume with the same "
                                  f"--{name.replace('_', '-')}, or the resumed run reads other data")
        # --lr on resume: applied, not refused. The loaded optimizer state carries the saved lr and
        # would silently win; lowering the lr of a running job (after a loss spike, or as decay by
        # hand) is a common reason to restart it, and Adam's moments stay valid under another lr.
        saved_lrs = sorted({param_group["lr"] for param_group in optimizer.param_groups})
        if saved_lrs != [cfg.lr]:
            log.info("--lr %g replaces the checkpoint's lr %s", cfg.lr,
                     "/".join(map(str, saved_lrs)))
            for param_group in optimizer.param_groups:
                param_group["lr"] = cfg.lr
        log.info("resumed from %s at step %d (saved by %d rank(s), loaded on %d)",
                 resume_dir, app.progress["step"], saved_by, world.world_size)
    elif cfg.init_from:
        load_full_state_dict(model, cfg.init_from)
        log.info("model initialised from %s", cfg.init_from)
    start_step = app.progress["step"]
    if start_step >= cfg.steps:
        log.info("the checkpoint is at step %d and --steps is %d: nothing to train", start_step, cfg.steps)
    later = [s for s in published_steps(cfg.checkpoint_dir) if s > start_step] if cfg.save_every else []
    if later:  # refuse now rather than after training up to the clash
        raise RecipeError(f"{cfg.checkpoint_dir} already holds checkpoints past step {start_step} (up to step "
                          f"{later[-1]}) that this run would collide with; use --resume-from latest or another "
                          "--checkpoint-dir")

    dataset = make_dataset(cfg.model, cfg.global_batch_size, batches_per_epoch=cfg.batches_per_epoch, seed=cfg.seed)
    sampler = ResumableSampler(dataset, per_rank_batch_size=per_rank_batch, num_replicas=world.world_size,
                               rank=world.rank, seed=cfg.seed)
    loader = DataLoader(dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True)

    losses, timer, pending = [], StepTimer(world.device), None
    saved_steps, blocked_seconds = [], []
    for step, (inputs, targets), progress in steps_from(loader, sampler, app.progress, cfg.steps):
        with timer:
            inputs, targets = inputs.to(world.device), targets.to(world.device)
            with autocast(world.device, compute_dtype):
                loss = lm_loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        losses.append(mean_over_ranks(loss))
        log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)
        app.progress = progress
        if cfg.save_every and (progress["step"] % cfg.save_every == 0 or progress["step"] == cfg.steps):
            started = time.perf_counter()
            if pending is not None:
                pending.finish()  # one save in flight at a time: wait for the previous one and publish it
            pending = save_checkpoint(cfg.checkpoint_dir, app, progress["step"], group=group,
                                      async_save=cfg.async_save, keep_last=cfg.keep_last,
                                      made_with=made_with)
            if not cfg.async_save:
                pending.finish()
                pending = None
            blocked_seconds.append(time.perf_counter() - started)  # the time training stood still
            saved_steps.append(progress["step"])
            log.info("checkpoint of step %d %s in %.1f ms", progress["step"],
                     "started" if cfg.async_save else "published", blocked_seconds[-1] * 1e3)
    if pending is not None:
        pending.finish()

    if cfg.export_to:
        export_full_state_dict(model, cfg.export_to)
        log.info("full state_dict written to %s", cfg.export_to)
    full_state, _ = full_state_on_rank0(model)
    return make_result(
        "sharded_checkpoint", world, losses, full_state.values(), timer,  # rank 0 holds the full state
        keep_final_state=full_state if cfg.keep_final_state else None,
        workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
        strategy=cfg.strategy, start_step=start_step, resumed_from=resume_dir or "", saved_by_world_size=saved_by,
        saved_steps=saved_steps, save_blocking_seconds=blocked_seconds,
        checkpoint_bytes=_published_bytes(cfg.checkpoint_dir, saved_steps[-1]) if saved_steps else 0,
    )
# --8<-- [end:train]


def _published_bytes(root: str, step: int) -> int:
    with open(os.path.join(root, step_dir_name(step), MANIFEST)) as f:
        return sum(entry["bytes"] for entry in json.load(f)["files"].values())


if __name__ == "__main__":
    run_cli(train, CheckpointConfig, __doc__)
