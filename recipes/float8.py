"""Float8 training: torchao's float8 linears, with FSDP2 all-gathering the weights in float8.

    torchrun --standalone --nproc_per_node=1 -m recipes.float8
    torchrun --standalone --nproc_per_node=8 -m recipes.float8 --model 100m --steps 20 --compile

Needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell: float8 tensor
cores) and torchao (``pip install -e ".[float8]"``). Anywhere else it refuses in one line
(exit 2) and its tests skip with that line as the reason.

Measured on one H200 (torch 2.11, torchao 0.18, the 100m preset, a world of 1, ``--compile``, 20
steps, results/float8.json): float8 ran at 0.57x bf16's tokens/s, its losses within 0.5% of
bf16's. At this width (768) the per-tensor scaling costs more than the float8 matmuls save;
float8 pays off on wide layers (thousands of features), as torchao's own tables show. Without
``--compile`` it ran at 0.33x: the scaling must be fused.

What changes against the bf16 fully_shard recipe (recipes/fsdp2.py), in this order:

1. ``convert_to_float8_training`` swaps each eligible ``nn.Linear`` for torchao's ``Float8Linear``:
   its matmuls cast inputs, weights and output gradients to float8 (e4m3 forward, e5m2 for
   gradients) with one dynamic per-tensor scale each, and run on the float8 tensor cores.
   Before compile and before fully_shard, as torchtitan does (the swap changes the modules that
   fully_shard groups and compile traces). Skipped: the output head (its logits feed the loss
   directly, where float8's 3 mantissa bits hurt most; torchtitan skips it too) and any linear
   whose dimensions are not multiples of 16 (the float8 GEMM's alignment).
2. ``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``: fully_shard casts each weight
   shard to float8 *before* the all-gather, so the all-gather moves 1 byte a parameter instead of
   2 (bf16). Every rank must then cast its shard with the same scale, the whole weight's amax,
   not its own shard's: step 3 computes it.
3. ``precompute_float8_dynamic_scale_for_fsdp(model)`` after each optimizer step computes every
   float8 weight's scale (its amax over all shards) in one all-reduce for the whole model,
   instead of one small all-reduce per weight inside the next forward.

The same model, data and seed are then trained in bf16 (fully_shard's bf16 MixedPrecisionPolicy)
in the same world; the result reports both tokens/s and the loss of every step of both.
Loss tolerance: float8 is not bitwise bf16, so the per-step losses are compared with a relative
tolerance (``--loss-rtol``, 5% by default). Why 5%: e4m3 rounds each element with a relative
error of up to 2**-4 (6.25%), but a matmul output sums K such products, whose independent
rounding errors mostly cancel; torchao's and torchtitan's published loss curves for tensorwise
float8 overlay bf16's within run-to-run noise. 5% is loose enough for those few-percent
differences early in training and tight enough to catch a broken scale (which diverges or
stalls the loss by far more). It is a chosen bound, not a measured one.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from recipes.core.cli import run_cli
from recipes.core.config import CompileOption, RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import mean_over_ranks
from recipes.core.speed import apply_compile, make_adamw, setup_precision
from recipes.core.throughput import Workload
from recipes.core.workload import (MODEL_PRESETS, Block, build_model, distributed_loader,
                                   iterate_steps, lm_loss, make_dataset)
from recipes.core.world import join_world

log = get_logger(__name__)

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later
MIN_TORCHAO = (0, 10)


@dataclass
class Float8Config(CompileOption, TrainConfig):
    # 100m: dims that are multiples of 16 (the tiny preset's 32-wide linears are too small for
    # float8 to pay off, and a speed comparison on them would measure launch overhead).
    model: Literal["tiny", "small", "100m"] = opt(
        "100m", "model size preset (see recipes.core.workload.MODEL_PRESETS)")
    steps: int = opt(10, "optimizer steps of each run (bf16, then float8)", ge=2)
    global_batch_size: int = opt(16, "sequences per optimizer step, summed over all ranks", ge=1)
    loss_rtol: float = opt(0.05, "float8 loss must be within this fraction of bf16's, each step",
                           gt=0)


def float8_unavailable() -> str | None:
    """None where float8 training can run, else the one line that says why not and what to do."""
    if not torch.cuda.is_available():
        return ("float8 training needs a CUDA GPU of compute capability >= 8.9 (Ada/Hopper); "
                "this machine has none")
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return (f"float8 training needs compute capability >= 8.9; "
                f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}")
    if importlib.util.find_spec("torchao") is None:
        return 'float8 training needs torchao: pip install -e ".[float8]"'
    version = importlib.metadata.version("torchao")
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < MIN_TORCHAO:
        return f'torchao {version} is too old for this recipe: pip install -e ".[float8]"'
    return None


# --8<-- [start:convert]
def float8_filter(module: nn.Module, fqn: str) -> bool:
    """Which linears become float8: not the output head, only dimensions divisible by 16."""
    if fqn == "output" or fqn.endswith(".output"):
        return False
    if isinstance(module, nn.Linear):
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return True


def apply_float8(model: nn.Module) -> nn.Module:
    """Swap eligible linears for Float8Linear, with float8 all-gather under fully_shard.
    Call before compile and before fully_shard."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=float8_filter)
