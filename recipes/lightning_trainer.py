"""Lightning Trainer: the shared workload under Lightning (DDP, FSDP, ModelParallel), equal to DDP.
The flags below run train(); a first argument `fit` or `validate` goes to LightningCLI instead.

    torchrun --standalone --nproc_per_node=2 -m recipes.lightning_trainer
    python -m recipes.lightning_trainer --strategy ddp_spawn --devices 2   # Lightning spawns 2
    python -m recipes.lightning_trainer fit --config configs/lightning/ddp.yaml   # LightningCLI

Copy with it: recipes/toy.py, recipes/dist_setup.py, recipes/parallelize.py,
recipes/_lightning_trainer_workarounds.py, recipes/options.py (the command line, from the config).

Two command lines share this module, told apart by the first argument:

- a LightningCLI subcommand (``fit``, ``validate``) goes to LightningCLI with this module's
  LightningModule (``LMModule``) and LightningDataModule (``LMDataModule``): options come from
  YAML (``--config``) and ``--trainer.*`` / ``--model.*`` / ``--data.*`` flags; ``fit --help``
  and ``fit --print_config`` show them all. Lightning launches the processes itself
  (``trainer.devices: 2`` re-runs the command once per extra device). A bad value is one line.
- anything else (``--strategy fsdp --steps 6``) goes to ``make_parser``: ``train(cfg)`` fits and
  prints one line per step from rank 0 (``step 0 loss 4.3398``). The processes come from torchrun;
  ``ddp_spawn`` is the exception, Lightning spawns its ``--devices`` processes.

Multi-node: under torchrun, run the same command on every node (the node count follows from
WORLD_SIZE / LOCAL_WORLD_SIZE); under SLURM, ``srun`` starts one task per device and Lightning
reads SLURM's variables: configs/lightning/slurm_multinode.sh.

Lightning and raw DDP agree exactly (tests/test_lightning_trainer.py): same init
(``build_model``), same data order (our DistributedSampler, ``use_distributed_sampler=False``),
same loss (``lm_loss``), same AdamW; the DDP strategy averages gradients the way DDP does.
Pitfalls named where they bite: resuming mid-epoch, 16-bit AMP on CPU, FSDP on CPU, HYBRID_SHARD
with one rank per node.

Speed: the Trainer wraps even one device in DDP, and logging ``train_loss`` with ``sync_dist``
synchronises the host with the GPU several times a step. Log less often (``log_every_n_steps``)
where the step is short.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

# FSDPOnCPUStrategy: the YAML configs name it as recipes.lightning_trainer.FSDPOnCPUStrategy.
from recipes._lightning_trainer_workarounds import (
    FSDPOnCPUStrategy,
    LeaveWorld,
    filter_known_warnings,
    hybrid_shard_layout,
)
from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset

__all__ = [
    "FSDPOnCPUStrategy",
    "LMDataModule",
    "LMModule",
    "LightningConfig",
    "LightningRun",
    "ConfigError",
    "lightning_cli",
    "make_parser",
    "train",
]

LIGHTNING_CLI_SUBCOMMANDS = ("fit", "validate")
STRATEGIES = ("ddp", "ddp_spawn", "fsdp", "model_parallel")
PRECISIONS = ("auto", "32-true", "bf16-mixed", "16-mixed")  # Lightning's own names, plus auto
SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


class ConfigError(ValueError):
    """A setting that cannot run: one line for the command line, never a traceback."""


@dataclass
class LightningConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    strategy: str = option(
        "ddp",
        "Lightning strategy; ddp_spawn starts --devices processes itself, the others join "
        "torchrun's world",
        choices=STRATEGIES,
    )
    precision: str = option(
        "auto",
        "Lightning precision; auto: bf16-mixed on a GPU, 32-true on CPU; 16-mixed: CUDA",
        choices=PRECISIONS,
    )
    devices: int = option(
        0,
        "processes per node; 0: as the launcher says; ddp_spawn: how many to start",
        at_least=0,
    )
    num_nodes: int = option(
        0, "nodes; 0: WORLD_SIZE / LOCAL_WORLD_SIZE (torchrun) or 1", at_least=0
    )
    # The Trainer's accumulation and clipping flags: part of what this recipe maps from the raw
    # loop to Trainer arguments, so they stay here
    accumulate_grad_batches: int = option(
        1,
        "micro-batches per optimizer step (the global batch stays global_batch_size)",
        at_least=1,
    )
    gradient_clip_val: float = option(
        0.0, "clip the global gradient norm to this value; 0: off", at_least=0
    )
    sharding_strategy: str = option(
        "FULL_SHARD",
        "fsdp: what to shard (FULL_SHARD: params, grads and optimizer state)",
        choices=SHARDING,
    )
    activation_checkpointing: bool = option(False, "fsdp: recompute each Block in backward")
    cpu_offload: bool = option(
        False, "fsdp on GPUs: keep sharded params and optimizer state in CPU memory"
    )
    state_dict_type: str = option(
        "sharded",
        "fsdp checkpoints: a folder of one shard per rank, or one full file (GPUs)",
        choices=["sharded", "full"],
    )
    tensor_parallel_size: int = option(
        0,
        "model_parallel: ranks per tensor-parallel group; 0: all ranks of a node",
        at_least=0,
    )
    checkpoint_every_n_steps: int = option(
        0, "ModelCheckpoint saves every N optimizer steps; 0: no checkpoints", at_least=0
    )
    resume_from: str = option(
        "", "checkpoint to resume from (Trainer.fit ckpt_path): a .ckpt file or FSDP folder"
    )
    logger: str = option(
        "csv",
        "metrics logger, written under --output-dir",
        choices=["csv", "tensorboard", "none"],
    )
    output_dir: str = option("lightning_logs", "where logs and checkpoints go")
    progress_bar: str = option(
        "auto",
        "auto: Lightning's bar on a terminal; elsewhere one line per step replaces it",
        choices=["auto", "on", "off"],
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self) -> None:
        check_options(self)  # the ranges and choices above: one line each
        if self.checkpoint_every_n_steps > self.steps:  # it would save nothing, and say nothing
            raise ConfigError(
                f"checkpoint_every_n_steps={self.checkpoint_every_n_steps} > "
                f"steps={self.steps}: no checkpoint would be written; use "
                f"--checkpoint-every-n-steps {self.steps} or less (0 = none)"
            )
        if self.logger == "tensorboard" and not tensorboard_available():
            raise ConfigError(
                "logger 'tensorboard' needs the tensorboard package: pip install "
                "tensorboard, or --logger csv"
            )


@dataclass
class LightningRun:
    """What ``train`` returns: the global batch's loss of each step it trained, the step it
    ended at, the checkpoints ModelCheckpoint wrote, the CSV logger's file (or None)."""

    losses: list[float]
    global_step: int
    checkpoints: list[str] = field(default_factory=list)
    metrics_file: str | None = None


