r"""Classic FSDP (FullyShardedDataParallel): ZeRO-3, ZeRO-2, DDP-like, hybrid; equal to DDP.

    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp
    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp --sharding-strategy shard_grad_op \
        --precision bf16
    torchrun --standalone --nproc_per_node=4 -m recipes.fsdp --sharding-strategy hybrid \
        --ranks-per-node 2

Each rank keeps 1/N of the parameters, gradients and AdamW state (``full``); FSDP all-gathers a
wrapped unit's parameters just before its forward and backward and reduce-scatters its gradients
after. The numbers are asserted by tests/test_memory.py with
``recipes.core.memory.model_state_bytes``; the training equals DDP's (same losses and final
parameters, fp32 atol 1e-5) on every strategy.

Strategies: ``full`` = FULL_SHARD (ZeRO-3); ``shard_grad_op`` = SHARD_GRAD_OP (ZeRO-2: parameters
stay unsharded from forward to the end of backward, no re-all-gather in backward); ``no_shard`` =
NO_SHARD (DDP-like, deprecated by torch in favour of DDP); ``hybrid`` = HYBRID_SHARD (shard inside a
node, replicate across nodes: a 2-D mesh ("replicate", "shard") of nodes x ``--ranks-per-node``).

Speed: ``--precision auto`` (bf16 on a GPU) is FSDP's own ``MixedPrecision`` (bf16 compute and
buffers, fp32 reduction), AdamW is fused on CUDA. On one H200 (100m, torch 2.11, a world of 1, where
FSDP switches itself to NO_SHARD) a step ran 62.9 ms at batch 64 against the bare bf16 loop's 67.4,
and 65.5 against 37.1 ms at batch 32 (scripts/bench.py), where issuing a step took ~72 ms of CPU in
a profiled probe.

New code should prefer ``fully_shard`` (recipes/fsdp2.py): this API is the one most existing
training code uses, so its options and pitfalls are shown here. Pitfalls named where they bite: fp16
needs ShardedGradScaler; clip with ``FSDP.clip_grad_norm_``; ``no_sync`` holds unsharded gradients;
the optimizer is built after wrapping; activation checkpointing goes inside the FSDP unit; the full
state dict is gathered on every rank's call but kept on rank 0 only.

``apply_fsdp`` (with the tied-weight check that guards its wrap policy) lives in
recipes/parallelize.py with the other functions that parallelize a model; each copies alone.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from recipes.core.cli import run_cli
from recipes.core.config import (RecipeError, TrainConfig, check_step_reached, opt,
                                 per_rank_batch_size)
from recipes.core.log import get_logger
from recipes.core.memory import inject_inf_gradient, measure_last_forward
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import full_state_on_rank0, mean_over_ranks, sharded_run_extras
from recipes.core.speed import (low_precision_dtype, make_adamw, setup_precision,
                                 step_with_scaler)
from recipes.core.throughput import Workload
from recipes.core.workload import (
    MODEL_PRESETS,
    Block,
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.world import join_world
from recipes.parallelize import (  # noqa: F401  (re-exported: copyable, with the others)
    FSDPWrapError, apply_fsdp, check_units, tied_modules)

log = get_logger(__name__)

@dataclass
class FSDPConfig(TrainConfig):
    sharding_strategy: Literal["full", "shard_grad_op", "no_shard", "hybrid"] = opt(
        "full", "full = ZeRO-3, shard_grad_op = ZeRO-2, no_shard = DDP-like, "
        "hybrid = shard inside a node, replicate across nodes")
    ranks_per_node: int = opt(
        0, "hybrid: size of each shard group (a 'node'); 0 = LOCAL_WORLD_SIZE", ge=0)
    wrap_policy: Literal["block", "size", "module", "none"] = opt(
        "block", "FSDP units: block = one per transformer Block, size = by --min-num-params, "
        "module = Blocks and Embeddings, none = the whole model is one unit (no overlap, "
        "full-size all-gathers)")
    min_num_params: int = opt(
        10_000, "size policy: wrap a submodule once it has at least this many parameters", ge=1)
    cpu_offload: bool = opt(
        False, "keep the sharded parameters and gradients in host memory; AdamW runs on CPU")
    backward_prefetch: Literal["pre", "post", "none"] = opt(
        "pre", "when to all-gather the next unit in backward: pre = before this unit's gradient "
        "(most overlap)")
    forward_prefetch: bool = opt(
        False, "all-gather the next unit before this one's forward (CPU-bound models)")
    limit_all_gathers: bool = opt(
        True, "rate-limit all-gathers so prefetching cannot grow GPU memory unbounded")
    sync_module_states: bool = opt(
        True, "broadcast rank 0's parameters at wrap time (ranks need not init equally)")
    activation_checkpointing: bool = opt(
        False, "recompute each Block's activations in backward (non-reentrant)")
    micro_batches: int = opt(1, "gradient accumulation: micro-batches per optimizer step", ge=1)
    accumulation: Literal["sync", "no_sync"] = opt(
        "sync", "sync = reduce-scatter every micro-batch (gradients stay sharded); "
        "no_sync = communicate on the last one only (every rank holds unsharded gradients: "
        "N x the memory)")
    max_grad_norm: float = opt(
        0.0, "clip the total gradient norm with FSDP.clip_grad_norm_ (0 = off)", ge=0)
    grad_scaler: Literal["sharded", "amp"] = opt(
        "sharded", "fp16 only: sharded = ShardedGradScaler (right); amp = torch.amp.GradScaler "
        "(wrong under FSDP: an inf in one rank's shard is not seen by the others; kept to show "
        "the pitfall)")
    inject_inf_step: int = opt(
        -1, "pitfall demo (fp16): at this step one rank puts an inf into its gradient shard; "
        "-1 = never", ge=-1)
    inject_inf_rank: int = opt(1, "the rank that injects the inf (see --inject-inf-step)", ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.inject_inf_step >= 0:
            check_step_reached("inject_inf_step", self.inject_inf_step, self.steps)


# The command line's names for torch's enums; apply_fsdp itself takes the enums.
STRATEGIES = {"full": ShardingStrategy.FULL_SHARD, "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
              "no_shard": ShardingStrategy.NO_SHARD, "hybrid": ShardingStrategy.HYBRID_SHARD}
PREFETCH = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST,
            "none": None}


def wrap_policy_for(name: str, *, block_types: tuple[type[nn.Module], ...],
                    min_num_params: int = 10_000):
    """The command line's --wrap-policy as torch's policy object (None: one unit)."""
    return {
        "block": ModuleWrapPolicy(set(block_types)),
        "size": functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params),
        "module": ModuleWrapPolicy({*block_types, nn.Embedding}),
        "none": None,  # one unit: the whole model is all-gathered at once, nothing to overlap
    }[name]


def fsdp_mixed_precision(precision: str) -> MixedPrecision | None:
    """bf16/fp16: compute (and keep buffers) in that dtype, reduce gradients in fp32: a sum over
    many ranks in bf16 loses bits. fp32/tf32: None, everything in the parameters' fp32."""
    low = low_precision_dtype(precision)
    if low is None:
        return None
    return MixedPrecision(param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=low)


