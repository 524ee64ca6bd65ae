r"""Classic FSDP (FullyShardedDataParallel): ZeRO-3, ZeRO-2, DDP-like, hybrid; equal to DDP.

    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp
    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp --sharding-strategy shard_grad_op \
        --precision bf16
    torchrun --standalone --nproc_per_node=4 -m recipes.fsdp --sharding-strategy hybrid \
        --ranks-per-node 2
    python -m recipes.fsdp                              # a world of 1: no torchrun needed

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/parallelize.py (``check_units``, ``tied_modules``: the wrap policy's
checks), recipes/options.py (the command line, from the config). recipes/parallelize.py's
``apply_fsdp`` makes the same ``FullyShardedDataParallel`` call for code that composes.

Each rank keeps 1/N of the parameters, gradients and AdamW state (``full``); FSDP all-gathers a
wrapped unit's parameters just before its forward and backward and reduce-scatters its gradients
after. The bytes per rank are asserted by tests/test_memory.py; the training equals DDP's (same
losses and final parameters, fp32 atol 1e-5) on every strategy. ``train`` returns the global
batch's loss of each step and prints it from rank 0.

Strategies: ``full`` = FULL_SHARD (ZeRO-3); ``shard_grad_op`` = SHARD_GRAD_OP (ZeRO-2: parameters
stay unsharded from forward to the end of backward, no re-all-gather in backward); ``no_shard`` =
NO_SHARD (DDP-like, deprecated by torch in favour of DDP); ``hybrid`` = HYBRID_SHARD (shard inside a
node, replicate across nodes: a 2-D mesh ("replicate", "shard") of nodes x ``--ranks-per-node``).

Speed: ``--precision auto`` (bf16 on a GPU) is FSDP's own ``MixedPrecision`` (bf16 compute and
buffers, fp32 reduction), AdamW is fused on CUDA except in fp16 (results/bench/ has the measured
steps).

New code should prefer ``fully_shard`` (recipes/fsdp2.py): this API is the one most existing
training code uses, so its options and pitfalls are shown here. ``wrap_with_fsdp`` holds the wrap
(its options all in one call); the loop is DDP's. Pitfalls named where they bite: fp16 needs
ShardedGradScaler, and a foreach AdamW (a fused one skips the scaler's check across ranks); the
optimizer is built after wrapping; activation checkpointing goes inside the FSDP unit.

Accumulation and clipping are other recipes' lessons (recipes/grad_accumulation.py,
recipes/grad_clipping.py); under classic FSDP they take its own calls, which tests/test_fsdp.py
checks on this wrap:

- accumulate in ``model.no_sync()``: every rank then holds the UNSHARDED gradients until the synced
  micro-batch (N x the bytes sharding saved); or sync every micro-batch and keep them sharded;
- clip with ``model.clip_grad_norm_(max_norm)``: it all-reduces the shards' partial norms, where
  ``torch.nn.utils.clip_grad_norm_`` would return this rank's shard's norm.
"""

from __future__ import annotations

import argparse
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, resolve_precision, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import check_units, tied_modules
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset


