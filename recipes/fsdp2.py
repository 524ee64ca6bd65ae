"""FSDP2 (``fully_shard``): per-parameter sharding as DTensors on a DeviceMesh, equal to DDP.

    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp2
    torchrun --standalone --nproc_per_node=2 -m recipes.fsdp2 --precision bf16 --explicit-prefetch
    torchrun --standalone --nproc_per_node=4 -m recipes.fsdp2 --hsdp-replicas 2   # HSDP: 2 x 2

Every parameter becomes a DTensor sharded on dim 0 over the mesh's "shard" dim; each Block is one
communication group (one all-gather before its forward and backward, one reduce-scatter after its
backward), then the root takes what is left (embeddings, final norm, output). Per-rank bytes are 1/N
of DDP's, like classic FULL_SHARD (asserted by tests/test_memory.py); training equals DDP's.

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

The model is built on CPU from the seed, then sharded: every rank starts from exactly the reference
weights (so the parity tests are exact), and each ``fully_shard`` call moves only its group to the
device and keeps a 1/N shard of it. A model too big for one host's memory is built under
``torch.device("meta")`` instead, sharded, then materialised with ``model.to_empty(device=...)`` and
initialised or loaded from a sharded checkpoint (recipes/sharded_checkpoint.py).

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

from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from recipes.core.cli import run_cli
from recipes.core.config import (CompileOption, RecipeError, TrainConfig, check_step_reached,
                                 opt, per_rank_batch_size)
from recipes.core.log import get_logger
from recipes.core.memory import inject_inf_gradient, measure_last_forward
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import full_state_on_rank0, mean_over_ranks, sharded_run_extras
from recipes.core.speed import (apply_compile, compile_loss, low_precision_dtype, make_adamw,
                                 setup_precision, step_with_scaler)
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
from recipes.parallelize import ShardingError, apply_fully_shard  # noqa: F401  (re-exported)

log = get_logger(__name__)


def parse_reshard_after_forward(value: str) -> bool | int:
    """"true" / "false" / an integer group size (the command line passes strings)."""
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return text == "true"
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise RecipeError(f"reshard_after_forward={value!r}: use true, false, or a group size that "
                      "divides the shard dim, e.g. 2")


@dataclass
class FSDP2Config(CompileOption, TrainConfig):
    reshard_after_forward: str = opt(
        "true", "true = free the unsharded Block parameters after forward, re-gather in backward "
        "(ZeRO-3); false = keep them until backward (ZeRO-2); k = keep a copy sharded over "
        "groups of k ranks")
    hsdp_replicas: int = opt(1, "HSDP: replicate over this many groups, shard inside each (mesh "
                                "replicate x shard)", ge=1)
    cpu_offload: bool = opt(
        False, "keep sharded parameters, gradients and AdamW state in host memory")
    explicit_prefetch: bool = opt(
        False, "issue each Block's all-gather one Block ahead, in forward and backward")
    micro_batches: int = opt(1, "gradient accumulation: micro-batches per optimizer step", ge=1)
    accumulation: Literal["sync", "no_sync"] = opt(
        "sync", "sync = reduce-scatter every micro-batch (gradients stay sharded); "
        "no_sync = set_requires_gradient_sync(False) until the last one (unsharded gradients: "
        "N x the memory)")
    max_grad_norm: float = opt(
        0.0, "clip the total gradient norm with torch.nn.utils.clip_grad_norm_ (0 = off)", ge=0)
    inject_inf_step: int = opt(
        -1, "pitfall demo (fp16): at this step one rank puts an inf into its gradient shard; "
        "-1 = never", ge=-1)
    inject_inf_rank: int = opt(1, "the rank that injects the inf (see --inject-inf-step)", ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_reshard_after_forward(self.reshard_after_forward)
        if self.inject_inf_step >= 0:
            check_step_reached("inject_inf_step", self.inject_inf_step, self.steps)


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16/fp16: compute in that dtype, reduce gradients in fp32 (a sum over many ranks in bf16
    loses bits); fp32/tf32: the default policy (everything in the parameters' fp32)."""
    low = low_precision_dtype(precision)
    if low is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)