def tensorboard_available() -> bool:
    return any(importlib.util.find_spec(name) for name in ("tensorboard", "tensorboardX"))


def check_batch(global_batch_size: int, ranks: int, micro_batches: int = 1) -> int:
    """Each data-parallel rank's micro-batch, or one line that names the sizes that would work."""
    parts = ranks * micro_batches
    if global_batch_size % parts:
        lower = max(parts, global_batch_size - global_batch_size % parts)
        what = f"{ranks} ranks" + (f" x {micro_batches} micro-batches" if micro_batches > 1 else "")
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide across {what}; "
            f"use a multiple of {parts}, e.g. {lower} or {lower + parts}"
        )
    return global_batch_size // parts


def check_model_name(model: str, key: str) -> None:
    if model not in MODEL_PRESETS:
        raise ConfigError(f"unknown {key}={model!r}; valid values: {', '.join(MODEL_PRESETS)}")


# --8<-- [start:module]
class LMModule(L.LightningModule):
    """The shared TransformerLM as a LightningModule: the raw loop's body, split into hooks."""

    def __init__(self, model: str = "tiny", lr: float = 1e-3, seed: int = 0):
        super().__init__()
        check_model_name(model, "model.model")  # LightningCLI's YAML reaches here unchecked
        self.save_hyperparameters()
        # build_model seeds its own RNG: every rank, and the raw DDP recipe, start from the same
        # weights.
        self.model = build_model(model, seed=seed)
        self.lr = lr
        self.local_losses: list[torch.Tensor] = []  # this rank's micro-batch losses
        self._parallelized = False

    def setup(self, stage: str) -> None:
        # again in each process that Lightning starts (ddp_spawn, the CLI's launcher)
        filter_known_warnings()

    def configure_model(self) -> None:
        # Only ModelParallelStrategy has a device mesh; DDP and FSDP wrap the model themselves.
        if self.device_mesh is None or self._parallelized:
            return
        from recipes.parallelize import apply_fully_shard

        apply_block_tp(self.model, self.device_mesh["tensor_parallel"])
        # Ordering: after tensor parallelism, so that FSDP2 shards the DTensors TP made.
        apply_fully_shard(self.model, self.device_mesh["data_parallel"], block_types=(Block,))
        self._parallelized = True

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        inputs, targets = batch
        # this rank's mean; the strategy averages the gradients
        loss = lm_loss(self.model(inputs), targets)
        # sync_dist: the logged value is the mean over ranks (the global batch's loss), not rank
        # 0's alone.
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.local_losses.append(loss.detach())
        # Lightning divides by accumulate_grad_batches before backward: return the plain mean.
        return loss

    def on_train_end(self) -> None:
        # The global batch's loss of each optimizer step: the mean over its micro-batches, then
        # over the ranks (one reduce, at the end). In callback_metrics: with ddp_spawn that is
        # what Lightning sends back to the main process (with rank 0's weights).
        k = self.trainer.accumulate_grad_batches
        local = torch.stack(self.local_losses or [torch.zeros(0)]).view(-1, k).mean(dim=1)
        losses = self.trainer.strategy.reduce(local, reduce_op="mean")
        self.trainer.callback_metrics["step_losses"] = losses.detach().cpu()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", lm_loss(self.model(inputs), targets), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # self.parameters() after configure_model/FSDP wrapping: the sharded parameters
        # (use_orig_params). fused=True on CUDA: one kernel for every parameter.
        return torch.optim.AdamW(
            self.parameters(), lr=self.lr, fused=True if self.device.type == "cuda" else None
        )


