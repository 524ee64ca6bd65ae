"""The complete training job, the recipe a team starts from: one config file, any parallelism.

    torchrun --standalone --nproc_per_node=2 -m recipes.job
    torchrun --standalone --nproc_per_node=2 -m recipes.job --config configs/job/fsdp_full.yaml
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 -m recipes.job --steps 200
    python -m recipes.job --config configs/job/learn.yaml --out-dir runs/learn   # one process
    torchrun --standalone --nproc_per_node=2 -m recipes.job --model path/to/save_pretrained_folder

Copy with it: recipes/_job_checkpoint.py, recipes/_checkpoint_store.py, recipes/_job_model.py,
recipes/toy.py, recipes/dist_setup.py, recipes/data.py, recipes/evaluation.py,
recipes/parallelize.py (each imports torch and these only; transformers for a Hugging Face model)
and recipes/options.py (the command line, from the config).

What it does, as torchtitan's and nanoGPT's train.py do: the token shards of recipes/data.py in a
global order that does not depend on the world size; a toy or Llama-style preset, or your Hugging
Face causal LM from a local folder (recipes/_job_model.py), under DDP, fully_shard, HSDP
(fully_shard on a (replicate, shard) mesh) or tensor parallel x fully_shard, with activation
checkpointing, per-block torch.compile and bf16 as configured; AdamW with linear warmup then
cosine decay; gradient accumulation and clipping; evaluation every N steps; TensorBoard and a
metrics.jsonl on rank 0; a DCP checkpoint every N steps (the last K and the best kept); and a
restart, by hand or by ``torchrun --max-restarts``, that continues exactly where the last
checkpoint that verifies stood: the weights, AdamW, the schedule, each rank's data position, the
RNG states. A damaged checkpoint is skipped with one line naming its bad file.

Configuration: the defaults below < a YAML file (``--config``) < flags (``--lr 3e-4``). An unknown
key, a wrong type, a layout the world cannot hold, a missing data folder: one line, exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import typing
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

import recipes._job_checkpoint as checkpoint
import recipes._job_model as job_model
from recipes.data import DataConfig, TokenWindows, prepare_shards
from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.evaluation import eval_shard, evaluate
from recipes.options import check_options, config_parser, exit_on_bad_input, option
from recipes.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fully_shard,
    apply_tp_and_fsdp,
)
from recipes.toy import lm_loss


# --8<-- [start:config]
@dataclass
class JobConfig:
    # model and data
    model: str = option(
        "tiny",
        "a preset (tiny, small, 100m; llama-100m, llama-1b) or a folder with a Hugging Face "
        "config.json (save_pretrained's): its weights if it holds them; the presets' and a "
        "config-only folder's vocabulary comes from the shards",
    )
    blocks: str | None = option(
        None, "block classes to shard, checkpoint, compile, comma-separated (default: the model's)"
    )
    seq_len: int = option(32, "tokens per window", at_least=1)
    data_dir: str = option(
        "data/job_shards", "token shards (prepared there from the corpus when absent)"
    )
    corpus: str | None = option(
        None, "folder of text files (default: Python's standard library sources)"
    )
    max_bytes: int = option(300_000, "text read from the corpus", at_least=1)
    vocab_size: int = option(256, "BPE vocabulary (256: bytes)", at_least=256, at_most=65536)
    prepare: bool = option(
        True, "tokenize the corpus into data_dir if it holds no shards (false: refuse)"
    )
    num_workers: int = option(1, "DataLoader worker processes per rank", at_least=0)
    # layout: world = dp_replicate x (dp shard) x tp
    parallelism: str = option(
        "fsdp", "ddp, fsdp, hsdp or tp_fsdp", choices=["ddp", "fsdp", "hsdp", "tp_fsdp"]
    )
    dp_replicate: int = option(1, "hsdp: replica groups (outer mesh dim)", at_least=1)
    tp: int = option(1, "tp_fsdp: tensor-parallel size (inner mesh dim)", at_least=1)
    precision: str = option("fp32", "fp32 or bf16", choices=["fp32", "bf16"])
    activation_checkpointing: bool = option(False, "recompute each block in backward")
    compile: bool = option(False, "torch.compile each block")
    # optimisation
    steps: int = option(12, "optimizer steps in all", at_least=1)
    global_batch_size: int = option(
        8, "windows per optimizer step over all ranks and micro-batches", at_least=1
    )
    accumulation: int = option(2, "micro-batches per rank per optimizer step", at_least=1)
    lr: float = option(3e-3, "peak learning rate", above=0)
    min_lr: float = option(3e-4, "learning rate at the end of the cosine (at most lr)", at_least=0)
    warmup_steps: int = option(3, "linear warmup steps (at most steps)", at_least=1)
    weight_decay: float = option(0.1, "AdamW decay of matrices", at_least=0)
    clip: float = option(1.0, "max gradient norm (0: measure only, no clipping)", at_least=0)
    seed: int = option(0, "model init and data order", at_least=0)
    # evaluation, checkpoints, logs
    eval_every: int = option(4, "evaluate every N steps", at_least=1)
    eval_windows: int = option(64, "validation windows (of the val split)", at_least=1)
    checkpoint_every: int = option(4, "checkpoint every N steps", at_least=1)
    keep: int = option(3, "last checkpoints kept (plus the best by validation loss)", at_least=1)
    out_dir: str = option("runs/job", "checkpoints, TensorBoard, metrics")
    tensorboard: bool = option(True, "write TensorBoard logs")
    log_every: int = option(1, "log every N steps", at_least=1)

    def __post_init__(self) -> None:
        check_options(self)  # the ranges and choices above: one line each
        hints = typing.get_type_hints(JobConfig)
        for f in dataclasses.fields(self):  # a YAML value of the wrong kind (true for a path)
            if not type_ok(getattr(self, f.name), hints[f.name]):
                want = " or ".join(
                    t.__name__ for t in typing.get_args(hints[f.name]) or [hints[f.name]]
                )
                raise ConfigError(f"{f.name} must be {want}, got {getattr(self, f.name)!r}")
        if self.min_lr > self.lr:  # else the cosine rises from lr to min_lr: silently wrong
            raise ConfigError(f"min_lr={self.min_lr} is above lr={self.lr}; use min_lr <= lr")
        if self.warmup_steps > self.steps:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps} > steps={self.steps}: the peak lr is never "
                f"reached; use warmup_steps {self.steps} or less"
            )
        if self.tp != 1 and self.parallelism != "tp_fsdp":
            raise ConfigError(f"tp={self.tp} needs parallelism=tp_fsdp")
        if self.dp_replicate != 1 and self.parallelism != "hsdp":
            raise ConfigError(f"dp_replicate={self.dp_replicate} needs parallelism=hsdp")
        # a preset's or a folder's config.json: positions, heads, tp_fsdp's plan, a causal LM
        job_model.check_model(
            self.model, seq_len=self.seq_len, parallelism=self.parallelism, tp=self.tp
        )
        if Path(self.out_dir).exists() and not Path(self.out_dir).is_dir():
            raise ConfigError(f"out_dir {self.out_dir} is a file; name a folder")
        self.data_config()  # the data's own checks: corpus and data_dir folders, vocab_size

    def data_config(self) -> DataConfig:
        """What recipes/data.py prepares the shards from (it checks its own values)."""
        return DataConfig(
            corpus=self.corpus,
            data_dir=self.data_dir,
            max_bytes=self.max_bytes,
            vocab_size=self.vocab_size,
        )


class ConfigError(ValueError):
    """A configuration the job cannot run: the message names the key and the fix."""


def load_config(path: str | None, overrides: dict) -> JobConfig:
    """Defaults < YAML file < command-line flags; JobConfig checks the keys' values, and an
    unknown key is refused naming the valid ones, as nanoGPT's configurator does."""
    values = {}
    if path is not None:
        import yaml  # PyYAML

        if not Path(path).is_file():
            raise ConfigError(f"config {path}: not a file; name a YAML file of key: value lines")
        try:
            values = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as exc:  # the line and column are in the first line of the message
            where = getattr(exc, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
            raise ConfigError(
                f"config {path}: not valid YAML{at}: {getattr(exc, 'problem', None) or exc}; "
                "write key: value lines"
            ) from None
        if not isinstance(values, dict):
            raise ConfigError(f"config {path}: expected key: value lines")
    values.update(overrides)
    names = [f.name for f in dataclasses.fields(JobConfig)]
    for key in values:
        if key not in names:
            raise ConfigError(
                f"{path or 'flags'}: unknown key {key!r}; valid keys: {', '.join(names)}"
            )
    return JobConfig(**values)


def type_ok(value, hint) -> bool:
    allowed = typing.get_args(hint) or (hint,)
    if value is None:
        return type(None) in allowed
    if isinstance(value, bool):  # YAML's true is a bool, and bool is an int: check it first
        return bool in allowed
    return (isinstance(value, int) and (int in allowed or float in allowed)) or any(
        isinstance(value, t) for t in allowed if t in (str, float)
    )


def check_layout(cfg: JobConfig, world_size: int) -> tuple[int, int]:
    """(dp_size, tp_size) for this world, or a ConfigError naming the fix."""
    tp = cfg.tp if cfg.parallelism == "tp_fsdp" else 1
    if world_size % (tp * cfg.dp_replicate):
        raise ConfigError(
            f"{cfg.parallelism} with tp={tp} x dp_replicate={cfg.dp_replicate} "
            f"does not divide the world size {world_size}; run on a multiple of "
            f"{tp * cfg.dp_replicate} ranks"
        )
    dp = world_size // tp
    if cfg.global_batch_size % (dp * cfg.accumulation):
        raise ConfigError(
            f"global_batch_size={cfg.global_batch_size} is not a multiple of "
            f"{dp} data-parallel ranks x accumulation={cfg.accumulation}; "
            f"use a multiple of {dp * cfg.accumulation}"
        )
    return dp, tp


# --8<-- [end:config]


# --8<-- [start:layout]
def parallelize(model: torch.nn.Module, cfg: JobConfig, world, tp: int, blocks: tuple):
    """The layout, in torchtitan's order: tensor parallel, activation checkpointing, compile,
    then data parallel (fully_shard or DDP) outermost. ``blocks``: the model's block classes.
    Returns (model, dp_rank, dp_size)."""
    device_type = world.device.type
    bf16 = cfg.precision == "bf16"
    # fully_shard's bf16: compute in bf16, reduce gradients in fp32 (a bf16 sum over many ranks
    # loses bits); the parameters AdamW updates stay fp32.
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else None
    )
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model, block_types=blocks)
    if cfg.compile:  # each block's forward: the sharding hooks stay outside the graphs
        apply_compile(model, block_types=blocks)
    if cfg.parallelism == "ddp":
        return DDP(model), world.rank, world.world_size
    if cfg.parallelism == "tp_fsdp":
        mesh = init_device_mesh(
            device_type, (world.world_size // tp, tp), mesh_dim_names=("dp", "tp")
        )
        apply_tp_and_fsdp(
            model, mesh, plan=job_model.tp_plan(model), block_types=blocks, mp_policy=mp_policy
        )
        # Ranks that differ only in tp read the same rows: one data share per dp coordinate.
        return model, mesh["dp"].get_local_rank(), mesh["dp"].size()
    if cfg.parallelism == "hsdp":
        mesh = init_device_mesh(
            device_type,
            (cfg.dp_replicate, world.world_size // cfg.dp_replicate),
            mesh_dim_names=("replicate", "shard"),
        )
    else:
        mesh = init_device_mesh(device_type, (world.world_size,), mesh_dim_names=("shard",))
    apply_fully_shard(model, mesh, block_types=blocks, mp_policy=mp_policy)
    return model, world.rank, world.world_size


def no_gradient_sync(model, last_micro_batch: bool):
    """Accumulation: reduce the gradients once, after the last micro-batch."""
    if isinstance(model, DDP):
        return contextlib.nullcontext() if last_micro_batch else model.no_sync()
    model.set_requires_gradient_sync(last_micro_batch)  # fully_shard's switch
    return contextlib.nullcontext()


# --8<-- [end:layout]


# --8<-- [start:data]
class GlobalBatches(Sampler):
    """Global batch ``b`` of epoch ``e`` is windows ``order_e[b*G : (b+1)*G]``; this rank takes
    rows ``dp_rank::dp_size`` of it. The order depends on the seed and the epoch only, never on
    the world size, so a checkpoint that says "epoch e, b batches done" continues the same
    sample order on 1, 2 or 3 ranks."""

    def __init__(
        self, num_windows: int, global_batch_size: int, *, dp_rank: int, dp_size: int, seed: int
    ):
        self.num_windows, self.size, self.seed = num_windows, global_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.batches_per_epoch = num_windows // global_batch_size  # the last partial one: dropped
        self.epoch, self.start = 0, 0

    def set_position(self, epoch: int, start: int) -> None:
        """The next ``iter()`` yields epoch ``epoch`` from global batch ``start`` on."""
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start

    def __iter__(self):
        order = torch.randperm(
            self.num_windows, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        for b in range(self.start, self.batches_per_epoch):
            yield order[b * self.size : (b + 1) * self.size][self.dp_rank :: self.dp_size].tolist()


def build_loader(windows, sampler: GlobalBatches, num_workers: int, device: torch.device):
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in 2.13
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(
            windows,
            batch_sampler=sampler,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            pin_memory=device.type == "cuda",
        )


def restore_position(
    loader, sampler: GlobalBatches, data: dict, *, same_world: bool, num_workers: int
) -> None:
    """Same world (and workers): the loader's own state, which knows what each worker had
    prefetched. Another world size: its per-rank state means nothing; the global position does."""
    if same_world and data["num_workers"] == num_workers:
        sampler.set_position(data["epoch"], data["iter_start"])
        loader.load_state_dict(data["loader"])  # skips what this iterator had yielded
    else:
        sampler.set_position(data["epoch"], data["batch"])


# --8<-- [end:data]


# --8<-- [start:schedule]
def warmup_cosine(cfg: JobConfig):
    """LambdaLR's factor of ``lr`` at step s: linear warmup to 1, then cosine to min_lr/lr."""
    floor = cfg.min_lr / cfg.lr

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(cfg.steps - cfg.warmup_steps, 1)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def build_optimizer(model, cfg: JobConfig, device: torch.device):
    # nanoGPT's split: weight decay on matrices (embeddings included), none on norms and biases;
    # fused AdamW on CUDA (one kernel for all parameters)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda" or None
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg))


# --8<-- [end:schedule]


# Dense bf16 peak FLOP/s (datasheets; recipes/core/throughput.py has the full table).
BF16_PEAK = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12}