def data_parallel_mesh(world, hsdp_replicas: int) -> DeviceMesh:
    if world.world_size % hsdp_replicas:
        raise RecipeError(f"hsdp_replicas={hsdp_replicas} does not divide world size "
                          f"{world.world_size}; pick a divisor of {world.world_size}")
    if hsdp_replicas == 1:
        return init_device_mesh(world.device.type, (world.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(world.device.type, (hsdp_replicas, world.world_size // hsdp_replicas),
                            mesh_dim_names=("replicate", "shard"))


# --8<-- [start:train]
def train(cfg: FSDP2Config) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        per_rank_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size,
                                             cfg.micro_batches)
        if cfg.inject_inf_step >= 0 and cfg.inject_inf_rank >= world.world_size:  # never injected
            raise RecipeError(f"inject_inf_rank={cfg.inject_inf_rank} is not a rank of this world "
                              f"of {world.world_size}; use 0 to {world.world_size - 1}")
        mesh = data_parallel_mesh(world, cfg.hsdp_replicas)
        shard_size = mesh.size(mesh.ndim - 1)
        reshard = parse_reshard_after_forward(cfg.reshard_after_forward)
        if not isinstance(reshard, bool) and shard_size % reshard:
            raise RecipeError(f"reshard_after_forward={reshard} does not divide the shard group "
                              f"size {shard_size}; use true, false or a divisor of {shard_size}")
        precision = setup_precision(cfg.precision, world.device)
        model = build_model(cfg.model, seed=cfg.seed, device="cpu")  # fully_shard moves each shard
        if cfg.compile:  # compile, then shard: the sharding hooks stay outside the compiled graphs
            apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
        loss_fn = compile_loss(lm_loss, backend=cfg.compile_backend) if cfg.compile else lm_loss
        # Pinned memory needs an accelerator: on a CPU-only world the offload only runs the code.
        offload = (
            CPUOffloadPolicy(pin_memory=world.device.type != "cpu") if cfg.cpu_offload else None
        )
        model = apply_fully_shard(
            model,
            mesh,
            block_types=(Block,),
            reshard_after_forward=reshard,
            mp_policy=mixed_precision_policy(precision),
            offload_policy=offload,
            explicit_prefetch=cfg.explicit_prefetch,
        )
        # After sharding: AdamW's state is created like the parameters, as DTensor shards (1/N
        # each). Fused on CUDA: foreach AdamW on DTensors pays DTensor dispatch for every op of
        # every parameter.
        optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=world.device)
        # Pitfall check: the plain amp GradScaler IS right here. DTensor reduces its found_inf over
        # the mesh, so an inf in one rank's shard makes every rank skip (tests/test_fsdp2.py injects
        # one).
        scaler = torch.amp.GradScaler(world.device.type) if precision == "fp16" else None
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=world.rank, world_size=world.world_size,
                                             per_rank_batch_size=per_rank_batch * cfg.micro_batches,
                                             seed=cfg.seed)
        log.info("fully_shard on mesh %s, reshard_after_forward=%s, %s, %d x %d sequences per rank",
                 tuple(mesh.shape), reshard, precision, cfg.micro_batches, per_rank_batch)

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
                    # Pitfall: with sync off, each rank accumulates UNSHARDED gradients until the
                    # last micro-batch: N x the gradient memory that sharding saved.
                    model.set_requires_gradient_sync(syncing)
                    loss = loss_fn(model(x), y) / cfg.micro_batches
                    (scaler.scale(loss) if scaler else loss).backward()
                    step_loss += loss.detach().float()
                if step == cfg.inject_inf_step and world.rank == cfg.inject_inf_rank:
                    inject_inf_gradient(model)  # an fp16 overflow in one rank's shard
                if scaler:
                    # Clip (and report) the true gradients, not the scaled ones.
                    scaler.unscale_(optimizer)
                if cfg.max_grad_norm > 0:
                    # On DTensor gradients the norm is global: each rank's partial sum is
                    # all-reduced.
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    grad_norms.append(
                        float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
                if step_with_scaler(optimizer, scaler):  # skipped: an inf/nan gradient
                    skipped_steps.append(step)
            losses.append(mean_over_ranks(step_loss))
            log.info("step %d loss %.4f time %.1f ms", step, losses[-1], timer.durations[-1] * 1e3)

        # After step, before zero_grad: gradients present. Every rank measures its own bytes.
        extras.update(sharded_run_extras(model, optimizer, grad_norms=grad_norms, scaler=scaler,
                                         skipped_steps=skipped_steps))
        full_state, checksum = full_state_on_rank0(model)  # every rank calls it: it all-gathers
        return make_result(  # the checksum is on every rank; the full state on rank 0 only
            "fsdp2", world, losses, checksum, timer,
            keep_final_state=full_state if cfg.keep_final_state and world.is_main else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            **extras)
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, FSDP2Config, __doc__)