# --8<-- [end:module]


# --8<-- [start:data]
class ResumableLoader(DataLoader):
    """A DataLoader that Lightning resumes mid-epoch: it counts the batches it handed out.

    Pitfall: a plain DataLoader restarts its epoch from the first batch after ``fit(ckpt_path=...)``
    (Lightning warns "not resumable"), so a run resumed at step 3 trains on batches 0, 1, 2 again.
    Lightning stores ``state_dict()`` in the checkpoint and hands it to ``load_state_dict`` on
    resume. The count is exact: Lightning does not prefetch from a loader that has a length.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.batches_done = 0
        self._resume_at: dict[str, int] | None = None

    def __iter__(self):
        # Lightning called sampler.set_epoch(epoch) just before
        epoch = getattr(self.sampler, "epoch", 0)
        resume, self._resume_at = self._resume_at, None
        # A checkpoint taken after an epoch's last batch resumes at the next epoch: skip nothing
        # there.
        skip = resume["batches_done"] if resume and resume["epoch"] == epoch else 0
        self.batches_done = skip
        for index, batch in enumerate(super().__iter__()):
            # The skipped batches are loaded and dropped: cheap for in-memory data; for costly data,
            # torchdata's StatefulDataLoader skips at the sampler and Lightning resumes it the same
            # way.
            if index >= skip:
                self.batches_done = index + 1
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": getattr(self.sampler, "epoch", 0), "batches_done": self.batches_done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = dict(state)


class LMDataModule(L.LightningDataModule):
    """The shared synthetic dataset, dealt to ranks exactly as recipes.ddp_torchrun deals it."""

    def __init__(self, model: str = "tiny", global_batch_size: int = 12, seed: int = 0):
        super().__init__()
        check_model_name(model, "data.model")
        if global_batch_size < 1:
            raise ConfigError(f"data.global_batch_size must be >= 1, got {global_batch_size}")
        self.model, self.global_batch_size, self.seed = model, global_batch_size, seed

    def _loader(self, dataset) -> DataLoader:
        # The data-parallel shard from the strategy: (world, rank) for DDP/FSDP, the data-parallel
        # mesh dimension for ModelParallelStrategy (tensor-parallel ranks read the same batch).
        shard = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        per_rank = check_batch(
            self.global_batch_size, shard["num_replicas"], self.trainer.accumulate_grad_batches
        )
        # The same DistributedSampler (seed, shuffle, drop_last) as the raw recipe; Lightning calls
        # its set_epoch at every epoch start.
        sampler = DistributedSampler(
            dataset,
            num_replicas=shard["num_replicas"],
            rank=shard["rank"],
            shuffle=True,
            seed=self.seed,
            drop_last=True,
        )
        return ResumableLoader(dataset, batch_size=per_rank, sampler=sampler, drop_last=True)

    def train_dataloader(self) -> DataLoader:
        return self._loader(make_dataset(self.model, self.global_batch_size, seed=self.seed))

    def val_dataloader(self) -> DataLoader:
        return self._loader(
            make_dataset(
                self.model, self.global_batch_size, batches_per_epoch=2, seed=self.seed + 1
            )
        )


# --8<-- [end:data]


# --8<-- [start:tensor_parallel]
def apply_block_tp(model: torch.nn.Module, tp_mesh) -> None:
    """Megatron-style tensor parallelism inside each Block: q/k/v and w_in split by columns, wo
    and w_out by rows. Not ``recipes.parallelize.apply_tp``: that one takes a plan for the
    whole model; this one is the smallest plan that Lightning's ModelParallelStrategy needs.

    Attention infers its local head count from wq's output size, so heads split across ranks
    unchanged. Embeddings, norms and the output layer stay replicated: DTensor all-reduces their
    input gradients.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(),
        "mlp.w_in": ColwiseParallel(),
        "mlp.w_out": RowwiseParallel(),
    }
    for block in model.modules():
        if isinstance(block, Block):
            parallelize_module(block, tp_mesh, plan)