@dataclass
class FSDPConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 on a GPU, fp32 on CPU; fp32: exact (TF32 off); tf32: TF32 matmuls (CUDA); "
        "bf16/fp16: FSDP's MixedPrecision (fp16 with a scaler)",
        choices=["auto", "fp32", "tf32", "bf16", "fp16"],
    )
    sharding_strategy: str = option(
        "full",
        "full = ZeRO-3, shard_grad_op = ZeRO-2, no_shard = DDP-like, hybrid = shard inside a "
        "node, replicate across nodes",
        choices=["full", "shard_grad_op", "no_shard", "hybrid"],
    )
    ranks_per_node: int = option(
        0, "hybrid: size of each shard group (a 'node'); 0 = LOCAL_WORLD_SIZE", at_least=0
    )
    wrap_policy: str = option(
        "block",
        "FSDP units: block = one per transformer Block, size = by --min-num-params, module = "
        "Blocks and Embeddings, none = the whole model is one unit (no overlap, full-size "
        "all-gathers)",
        choices=["block", "size", "module", "none"],
    )
    min_num_params: int = option(
        10_000,
        "size policy: wrap a submodule once it has at least this many parameters",
        at_least=1,
    )
    cpu_offload: bool = option(
        False, "keep the sharded parameters and gradients in host memory; AdamW runs on CPU"
    )
    backward_prefetch: str = option(
        "pre",
        "when to all-gather the next unit in backward: pre = before this unit's gradient "
        "(most overlap)",
        choices=["pre", "post", "none"],
    )
    forward_prefetch: bool = option(
        False, "all-gather the next unit before this one's forward (CPU-bound models)"
    )
    limit_all_gathers: bool = option(
        True, "rate-limit all-gathers so prefetching cannot grow GPU memory unbounded"
    )
    sync_module_states: bool = option(
        True, "broadcast rank 0's parameters at wrap time (ranks need not init equally)"
    )
    activation_checkpointing: bool = option(
        False, "recompute each Block's activations in backward (non-reentrant)"
    )
    grad_scaler: str = option(
        "sharded",
        "fp16 only: sharded = ShardedGradScaler (right); amp = torch.amp.GradScaler (wrong "
        "under FSDP: an inf in one rank's shard is not seen by the others; kept to show the "
        "pitfall)",
        choices=["sharded", "amp"],
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        if self.cpu_offload and not torch.cuda.is_available():
            raise ValueError(
                "cpu_offload needs a GPU: FSDP pins host memory for the copies to and from the "
                "device; on a CPU-only world the parameters already live in host memory: drop "
                "--cpu-offload"
            )


# The command line's names for torch's enums.
STRATEGIES = {
    "full": ShardingStrategy.FULL_SHARD,
    "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
    "no_shard": ShardingStrategy.NO_SHARD,
    "hybrid": ShardingStrategy.HYBRID_SHARD,
}
PREFETCH = {
    "pre": BackwardPrefetch.BACKWARD_PRE,
    "post": BackwardPrefetch.BACKWARD_POST,
    "none": None,
}
WRAP_POLICIES = ("block", "size", "module", "none")


def wrap_policy_for(
    name: str, *, block_types: tuple[type[nn.Module], ...], min_num_params: int = 10_000
):
    """The command line's --wrap-policy as torch's policy object (None: one unit)."""
    if name not in WRAP_POLICIES:
        raise ValueError(f"unknown wrap_policy={name!r}; valid values: {', '.join(WRAP_POLICIES)}")
    return {
        "block": ModuleWrapPolicy(set(block_types)),
        "size": functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params),
        "module": ModuleWrapPolicy({*block_types, nn.Embedding}),
        "none": None,  # one unit: the whole model is all-gathered at once, nothing to overlap
    }[name]


def hybrid_mesh(world_size: int, ranks_per_node: int, device_type: str) -> DeviceMesh:
    """nodes x ranks_per_node: FSDP shards over the inner dim and replicates over the outer one."""
    ranks_per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if world_size % ranks_per_node:
        raise ValueError(
            f"hybrid: world size {world_size} is not a multiple of "
            f"ranks_per_node={ranks_per_node}; pick --ranks-per-node dividing "
            f"{world_size}"
        )
    return init_device_mesh(
        device_type,
        (world_size // ranks_per_node, ranks_per_node),
        mesh_dim_names=("replicate", "shard"),
    )


# --8<-- [start:wrap]
def wrap_with_fsdp(
    model: nn.Module,
    cfg: FSDPConfig,
    *,
    precision: str,
    device: torch.device,
    world_size: int,
    block_types: tuple[type[nn.Module], ...] = (Block,),
) -> FullyShardedDataParallel:
    """``model`` as FSDP units, as ``cfg`` says: the wrap policy, the sharding strategy (and the
    hybrid mesh), mixed precision and prefetching; then activation checkpointing inside units.
    ``block_types``: your model's repeated block class (GPT-2's ``GPT2Block``, say)."""
    policy = wrap_policy_for(
        cfg.wrap_policy, block_types=block_types, min_num_params=cfg.min_num_params
    )
    blocks = [m for m in model.modules() if isinstance(m, block_types)]
    if cfg.activation_checkpointing and not blocks:  # else it checkpoints nothing, silently
        names = ", ".join(t.__name__ for t in block_types)
        raise ValueError(f"no module of {type(model).__name__} is a {names}: pass block_types")
    strategy, mesh = STRATEGIES[cfg.sharding_strategy], None
    if cfg.sharding_strategy == "hybrid":
        mesh = hybrid_mesh(world_size, cfg.ranks_per_node, device.type)
        if mesh.size(1) == 1:
            # Pitfall (torch's FSDP, seen on 2.13): with one rank per shard group FSDP clamps the
            # group to NO_SHARD and never all-reduces across the replicas: each rank trains on its
            # own gradient. One rank per node is NO_SHARD over the whole world.
            strategy, mesh = ShardingStrategy.NO_SHARD, None
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    use_cuda = device.type == "cuda"
    if cfg.sync_module_states and not use_cuda:
        # FSDP's own sync_module_states broadcasts on the accelerator and refuses CPU tensors: on
        # a CPU-only world, broadcast rank 0's parameters and buffers by hand.
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
    tied = tied_modules(model)  # before wrapping: FSDP flattens them away
    model = FullyShardedDataParallel(
        model,
        sharding_strategy=strategy,
        auto_wrap_policy=policy,  # one FSDP unit per module it picks, the root takes the rest
        # bf16/fp16: compute (and keep buffers) in it, reduce gradients in fp32: a sum over many
        # ranks in bf16 loses bits. fp32: None, everything in the parameters' fp32.
        mixed_precision=MixedPrecision(
            param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=low
        )
        if low
        else None,
        cpu_offload=CPUOffload(offload_params=True) if cfg.cpu_offload else None,
        backward_prefetch=PREFETCH[cfg.backward_prefetch],
        forward_prefetch=cfg.forward_prefetch,
        limit_all_gathers=cfg.limit_all_gathers,
        sync_module_states=cfg.sync_module_states and use_cuda,
        # use_orig_params: parameters keep their names and shapes for the optimizer and for
        # torch.compile; gradients are views into the flat shard.
        use_orig_params=True,
        device_id=device,  # Pitfall: without it FSDP refuses a CPU-only host
        device_mesh=mesh,
    )
    check_units(model, policy, tied)  # a policy that wraps nothing, or splits a tied weight
    if cfg.activation_checkpointing:
        # Order: wrap with FSDP FIRST, then checkpoint, so each unit is
        # FSDP(CheckpointWrapper(Block)): the recomputation runs inside the unit while its
        # parameters are all-gathered. Non-reentrant: FSDP's hooks expect no nested backward.
        apply_activation_checkpointing(
            model,
            check_fn=lambda module: isinstance(module, block_types),
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            ),
        )
    return model