def mfu(tokens_per_s: float, flops_per_token: int, world, precision: str) -> float | None:
    """Model FLOPs per second over the world's peak; None on a CPU or an unknown device."""
    if world.device.type != "cuda" or precision != "bf16":
        return None  # no made-up number for a CPU
    name = torch.cuda.get_device_name(world.device)
    peak = next((peak for key, peak in BF16_PEAK.items() if key in name), None)
    return tokens_per_s * flops_per_token / (world.world_size * peak) if peak else None


# --8<-- [start:train]
def train(cfg: JobConfig) -> dict:
    world = setup_distributed()
    try:
        dp_size, tp = check_layout(cfg, world.world_size)  # before any collective
        out = Path(cfg.out_dir)
        if not cfg.prepare and not (Path(cfg.data_dir) / "index.json").exists():
            raise ConfigError(  # (not in JobConfig: a config file loads before its data exists)
                f"data_dir {cfg.data_dir}: no shards (index.json) there; run "
                f"python -m recipes.data --steps 0 --data-dir {cfg.data_dir}, "
                "or set prepare: true"
            )
        refused = [None]
        if world.rank == 0 and not (Path(cfg.data_dir) / "index.json").exists():
            try:
                prepare_shards(cfg.data_config())
            except ValueError as exc:  # a corpus of no text: every rank refuses, not only rank 0
                refused = [str(exc)]
        dist.broadcast_object_list(refused, src=0)  # and a barrier: the others read the shards
        if refused[0]:
            raise ConfigError(refused[0])
        windows = TokenWindows(cfg.data_dir, "train", cfg.seq_len)
        val = TokenWindows(cfg.data_dir, "val", cfg.seq_len)
        # too little data, seen alike by every rank (the same index): refused on all of them
        for split, have, need in (
            ("train", len(windows), cfg.global_batch_size),
            ("val", len(val), 1),
        ):
            if have < need:
                raise ConfigError(
                    f"the {split} split of {cfg.data_dir} holds {have} windows of "
                    f"seq_len={cfg.seq_len}, fewer than {need}; lower seq_len"
                    + (" or global_batch_size" if split == "train" else "")
                    + ", or prepare more text (max_bytes)"
                )
        vocab = json.loads((Path(cfg.data_dir) / "index.json").read_text())["vocab_size"]
        model = job_model.build(
            cfg.model, vocab_size=vocab, seq_len=cfg.seq_len, seed=cfg.seed, device=world.device
        )
        about = {  # counted on the whole model, before the layout splits it
            "model": cfg.model,
            "model_class": type(model).__name__,
            "model_params": job_model.parameter_count(model),
            "flops_per_token": job_model.flops_per_token(model, cfg.seq_len),
        }
        blocks = job_model.block_types(model, cfg.blocks)  # _no_split_modules, or cfg.blocks
        about["blocks"] = [block.__name__ for block in blocks]
        model, dp_rank, dp_size = parallelize(model, cfg, world, tp, blocks)
        # compiled, the loss's fp32 cast, log-softmax and gradient fuse over the wide logits
        loss_fn = torch.compile(lm_loss) if cfg.compile else lm_loss
        optimizer, scheduler = build_optimizer(model, cfg, world.device)
        sampler = GlobalBatches(
            len(windows), cfg.global_batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=cfg.seed
        )
        loader = build_loader(windows, sampler, cfg.num_workers, world.device)
        val = Subset(val, range(min(cfg.eval_windows, len(val))))
        micro = cfg.global_batch_size // dp_size // cfg.accumulation
        val_loader = DataLoader(eval_shard(val, dp_rank, dp_size), batch_size=micro)

        # Resume: everything a step depends on comes back from the newest checkpoint that
        # verifies (every file's size and sha256 against its manifest; a damaged one is skipped).
        step, epoch, batch_in_epoch, iter_start, resumed_from = 0, 0, 0, 0, None
        found = checkpoint.latest(out / "checkpoints")
        if found is not None:
            state = checkpoint.load(found, model, optimizer)
            own = state["rank"]
            scheduler.load_state_dict(own["scheduler"])
            step = resumed_from = own["step"]
            epoch, batch_in_epoch = own["data"]["epoch"], own["data"]["batch"]
            iter_start = own["data"]["iter_start"] if state["same_world"] else batch_in_epoch
            restore_position(
                loader,
                sampler,
                own["data"],
                same_world=state["same_world"],
                num_workers=cfg.num_workers,
            )
            if state["same_world"]:
                checkpoint.set_rng_states(own["rng"])
        else:
            sampler.set_position(0, 0)

        writer, metrics = None, None
        if world.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            metrics = open(out / "metrics.jsonl", "a")  # a restart appends the steps it redoes
            if cfg.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: TensorBoard drops the events a crashed run wrote after this step
                writer = SummaryWriter(str(out / "tensorboard"), purge_step=step + 1)
        autocast = (
            torch.autocast(world.device.type, dtype=torch.bfloat16)
            if cfg.precision == "bf16" and cfg.parallelism == "ddp"
            else contextlib.nullcontext()
        )
        losses, val_losses, times, waits, last_val = [], [], [], [], None

        def validation_loss() -> float:
            # DDP: the module itself (DDP's forward may broadcast buffers: a collective that
            # uneven shards would hang); fully_shard and TP step together (lockstep)
            bare = model.module if isinstance(model, DDP) else model
            return evaluate(bare, val_loader, world.device, lockstep=not isinstance(model, DDP))

        if step == 0:  # the untrained model's loss: where the curve starts
            val_losses.append([0, validation_loss()])
        batches = iter(loader)
        while step < cfg.steps:
            started = time.perf_counter()
            batch = next(batches, None)  # the time blocked here is time waiting for data
            if batch is None:  # the epoch is over: the next one, in a new order
                epoch, batch_in_epoch, iter_start = epoch + 1, 0, 0
                sampler.set_position(epoch, 0)
                batches = iter(loader)
                batch = next(batches)
            waited = time.perf_counter() - started
            batch_in_epoch += 1
            inputs, targets = (t.to(world.device, non_blocking=True) for t in batch)
            loss_sum = torch.zeros((), device=world.device)
            for i in range(cfg.accumulation):
                part = slice(i * micro, (i + 1) * micro)
                with no_gradient_sync(model, i == cfg.accumulation - 1), autocast:
                    loss = loss_fn(job_model.logits(model, inputs[part]), targets[part])
                (loss / cfg.accumulation).backward()  # the mean over the micro-batches
                loss_sum += loss.detach()
            # One norm over every parameter, DTensor shards included: clip_grad_norm_ reduces it
            # across the ranks that hold the pieces. clip=0: measure only.
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), cfg.clip if cfg.clip > 0 else math.inf
            )
            if isinstance(grad_norm, DTensor):
                grad_norm = grad_norm.full_tensor()
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            dist.all_reduce(loss_sum)  # tp replicas hold the same value: / world is the dp mean
            loss = (loss_sum / (cfg.accumulation * world.world_size)).item()
            times.append(time.perf_counter() - started)
            waits.append(waited)
            losses.append(loss)
            if world.rank == 0:
                tokens_per_s = cfg.global_batch_size * cfg.seq_len / times[-1]
                logged = {
                    "step": step,
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": tokens_per_s,
                    "data_wait": waited / times[-1],
                    "mfu": mfu(tokens_per_s, about["flops_per_token"], world, cfg.precision),
                }
                metrics.write(json.dumps(logged) + "\n")
                metrics.flush()
                if writer:
                    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "data_wait", "mfu"):
                        if logged[key] is not None:
                            writer.add_scalar(f"train/{key}", logged[key], step)
                if step % cfg.log_every == 0 or step == cfg.steps:
                    print(
                        f"step {step}/{cfg.steps} loss {loss:.4f} lr {lr:.2e} grad_norm "
                        f"{logged['grad_norm']:.3f} {tokens_per_s:,.0f} tok/s data_wait "
                        f"{logged['data_wait']:.0%}",
                        file=sys.stderr,
                        flush=True,
                    )
            save_now = step % cfg.checkpoint_every == 0 or step == cfg.steps
            if step % cfg.eval_every == 0 or save_now:  # every checkpoint has its val loss
                last_val = validation_loss()
                val_losses.append([step, last_val])
                if world.rank == 0:
                    print(f"step {step} val_loss {last_val:.4f}", file=sys.stderr, flush=True)
                    if writer:
                        writer.add_scalar("val/loss", last_val, step)
            if save_now:
                data = {
                    "epoch": epoch,
                    "batch": batch_in_epoch,
                    "iter_start": iter_start,
                    "num_workers": cfg.num_workers,
                    "loader": loader.state_dict(),
                }
                rank_state = {
                    "step": step,
                    "scheduler": scheduler.state_dict(),
                    "data": data,
                    "rng": checkpoint.rng_states(),
                }
                checkpoint.save(
                    out / "checkpoints",
                    step,
                    model,
                    optimizer,
                    rank_state,
                    val_loss=last_val if val_losses[-1][0] == step else None,
                    keep=cfg.keep,
                )
        if writer:
            writer.close()
        if metrics:
            metrics.close()
        return summary(
            cfg,
            model,
            about,
            world,
            losses,
            val_losses,
            times,
            waits,
            resumed_from,
            dp_size,
            tp,
        )
    finally:
        cleanup_distributed()