# --8<-- [end:convert]


# --8<-- [start:run_one]
def run_one(cfg: Float8Config, world, mesh, *, float8: bool) -> tuple[list[float], StepTimer, int]:
    """Train cfg.steps in bf16 (float8=False) or float8: losses, timer, float8 linears."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from recipes.parallelize import apply_fully_shard

    model = build_model(cfg.model, seed=cfg.seed, device="cpu")
    if float8:
        apply_float8(model)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if cfg.compile:
        apply_compile(model, block_types=(Block,), backend=cfg.compile_backend)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = apply_fully_shard(model, mesh, block_types=(Block,), mp_policy=policy)
    optimizer = make_adamw(model.parameters(), lr=cfg.lr, device=world.device)
    if float8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    per_rank = per_rank_batch_size(cfg.global_batch_size, world.world_size)
    loader, sampler = distributed_loader(
        make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed), rank=world.rank,
        world_size=world.world_size, per_rank_batch_size=per_rank, seed=cfg.seed)
    losses, timer = [], StepTimer(world.device)
    for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
        with timer:
            optimizer.zero_grad(set_to_none=True)
            loss = lm_loss(model(inputs.to(world.device)), targets.to(world.device))
            loss.backward()
            optimizer.step()
            if float8:  # one all-reduce of every weight's amax, ready for the next all-gather
                precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(mean_over_ranks(loss))
        log.info("%s step %d loss %.4f time %.1f ms", "float8" if float8 else "bf16", step,
                 losses[-1], timer.durations[-1] * 1e3)
    return losses, timer, converted
# --8<-- [end:run_one]


def train(cfg: Float8Config) -> RecipeResult:
    reason = float8_unavailable()
    if reason:
        raise RecipeError(reason)
    from torch.distributed.device_mesh import init_device_mesh

    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        if world.device.type != "cuda":
            raise RecipeError("float8 training runs on nccl ranks, one GPU each; use "
                              "--backend nccl (or auto) under torchrun")
        setup_precision("bf16", world.device)
        mesh = init_device_mesh("cuda", (world.world_size,), mesh_dim_names=("shard",))
        bf16_losses, bf16_timer, _ = run_one(cfg, world, mesh, float8=False)
        f8_losses, f8_timer, converted = run_one(cfg, world, mesh, float8=True)
        # Both against the bf16 peak: float8 changes how fast the same model FLOPs run.
        workload = Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, "bf16")
        devices = world.world_size
        bf16_speed = workload.measure(bf16_timer.seconds_per_step, world.device, devices)
        rel_diffs = [abs(a - b) / abs(b) for a, b in zip(f8_losses, bf16_losses)]
        result = make_result(
            "float8", world, f8_losses, [], f8_timer, workload=workload,
            bf16_losses=bf16_losses, bf16_tokens_per_second=bf16_speed["tokens_per_second"],
            float8_linears=converted, max_loss_rel_diff=max(rel_diffs), loss_rtol=cfg.loss_rtol,
            loss_within_tolerance=max(rel_diffs) <= cfg.loss_rtol)
        result.precision = "float8"
        result.extras["speedup_vs_bf16"] = (bf16_timer.seconds_per_step
                                            / f8_timer.seconds_per_step)
        return result


if __name__ == "__main__":
    run_cli(train, Float8Config, __doc__)
