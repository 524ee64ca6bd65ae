"""FSDP2 (``fully_shard``): per-parameter sharding as DTensors on a DeviceMesh, equal to DDP.

    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp2
    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp2 --precision bf16 --explicit-prefetch
    torchrun --standalone --nproc_per_node=4 -m recipes.fsdp2 --hsdp-replicas 2   # HSDP: 2 x 2
    python -m recipes.fsdp2                             # a world of 1: no torchrun needed

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/options.py (the command line, from the config).

Every parameter becomes a DTensor sharded on dim 0 over the mesh's "shard" dim; each Block is one
communication group (one all-gather before its forward and backward, one reduce-scatter after its
backward), then the root takes what is left (embeddings, final norm, output). Per-rank bytes are 1/N
of DDP's, like classic FULL_SHARD (asserted by tests/test_memory.py); training equals DDP's.
``train`` returns the global batch's loss of each step and prints it from rank 0. The calls are
written out here; recipes/parallelize.py's ``apply_fully_shard`` makes the same ones for recipes
that compose several parallelisms (asserted alike by tests/test_fsdp2.py).

Fast on a GPU: ``--precision auto`` (bf16 there) is fully_shard's own ``MixedPrecisionPolicy`` (bf16
parameters for compute, fp32 gradient reduction, fp32 sharded master weights), never autocast on top
of it; AdamW is fused (foreach AdamW pays DTensor's dispatch for every op of every parameter).
``--compile`` compiles each Block's forward before it is sharded, so the sharding hooks run around
the compiled graphs. Accumulation under fully_shard is recipes/sharded_accumulation.py's lesson,
fp16 loss scaling recipes/amp.py's, clipping sharded gradients recipes/grad_clipping.py's.

A model too big for one host's memory is built under ``torch.device("meta")`` instead of on CPU,
sharded, then materialised with ``model.to_empty(device=...)`` and initialised or loaded from a
sharded checkpoint (recipes/meta_init.py, recipes/sharded_checkpoint.py).

| fully_shard (this recipe)                         | classic FSDP (recipes/fsdp.py)            |
|---------------------------------------------------|-------------------------------------------|
| ``reshard_after_forward=True``                    | ``FULL_SHARD`` (ZeRO-3)                   |
| ``reshard_after_forward=False``                   | ``SHARD_GRAD_OP`` (ZeRO-2)                |
| ``reshard_after_forward=2``: re-gather in pairs   | no counterpart                            |
| 2-D mesh ("replicate", "shard")                   | ``HYBRID_SHARD`` with a 2-D mesh          |
| ``MixedPrecisionPolicy(param_, reduce_dtype)``    | ``MixedPrecision(param_, reduce_, ...)``  |
| ``CPUOffloadPolicy()``                            | ``CPUOffload(offload_params=True)``       |
| ``set_modules_to_forward_prefetch``               | ``forward_prefetch=True``                 |
| ``set_modules_to_backward_prefetch``              | ``backward_prefetch=BackwardPrefetch...`` |
| one ``fully_shard`` per block, then the root      | ``ModuleWrapPolicy({Block})``             |
| ``set_requires_gradient_sync(False)``             | ``no_sync()``                             |
| ``torch.nn.utils.clip_grad_norm_`` (DTensor)      | ``FSDP.clip_grad_norm_``                  |
| ``torch.amp.GradScaler`` (reduces found_inf)      | ``ShardedGradScaler``                     |
| DTensor parameters, names unchanged               | ``use_orig_params=True``                  |
| same init on every rank, or a checkpoint load     | ``sync_module_states=True``               |
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, resolve_precision, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset


@dataclass
class FSDP2Config:
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
        "bf16: MixedPrecisionPolicy",
        choices=["auto", "fp32", "tf32", "bf16"],
    )
    # True: free each Block's unsharded parameters after forward, re-gather them in backward
    # (ZeRO-3); False: keep them until backward (ZeRO-2); k: keep a copy sharded over k ranks.
    # The command line gives a string ("true", "false", "2"): __post_init__ reads it.
    reshard_after_forward: str | bool | int = option(
        True,
        "true: free the unsharded Block parameters after forward, re-gather in backward "
        "(ZeRO-3); false: keep them until backward (ZeRO-2); k: keep a copy sharded over groups "
        "of k ranks",
    )
    hsdp_replicas: int = option(
        1,
        "HSDP: replicate over this many groups, shard inside each (mesh replicate x shard)",
        at_least=1,
    )
    cpu_offload: bool = option(
        False, "keep sharded parameters, gradients and AdamW state in host memory"
    )
    explicit_prefetch: bool = option(
        False, "issue each Block's all-gather one Block ahead, in forward and backward"
    )
    compile: bool = option(
        False, "torch.compile each transformer block (and the loss) before sharding"
    )
    compile_backend: str = option(
        "inductor", "torch.compile's backend", choices=["inductor", "aot_eager", "eager"]
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        reshard = self.reshard_after_forward
        if isinstance(reshard, str):
            word = reshard.strip().lower()
            reshard = word == "true" if word in ("true", "false") else word
            reshard = int(reshard) if isinstance(reshard, str) and reshard.isdigit() else reshard
        if isinstance(reshard, str) or (not isinstance(reshard, bool) and reshard < 1):
            raise ValueError(
                f"reshard_after_forward={self.reshard_after_forward!r}: use true, false, or a "
                "group size that divides the shard dim, e.g. 2"
            )
        self.reshard_after_forward = reshard


# --8<-- [start:shard]
def shard_with_fully_shard(
    model: nn.Module,
    cfg: FSDP2Config,
    *,
    mesh: DeviceMesh,
    precision: str,
    use_cuda: bool,
    block_types: tuple[type[nn.Module], ...] = (Block,),
) -> nn.Module:
    """``model`` sharded in place by ``fully_shard``: one group per block, then the root, with the
    mixed-precision and offload policies and the prefetch order ``cfg`` asks for. Returns
    ``model``, now also an ``FSDPModule``. ``block_types``: your model's repeated block class."""
    blocks = [m for m in model.modules() if isinstance(m, block_types)]
    if not blocks:
        names = ", ".join(t.__name__ for t in block_types)
        raise ValueError(f"no module of {model.__class__.__name__} is a {names}: pass block_types")
    # bf16: compute in it, reduce gradients in fp32 (a sum over many ranks in bf16 loses
    # bits), keep fp32 sharded master weights. Never autocast on top of it.
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    # Pinned memory needs an accelerator: on a CPU-only world this only runs the code.
    offload_policy = CPUOffloadPolicy(pin_memory=use_cuda) if cfg.cpu_offload else OffloadPolicy()
    # Order: bottom-up. Each call groups the parameters no inner call has claimed, so the
    # Blocks go first and the root call collects the rest (embeddings, final norm, output).
    for block in blocks:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=cfg.reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
        )
    # The root keeps fully_shard's default (not resharded after forward): backward needs its
    # parameters (the output layer) first, so freeing them would only re-gather them at once.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    if cfg.explicit_prefetch:
        # Default: each group all-gathers when its own forward / backward starts. Explicit:
        # Block i issues Block i+1's all-gather in forward and Block i-1's in backward, so the
        # communication runs under Block i's compute.
        for previous, following in zip(blocks, blocks[1:]):
            previous.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([previous])
    return model


