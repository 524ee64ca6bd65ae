"""FSDP2 (``fully_shard``): per-parameter sharding as DTensors on a DeviceMesh, equal to DDP.

    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp2
    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp2 --precision bf16 --explicit-prefetch
    torchrun --standalone --nproc_per_node=4 -m recipes.fsdp2 --hsdp-replicas 2   # HSDP: 2 x 2
    python -m recipes.fsdp2                             # a world of 1: no torchrun needed

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/parallelize.py (``apply_fully_shard``, the part that shards).

Every parameter becomes a DTensor sharded on dim 0 over the mesh's "shard" dim; each Block is one
communication group (one all-gather before its forward and backward, one reduce-scatter after its
backward), then the root takes what is left (embeddings, final norm, output). Per-rank bytes are 1/N
of DDP's, like classic FULL_SHARD (asserted by tests/test_memory.py); training equals DDP's.
``train`` returns the global batch's loss of each step and prints it from rank 0.

Fast on a GPU: ``--precision auto`` (bf16 there) is fully_shard's own ``MixedPrecisionPolicy`` (bf16
parameters for compute, fp32 gradient reduction, fp32 sharded master weights), never autocast on top
of it; AdamW is fused. Measured on one H200 (100m preset, torch 2.11, world of 1):

- foreach AdamW sends every optimizer op through DTensor dispatch, parameter by parameter: 88.6 ms
  a step against 36.1 ms fused (batch 32, a probe of the bare fully_shard loop).
- At batch 64 this recipe runs 5.5% *faster* than the bare bf16 autocast loop (63.8 vs 67.4 ms):
  the policy also runs the norms and the output head in bf16.
- At batch 32 it costs 82% more (67.5 vs 37.1 ms): the step is bound by host-side work. In a
  profiled probe, issuing one step took ~82 ms of CPU against the bare loop's 33, with about the
  same number of kernel launches (812 against 822): the time goes to per-parameter Python work in
  the hooks (the copy-in/out of each all-gather and reduce-scatter: 319 memcpy and 614 copy_ calls
  a step), not to launches.
  ``reshard_after_forward=False`` skips the backward re-gather (memcpy 175 a step): 54.8 ms. A
  bigger step hides the host work; so would CUDA graphs, which this recipe does not use.
- ``--compile`` compiles each Block's forward before it is sharded, and the loss: 57.2 ms at batch
  64 against 51.3 ms for the compiled bare loop (+11.5%; H200, torch 2.11, 2026-11-26). At batch
  32 compile barely helps (58.3 ms against 27.8): the hooks run outside the compiled blocks, and
  their host time is the step's time (results/bench/nvidia-h200-profiles.txt: 323 memcpy and
  617 copy_ a step, ~52 ms of Python outside any op against a GPU busy for ~31 ms).

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
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.parallelize import apply_compile, apply_fully_shard
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset


@dataclass
class FSDP2Config:
    model: str = "tiny"  # a key of MODEL_PRESETS
    steps: int = 6
    global_batch_size: int = 12  # sequences per optimizer step, summed over all ranks
    lr: float = 1e-3
    seed: int = 0  # same seed -> same weights and data order on every rank, on any world size
    precision: str = "auto"  # auto: bf16 on a GPU, fp32 on CPU; fp16 adds a loss scaler
    # True: free each Block's unsharded parameters after forward, re-gather them in backward
    # (ZeRO-3); False: keep them until backward (ZeRO-2); k: keep a copy sharded over k ranks
    reshard_after_forward: bool | int = True
    hsdp_replicas: int = 1  # HSDP: replicate over this many groups of ranks, shard inside each
    cpu_offload: bool = False  # sharded parameters, gradients and AdamW state in host memory
    explicit_prefetch: bool = False  # each Block's all-gather issued one Block ahead
    micro_batches: int = 1  # gradient accumulation: micro-batches per optimizer step
    accumulation: str = "sync"  # sync: reduce-scatter every micro-batch; no_sync: the last only
    max_grad_norm: float = 0.0  # clip the total gradient norm to this (0: no clipping)
    compile: bool = False
    compile_backend: str = "inductor"
    backend: str = "auto"  # auto: nccl with a GPU for each local rank, else gloo
    timeout_s: float = 300.0


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


# --8<-- [start:train]
def train(cfg: FSDP2Config, observer=None) -> list[float]:
    """Train on this process's rank; returns the global batch's loss of each step (every rank)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        device, rank, world_size = world.device, world.rank, world.world_size
        use_cuda, parts = device.type == "cuda", world_size * cfg.micro_batches
        if cfg.global_batch_size % parts:
            lower = max(parts, cfg.global_batch_size - cfg.global_batch_size % parts)
            over = f" x {cfg.micro_batches} micro-batches" if cfg.micro_batches > 1 else ""
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across "
                f"{world_size} ranks{over}; use a multiple of {parts}, e.g. {lower} or "
                f"{lower + parts}"
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
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

        # --8<-- [start:loop]
        # On CPU from the seed, then sharded: every rank starts from exactly the same weights, and
        # each fully_shard call moves only its group to the device, keeping a 1/N shard of it.
        model = build_model(cfg.model, seed=cfg.seed, device="cpu")
        loss_fn = lm_loss
        if cfg.compile:  # compile, then shard: the sharding hooks stay outside the graphs
            apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
            loss_fn = torch.compile(lm_loss, backend=cfg.compile_backend)
        model = apply_fully_shard(
            model,
            mesh,
            block_types=(Block,),
            reshard_after_forward=reshard,
            # bf16/fp16: compute in it, reduce gradients in fp32 (a sum over many ranks in bf16
            # loses bits), keep fp32 sharded master weights. Never autocast on top of it.
            mp_policy=MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
            if low
            else None,
            # Pinned memory needs an accelerator: on a CPU-only world this only runs the code.
            offload_policy=CPUOffloadPolicy(pin_memory=use_cuda) if cfg.cpu_offload else None,
            explicit_prefetch=cfg.explicit_prefetch,
        )
        # After sharding: AdamW's state is created like the parameters, as DTensor shards (1/N
        # each). Fused on CUDA: foreach AdamW on DTensors pays DTensor dispatch for every op of
        # every parameter.
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)
        # Pitfall check: the plain amp GradScaler IS right here (classic FSDP needs its
        # ShardedGradScaler): DTensor reduces found_inf over the mesh, so an inf in one rank's
        # shard makes every rank skip the step (tests/test_fsdp2.py injects one).
        scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
        # at step s is one process's batch s (HSDP's replicas too: every rank is a data-parallel
        # rank). drop_last keeps every global batch full.
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, pin_memory=use_cuda
        )
        if rank == 0:
            print(
                f"fully_shard on mesh {tuple(mesh.shape)}, reshard_after_forward={reshard}, "
                f"{precision}, {cfg.micro_batches} x {cfg.global_batch_size // parts} "
                "sequences per rank",
                flush=True,
            )

        losses, step, epoch = [], 0, 0
        while step < cfg.steps:
            # Pitfall: without set_epoch every epoch repeats the first epoch's order
            sampler.set_epoch(epoch)
            for inputs, targets in loader:
                if step == cfg.steps:
                    break
                optimizer.zero_grad(set_to_none=True)
                step_loss = torch.zeros((), device=device)
                micro = list(
                    zip(
                        inputs.to(device, non_blocking=True).chunk(cfg.micro_batches),
                        targets.to(device, non_blocking=True).chunk(cfg.micro_batches),
                    )
                )
                for index, (x, y) in enumerate(micro):
                    # Pitfall: with sync off, each rank accumulates UNSHARDED gradients until the
                    # last micro-batch: N x the gradient memory that sharding saved.
                    model.set_requires_gradient_sync(
                        cfg.accumulation == "sync" or index == len(micro) - 1
                    )
                    loss = loss_fn(model(x), y) / cfg.micro_batches
                    (scaler.scale(loss) if scaler else loss).backward()
                    step_loss += loss.detach().float()
                if scaler:
                    scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                if cfg.max_grad_norm > 0:
                    # On DTensor gradients the norm is global (each rank's partial sum is
                    # all-reduced); it returns a DTensor: .full_tensor() is the number.
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                if scaler:
                    scaler.step(optimizer)  # skips optimizer.step() if any rank found an inf
                    scaler.update()
                else:
                    optimizer.step()
                # Pitfall: each rank's loss is its share of the batch: log the mean over ranks
                dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
                losses.append(step_loss.item())
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


