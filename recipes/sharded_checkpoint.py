"""Sharded checkpoints with torch.distributed.checkpoint (DCP): resume on any world size, export.

    torchrun --standalone --nproc_per_node=2 -m recipes.sharded_checkpoint --steps 3
    torchrun --standalone --nproc_per_node=4 -m recipes.sharded_checkpoint --steps 6  # resumes on 4
    python -m recipes.sharded_checkpoint --steps 9 --export-to model.pt   # ... on 1, then exports

Copy with it: recipes/_checkpoint_store.py (the crash-safe, verified checkpoint folder),
recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and leave the world),
recipes/parallelize.py (``apply_fully_shard``, ``apply_fsdp``), recipes/options.py (the command
line, from the config).

Every rank writes only the shard it holds (``dcp.save``), in parallel, and a load reads what each
rank of the NEW world needs, whatever world wrote it: a checkpoint from 2 ranks resumes on 1, 3 or
4, from FSDP into fully_shard or DDP. What a resumed run needs is one ``Stateful`` (``AppState``):
model, optimizer, the data position (epoch and batches done in it) and every rank's RNG state. A run
resumed at step k gives the same losses as one that never stopped (tests/test_sharded_checkpoint.py
asserts it for DDP, FSDP and fully_shard, and after resharding to 1, 3 and 4 ranks).

Crash safety, the part DCP leaves to you, lives beside this file (recipes/_checkpoint_store.py,
which recipes/job.py uses too): every save goes to ``.tmp-step_N/``; when all ranks are done, a
manifest (size, sha256 of every file, and what the run was made with), an atomic rename to
``step_N/`` and then the ``latest`` pointer publish it. A load verifies the manifest first.
``--resume-from latest`` takes the newest checkpoint that verifies, skipping each damaged one with
one line naming its bad file; a checkpoint named explicitly with a missing, truncated or altered
file is refused with one line naming it.

``--async-save`` overlaps writing with training (``dcp.async_save``: the state is copied to host
memory, then written by a background thread, or with ``--async-mode process`` by a background
process per rank); the next save first waits for the previous one and publishes it. ``--export-to``
writes one full ``state_dict`` file on rank 0 for single-device inference (``torch.load(...,
weights_only=True)`` into a plain model), and ``--init-from`` is the path back: rank 0 reads such a
file and every rank gets its shard. Offline, without a world: ``python -m
torch.distributed.checkpoint.format_utils dcp_to_torch step_N/ model.pt`` converts a whole
checkpoint (optimizer included) to one torch.save file.

``train`` returns a ``CheckpointRun``: the global loss of each step trained, and what the resume
and the saves did (the step it started from, who saved what it loaded, the steps it saved, how long
each save held training up, the last checkpoint's bytes). It prints one line per step from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from recipes._checkpoint_store import (
    MANIFEST,
    CheckpointError,
    async_options,
    load_checkpoint,
    published_steps,
    resume_checkpoint,
    save_checkpoint,
    say,
    step_dir_name,
    unwritable,
)
from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import apply_fsdp, apply_fully_shard
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset


@dataclass
class CheckpointConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    # counted from the start of the run, not from the resume
    steps: int = option(
        6,
        "train up to this step (a resumed run continues from its checkpoint's step)",
        at_least=1,
    )
    global_batch_size: int = option(
        12, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    lr: float = option(
        1e-3, "AdamW's learning rate; on resume it replaces the checkpoint's", above=0
    )
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    # no fp16: a loss scaler's state would need checkpointing too
    precision: str = option(
        "auto",
        "auto: bf16 on a GPU, fp32 on CPU; bf16: the FSDPs' mixed-precision policies, "
        "autocast for DDP",
        choices=["auto", "fp32", "tf32", "bf16"],
    )
    strategy: str = option(
        "fsdp2",
        "ddp (replicated), fsdp (classic FullyShardedDataParallel) or fsdp2 (fully_shard); "
        "a checkpoint saved with one loads into any other",
        choices=["ddp", "fsdp", "fsdp2"],
    )
    checkpoint_dir: str = option(
        "checkpoints/sharded_checkpoint",
        "where step_NNNNNNNN/ checkpoints and the 'latest' pointer live",
    )
    save_every: int = option(
        3, "save every N steps and after the last one; 0 = never save", at_least=0
    )
    resume_from: str = option(
        "latest",
        "'latest' = the checkpoint 'latest' names in --checkpoint-dir (start fresh if there "
        "is none yet: the same command starts and resumes a job); a step_* directory; or '' = "
        "always start fresh",
    )
    async_save: bool = option(
        False, "write checkpoints in the background (dcp.async_save) while training goes on"
    )
    async_mode: str = option(
        "thread",
        "with --async-save: write in a background thread of each rank, or in a background "
        "process per rank (no GIL contention with training)",
        choices=["thread", "process"],
    )
    keep_last: int = option(
        2, "published checkpoints to keep; older ones are deleted (0 = keep all)", at_least=0
    )
    export_to: str = option(
        "", "after training, rank 0 writes the full model state_dict to this file (inference)"
    )
    init_from: str = option(
        "",
        "when starting fresh, load the model from this full state_dict file (e.g. an "
        "--export-to file): rank 0 reads it, every rank gets its part",
    )
    # 4: 6 steps cross an epoch, so a resume must restore the epoch
    batches_per_epoch: int = option(
        4,
        "global batches per epoch of the synthetic data; 4 makes 6 steps cross an epoch "
        "boundary, so a resume must restore the epoch, not only the step",
        at_least=1,
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.async_mode != "thread" and not self.async_save:
            raise CheckpointError(
                f"--async-mode {self.async_mode} chooses how --async-save writes; "
                "add --async-save, or drop --async-mode"
            )
        # A folder where a file goes, or a file where a folder goes (the rest: path_problem)
        if os.path.exists(self.checkpoint_dir) and not os.path.isdir(self.checkpoint_dir):
            raise CheckpointError(
                f"--checkpoint-dir {self.checkpoint_dir} is a file; name a directory"
            )
        if self.export_to and os.path.isdir(self.export_to):
            raise CheckpointError(
                f"--export-to {self.export_to} is a directory; name a file, e.g. "
                f"{os.path.join(self.export_to, 'model.pt')}"
            )
        if self.init_from and os.path.isdir(self.init_from):
            raise CheckpointError(
                f"--init-from {self.init_from} is a directory; name a full state_dict file (as "
                "--export-to writes one; a step_* directory is for --resume-from)"
            )


@dataclass
class CheckpointRun:
    losses: list[float]  # the global batch's loss of each step this run trained
    start_step: int = 0
    resumed_from: str = ""
    saved_by_world_size: int | None = None  # the world that wrote the checkpoint resumed from
    saved_steps: list[int] = field(default_factory=list)
    save_blocking_seconds: list[float] = field(default_factory=list)  # training stood still
    checkpoint_bytes: int = 0  # all files of the last checkpoint this run published


def parallelize(model: nn.Module, strategy: str, world: Any, precision: str = "fp32") -> nn.Module:
    """The model as each strategy wraps it, in ``precision``: the FSDPs' own mixed-precision
    policies (DDP autocasts in the loop). The checkpoint code is the same for all."""
    low = {"bf16": torch.bfloat16}.get(precision)
    if strategy == "ddp":
        return DDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None)
    if strategy == "fsdp":
        policy = MixedPrecision(param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=low)
        return apply_fsdp(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            device=world.device,
            mixed_precision=policy if low else None,
        )
    return apply_fully_shard(
        model,
        init_device_mesh(world.device.type, (world.world_size,)),
        block_types=(Block,),
        mp_policy=MixedPrecisionPolicy(
            param_dtype=low, reduce_dtype=torch.float32 if low else None
        ),
    )


# --8<-- [start:app_state]
class AppState(Stateful):
    """Everything a resumed run needs. DCP calls ``state_dict()`` on every rank when saving, and
    ``state_dict()`` (for the shapes to read into) then ``load_state_dict()`` when loading."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        global_batch_size: int,
        batches_per_epoch: int,
        group: dist.ProcessGroup | None = None,
    ):
        self.model, self.optimizer, self.group = model, optimizer, group
        # The data position, in world-size-free units: global step s reads the same samples on any
        # world size, so (epoch, global batches done in it) means the same thing to a resharded run,
        # as long as the global batch and the epoch are the same size (checked on resume).
        self.progress = {
            "step": 0,
            "epoch": 0,
            "batch_in_epoch": 0,
            "global_batch_size": global_batch_size,
            "batches_per_epoch": batches_per_epoch,
        }

    def state_dict(self) -> dict[str, Any]:
        # get_state_dict: one call for DDP, FSDP and fully_shard. Names come without "module." or
        # "_fsdp_wrapped_module." prefixes, and sharded tensors stay sharded (DTensor /
        # ShardedTensor), so each rank writes only its part and any other wrapping can read it back.
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optim": optim_state,
            "progress": dict(self.progress),
            "rng": gather_rng_states(self.group),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
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
    local = (
        torch.get_rng_state().numpy().tobytes().hex(),
        torch.cuda.get_rng_state().numpy().tobytes().hex() if cuda else "",
    )
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
        indices = list(super().__iter__())[self.skip_batches * self.per_rank_batch_size :]
        self.skip_batches = 0
        return iter(indices)