# --8<-- [end:shard]


# --8<-- [start:train]
def train(cfg: FSDP2Config, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, rank, world_size = world.device, world.rank, world.world_size
        use_cuda = device.type == "cuda"
        if cfg.global_batch_size % world_size:
            lower = max(world_size, cfg.global_batch_size - cfg.global_batch_size % world_size)
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across {world_size} "
                f"ranks; use a multiple of {world_size}, e.g. {lower} or {lower + world_size}"
            )
        if world_size % cfg.hsdp_replicas:
            raise ValueError(
                f"hsdp_replicas={cfg.hsdp_replicas} does not divide world size "
                f"{world_size}; pick a divisor of {world_size}"
            )
        per_rank_batch = cfg.global_batch_size // world_size
        shard = world_size // cfg.hsdp_replicas
        if cfg.hsdp_replicas == 1:
            mesh = init_device_mesh(device.type, (shard,), mesh_dim_names=("shard",))
        else:  # HSDP: 2 x 2 is 2 copies, each sharded over 2 ranks (in a node: fast all-gathers)
            mesh = init_device_mesh(
                device.type, (cfg.hsdp_replicas, shard), mesh_dim_names=("replicate", "shard")
            )
        reshard = cfg.reshard_after_forward
        if not isinstance(reshard, bool) and shard % reshard:
            raise ValueError(
                f"reshard_after_forward={reshard} does not divide the shard group "
                f"size {shard}; use true, false or a divisor of {shard}"
            )
        precision = resolve_precision(cfg.precision, device)
        if rank == 0:
            print(
                f"fully_shard on mesh {tuple(mesh.shape)}, reshard_after_forward={reshard}, "
                f"{precision}, {per_rank_batch} sequences per rank",
                flush=True,
            )

        # --8<-- [start:loop]
        # On CPU from the seed, then sharded: every rank starts from exactly the same weights, and
        # each fully_shard call moves only its group to the device, keeping a 1/N shard of it.
        model = build_model(cfg.model, seed=cfg.seed, device="cpu")
        loss_fn = lm_loss
        if cfg.compile:  # each block's forward, before sharding: the hooks stay out of the graphs
            for block in [m for m in model.modules() if isinstance(m, Block)]:
                block.forward = torch.compile(block.forward, backend=cfg.compile_backend)
            loss_fn = torch.compile(lm_loss, backend=cfg.compile_backend)
        model = shard_with_fully_shard(
            model, cfg, mesh=mesh, precision=precision, use_cuda=use_cuda
        )
        # Pitfall: build the optimizer AFTER sharding: its state is then created like the
        # parameters, as DTensor shards (1/N each), not for the replaced full tensors.
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
        # at step s is one process's batch s. drop_last keeps every global batch full. (HSDP too:
        # every rank of a 2 x 2 mesh is a data-parallel rank.)
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
                loss = loss_fn(model(inputs), targets)  # no autocast: the policy casts
                loss.backward()  # each Block's reduce-scatter runs as its backward ends
                optimizer.step()  # each rank updates its own shards
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
    return config_parser(FSDP2Config, prog="python -m recipes.fsdp2", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), FSDP2Config, argv)
    with exit_on_bad_input():  # a mesh or batch that does not divide: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