# --8<-- [end:tensor_parallel]


def build_strategy(cfg: LightningConfig, accelerator: str, world_size: int, num_nodes: int):
    """The Lightning strategy object for ``cfg``: FSDP and ModelParallel with their options."""
    if cfg.strategy == "fsdp":
        # Pitfalls: Lightning's FSDPStrategy assumes CUDA, yet torch's FSDP runs on CPU with gloo;
        # FSDP1's HYBRID_SHARD with one rank per node never reduces across nodes. Both worked
        # around in recipes/_lightning_trainer_workarounds.py
        strategy_cls = FSDPStrategy if accelerator == "cuda" else FSDPOnCPUStrategy
        sharding, mesh = hybrid_shard_layout(
            cfg.sharding_strategy, accelerator, world_size, num_nodes
        )
        return strategy_cls(
            sharding_strategy=sharding,
            device_mesh=mesh,
            # one FSDP unit per Block: its params are gathered only while it runs
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if cfg.activation_checkpointing else None,
            cpu_offload=cfg.cpu_offload,
            state_dict_type=cfg.state_dict_type,
        )
    if cfg.strategy == "model_parallel":
        tp = cfg.tensor_parallel_size or world_size // num_nodes
        if world_size % tp:
            raise ConfigError(
                f"tensor_parallel_size={tp} does not divide the world of "
                f"{world_size} ranks; use a divisor of {world_size}"
            )
        return ModelParallelStrategy(data_parallel_size=world_size // tp, tensor_parallel_size=tp)
    return cfg.strategy  # "ddp" / "ddp_spawn": Lightning's defaults match DistributedDataParallel's


class PrintSteps(L.Callback):
    """One line per optimizer step on rank 0, where no progress bar shows (CI logs, torchrun)."""

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 and trainer.is_global_zero:
            loss = float(trainer.callback_metrics.get("train_loss", float("nan")))
            print(f"step {trainer.global_step - 1} loss {loss:.4f}", flush=True)


# --8<-- [start:trainer]
def make_trainer(
    cfg: LightningConfig,
    *,
    accelerator: str,
    devices: int,
    num_nodes: int,
    precision: str,
    callbacks: list[L.Callback],
) -> L.Trainer:
    progress_bar = cfg.progress_bar == "on" or (cfg.progress_bar == "auto" and sys.stdout.isatty())
    callbacks = [*callbacks] + ([] if progress_bar else [PrintSteps()])
    if cfg.strategy == "ddp_spawn":  # Lightning owns that world; under torchrun we own it
        callbacks.append(LeaveWorld())
    if cfg.checkpoint_every_n_steps:
        # save_top_k=-1: keep every checkpoint (no metric to rank them by); FSDP "sharded"
        # writes a folder.
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.join(cfg.output_dir, "checkpoints"),
                filename="{step}",
                every_n_train_steps=cfg.checkpoint_every_n_steps,
                save_top_k=-1,
            )
        )
    return L.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=build_strategy(cfg, accelerator, devices * num_nodes, num_nodes),
        precision=precision,  # "auto" resolved: bf16-mixed on a GPU, 32-true on CPU
        max_steps=cfg.steps,
        max_epochs=-1,  # steps, not epochs, as in the raw recipe
        accumulate_grad_batches=cfg.accumulate_grad_batches,
        gradient_clip_val=cfg.gradient_clip_val or None,
        gradient_clip_algorithm="norm",
        # Our loader already deals the data like the raw recipe's DistributedSampler: keep
        # Lightning's hands off.
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,  # the raw recipe does not validate (the CLI path does)
        callbacks=callbacks,
        logger=make_logger(cfg),
        log_every_n_steps=1,  # metrics of every step
        # else Lightning adds a checkpoint callback that saves every epoch
        enable_checkpointing=bool(cfg.checkpoint_every_n_steps),
        enable_progress_bar=progress_bar,
        default_root_dir=cfg.output_dir,
    )