def _reshard(text: str) -> bool | int:
    """true / false / a group size (the command line passes strings)."""
    word = text.strip().lower()
    if word in ("true", "false"):
        return word == "true"
    if word.isdigit() and int(word) >= 1:
        return int(word)
    raise argparse.ArgumentTypeError(
        f"reshard_after_forward={text!r}: use true, false, or a "
        "group size that divides the shard dim, e.g. 2"
    )


def _backend(text: str) -> str:
    if text == "nccl" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            "backend 'nccl' needs one CUDA device per local rank and this machine has none; "
            "use --backend gloo"
        )
    return text


def make_parser() -> argparse.ArgumentParser:
    defaults = FSDP2Config()
    parser = argparse.ArgumentParser(
        prog="python -m recipes.fsdp2",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
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
        "off); tf32: TF32 matmuls (CUDA); bf16/fp16: MixedPrecisionPolicy (fp16 with a scaler)",
    )
    add(
        "--reshard-after-forward",
        type=_reshard,
        default=defaults.reshard_after_forward,
        help="true: free the unsharded Block parameters after forward, re-gather in backward "
        "(ZeRO-3); false: keep them until backward (ZeRO-2); k: keep a copy sharded over groups "
        "of k ranks",
    )
    add(
        "--hsdp-replicas",
        type=_number(int, at_least=1),
        default=defaults.hsdp_replicas,
        help="HSDP: replicate over this many groups, shard inside each (mesh replicate x shard)",
    )
    add(
        "--cpu-offload",
        action=argparse.BooleanOptionalAction,
        default=defaults.cpu_offload,
        help="keep sharded parameters, gradients and AdamW state in host memory",
    )
    add(
        "--explicit-prefetch",
        action=argparse.BooleanOptionalAction,
        default=defaults.explicit_prefetch,
        help="issue each Block's all-gather one Block ahead, in forward and backward",
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
        help="sync: reduce-scatter every micro-batch (gradients stay sharded); no_sync: "
        "set_requires_gradient_sync(False) until the last one (unsharded gradients: N x the "
        "memory)",
    )
    add(
        "--max-grad-norm",
        type=_number(float, at_least=0),
        default=defaults.max_grad_norm,
        help="clip the total gradient norm with torch.nn.utils.clip_grad_norm_ (0: off)",
    )
    add(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=defaults.compile,
        help="torch.compile each transformer block (and the loss) before sharding",
    )
    add(
        "--compile-backend",
        choices=["inductor", "aot_eager", "eager"],
        default=defaults.compile_backend,
        help="torch.compile's backend; inductor is the fast one",
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
    cfg = FSDP2Config(**vars(make_parser().parse_args(argv)))
    try:
        train(cfg)
    except ValueError as exc:  # bad input every rank sees (a mesh or batch that does not divide)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
