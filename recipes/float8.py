"""Float8 training: torchao's float8 linears, with FSDP2 all-gathering the weights in float8.

    torchrun --standalone --nproc_per_node=1 -m recipes.float8
    torchrun --standalone --nproc_per_node=8 -m recipes.float8 --model 100m --steps 20 --compile

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (join and
leave the world), recipes/parallelize.py (``apply_fully_shard``, the part that shards),
recipes/options.py (the command line, from the config).

Needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell: float8 tensor
cores) and torchao (``pip install -e ".[float8]"``). Anywhere else it refuses in one line
(exit 2) and its tests skip with that line as the reason: this file's GPU path is exercised on
such a GPU only.

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

The same model, data and seed are trained in bf16 (fully_shard's bf16 MixedPrecisionPolicy), then
in float8, in the same world: ``train`` returns a ``Float8Run``, the float8 run's losses with the
bf16 run's beside them and how far apart they are. The harness (``python -m recipes.core.prove
float8``) times both runs from outside and reports both tokens/s.
Loss tolerance: float8 is not bitwise bf16, so the per-step losses are compared with a relative
tolerance (``--loss-rtol``, 5% by default). Why 5%: e4m3 rounds each element with a relative
error of up to 2**-4 (6.25%), but a matmul output sums K such products, whose independent
rounding errors mostly cancel; torchao's and torchtitan's published loss curves for tensorwise
float8 overlay bf16's within run-to-run noise. 5% is loose enough for those few-percent
differences early in training and tight enough to catch a broken scale (which diverges or
stalls the loss by far more). It is a chosen bound, not a measured one.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import DistInfo, cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import apply_fully_shard
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and later
MIN_TORCHAO = (0, 10)


@dataclass
class Float8Config:
    # 100m: dims that are multiples of 16 (the tiny preset's 32-wide linears are too small for
    # float8 to pay off, and a speed comparison on them would measure launch overhead).
    model: str = option("100m", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(10, "optimizer steps of each run (bf16, then float8)", at_least=2)
    global_batch_size: int = option(
        16, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order in both runs, on every rank
    seed: int = option(0, "model init and data order, the same in both runs", at_least=0)
    loss_rtol: float = option(
        0.05, "float8 loss must be within this fraction of bf16's, each step", above=0
    )
    compile: bool = option(
        False, "torch.compile each transformer block before sharding (fuses float8's scaling)"
    )
    compile_backend: str = option(
        "inductor", "torch.compile's backend", choices=["inductor", "aot_eager", "eager"]
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank (float8 needs nccl)",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each


@dataclass
class Float8Run:
    """What ``train`` returns: the float8 run's losses, and the bf16 run's beside them."""

    losses: list[float]  # float8's, one a step
    bf16_losses: list[float]
    float8_linears: int  # how many nn.Linear the swap converted
    max_loss_rel_diff: float  # the largest |float8 - bf16| / bf16 over the steps
    loss_rtol: float
    loss_within_tolerance: bool


class Float8UnavailableError(ValueError):
    """float8 training cannot run here (no GPU with float8 tensor cores, or no torchao)."""


def float8_unavailable() -> str | None:
    """None where float8 training can run, else the one line that says why not and what to do."""
    if not torch.cuda.is_available():
        return (
            "float8 training needs a CUDA GPU of compute capability >= 8.9 (Ada/Hopper); "
            "this machine has none"
        )
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        return (
            f"float8 training needs compute capability >= 8.9; "
            f"{torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}"
        )
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
def run_one(
    cfg: Float8Config, world: DistInfo, mesh: DeviceMesh, *, float8: bool, observer=None
) -> tuple[list[float], int]:
    """Train cfg.steps in bf16 (float8=False) or float8: the losses, and the float8 linears."""
    rank, world_size, device = world.rank, world.world_size, world.device
    per_rank_batch = cfg.global_batch_size // world_size
    label = "float8" if float8 else "bf16"

    # --8<-- [start:loop]
    model = build_model(cfg.model, seed=cfg.seed, device="cpu")
    if float8:  # before compile and before fully_shard: both see the Float8Linear modules
        apply_float8(model)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    if cfg.compile:  # each block's forward, before sharding: the hooks stay out of the graphs
        for block in [m for m in model.modules() if isinstance(m, Block)]:
            block.forward = torch.compile(block.forward, backend=cfg.compile_backend)
    # bf16 compute and fp32 gradient reduction in both runs: float8 changes the matmuls only
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = apply_fully_shard(model, mesh, block_types=(Block,), mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)  # one kernel
    if observer:
        observer.model_ready(model, optimizer)
    if float8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
    # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
    # at step s is one process's batch s. drop_last keeps every global batch full.
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
    )
    loader = DataLoader(
        dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, pin_memory=True
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
            loss = lm_loss(model(inputs), targets)  # this rank's sequences' mean
            loss.backward()
            optimizer.step()
            if float8:  # one all-reduce of every weight's amax, ready for the next all-gather
                precompute_float8_dynamic_scale_for_fsdp(model)
            # Pitfall: rank 0's loss alone is its share of the batch (a half on 2 ranks)
            global_loss = loss.detach().float().clone()
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
            losses.append(global_loss.item())
            if rank == 0:
                print(f"{label} step {step} loss {losses[-1]:.4f}", flush=True)
            if observer:
                observer.step_end(step, losses[-1])
            step += 1
        epoch += 1
    # --8<-- [end:loop]
    return losses, converted


# --8<-- [end:run_one]


# --8<-- [start:train]
def train(cfg: Float8Config, observer=None) -> Float8Run:
    """bf16, then float8, on the same model, data and seed, in one world (every rank)."""
    reason = float8_unavailable()
    if reason:  # before joining: every rank refuses alike, in one line
        raise Float8UnavailableError(reason)
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)  # torchrun's, or a world of 1
    try:
        if world.device.type != "cuda":
            raise ValueError(
                "float8 training runs on nccl ranks, one GPU each; use "
                "--backend nccl (or auto) under torchrun"
            )
        if cfg.global_batch_size % world.world_size:
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across "
                f"{world.world_size} ranks; use a multiple of {world.world_size}"
            )
        # bf16 is the baseline: no TF32 for what stays fp32 (a process-wide switch)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        mesh = init_device_mesh("cuda", (world.world_size,), mesh_dim_names=("shard",))
        bf16_losses, _ = run_one(cfg, world, mesh, float8=False, observer=observer)
        f8_losses, converted = run_one(cfg, world, mesh, float8=True, observer=observer)
        rel_diffs = [abs(a - b) / abs(b) for a, b in zip(f8_losses, bf16_losses)]
        return Float8Run(
            losses=f8_losses,
            bf16_losses=bf16_losses,
            float8_linears=converted,
            max_loss_rel_diff=max(rel_diffs),
            loss_rtol=cfg.loss_rtol,
            loss_within_tolerance=max(rel_diffs) <= cfg.loss_rtol,
        )
    finally:
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(Float8Config, prog="python -m recipes.float8", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), Float8Config, argv)
    with exit_on_bad_input():  # bad input every rank sees: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
