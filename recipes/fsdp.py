r"""Classic FSDP (FullyShardedDataParallel): ZeRO-3, ZeRO-2, DDP-like, hybrid; equal to DDP.

    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp
    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp --sharding-strategy shard_grad_op \
        --precision bf16
    torchrun --standalone --nproc_per_node=4 -m recipes.fsdp --sharding-strategy hybrid \
        --ranks-per-node 2
    python -m recipes.fsdp                              # a world of 1: no torchrun needed

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/parallelize.py (``apply_fsdp``, the part that wraps).

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
buffers, fp32 reduction), AdamW is fused on CUDA. On one H200 (100m, torch 2.11, a world of 1, where
FSDP switches itself to NO_SHARD) a step ran 62.9 ms at batch 64 against the bare bf16 loop's 67.4,
and 65.5 against 37.1 ms at batch 32 (scripts/bench.py), where issuing a step took ~72 ms of CPU in
a profiled probe.

New code should prefer ``fully_shard`` (recipes/fsdp2.py): this API is the one most existing
training code uses, so its options and pitfalls are shown here. Pitfalls named where they bite: fp16
needs ShardedGradScaler; clip with ``FSDP.clip_grad_norm_``; ``no_sync`` holds unsharded gradients;
the optimizer is built after wrapping; activation checkpointing goes inside the FSDP unit
(``apply_fsdp``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.parallelize import FSDPWrapError, apply_fsdp  # noqa: F401  (FSDPWrapError: re-export)
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset


@dataclass
class FSDPConfig:
    model: str = "tiny"  # a key of MODEL_PRESETS
    steps: int = 6
    global_batch_size: int = 12  # sequences per optimizer step, summed over all ranks
    lr: float = 1e-3
    seed: int = 0  # same seed -> same weights and data order on every rank, on any world size
    precision: str = "auto"  # auto: bf16 on a GPU, fp32 on CPU; fp16 adds a loss scaler
    sharding_strategy: str = "full"  # full, shard_grad_op, no_shard, hybrid (see STRATEGIES)
    ranks_per_node: int = 0  # hybrid: size of each shard group; 0 = LOCAL_WORLD_SIZE
    wrap_policy: str = "block"  # block, size, module, none (see wrap_policy_for)
    min_num_params: int = 10_000  # the size policy's threshold
    cpu_offload: bool = False  # sharded parameters and gradients in host memory (needs a GPU)
    backward_prefetch: str = "pre"  # pre, post, none (see PREFETCH)
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    sync_module_states: bool = True  # broadcast rank 0's parameters at wrap time
    activation_checkpointing: bool = False
    micro_batches: int = 1  # gradient accumulation: micro-batches per optimizer step
    accumulation: str = "sync"  # sync: reduce-scatter every micro-batch; no_sync: the last only
    max_grad_norm: float = 0.0  # clip the total gradient norm to this (0: no clipping)
    grad_scaler: str = "sharded"  # fp16: sharded (right) or amp (the pitfall, kept to show it)
    backend: str = "auto"  # auto: nccl with a GPU for each local rank, else gloo
    timeout_s: float = 300.0


# The command line's names for torch's enums; apply_fsdp itself takes the enums.
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


def resolve_precision(requested: str, device: torch.device) -> str:
    """auto -> bf16 on a GPU that has it, else fp32. Sets the fp32 matmul mode on CUDA: TF32 for
    ``tf32`` only (a process-wide switch: set on every run, never inherited from an earlier one)."""
    on_cuda = device.type == "cuda"
    if requested == "auto":
        requested = "bf16" if on_cuda and torch.cuda.is_bf16_supported() else "fp32"
    if requested == "tf32" and not on_cuda:
        raise ValueError(
            f"--precision tf32 is a CUDA matmul mode and this run is on "
            f"{device.type}; use --precision fp32 (or bf16)"
        )
    if on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
            requested == "tf32"
        )
    return requested


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


# --8<-- [start:train]
def train(cfg: FSDPConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    policy = wrap_policy_for(
        cfg.wrap_policy, block_types=(Block,), min_num_params=cfg.min_num_params
    )
    if cfg.micro_batches < 1:  # before joining: every rank refuses alike
        raise ValueError(f"micro_batches={cfg.micro_batches}: use 1 or more")
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, parts = world.device, world.world_size * cfg.micro_batches
        if cfg.global_batch_size % parts:
            lower = max(parts, cfg.global_batch_size - cfg.global_batch_size % parts)
            over = f" x {cfg.micro_batches} micro-batches" if cfg.micro_batches > 1 else ""
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across "
                f"{world.world_size} ranks{over}; use a multiple of {parts}, e.g. {lower} or "
                f"{lower + parts}"
            )
        mesh = (
            hybrid_mesh(world.world_size, cfg.ranks_per_node, device.type)
            if cfg.sharding_strategy == "hybrid"
            else None
        )
        precision = resolve_precision(cfg.precision, device)
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        rank, world_size, use_cuda = world.rank, world.world_size, device.type == "cuda"
        per_rank_batch = cfg.global_batch_size // world_size
        if rank == 0:
            print(
                f"FSDP {cfg.sharding_strategy} on {world_size} rank(s), wrap={cfg.wrap_policy}, "
                f"{precision}, {cfg.micro_batches} x {per_rank_batch // cfg.micro_batches} "
                "sequences per rank",
                flush=True,
            )

        # --8<-- [start:loop]
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        model = apply_fsdp(
            model,
            auto_wrap_policy=policy,
            sharding_strategy=STRATEGIES[cfg.sharding_strategy],
            # bf16/fp16: compute (and keep buffers) in it, reduce gradients in fp32: a sum over
            # many ranks in bf16 loses bits. fp32: None, everything in the parameters' fp32.
            mixed_precision=MixedPrecision(
                param_dtype=low, reduce_dtype=torch.float32, buffer_dtype=low
            )
            if low
            else None,
            cpu_offload=CPUOffload(offload_params=True) if cfg.cpu_offload else None,
            backward_prefetch=PREFETCH[cfg.backward_prefetch],
            forward_prefetch=cfg.forward_prefetch,
            limit_all_gathers=cfg.limit_all_gathers,
            sync_module_states=cfg.sync_module_states,
            checkpoint_block_types=(Block,) if cfg.activation_checkpointing else (),
            device=device,
            mesh=mesh,
        )
        # Pitfall: build the optimizer AFTER wrapping: it must hold the sharded parameters, not the
        # originals.
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)
        scaler = None
        if precision == "fp16":  # fp32 and bf16 share fp32's exponent range: nothing to scale
            # Pitfall: torch.amp.GradScaler looks for inf/nan in THIS rank's gradients only. Each
            # rank holds a different shard, so one rank would skip the step and the others would
            # not: the shards silently stop being one model. ShardedGradScaler all-reduces
            # found_inf: every rank decides alike.
            scaler = (
                ShardedGradScaler(device.type)
                if cfg.grad_scaler == "sharded"
                else torch.amp.GradScaler(device.type)
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
                step_loss = torch.zeros((), device=device)
                micro = list(zip(inputs.chunk(cfg.micro_batches), targets.chunk(cfg.micro_batches)))
                for index, (x, y) in enumerate(micro):
                    syncing = cfg.accumulation == "sync" or index == len(micro) - 1
                    # Pitfall: no_sync() skips the reduce-scatter, so every rank keeps UNSHARDED
                    # gradients until the synced micro-batch: N x the gradient memory that
                    # sharding saved.
                    with contextlib.nullcontext() if syncing else model.no_sync():
                        loss = lm_loss(model(x), y) / cfg.micro_batches
                        (scaler.scale(loss) if scaler else loss).backward()
                    step_loss += loss.detach().float()
                if scaler:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                if cfg.max_grad_norm > 0:
                    # Pitfall: torch.nn.utils.clip_grad_norm_ here would return the norm of this
                    # rank's shard; FSDP's all-reduces the partial norms.
                    model.clip_grad_norm_(cfg.max_grad_norm)
                if scaler:
                    scaler.step(optimizer)  # skips optimizer.step() if any rank found an inf
                    scaler.update()
                else:
                    optimizer.step()
                # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks)
                global_loss = step_loss.detach().float().clone()
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


def _number(kind, *, above=None, at_least=None):
    """An argparse type: a finite ``kind`` in range, else one line that says what is valid."""
    bound = f"> {above}" if above is not None else f">= {at_least}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not math.isfinite(value) or not (
            value > above if above is not None else value >= at_least
        ):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    return parse


def _backend(text: str) -> str:
    if text == "nccl" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            "backend 'nccl' needs one CUDA device per local rank and this machine has none; "
            "use --backend gloo"
        )
    return text


def make_parser() -> argparse.ArgumentParser:
    defaults = FSDPConfig()
    parser = argparse.ArgumentParser(
        prog="python -m recipes.fsdp",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    flag = argparse.BooleanOptionalAction
    add("--model", choices=sorted(MODEL_PRESETS), default=defaults.model, help="model size")
    add("--steps", type=_number(int, at_least=1), default=defaults.steps, help="optimizer steps")
    add(
        "--global-batch-size",
        type=_number(int, at_least=1),
        default=defaults.global_batch_size,
        help="sequences per optimizer step, summed over all ranks",
    )
    add("--lr", type=_number(float, above=0), default=defaults.lr, help="AdamW's")
    add(
        "--seed",
        type=_number(int, at_least=0),
        default=defaults.seed,
        help="model init and data order; the same seed gives the same losses on any world size",
    )
    add(
        "--precision",
        choices=["auto", "fp32", "tf32", "bf16", "fp16"],
        default=defaults.precision,
        help="auto: bf16 on a GPU, fp32 on CPU; fp32: exact (TF32 "
        "off); tf32: TF32 matmuls (CUDA); bf16/fp16: FSDP's MixedPrecision (fp16 with a scaler)",
    )
    add(
        "--sharding-strategy",
        choices=list(STRATEGIES),
        default=defaults.sharding_strategy,
        help="full = ZeRO-3, shard_grad_op = ZeRO-2, no_shard = DDP-like, hybrid = shard inside "
        "a node, replicate across nodes",
    )
    add(
        "--ranks-per-node",
        type=_number(int, at_least=0),
        default=defaults.ranks_per_node,
        help="hybrid: size of each shard group (a 'node'); 0 = LOCAL_WORLD_SIZE",
    )
    add(
        "--wrap-policy",
        choices=WRAP_POLICIES,
        default=defaults.wrap_policy,
        help="FSDP units: block = one per transformer Block, size = by --min-num-params, "
        "module = Blocks and Embeddings, none = the whole model is one unit (no overlap, "
        "full-size all-gathers)",
    )
    add(
        "--min-num-params",
        type=_number(int, at_least=1),
        default=defaults.min_num_params,
        help="size policy: wrap a submodule once it has at least this many parameters",
    )
    add(
        "--cpu-offload",
        action=flag,
        default=defaults.cpu_offload,
        help="keep the sharded parameters and gradients in host memory; AdamW runs on CPU",
    )
    add(
        "--backward-prefetch",
        choices=list(PREFETCH),
        default=defaults.backward_prefetch,
        help="when to all-gather the next unit in backward: pre = before this unit's gradient "
        "(most overlap)",
    )
    add(
        "--forward-prefetch",
        action=flag,
        default=defaults.forward_prefetch,
        help="all-gather the next unit before this one's forward (CPU-bound models)",
    )
    add(
        "--limit-all-gathers",
        action=flag,
        default=defaults.limit_all_gathers,
        help="rate-limit all-gathers so prefetching cannot grow GPU memory unbounded",
    )
    add(
        "--sync-module-states",
        action=flag,
        default=defaults.sync_module_states,
        help="broadcast rank 0's parameters at wrap time (ranks need not init equally)",
    )
    add(
        "--activation-checkpointing",
        action=flag,
        default=defaults.activation_checkpointing,
        help="recompute each Block's activations in backward (non-reentrant)",
    )
    add(
        "--micro-batches",
        type=_number(int, at_least=1),
        default=defaults.micro_batches,
        help="gradient accumulation: micro-batches per optimizer step",
    )
    add(
        "--accumulation",
        choices=["sync", "no_sync"],
        default=defaults.accumulation,
        help="sync = reduce-scatter every micro-batch (gradients stay sharded); no_sync = "
        "communicate on the last one only (every rank holds unsharded gradients: N x the memory)",
    )
    add(
        "--max-grad-norm",
        type=_number(float, at_least=0),
        default=defaults.max_grad_norm,
        help="clip the total gradient norm with FSDP.clip_grad_norm_ (0 = off)",
    )
    add(
        "--grad-scaler",
        choices=["sharded", "amp"],
        default=defaults.grad_scaler,
        help="fp16 only: sharded = ShardedGradScaler (right); amp = torch.amp.GradScaler (wrong "
        "under FSDP: an inf in one rank's shard is not seen by the others; kept to show the "
        "pitfall)",
    )
    add(
        "--backend",
        type=_backend,
        choices=["auto", "nccl", "gloo"],
        default=defaults.backend,
        help="process-group backend; auto: nccl with a GPU per local rank, else gloo",
    )
    add(
        "--timeout-s",
        type=_number(float, above=0),
        default=defaults.timeout_s,
        help="seconds a collective waits for its peers before failing",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    cfg = FSDPConfig(**vars(make_parser().parse_args(argv)))
    try:
        train(cfg)
    except ValueError as exc:  # bad input every rank sees (a mesh or batch that does not divide)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