# --8<-- [end:wrap]


# --8<-- [start:train]
def train(cfg: FSDPConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, rank, world_size = world.device, world.rank, world.world_size
        if cfg.global_batch_size % world_size:
            lower = max(world_size, cfg.global_batch_size - cfg.global_batch_size % world_size)
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across {world_size} "
                f"ranks; use a multiple of {world_size}, e.g. {lower} or {lower + world_size}"
            )
        precision = resolve_precision(cfg.precision, device)
        use_cuda, per_rank_batch = device.type == "cuda", cfg.global_batch_size // world_size
        if rank == 0:
            print(
                f"FSDP {cfg.sharding_strategy} on {world_size} rank(s), wrap={cfg.wrap_policy}, "
                f"{precision}, {per_rank_batch} sequences per rank",
                flush=True,
            )

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (FSDP broadcasts
        # rank 0's weights with sync_module_states, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        model = wrap_with_fsdp(
            model, cfg, precision=precision, device=device, world_size=world_size
        )
        # Pitfall: build the optimizer AFTER wrapping: it must hold the sharded parameters.
        # Pitfall: in fp16 a fused AdamW skips the sharded scaler's inf check across ranks
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda and precision != "fp16" else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)
        # Pitfall (fp16): torch.amp.GradScaler looks for inf/nan in THIS rank's gradient shard
        # only: one rank would skip the step and the others would not, and the shards stop being
        # one model. ShardedGradScaler all-reduces found_inf. Off (a pass-through) unless fp16.
        scaler = (ShardedGradScaler if cfg.grad_scaler == "sharded" else torch.amp.GradScaler)(
            device.type, enabled=precision == "fp16"
        )

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
        # at step s is one process's batch s. drop_last keeps every global batch full.
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, pin_memory=use_cuda
        )

        losses, step, epoch = [], 0, 0
        while step < cfg.steps:
            # Pitfall: without set_epoch every epoch repeats the first epoch's order
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                inputs = inputs.to(device, non_blocking=True)
                targets = targets.to(device, non_blocking=True)
                optimizer.zero_grad(set_to_none=True)
                loss = lm_loss(model(inputs), targets)  # MixedPrecision casts inside each unit
                scaler.scale(loss).backward()  # FSDP reduce-scatters each unit's gradients here
                scaler.step(optimizer)  # skips optimizer.step() if any rank found an inf
                scaler.update()
                # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks)
                global_loss = loss.detach().float().clone()
                dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
                losses.append(global_loss.item())
                if rank == 0:
                    print(f"step {step} loss {losses[-1]:.4f}", flush=True)
                if observer:
                    observer.step_end(step, losses[-1])
                step += 1
            epoch += 1
        # --8<-- [end:loop]
        return losses
    finally:
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(FSDPConfig, prog="python -m recipes.fsdp", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), FSDPConfig, argv)
    with exit_on_bad_input():  # bad input every rank sees: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