# --8<-- [end:trainer]


def make_logger(cfg: LightningConfig):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if cfg.logger == "none":
        return False
    logger_cls = CSVLogger if cfg.logger == "csv" else TensorBoardLogger
    return logger_cls(save_dir=cfg.output_dir, name="lightning_trainer")


def _check_paths(cfg: LightningConfig) -> None:
    """Before any work, on every rank alike: a file where --output-dir goes failed in makedirs; a
    missing --resume-from in Lightning's traceback. DDP's checkpoint is one file; FSDP's sharded
    one is a directory."""
    if os.path.exists(cfg.output_dir) and not os.path.isdir(cfg.output_dir):
        raise ConfigError(
            f"--output-dir {cfg.output_dir} is a file; name a directory (created if missing)"
        )
    what = "a .ckpt file (or the FSDP checkpoint directory) that an earlier run wrote"
    if cfg.resume_from and not os.path.exists(cfg.resume_from):
        raise ConfigError(f"--resume-from {cfg.resume_from} does not exist; pass {what}")
    if cfg.resume_from and cfg.strategy in ("ddp", "ddp_spawn") and os.path.isdir(cfg.resume_from):
        raise ConfigError(
            f"--resume-from {cfg.resume_from} is a directory, not a file; pass {what}"
        )


# --8<-- [start:train]
def train(cfg: LightningConfig, observer: L.Callback | None = None) -> LightningRun:
    """Fit on this process's rank (ddp_spawn: in the processes Lightning starts); returns the
    global batch's loss of each step, on every rank. ``observer``: a Callback added to the
    Trainer's (the cookbook's harness measures the run through it)."""
    filter_known_warnings()
    _check_paths(cfg)
    if cfg.strategy == "ddp_spawn":
        # Lightning starts cfg.devices processes (torch.multiprocessing.spawn) and joins them
        if dist.is_initialized() or "RANK" in os.environ:
            raise ConfigError(
                "strategy 'ddp_spawn' starts its own processes: run it with plain "
                "python and --devices N, or use --strategy ddp under torchrun"
            )
        devices, num_nodes = cfg.devices or 1, 1
        # Checked here, in the parent: in the spawned processes a batch that does not divide
        # fails N times over, as a 70-line ProcessRaisedException.
        check_batch(cfg.global_batch_size, devices, cfg.accumulate_grad_batches)
        use_cuda = cfg.backend == "nccl" or (
            cfg.backend == "auto"
            and torch.cuda.is_available()
            and torch.cuda.device_count() >= devices
        )
        return _fit(cfg, observer, "cuda" if use_cuda else "cpu", devices, num_nodes)
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        devices = int(os.environ.get("LOCAL_WORLD_SIZE", world.world_size))
        num_nodes = world.world_size // devices
        if cfg.devices not in (0, devices) or cfg.num_nodes not in (0, num_nodes):
            raise ConfigError(
                f"the launcher started {num_nodes} node(s) x {devices} process(es); --devices "
                f"{cfg.devices} --num-nodes {cfg.num_nodes} disagree: drop them or match torchrun"
            )
        return _fit(cfg, observer, world.device.type, devices, num_nodes)
    finally:
        # the Trainer and its DDP wrapper were freed in _fit, while the group was alive
        cleanup_distributed()


