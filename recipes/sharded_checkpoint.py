"""Sharded checkpoints with torch.distributed.checkpoint (DCP): resume on any world size, export.

    torchrun --standalone --nproc_per_node=2 -m recipes.sharded_checkpoint --steps 3
    torchrun --standalone --nproc_per_node=4 -m recipes.sharded_checkpoint --steps 6  # resumes on 4
    python -m recipes.sharded_checkpoint --steps 9 --export-to model.pt   # ... on 1, then exports

Every rank writes only the shard it holds (``dcp.save``), in parallel, and a load reads what each
rank of the NEW world needs, whatever world wrote it: a checkpoint from 2 ranks resumes on 1, 3 or
4, from FSDP into fully_shard or DDP. What a resumed run needs is one ``Stateful`` (``AppState``):
model, optimizer, the data position (epoch and batches done in it) and every rank's RNG state. A run
resumed at step k gives the same losses as one that never stopped (tests/test_sharded_checkpoint.py
asserts it for DDP, FSDP and fully_shard, and after resharding to 1, 3 and 4 ranks).

Crash safety, the part DCP leaves to you, lives in recipes/core/publish.py: every save goes to
``.tmp-step_N/``; when all ranks are done, a manifest (size, sha256 of every file, and what the run
was made with), an atomic rename to ``step_N/`` and then the ``latest`` pointer publish it. A load
verifies the manifest first and refuses a missing, truncated or altered file with one line naming
it.

``--async-save`` overlaps writing with training (``dcp.async_save``: the state is copied to host
memory, then written by a background thread, or with ``--async-mode process`` by a background
process per rank); the next save first waits for the previous one and publishes it. ``--export-to``
writes one full ``state_dict`` file on rank 0 for single-device inference (``torch.load(...,
weights_only=True)`` into a plain model), and ``--init-from`` is the path back: rank 0 reads such a
file and every rank gets its shard. Offline, without a world: ``python -m
torch.distributed.checkpoint.format_utils dcp_to_torch step_N/ model.pt`` converts a whole
checkpoint (optimizer included) to one torch.save file.

Length: about 450 lines, over the cookbook's ~300, because everything a resume must carry (model,
optimizer, data position, RNG streams, resharding), the export and the two background writers are
one lesson that reads top to bottom; the second idea, publishing, lives in recipes/core/publish.py.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.publish import (PendingSave, begin_save, check_made_with,
                                  dcp_errors_in_one_line, find_checkpoint, published_bytes,
                                  published_steps, refuse_bad_paths, verify_checkpoint)
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.speed import autocast, make_adamw, mixed_precision_policy, setup_precision
from recipes.core.state import full_state_on_rank0, mean_over_ranks
from recipes.core.throughput import Workload
from recipes.core.workload import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset
from recipes.core.world import World, join_world
from recipes.fsdp import apply_fsdp, fsdp_mixed_precision
from recipes.parallelize import apply_fully_shard

log = get_logger(__name__)


@dataclass
class CheckpointConfig(TrainConfig):
    strategy: Literal["ddp", "fsdp", "fsdp2"] = opt(
        "fsdp2", "ddp (replicated), fsdp (classic FullyShardedDataParallel) or fsdp2 "
        "(fully_shard); a checkpoint saved with one loads into any other")
    checkpoint_dir: str = opt("checkpoints/sharded_checkpoint",
                              "where step_NNNNNNNN/ checkpoints and the 'latest' pointer live")
    save_every: int = opt(3, "save every N steps and after the last one; 0 = never save", ge=0)
    resume_from: str = opt(
        "latest", "'latest' = the checkpoint 'latest' names in --checkpoint-dir (start fresh if "
        "there is none yet: the same command starts and resumes a job); a step_* directory; or "
        "'' = always start fresh")
    async_save: bool = opt(
        False, "write checkpoints in the background (dcp.async_save) while training goes on")
    async_mode: Literal["thread", "process"] = opt(
        "thread", "with --async-save: write in a background thread of each rank, or in a "
        "background process per rank (no GIL contention with training; needs a torch with "
        "AsyncCheckpointerType.PROCESS)")
    keep_last: int = opt(
        2, "published checkpoints to keep; older ones are deleted (0 = keep all)", ge=0)
    export_to: str = opt(
        "", "after training, rank 0 writes the full model state_dict to this file (for inference)")
    init_from: str = opt(
        "", "when starting fresh, load the model from this full state_dict file (e.g. an "
        "--export-to file): rank 0 reads it, every rank gets its part")
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

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 global_batch_size: int, batches_per_epoch: int,
                 group: dist.ProcessGroup | None = None):
        self.model, self.optimizer, self.group = model, optimizer, group
        # The data position, in world-size-free units: global step s reads the same samples on any
        # world size, so (epoch, global batches done in it) means the same thing to a resharded run,
        # as long as the global batch and the epoch are the same size (checked on resume).
        self.progress = {"step": 0, "epoch": 0, "batch_in_epoch": 0,
                         "global_batch_size": global_batch_size,
                         "batches_per_epoch": batches_per_epoch}

    def state_dict(self) -> dict[str, Any]:
        # get_state_dict: one call for DDP, FSDP and fully_shard. Names come without "module." or
        # "_fsdp_wrapped_module." prefixes, and sharded tensors stay sharded (DTensor /
        # ShardedTensor), so each rank writes only its part and any other wrapping can read it back.
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "progress": dict(self.progress),
                "rng": gather_rng_states(self.group)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.progress = dict(state["progress"])
        restore_rng_state(state["rng"])


def gather_rng_states(group: dist.ProcessGroup | None) -> dict[str, list[str]]:
    """Every rank's RNG states, so that dropout masks or random augmentations continue, not restart.

    Gathered into lists that are the same on every rank: DCP stores a value that every rank has
    once, and a per-rank key would be missing for the extra ranks of a larger world. A list of
    strings is one value to DCP (a list of tensors would be split into per-rank keys again) and
    loads with ``weights_only=True`` (bytes would not). "cuda" is always there, empty on a CPU
    world, so that a GPU world can load a CPU world's checkpoint.
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    local = (torch.get_rng_state().numpy().tobytes().hex(),
             torch.cuda.get_rng_state().numpy().tobytes().hex() if cuda else "")
    states: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, local, group=group)
    return {"cpu": [cpu for cpu, _ in states], "cuda": [cuda for _, cuda in states]}