def hybrid_mesh(world, ranks_per_node: int) -> DeviceMesh:
    """nodes x ranks_per_node: FSDP shards over the inner dim and replicates over the outer one."""
    ranks_per_node = ranks_per_node or world.local_world_size
    if world.world_size % ranks_per_node:
        raise RecipeError(f"hybrid: world size {world.world_size} is not a multiple of "
                          f"ranks_per_node={ranks_per_node}; pick --ranks-per-node dividing "
                          f"{world.world_size}")
    return init_device_mesh(world.device.type, (world.world_size // ranks_per_node, ranks_per_node),
                            mesh_dim_names=("replicate", "shard"))


def fsdp_grad_scaler(cfg: FSDPConfig, precision: str, device: torch.device):
    if precision != "fp16":
        return None  # fp32 and bf16 share fp32's exponent range: nothing to scale
    # Pitfall: torch.amp.GradScaler looks for inf/nan in THIS rank's gradients only. Under FSDP each
    # rank holds a different shard, so one rank would skip the step and the others would not: the
    # shards silently stop being one model. ShardedGradScaler all-reduces found_inf: every rank
    # decides alike.
    if cfg.grad_scaler == "amp":
        return torch.amp.GradScaler(device.type)
    return ShardedGradScaler(device.type)


# --8<-- [start:train]
def train(cfg: FSDPConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        per_rank_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size,
                                             cfg.micro_batches)
        if cfg.inject_inf_step >= 0 and cfg.inject_inf_rank >= world.world_size:  # never injected
            raise RecipeError(f"inject_inf_rank={cfg.inject_inf_rank} is not a rank of this world "
                              f"of {world.world_size}; use 0 to {world.world_size - 1}")
        mesh = hybrid_mesh(world, cfg.ranks_per_node) if cfg.sharding_strategy == "hybrid" else None
        precision = setup_precision(cfg.precision, world.device)
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        model = apply_fsdp(
            model,
            auto_wrap_policy=wrap_policy_for(cfg.wrap_policy, block_types=(Block,),
                                             min_num_params=cfg.min_num_params),
            sharding_strategy=STRATEGIES[cfg.sharding_strategy],
            mixed_precision=fsdp_mixed_precision(precision),
            cpu_offload=CPUOffload(offload_params=True) if cfg.cpu_offload else None,
            backward_prefetch=PREFETCH[cfg.backward_prefetch],
            forward_prefetch=cfg.forward_prefetch,
            limit_all_gathers=cfg.limit_all_gathers,
            sync_module_states=cfg.sync_module_states,
            checkpoint_block_types=(Block,) if cfg.activation_checkpointing else (),
            device=world.device, mesh=mesh)
        # Pitfall: build the optimizer AFTER wrapping: it must hold the sharded parameters, not the
        # originals.
        optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=world.device)  # fused on CUDA
        scaler = fsdp_grad_scaler(cfg, precision, world.device)
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=world.rank, world_size=world.world_size,
                                             per_rank_batch_size=per_rank_batch * cfg.micro_batches,
                                             seed=cfg.seed)
        log.info("FSDP %s on %d rank(s), wrap=%s, precision=%s, "
                 "%d x %d sequences per rank per step",
                 cfg.sharding_strategy, world.world_size, cfg.wrap_policy, precision,
                 cfg.micro_batches, per_rank_batch)

        losses, grad_norms, skipped_steps, timer = [], [], [], StepTimer(world.device)
        extras: dict = {}  # the last forward's bytes come from hooks (the tests read them)
        measure_last_forward(model, steps=cfg.steps, micro_batches=cfg.micro_batches,
                             extras=extras)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer:
                optimizer.zero_grad(set_to_none=True)
                step_loss = torch.zeros((), device=world.device)
                micro = list(zip(inputs.to(world.device).chunk(cfg.micro_batches),
                                 targets.to(world.device).chunk(cfg.micro_batches)))
                for index, (x, y) in enumerate(micro):
                    syncing = cfg.accumulation == "sync" or index == len(micro) - 1
                    # Pitfall: no_sync() skips the reduce-scatter, so every rank keeps UNSHARDED
                    # gradients until the synced micro-batch: N x the gradient memory that sharding
                    # saved.
                    with contextlib.nullcontext() if syncing else model.no_sync():
                        loss = lm_loss(model(x), y) / cfg.micro_batches
                        (scaler.scale(loss) if scaler else loss).backward()
                    step_loss += loss.detach().float()
                if step == cfg.inject_inf_step and world.rank == cfg.inject_inf_rank:
                    inject_inf_gradient(model)  # an fp16 overflow in one rank's shard
                if scaler:
                    # Clip (and report) the true gradients, not the scaled ones.
                    scaler.unscale_(optimizer)
                if cfg.max_grad_norm > 0:
                    # Pitfall: torch.nn.utils.clip_grad_norm_ here would return the norm of this
                    # rank's shard.
                    grad_norms.append(float(model.clip_grad_norm_(cfg.max_grad_norm)))
                if step_with_scaler(optimizer, scaler):  # skipped: an inf/nan gradient
                    skipped_steps.append(step)
            losses.append(mean_over_ranks(step_loss))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        # After step, before zero_grad: gradients present. Every rank measures its own bytes.
        extras.update(sharded_run_extras(model, optimizer, grad_norms=grad_norms, scaler=scaler,
                                         skipped_steps=skipped_steps))
        full_state, checksum = full_state_on_rank0(model)  # every rank calls it: it all-gathers
        return make_result(  # the checksum is on every rank; the full state on rank 0 only
            "fsdp", world, losses, checksum, timer,
            keep_final_state=full_state if cfg.keep_final_state and world.is_main else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            **extras)
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, FSDPConfig, __doc__)