def _fit(
    cfg: LightningConfig,
    observer: L.Callback | None,
    accelerator: str,
    devices: int,
    num_nodes: int,
) -> LightningRun:
    precision = cfg.precision
    if precision == "auto":
        bf16 = accelerator == "cuda" and torch.cuda.is_bf16_supported()
        precision = "bf16-mixed" if bf16 else "32-true"
    if precision == "16-mixed" and accelerator == "cpu":
        # Lightning would silently switch to bf16-mixed: say it instead of training in another
        raise ConfigError(
            "precision '16-mixed' needs CUDA (fp16 autocast does not run on CPU); "
            "use --precision bf16-mixed or 32-true"
        )
    if cfg.strategy == "model_parallel" and precision == "16-mixed":
        raise ConfigError(
            "ModelParallelStrategy does not take precision '16-mixed'; use bf16-mixed or 32-true"
        )
    if accelerator == "cuda" and precision == "32-true":  # fp32 means fp32: no TF32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if cfg.strategy == "fsdp" and accelerator == "cpu":
        # GPU-only in practice: each found by running it on CPU with torch 2.13, refused up front
        if cfg.cpu_offload:
            raise ConfigError(
                "cpu_offload moves FSDP shards from GPU to CPU memory; on a CPU "
                "world they are there already (and torch pins memory, which needs "
                "an accelerator): drop --cpu-offload"
            )
        if cfg.state_dict_type == "full":
            raise ConfigError(
                "state_dict_type 'full' crashes torch's FSDP on CPU (a segfault "
                "offloading the gathered state to CPU); use --state-dict-type "
                "sharded on CPU, full on GPUs"
            )
    module = LMModule(cfg.model, lr=cfg.lr, seed=cfg.seed)
    data = LMDataModule(cfg.model, cfg.global_batch_size, seed=cfg.seed)
    trainer = make_trainer(
        cfg,
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        precision=precision,
        callbacks=[observer] if observer else [],
    )
    trainer.fit(module, datamodule=data, ckpt_path=cfg.resume_from or None)

    checkpoint = trainer.checkpoint_callback if cfg.checkpoint_every_n_steps else None
    folder = checkpoint.dirpath if checkpoint else None
    return LightningRun(
        losses=[float(x) for x in trainer.callback_metrics["step_losses"]],
        global_step=trainer.global_step,
        checkpoints=sorted(os.path.join(folder, name) for name in os.listdir(folder))
        if folder and os.path.isdir(folder)
        else [],
        metrics_file=os.path.join(trainer.logger.log_dir, "metrics.csv")
        if cfg.logger == "csv"
        else None,
    )


# --8<-- [end:train]


def lightning_cli(args: list[str] | None = None) -> None:
    """``fit`` / ``validate`` from YAML: Lightning's own command line, same module and data.

    ``args=None`` reads sys.argv, as Lightning's launcher expects when it re-runs the command
    per device.
    """
    from lightning.pytorch.cli import LightningCLI

    class RecipeCLI(LightningCLI):
        """LightningCLI that checks the batch against the world before fit starts any process."""

        def before_fit(self) -> None:
            check_cli_batch(self.trainer, self.datamodule)

        before_validate = before_fit

    filter_known_warnings()
    try:
        RecipeCLI(
            LMModule,
            LMDataModule,
            args=args,
            save_config_kwargs={"overwrite": True},
            trainer_defaults={"use_distributed_sampler": False, "callbacks": [LeaveWorld()]},
        )
    except ConfigError as exc:  # a bad YAML value: one line and exit 2, as the flags' CLI does
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def check_cli_batch(trainer: L.Trainer, data: LMDataModule) -> None:
    """The global batch must divide over the data-parallel ranks: checked in the launching process,
    before Lightning starts the others (where it would fail once per process, 108 lines deep)."""
    if isinstance(trainer.strategy, ModelParallelStrategy):
        return  # its data-parallel size is known only once the mesh exists; the loader checks it
    try:
        check_batch(
            data.global_batch_size,
            trainer.num_devices * trainer.num_nodes,
            trainer.accumulate_grad_batches,
        )
    except ConfigError as exc:
        raise ConfigError(
            f"data.{exc} (trainer.devices={trainer.num_devices}, "
            f"trainer.num_nodes={trainer.num_nodes})"
        ) from None


def make_parser() -> argparse.ArgumentParser:
    parser = config_parser(LightningConfig, prog="python -m recipes.lightning_trainer", doc=__doc__)
    parser.description = __doc__.split("\n\n")[0]  # both lines: `fit` goes to LightningCLI
    return parser


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    """The flags' command line; ``fit`` / ``validate`` first go to LightningCLI."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in LIGHTNING_CLI_SUBCOMMANDS:
        lightning_cli()  # reads sys.argv: Lightning's launcher re-runs the command per device
        return
    cfg = parse_config(make_parser(), LightningConfig, argv)
    with exit_on_bad_input():  # bad input every rank sees: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