def restore_rng_state(states: dict[str, list[str]]) -> None:
    # Same world size: each rank continues its own stream. Resharded: rank r takes saved rank r mod
    # N's (per-rank streams of another world size cannot be continued; this keeps them
    # deterministic).
    index = dist.get_rank() % len(states["cpu"])

    def as_tensor(hex_state: str) -> torch.Tensor:
        return torch.frombuffer(bytearray.fromhex(hex_state), dtype=torch.uint8)

    torch.set_rng_state(as_tensor(states["cpu"][index]))
    if states["cuda"][index] and torch.cuda.is_available():
        torch.cuda.set_rng_state(as_tensor(states["cuda"][index]))
# --8<-- [end:app_state]


# --8<-- [start:data_position]
class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` that can start part-way into an epoch, without reading the skipped
    batches.

    Global batch b of an epoch is positions [b*G, (b+1)*G) of the epoch's shuffled order, dealt
    round-robin, whatever the world size; skipping b batches = skipping b * per_rank_batch_size of
    this rank's indices. (torchdata's StatefulDataLoader does the same for real pipelines.)
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
    """Yield ``(step, batch, progress after this batch)`` from the saved position on."""
    step, epoch, batch_in_epoch = progress["step"], progress["epoch"], progress["batch_in_epoch"]
    sampler.skip_batches = batch_in_epoch
    while step < num_steps:
        # Pitfall: restore the epoch too, or the resumed epoch reshuffles differently.
        sampler.set_epoch(epoch)
        for batch in loader:
            if step == num_steps:
                return
            batch_in_epoch += 1
            step += 1
            yield step - 1, batch, {**progress, "step": step, "epoch": epoch,
                                    "batch_in_epoch": batch_in_epoch}
        epoch, batch_in_epoch = epoch + 1, 0
# --8<-- [end:data_position]


# --8<-- [start:save]
def async_options(mode: str, device: torch.device) -> dict[str, Any]:
    """dcp.async_save's keywords for ``--async-mode``. "process": each rank starts one background
    process on its first async save (its own gloo world, set up through ``group``), which then
    writes every checkpoint: the write no longer competes with training for the GIL."""
    if mode == "thread":
        return {}  # dcp.async_save's default: a thread, and a stager it owns and closes
    from torch.distributed.checkpoint import state_dict_saver

    kind = getattr(getattr(state_dict_saver, "AsyncCheckpointerType", None), "PROCESS", None)
    if kind is None:  # added after torch 2.11's floor? checked, not assumed
        raise RecipeError(f"--async-mode process needs dcp's AsyncCheckpointerType.PROCESS, which "
                          f"torch {torch.__version__} lacks; use --async-mode thread")
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
    options["async_stager"] = DefaultStager(StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=False,
        use_non_blocking_copy=cuda))
    return options


def save_checkpoint(root: str, app: AppState, step: int, *, group: dist.ProcessGroup | None,
                    async_save: bool = False, keep_last: int = 0,
                    made_with: dict[str, Any] | None = None,
                    async_kwargs: dict[str, Any] | None = None) -> PendingSave:
    """Write every rank's shard into ``root/.tmp-step_N``; ``finish()`` on the result publishes it
    (recipes/core/publish.py). ``made_with`` (what a resume must repeat) goes into the manifest;
    ``async_kwargs`` (from async_options) choose the background writer."""
    pending = PendingSave(root, step, group, keep_last, dict(made_with or {}))
    tmp_dir = begin_save(pending)
    if async_save:
        # The state is copied to host memory before async_save returns, so training may change the
        # parameters right away; the write runs in the background, with collectives on `group`
        # only (a background process gets a gloo world of its own, set up through `group`).
        future = dcp.async_save({"app": app}, checkpoint_id=tmp_dir, process_group=group,
                                **(async_kwargs or {}))
        pending.future = getattr(future, "upload_completion", future)  # newer torch: a response
    else:
        dcp.save({"app": app}, checkpoint_id=tmp_dir, process_group=group)
    return pending
# --8<-- [end:save]


# --8<-- [start:load]
def load_checkpoint(path: str, app: AppState, *, group: dist.ProcessGroup | None,
                    made_with: dict[str, Any] | None = None) -> dict[str, Any]:
    """Verify, compare ``made_with`` with the manifest's, then read into the model and optimizer
    that already exist (DCP loads in place, resharding)."""
    manifest = verify_checkpoint(path, group)
    check_made_with(path, manifest, made_with or {})  # before dcp.load: see check_made_with
    with dcp_errors_in_one_line(path):  # a CheckpointException is not an Exception
        dcp.load({"app": app}, checkpoint_id=path, process_group=group)
    return manifest
# --8<-- [end:load]


# --8<-- [start:export]
def export_full_state_dict(model: nn.Module, path: str) -> None:
    """One ``state_dict`` file for single-device inference, written by rank 0; all ranks call it."""
    state, _ = full_state_on_rank0(model)  # every rank calls it: it all-gathers
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier()


def load_full_state_dict(model: nn.Module, path: str) -> None:
    """The path back: rank 0 reads a full ``state_dict`` file, each rank receives its part."""
    # Only rank 0 touches the file (one read, not N); weights_only: a pickle must not run code.
    state = torch.load(path, map_location="cpu", weights_only=True) if dist.get_rank() == 0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True,
                                                                broadcast_from_rank0=True))
# --8<-- [end:export]


# --8<-- [start:train]
def train(cfg: CheckpointConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        per_rank_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size)
        # Checkpoint I/O gets a gloo group of its own: async_save runs its collectives in a
        # background thread, and two threads must not issue collectives on one group (they can
        # interleave); DCP's async_save also needs a CPU-capable group when training runs on NCCL.
        group = dist.new_group(backend="gloo")
        try:
            return _train(cfg, world, per_rank_batch, group)
        finally:
            dist.destroy_process_group(group)


def _train(cfg: CheckpointConfig, world: World, per_rank_batch: int,
           group: dist.ProcessGroup) -> RecipeResult:
    precision = setup_precision(cfg.precision, world.device)
    if precision == "fp16":
        raise RecipeError("sharded_checkpoint does not checkpoint a loss scaler; use --precision "
                          "bf16 (no scaler needed) or fp32")
    if cfg.async_mode != "thread" and not cfg.async_save:
        raise RecipeError(f"--async-mode {cfg.async_mode} chooses how --async-save writes; "
                          "add --async-save, or drop --async-mode")
    async_kwargs = async_options(cfg.async_mode, world.device) if cfg.async_save else {}
    stager = async_kwargs.get("async_stager")
    try:
        return _train_loop(cfg, world, per_rank_batch, group, precision, async_kwargs)
    finally:
        if stager is not None:
            stager.close()  # ours, not DCP's (see async_options); after the last save finished


def _train_loop(cfg: CheckpointConfig, world: World, per_rank_batch: int,
                group: dist.ProcessGroup, precision: str,
                async_kwargs: dict[str, Any]) -> RecipeResult:
    # Now, not after training (bad paths once trained first and then failed with a traceback).
    refuse_bad_paths(cfg.checkpoint_dir, saving=cfg.save_every > 0, init_from=cfg.init_from,
                     export_to=cfg.export_to, group=group)
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
                raise RecipeError(f"{resume_dir} was trained with {name}={app.progress[name]}; "
                                  f"resume with the same --{name.replace('_', '-')}, or the "
                                  "resumed run reads other data")
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
        log.info("the checkpoint is at step %d and --steps is %d: nothing to train",
                 start_step, cfg.steps)
    later = [s for s in published_steps(cfg.checkpoint_dir) if s > start_step]
    if later and cfg.save_every:  # refuse now rather than after training up to the clash
        raise RecipeError(f"{cfg.checkpoint_dir} already holds checkpoints past step {start_step} "
                          f"(up to step {later[-1]}) that this run would collide with; use "
                          "--resume-from latest or another --checkpoint-dir")

    dataset = make_dataset(cfg.model, cfg.global_batch_size,
                           batches_per_epoch=cfg.batches_per_epoch, seed=cfg.seed)
    sampler = ResumableSampler(dataset, per_rank_batch_size=per_rank_batch,
                               num_replicas=world.world_size, rank=world.rank, seed=cfg.seed)
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
        done = progress["step"]
        if cfg.save_every and (done % cfg.save_every == 0 or done == cfg.steps):
            started = time.perf_counter()
            if pending is not None:
                pending.finish()  # one save in flight at a time: wait for the previous, publish it
            pending = save_checkpoint(cfg.checkpoint_dir, app, done, group=group,
                                      async_save=cfg.async_save, keep_last=cfg.keep_last,
                                      made_with=made_with, async_kwargs=async_kwargs)
            if not cfg.async_save:
                pending.finish()
                pending = None
            blocked_seconds.append(time.perf_counter() - started)  # the time training stood still
            saved_steps.append(done)
            log.info("checkpoint of step %d %s in %.1f ms", done,
                     "started" if cfg.async_save else "published", blocked_seconds[-1] * 1e3)
    if pending is not None:
        pending.finish()

    if cfg.export_to:
        export_full_state_dict(model, cfg.export_to)
        log.info("full state_dict written to %s", cfg.export_to)
    full_state, _ = full_state_on_rank0(model)  # rank 0 holds the full state
    return make_result(
        "sharded_checkpoint", world, losses, full_state.values(), timer,
        keep_final_state=full_state if cfg.keep_final_state else None,
        workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
        strategy=cfg.strategy, start_step=start_step, resumed_from=resume_dir or "",
        saved_by_world_size=saved_by, saved_steps=saved_steps,
        save_blocking_seconds=blocked_seconds,
        checkpoint_bytes=(published_bytes(cfg.checkpoint_dir, saved_steps[-1])
                          if saved_steps else 0),
    )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, CheckpointConfig, __doc__)