# --8<-- [end:train]


def summary(
    cfg, model, about, world, losses, val_losses, times, waits, resumed_from, dp_size, tp
) -> dict:
    """Plain values: the steps this process ran, throughput and a checksum of the weights."""
    # full_state_dict: every rank joins the all-gathers; cpu_offload: only rank 0 keeps the copy
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    digest, abs_sum = hashlib.sha256(), 0.0
    for name in sorted(full):
        tensor = full[name].detach().float().cpu().contiguous()
        digest.update(name.encode() + tensor.numpy().tobytes())
        abs_sum += tensor.abs().double().sum().item()
    timed = times[1:] or times  # the first step pays for warm-up (compile, workers, allocator)
    seconds = sum(timed) / max(len(timed), 1)
    tokens_per_s = cfg.global_batch_size * cfg.seq_len / seconds if seconds else 0.0
    return {
        **about,
        "world_size": world.world_size,
        "dp_size": dp_size,
        "tp_size": tp,
        "parallelism": cfg.parallelism,
        "resumed_from": resumed_from,
        "first_step": (resumed_from or 0) + 1,
        "losses": losses,
        "val_losses": val_losses,
        "parameter_type": type(next(model.parameters())).__name__,
        "params": sum(t.numel() for t in full.values()) if full else None,
        "weights_sha256": digest.hexdigest() if full else None,
        "weights_abs_sum": abs_sum if full else None,
        "seconds_per_step": seconds,
        "tokens_per_second": tokens_per_s,
        "mfu": mfu(tokens_per_s, about["flops_per_token"], world, cfg.precision),
        "data_wait_fraction": sum(waits[1:] or waits) / max(sum(timed), 1e-12),
    }