def steps_from(
    loader: DataLoader, sampler: ResumableSampler, progress: dict[str, int], num_steps: int
) -> Iterator[tuple[int, Any, dict[str, int]]]:
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
            yield (
                step - 1,
                batch,
                {**progress, "step": step, "epoch": epoch, "batch_in_epoch": batch_in_epoch},
            )
        epoch, batch_in_epoch = epoch + 1, 0


# --8<-- [end:data_position]


def path_problem(cfg: CheckpointConfig) -> str | None:
    """What is wrong with a path that would otherwise fail only after training, or None. Writing is
    tried (a temporary file), not guessed from modes; nothing is created."""
    ckpt, export_to = cfg.checkpoint_dir, cfg.export_to
    if cfg.save_every and (why := unwritable(ckpt)):
        return f"--checkpoint-dir {ckpt}: {why}; name a directory you can write to"
    if cfg.init_from and not os.path.isfile(cfg.init_from):
        return (
            f"--init-from {cfg.init_from}: no such file; name a full state_dict file "
            "(as --export-to writes one), or drop --init-from"
        )
    if export_to and (why := unwritable(os.path.dirname(os.path.abspath(export_to)))):
        return f"--export-to {export_to}: {why}; name a file in a directory you can write to"
    return None


# --8<-- [start:export]
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded ``state_dict`` on CPU (all ranks call it: it all-gathers). Pitfall: classic
    FSDP's flat parameters already on the host crash under ``cpu_offload`` (pytorch#188989), while
    fully_shard on a CPU world aborts without it."""
    on_host_fsdp = next(model.parameters()).device.type == "cpu" and any(
        isinstance(module, FullyShardedDataParallel) for module in model.modules()
    )
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=not on_host_fsdp)
    )
    return {name: tensor.detach().cpu() for name, tensor in state.items()}


def export_full_state_dict(model: nn.Module, path: str) -> None:
    """One ``state_dict`` file for single-device inference, written by rank 0; all ranks call it."""
    state = full_state_dict(model)
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier()


def load_full_state_dict(model: nn.Module, path: str) -> None:
    """The path back: rank 0 reads a full ``state_dict`` file, each rank receives its part."""
    # Only rank 0 touches the file (one read, not N); weights_only: a pickle must not run code.
    state, problem = {}, [None]
    if dist.get_rank() == 0:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # not torch.save's format, truncated, or a pickle of code
            first = (str(exc).strip().splitlines() or [""])[0][:120]
            problem[0] = f"{type(exc).__name__}: {first}"
    dist.broadcast_object_list(problem, src=0)  # every rank refuses alike, none waits for rank 0
    if problem[0]:
        raise CheckpointError(
            f"--init-from {path} is not a state_dict file torch.load reads ({problem[0]}); "
            "name one that --export-to wrote"
        )
    set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )


# --8<-- [end:export]


# --8<-- [start:resume]
def resume_or_init(
    cfg: CheckpointConfig,
    app: AppState,
    run: CheckpointRun,
    *,
    group: dist.ProcessGroup,
    made_with: dict,
    world_size: int,
) -> None:
    """Load the checkpoint ``cfg.resume_from`` names into ``app`` (model, optimizer, data position,
    RNG), or ``cfg.init_from``'s full weights into the model, or nothing (a fresh run)."""
    # 'latest': the newest checkpoint that verifies (a damaged one is skipped, in one line)
    resume = resume_checkpoint(cfg.resume_from, cfg.checkpoint_dir, group=group)
    if resume is None:
        if cfg.init_from:
            load_full_state_dict(app.model, cfg.init_from)
            say(f"model initialised from {cfg.init_from}")
        return
    resume_dir, manifest = resume
    load_checkpoint(resume_dir, {"app": app}, group=group, made_with=made_with, manifest=manifest)
    run.resumed_from, run.saved_by_world_size = resume_dir, manifest["world_size"]
    for name in ("global_batch_size", "batches_per_epoch"):  # checkpoints without made_with
        if app.progress[name] != getattr(cfg, name):
            raise CheckpointError(
                f"{resume_dir} was trained with {name}={app.progress[name]}; resume with "
                f"the same --{name.replace('_', '-')}, or the resumed run reads other data"
            )
    # --lr on resume: applied, not refused. The loaded optimizer state carries the saved lr and
    # would silently win; lowering the lr of a running job is a common reason to restart it, and
    # Adam's moments stay valid under another lr.
    param_groups = app.optimizer.param_groups
    saved_lrs = sorted({param_group["lr"] for param_group in param_groups})
    if saved_lrs != [cfg.lr]:
        say(f"--lr {cfg.lr:g} replaces the checkpoint's lr {'/'.join(map(str, saved_lrs))}")
        for param_group in param_groups:
            param_group["lr"] = cfg.lr
    say(
        f"resumed from {resume_dir} at step {app.progress['step']} (saved by "
        f"{run.saved_by_world_size} rank(s), loaded on {world_size})"
    )


