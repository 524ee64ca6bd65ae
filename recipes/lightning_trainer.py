"""Lightning Trainer: the shared workload under Lightning (DDP, FSDP, ModelParallel), equal to DDP.
The flags below run train(); a first argument `fit` or `validate` goes to LightningCLI instead.

    torchrun --standalone --nproc_per_node=2 -m recipes.lightning_trainer
    python -m recipes.lightning_trainer --strategy ddp_spawn --devices 2   # Lightning spawns 2
    python -m recipes.lightning_trainer fit --config configs/lightning/ddp.yaml   # LightningCLI

Two command lines share this module, told apart by the first argument:

- a LightningCLI subcommand (``fit``, ``validate``) goes to LightningCLI with this module's
  LightningModule (``LMModule``) and LightningDataModule (``LMDataModule``): options come from
  YAML (``--config``) and ``--trainer.*`` / ``--model.*`` / ``--data.*`` flags; ``fit --help``
  and ``fit --print_config`` show them all. Lightning launches the processes itself
  (``trainer.devices: 2`` re-runs the command once per extra device). A bad value is one line.
- anything else (``--strategy fsdp --steps 6``) goes to the project's dataclass command line:
  ``train(cfg)`` returns a RecipeResult, printed as JSON on rank 0's last stdout line. The
  processes come from torchrun (or the tests' spawned world); ``ddp_spawn`` is the exception,
  Lightning spawns its ``--devices`` processes.

Multi-node: under torchrun, run the same command on every node (the node count follows from
WORLD_SIZE / LOCAL_WORLD_SIZE); under SLURM, ``srun`` starts one task per device and Lightning
reads SLURM's variables: configs/lightning/slurm_multinode.sh.

Lightning and raw DDP agree exactly (tests/test_lightning_trainer.py): same init
(``build_model``), same data order (our DistributedSampler, ``use_distributed_sampler=False``),
same loss (``lm_loss``), same AdamW; the DDP strategy averages gradients the way DDP does.
Pitfalls named where they bite: resuming mid-epoch, 16-bit AMP on CPU, FSDP on CPU, HYBRID_SHARD
with one rank per node, reading the full weights out of a sharded model.

Speed: on one H200 (100m, bf16, batch 64, torch 2.11) a step ran 70.6 ms against 67.4 for the
bare loop (+4.8%; scripts/bench.py, 2026-11-26). The profile names both parts: the Trainer wraps
even one device in DDP (its bucket copies and per-gradient division: ddp_torchrun alone costs
+2.5%), and logging ``train_loss`` with ``sync_dist`` and reading it back synchronises the host
with the GPU 5 times a step (cudaStreamSynchronize), so the GPU idles while the next step is
queued. Log less often (``log_every_n_steps``) where the step is short.

Length: about 650 lines, over the cookbook's ~300, on purpose: one LightningModule and DataModule
serve four strategies and two command lines. The workarounds around Lightning (FSDP on CPU, gloo
teardown, gathering the full weights, warnings) live in recipes/core/lightning.py.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Literal

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

# FSDPOnCPUStrategy: the YAML configs name it as recipes.lightning_trainer.FSDPOnCPUStrategy.
__all__ = [
    "FSDPOnCPUStrategy",
    "LMDataModule",
    "LMModule",
    "LightningConfig",
    "lightning_cli",
    "train",
]
from torch.utils.data import DataLoader

from recipes.core.cli import run_cli
from recipes.core.config import (
    RecipeError,
    TrainConfig,
    exit_with,
    opt,
    per_rank_batch_size,
)
from recipes.core.lightning import (
    FSDPOnCPUStrategy,
    LeaveWorld,
    RecipeMetrics,
    StepLog,
    filter_known_warnings,
    full_state,
    tensorboard_available,
)
from recipes.core.log import get_logger
from recipes.core.paths import input_file_problem, output_dir_problem, refuse
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.speed import lightning_precision
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    Block,
    build_model,
    distributed_loader,
    lm_loss,
    make_dataset,
)
from recipes.core.world import World, join_world, resolve_backend

log = get_logger(__name__)

LIGHTNING_CLI_SUBCOMMANDS = ("fit", "validate")


@dataclass
class LightningConfig(TrainConfig):
    strategy: Literal["ddp", "ddp_spawn", "fsdp", "model_parallel"] = opt(
        "ddp",
        "Lightning strategy; ddp_spawn starts --devices processes itself, the others join "
        "torchrun's world",
    )
    # Lightning's own precision names (plus auto), not the cookbook's: Lightning users know these.
    precision: Literal[  # type: ignore[assignment]
        "auto", "32-true", "bf16-mixed", "16-mixed"
    ] = opt(
        "auto",
        "Lightning precision; auto = bf16-mixed on a GPU, 32-true on CPU; 16-mixed needs CUDA",
    )
    devices: int = opt(
        0,
        "processes per node; 0 = as the launcher says (LOCAL_WORLD_SIZE); ddp_spawn: how many "
        "to start",
        ge=0,
    )
    num_nodes: int = opt(0, "nodes; 0 = WORLD_SIZE / LOCAL_WORLD_SIZE (torchrun) or 1", ge=0)
    accumulate_grad_batches: int = opt(
        1, "micro-batches per optimizer step (the global batch stays global_batch_size)", ge=1
    )
    gradient_clip_val: float = opt(
        0.0, "clip the global gradient norm to this value; 0 = off", ge=0
    )
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"] = opt(
        "FULL_SHARD",
        "fsdp: what to shard (FULL_SHARD = params, grads and optimizer state; HYBRID_SHARD: GPUs)",
    )
    activation_checkpointing: bool = opt(
        False, "fsdp: recompute each Block's activations in backward"
    )
    cpu_offload: bool = opt(
        False, "fsdp on GPUs: keep sharded params and optimizer state in CPU memory"
    )
    state_dict_type: Literal["sharded", "full"] = opt(
        "sharded",
        "fsdp checkpoints: a folder with one shard per rank, or one full file written by rank 0 "
        "(GPUs)",
    )
    tensor_parallel_size: int = opt(
        0, "model_parallel: ranks per tensor-parallel group; 0 = all ranks of a node", ge=0
    )
    checkpoint_every_n_steps: int = opt(
        0, "ModelCheckpoint saves every N optimizer steps; 0 = no checkpoints", ge=0
    )
    resume_from: str = opt(
        "", "checkpoint to resume from (Trainer.fit ckpt_path): a .ckpt file or FSDP folder"
    )
    logger: Literal["csv", "tensorboard", "none"] = opt(
        "csv", "metrics logger, written under --output-dir"
    )
    output_dir: str = opt("lightning_logs", "where logs and checkpoints go")
    progress_bar: Literal["auto", "on", "off"] = opt(
        "auto", "auto = Lightning's bar on a terminal; in CI logs one line per step replaces it"
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.checkpoint_every_n_steps > self.steps:  # it would save nothing, and say nothing
            raise RecipeError(f"checkpoint_every_n_steps={self.checkpoint_every_n_steps} > "
                              f"steps={self.steps}: no checkpoint would be written; use "
                              f"--checkpoint-every-n-steps {self.steps} or less (0 = none)")
        if self.logger == "tensorboard" and not tensorboard_available():
            raise RecipeError(
                "logger 'tensorboard' needs the tensorboard package: pip install tensorboard, "
                "or --logger csv"
            )


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
        self.local_losses: list[
            torch.Tensor
        ] = []  # this rank's micro-batch losses, for the RecipeResult
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
        loss = lm_loss(
            self.model(inputs), targets
        )  # this rank's mean; the strategy averages the gradients
        # sync_dist: the logged value is the mean over ranks (the global batch's loss), not rank 0's
        # alone.
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.local_losses.append(loss.detach())
        # Lightning divides by accumulate_grad_batches before backward: return the plain mean.
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", lm_loss(self.model(inputs), targets), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # self.parameters() after configure_model/FSDP wrapping: the sharded parameters
        # (use_orig_params). fused=True on CUDA: one kernel for every parameter (as
        # recipes.core.speed.make_adamw).
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
        epoch = getattr(
            self.sampler, "epoch", 0
        )  # Lightning called sampler.set_epoch(epoch) just before
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
            raise RecipeError(f"data.global_batch_size must be >= 1, got {global_batch_size}")
        self.model, self.global_batch_size, self.seed = model, global_batch_size, seed

    def _loader(self, dataset) -> DataLoader:
        # The data-parallel shard from the strategy: (world, rank) for DDP/FSDP, the data-parallel
        # mesh dimension for ModelParallelStrategy (tensor-parallel ranks read the same batch).
        shard = self.trainer.strategy.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        per_rank = per_rank_batch_size(
            self.global_batch_size, shard["num_replicas"], self.trainer.accumulate_grad_batches
        )
        # The same DistributedSampler (seed, shuffle, drop_last) as the raw recipe; Lightning calls
        # its set_epoch at every epoch start.
        _, sampler = distributed_loader(
            dataset,
            rank=shard["rank"],
            world_size=shard["num_replicas"],
            per_rank_batch_size=per_rank,
            seed=self.seed,
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
        # Pitfall: Lightning's FSDPStrategy assumes CUDA, yet torch's FSDP runs on CPU with gloo:
        # see below.
        strategy_cls = FSDPStrategy if accelerator == "cuda" else FSDPOnCPUStrategy
        sharding, mesh = hybrid_shard_layout(
            cfg.sharding_strategy, accelerator, world_size, num_nodes
        )
        return strategy_cls(
            sharding_strategy=sharding,
            device_mesh=mesh,
            auto_wrap_policy={
                Block
            },  # one FSDP unit per Block: its params are gathered only while it runs
            activation_checkpointing_policy={Block} if cfg.activation_checkpointing else None,
            cpu_offload=cfg.cpu_offload,
            state_dict_type=cfg.state_dict_type,
        )
    if cfg.strategy == "model_parallel":
        tp = cfg.tensor_parallel_size or world_size // num_nodes
        if world_size % tp:
            raise RecipeError(
                f"tensor_parallel_size={tp} does not divide the world of {world_size} ranks; "
                f"use a divisor of {world_size}"
            )
        return ModelParallelStrategy(data_parallel_size=world_size // tp, tensor_parallel_size=tp)
    return cfg.strategy  # "ddp" / "ddp_spawn": Lightning's defaults match DistributedDataParallel's


# --8<-- [start:hybrid]
def hybrid_shard_layout(sharding_strategy: str, accelerator: str, world_size: int, num_nodes: int):
    """FSDP1's sharding strategy and device mesh: HYBRID_SHARD gets an explicit (nodes, ranks) mesh.

    Pitfall (torch's FSDP1, seen on 2.13): HYBRID_SHARD shards over a node's ranks and all-reduces
    across nodes. With one rank per node the shard group has one rank, FSDP clamps the strategy to
    NO_SHARD over that group, and the cross-node all-reduce never runs: each rank trains on its own
    half of the batch, its gradient divided by the world size (tests/test_lightning_trainer.py
    keeps the reproduction). Without a mesh it is worse on CPU: FSDP counts ranks per node with
    ``torch.cpu.device_count()``, which is 1, so every rank is a "node". With one rank per node,
    HYBRID_SHARD means replication, which is NO_SHARD over the whole world: that is what runs.
    """
    if sharding_strategy != "HYBRID_SHARD" or not dist.is_initialized():
        return sharding_strategy, None  # ddp_spawn has no world yet; it never runs FSDP
    from torch.distributed.device_mesh import init_device_mesh

    per_node = world_size // num_nodes
    if per_node == 1:
        log.info("HYBRID_SHARD with one rank per node is replication: NO_SHARD over the world")
        return "NO_SHARD", None
    return sharding_strategy, init_device_mesh(
        accelerator, (num_nodes, per_node), mesh_dim_names=("replicate", "shard")
    )


# --8<-- [end:hybrid]


# --8<-- [start:trainer]
def make_trainer(
    cfg: LightningConfig,
    *,
    accelerator: str,
    devices: int,
    num_nodes: int,
    timer: StepTimer,
    precision: str,
) -> L.Trainer:
    callbacks: list[L.Callback] = [
        StepLog(timer, print_lines=not _progress_bar(cfg)),
        RecipeMetrics(timer),
    ]
    if cfg.strategy == "ddp_spawn":  # Lightning owns that world; under torchrun join_world owns it
        callbacks.append(LeaveWorld())
    if cfg.checkpoint_every_n_steps:
        # save_top_k=-1: keep every checkpoint (no metric to rank them by); FSDP "sharded" writes a
        # folder.
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
        enable_checkpointing=bool(
            cfg.checkpoint_every_n_steps
        ),  # else Lightning adds one that saves every epoch
        enable_progress_bar=_progress_bar(cfg),
        default_root_dir=cfg.output_dir,
    )


# --8<-- [end:trainer]


def make_logger(cfg: LightningConfig):
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if cfg.logger == "none":
        return False
    logger_cls = CSVLogger if cfg.logger == "csv" else TensorBoardLogger
    return logger_cls(save_dir=cfg.output_dir, name="lightning_trainer")


def _progress_bar(cfg: LightningConfig) -> bool:
    return cfg.progress_bar == "on" or (cfg.progress_bar == "auto" and sys.stdout.isatty())


# --8<-- [start:train]
def train(cfg: LightningConfig) -> RecipeResult:
    filter_known_warnings()
    if cfg.strategy == "ddp_spawn":
        # Lightning starts cfg.devices processes (torch.multiprocessing.spawn) and joins them
        # itself.
        if dist.is_initialized() or "RANK" in os.environ:
            raise RecipeError(
                "strategy 'ddp_spawn' starts its own processes: run it with plain python and "
                "--devices N, or use --strategy ddp under torchrun"
            )
        backend = resolve_backend(cfg.backend, max(cfg.devices, 1))
        devices = cfg.devices or 1
        # Checked here, in the parent: in the spawned processes a batch that does not divide fails N
        # times over, as a 70-line ProcessRaisedException.
        per_rank_batch_size(cfg.global_batch_size, devices, cfg.accumulate_grad_batches)
        world = World(
            0,
            devices,
            0,
            devices,
            backend,
            torch.device("cuda" if backend == "nccl" else "cpu"),
            "spawn",
        )
        return _fit(cfg, world, devices=devices, num_nodes=1)
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        devices, num_nodes = world.local_world_size, world.world_size // world.local_world_size
        if cfg.devices not in (0, devices) or cfg.num_nodes not in (0, num_nodes):
            raise RecipeError(
                f"the launcher started {num_nodes} node(s) x {devices} process(es); --devices "
                f"{cfg.devices} --num-nodes {cfg.num_nodes} disagree: drop them or match torchrun"
            )
        return _fit(cfg, world, devices=devices, num_nodes=num_nodes)


def _exists_problem(path: str, flag: str, what: str) -> str | None:
    return None if os.path.exists(path) else f"{flag} {path} does not exist; pass {what}"


def _fit(cfg: LightningConfig, world: World, *, devices: int, num_nodes: int) -> RecipeResult:
    accelerator = "cuda" if world.device.type == "cuda" else "cpu"
    precision, core_precision = lightning_precision(cfg.precision, world.device)
    if precision == "16-mixed" and accelerator == "cpu":
        # Lightning would silently switch to bf16-mixed: say it instead of measuring the wrong
        # thing.
        raise RecipeError(
            "precision '16-mixed' needs CUDA (fp16 autocast does not run on CPU); "
            "use --precision bf16-mixed or 32-true"
        )
    if cfg.strategy == "model_parallel" and precision == "16-mixed":
        raise RecipeError(
            "ModelParallelStrategy does not take precision '16-mixed'; use bf16-mixed or 32-true"
        )
    if cfg.strategy == "fsdp" and accelerator == "cpu":
        # GPU-only in practice: each found by running it on CPU with torch 2.13, and refused up
        # front.
        if cfg.cpu_offload:
            raise RecipeError(
                "cpu_offload moves FSDP shards from GPU to CPU memory; on a CPU world they are "
                "there already (and torch pins memory, which needs an accelerator): "
                "drop --cpu-offload"
            )
        if cfg.state_dict_type == "full":
            raise RecipeError(
                "state_dict_type 'full' crashes torch's FSDP on CPU (a segfault offloading the "
                "gathered state to CPU); use --state-dict-type sharded on CPU, full on GPUs"
            )
    # Before fit: a file where --output-dir goes failed in makedirs; a missing --resume-from in
    # Lightning's traceback. DDP's checkpoint is one file; FSDP's sharded one is a directory.
    resume_what = "a .ckpt file (or the FSDP checkpoint directory) that an earlier run wrote"
    refuse(output_dir_problem(cfg.output_dir, "--output-dir"),
           cfg.resume_from and (input_file_problem if cfg.strategy in ("ddp", "ddp_spawn") else
                                _exists_problem)(cfg.resume_from, "--resume-from", resume_what))
    timer = StepTimer(world.device)
    module = LMModule(cfg.model, lr=cfg.lr, seed=cfg.seed)
    data = LMDataModule(cfg.model, cfg.global_batch_size, seed=cfg.seed)
    trainer = make_trainer(
        cfg,
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        timer=timer,
        precision=precision,
    )
    log.info(
        "Lightning %s on %d node(s) x %d device(s), precision %s",
        cfg.strategy,
        num_nodes,
        devices,
        precision,
    )
    trainer.fit(module, datamodule=data, ckpt_path=cfg.resume_from or None)
    # _fit returns inside join_world: the Trainer and its DDP wrapper are freed while the process
    # group is alive (freed after it, a DDP reducer can deadlock the gloo teardown: see
    # recipes/lightning_fabric.py).

    metrics = trainer.callback_metrics
    state = full_state(
        trainer, module
    )  # every rank takes part in the gather; rank 0 keeps the result
    checkpoint = trainer.checkpoint_callback if cfg.checkpoint_every_n_steps else None
    extras = {
        "strategy": cfg.strategy,
        "lightning_precision": precision,
        "global_step": trainer.global_step,
        # Rank 0 holds the gathered state (with cpu_offload the other ranks hold none: max(..., 1)).
        "param_fraction_per_rank": int(metrics["recipe/param_elements_per_rank"])
        / max(sum(t.numel() for t in state.values()), 1),
        "metrics_file": os.path.join(trainer.logger.log_dir, "metrics.csv")
        if cfg.logger == "csv"
        else None,
        "checkpoints": sorted(
            os.path.join(checkpoint.dirpath, name) for name in os.listdir(checkpoint.dirpath)
        )
        if checkpoint and os.path.isdir(checkpoint.dirpath)
        else [],
    }
    result = make_result(
        "lightning_trainer",
        world,
        [float(x) for x in metrics["recipe/losses"]],
        state.values(),
        timer,
        keep_final_state=state if cfg.keep_final_state else None,
        **extras,
    )
    # Measured in the training processes (with ddp_spawn, not this one): see RecipeMetrics.
    result.seconds_per_step = float(metrics["recipe/seconds_per_step"])
    result.peak_memory_bytes = int(metrics["recipe/peak_memory_bytes"])
    speed = Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, core_precision).measure(
        result.seconds_per_step, world.device, devices * num_nodes if accelerator == "cuda" else 1
    )
    for name, value in speed.items():
        setattr(result, name, value)
    return result


# --8<-- [end:train]


def check_model_name(model: str, key: str) -> None:
    if model not in MODEL_PRESETS:
        raise RecipeError(f"unknown {key}={model!r}; valid values: {', '.join(MODEL_PRESETS)}")


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
    except RecipeError as exc:  # a bad YAML value: one line and exit 2, as the flags' CLI does
        exit_with(str(exc), 2)


def check_cli_batch(trainer: L.Trainer, data: LMDataModule) -> None:
    """The global batch must divide over the data-parallel ranks: checked in the launching process,
    before Lightning starts the others (where it would fail once per process, 108 lines deep)."""
    if isinstance(trainer.strategy, ModelParallelStrategy):
        return  # its data-parallel size is known only once the mesh exists; the loader checks it
    try:
        per_rank_batch_size(
            data.global_batch_size,
            trainer.num_devices * trainer.num_nodes,
            trainer.accumulate_grad_batches,
        )
    except RecipeError as exc:
        raise RecipeError(
            f"data.{exc} (trainer.devices={trainer.num_devices}, "
            f"trainer.num_nodes={trainer.num_nodes})"
        ) from None


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in LIGHTNING_CLI_SUBCOMMANDS:
        lightning_cli()
    else:
        run_cli(train, LightningConfig, __doc__)