class TrueOrFalse(argparse.BooleanOptionalAction):
    """``--tensorboard``, ``--no-tensorboard``, and ``--tensorboard false`` as YAML writes it."""

    def __call__(self, parser, namespace, values, option_string=None):
        on = not option_string.startswith("--no-")
        setattr(namespace, self.dest, on if values is None else values == on)


def parse_bool(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
    return text.lower() in ("true", "1", "yes")


def make_parser() -> argparse.ArgumentParser:
    parser = config_parser(JobConfig, prog="python -m recipes.job", doc=__doc__)
    for action in parser._actions:
        if isinstance(action, argparse.BooleanOptionalAction):
            action.__class__, action.nargs, action.type = TrueOrFalse, "?", parse_bool
    parser.add_argument(
        "--config",
        default=argparse.SUPPRESS,
        help="YAML file of key: value lines (keys as below, with underscores); flags win over it",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """The config the command line asks for: defaults < YAML < flags; a bad one: usage, exit 2."""
    explicit = make_parser()  # the same flags without defaults: what the command line gave
    for action in explicit._actions:
        action.default = argparse.SUPPRESS
    given = vars(explicit.parse_args(argv))
    try:
        return load_config(given.pop("config", None), given)  # defaults < YAML < flags
    except ValueError as exc:
        explicit.error(str(exc))


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    with exit_on_bad_input():  # a layout the world cannot hold, too little data: one line
        result = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"config": asdict(cfg), **result}))


if __name__ == "__main__":
    main()