def check_start(cfg: CheckpointConfig, start_step: int) -> None:
    """Say when there is nothing left to train; refuse, before training, a run whose saves would
    collide with checkpoints of later steps already in ``cfg.checkpoint_dir``."""
    if start_step >= cfg.steps:
        say(f"the checkpoint is at step {start_step} and --steps is {cfg.steps}: nothing to train")
    later = [s for s in published_steps(cfg.checkpoint_dir) if s > start_step]
    if later and cfg.save_every:  # refuse now rather than after training up to the clash
        raise CheckpointError(
            f"{cfg.checkpoint_dir} already holds checkpoints past step {start_step} (up to "
            f"step {later[-1]}) that this run would collide with; use --resume-from latest or "
            "another --checkpoint-dir"
        )


# --8<-- [end:resume]


# --8<-- [start:train]
def train(cfg: CheckpointConfig, observer=None) -> CheckpointRun:
    """Train on this process's rank from the checkpoint ``cfg.resume_from`` names (or fresh), saving
    every ``cfg.save_every`` steps; every rank returns the same CheckpointRun."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    # Checkpoint I/O gets a gloo group of its own: async_save runs its collectives in a background
    # thread, and two threads must not issue collectives on one group (they can interleave); DCP's
    # async_save also needs a CPU-capable group when training runs on NCCL.
    group, stager = dist.new_group(backend="gloo"), None
    try:
        if cfg.global_batch_size % world.world_size:
            raise CheckpointError(
                f"global_batch_size={cfg.global_batch_size} does not divide "
                f"across {world.world_size} ranks; use a multiple of "
                f"{world.world_size}"
            )
        device, rank, world_size = world.device, world.rank, world.world_size
        use_cuda = device.type == "cuda"
        per_rank_batch = cfg.global_batch_size // world_size
        precision = cfg.precision
        if precision == "auto":
            precision = "bf16" if world.device.type == "cuda" else "fp32"
        if precision == "tf32" and world.device.type != "cuda":
            raise CheckpointError(
                "--precision tf32 is a CUDA matmul mode and this run is on "
                f"{world.device.type}; use --precision fp32 (or bf16)"
            )
        if world.device.type == "cuda":  # process-wide: set on every run, never inherited
            torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        async_kwargs = async_options(cfg.async_mode, world.device) if cfg.async_save else {}
        stager = async_kwargs.get("async_stager")  # ours, not DCP's: closed after the last save
        # Bad paths now, not after training (they once trained first, then failed). Rank 0 looks:
        # only it reads --init-from and writes --export-to.
        problem = [path_problem(cfg) if world.rank == 0 else None]
        dist.broadcast_object_list(problem, src=0, group=group)
        if problem[0]:
            raise CheckpointError(problem[0])

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
        # rank 0's weights at construction, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        model = parallelize(model, cfg.strategy, world, precision)  # DDP, FSDP or fully_shard
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        app = AppState(
            model,
            optimizer,
            global_batch_size=cfg.global_batch_size,
            batches_per_epoch=cfg.batches_per_epoch,
            group=group,
        )
        # What a resume must repeat to continue the same run; saved in each manifest, compared on
        # load before anything is read. The seed too: it decides the data and the shuffle order.
        made_with = {
            "model": cfg.model,
            "global_batch_size": cfg.global_batch_size,
            "batches_per_epoch": cfg.batches_per_epoch,
            "seed": cfg.seed,
        }
        run = CheckpointRun(losses=[])
        # 'latest': the newest checkpoint that verifies; else --init-from's weights; else fresh
        resume_or_init(cfg, app, run, group=group, made_with=made_with, world_size=world_size)
        if observer:
            observer.model_ready(model, optimizer)
        run.start_step = app.progress["step"]
        check_start(cfg, run.start_step)  # no checkpoint of a later step is overwritten

        dataset = make_dataset(
            cfg.model, cfg.global_batch_size, batches_per_epoch=cfg.batches_per_epoch, seed=cfg.seed
        )
        # A DistributedSampler that starts mid-epoch: the data position is part of the state
        sampler = ResumableSampler(
            dataset,
            per_rank_batch_size=per_rank_batch,
            num_replicas=world_size,
            rank=rank,
            seed=cfg.seed,
        )
        loader = DataLoader(
            dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, pin_memory=use_cuda
        )
        # DDP computes in bf16 under autocast; the FSDPs' policies already do (no autocast on top)
        autocast_on = precision == "bf16" and cfg.strategy == "ddp"
        losses, pending = run.losses, None
        for step, (inputs, targets), progress in steps_from(
            loader, sampler, app.progress, cfg.steps
        ):
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_on):
                loss = lm_loss(model(inputs), targets)  # this rank's sequences' mean
            loss.backward()
            optimizer.step()
            # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks)
            global_loss = loss.detach().float().clone()
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
            losses.append(global_loss.item())
            if rank == 0:
                print(f"step {step} loss {losses[-1]:.4f}", flush=True)
            if observer:
                observer.step_end(step, losses[-1])
            app.progress = progress
            done = progress["step"]
            if cfg.save_every and (done % cfg.save_every == 0 or done == cfg.steps):
                started = time.perf_counter()
                if pending is not None:
                    pending.finish()  # one save in flight at a time: wait for it, publish it
                pending = save_checkpoint(
                    cfg.checkpoint_dir,
                    {"app": app},
                    done,
                    group=group,
                    async_save=cfg.async_save,
                    keep_last=cfg.keep_last,
                    made_with=made_with,
                    async_kwargs=async_kwargs,
                )
                if not cfg.async_save:
                    pending.finish()
                    pending = None
                run.save_blocking_seconds.append(time.perf_counter() - started)
                run.saved_steps.append(done)
                say(
                    f"checkpoint of step {done} {'started' if cfg.async_save else 'published'} "
                    f"in {run.save_blocking_seconds[-1] * 1e3:.1f} ms"
                )
        # --8<-- [end:loop]
        if pending is not None:
            pending.finish()
        if run.saved_steps:
            manifest_path = os.path.join(
                cfg.checkpoint_dir, step_dir_name(run.saved_steps[-1]), MANIFEST
            )
            with open(manifest_path) as f:
                run.checkpoint_bytes = sum(e["bytes"] for e in json.load(f)["files"].values())
        if cfg.export_to:
            export_full_state_dict(model, cfg.export_to)
            say(f"full state_dict written to {cfg.export_to}")
        return run
    finally:
        if stager is not None:
            stager.close()
        dist.destroy_process_group(group)
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(CheckpointConfig, prog="python -m recipes.sharded_checkpoint", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), CheckpointConfig, argv)
    with exit_on_bad_input():  # bad input or a bad checkpoint: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
