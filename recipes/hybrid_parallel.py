"""Hybrid parallelism on a DeviceMesh: fully_shard x tensor parallel (2-D), and x pipeline (3-D).

    torchrun --standalone --nproc_per_node=4 -m recipes.hybrid_parallel          # dp 2, tp 2
    torchrun --standalone --nproc_per_node=8 -m recipes.hybrid_parallel --pp 2   # pp, dp, tp 2
    torchrun --standalone --nproc_per_node=4 -m recipes.hybrid_parallel --sequence-parallel

Copy with it: recipes/toy.py, recipes/dist_setup.py, recipes/parallelize.py (``apply_tp_and_fsdp``
with the ``apply_tp`` and ``apply_fully_shard`` it composes, ``transformer_lm_plan``,
``rank_grid``), recipes/options.py (the command line, from the config).

The world is one mesh; each parallelism takes one named dimension of it, from the outside in:

- ``pp`` (3-D only, outermost): pipeline stages (torch.distributed.pipelining, as in
  recipes/pipeline_parallel.py), point-to-point between stage neighbours: the least traffic, so
  it may cross the slowest links (between nodes);
- ``dp``: ``fully_shard``: each data-parallel rank reads its own share of the batch, parameters
  are sharded across the dp ranks and all-gathered per block;
- ``tp`` (innermost: consecutive ranks, i.e. one node's NVLink): tensor parallel, collectives
  inside every layer.

With 8 ranks as pp 2 x dp 2 x tp 2, rank 5 is stage 1, data shard 0, tensor slice 1. Rank 0 prints
the rank layout as a grid (recipes/process_groups.py explains how mesh dims map to process
groups). The groups each piece uses are taken from the mesh: ``mesh["tp"]`` for TP, ``mesh["dp"]``
for fully_shard, ``mesh["pp"].get_group()`` for the pipeline's send/recv,
``mesh["dp"].get_group()`` for the loss average.

Order matters: tensor parallel first, then fully_shard (it shards the TP DTensors again along dp,
giving 2-D DTensors), then the optimizer; a pipeline stage is cut before both. Losses and weights
equal single-process training (tests/test_hybrid_parallel.py). Runs on gloo/CPU (checked with torch
2.13). ``train`` returns a ``HybridRun``: the global batch's loss of each step and the layout it
ran on (the mesh's dims, its rank grid, this rank's group along each dim).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, resolve_precision, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.parallelize import (
    apply_tp_and_fsdp,
    check_tp_fits,
    matching_modules,
    rank_grid,
    transformer_lm_plan,
)
from recipes.toy import MODEL_PRESETS, Block, build_model, lm_loss, make_dataset

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # one stage per pipeline rank


@dataclass
class HybridConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, split over the data-parallel ranks", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any layout
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 on a GPU, fp32 on CPU; fp32: exact (TF32 off); tf32: TF32 matmuls (CUDA); "
        "bf16/fp16: fully_shard's MixedPrecisionPolicy",
        choices=["auto", "fp32", "tf32", "bf16", "fp16"],
    )
    tp: int = option(2, "tensor-parallel size (innermost mesh dim)", at_least=1)
    pp: int = option(
        1,
        "pipeline stages, one per pp rank (outermost mesh dim); 1 = the 2-D dp x tp mesh",
        at_least=1,
    )
    sequence_parallel: bool = option(
        False, "tensor parallel with the sequence split between blocks (see tensor_parallel)"
    )
    schedule: str = option("1f1b", "pipeline schedule when pp > 1", choices=sorted(SCHEDULES))
    microbatches: int = option(
        2, "pipeline micro-batches per optimizer step, per data-parallel rank (pp > 1)", at_least=1
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        model_cfg = MODEL_PRESETS[self.model]
        # Every dimension the plan splits must divide by the tensor-parallel size.
        check_tp_fits(
            self.tp,
            n_heads=model_cfg.n_heads,
            mlp_width=model_cfg.mlp_ratio * model_cfg.dim,
            vocab_size=model_cfg.vocab_size,
            seq_len=model_cfg.seq_len,
        )
        if self.pp > 1 and model_cfg.n_layers < self.pp:
            raise ValueError(
                f"{model_cfg.n_layers} blocks cannot fill {self.pp} pipeline stages; "
                f"use --pp {model_cfg.n_layers} or fewer, or a bigger --model"
            )
        if self.pp > 1 and self.schedule == "1f1b" and self.microbatches < self.pp:
            raise ValueError(
                f"1f1b needs at least one micro-batch per stage: microbatches="
                f"{self.microbatches} < {self.pp} stages; use --microbatches {self.pp}"
            )


@dataclass
class HybridRun:
    losses: list[float]  # the global batch's loss of each step, the same on every rank
    mesh_dim_names: list[str]
    mesh_shape: list[int]
    rank_grid: list  # the global ranks laid out on the mesh (nested lists)
    groups_of_this_rank: dict[str, list[int]]  # dim -> the ranks of this rank's group along it


def build_mesh(world, *, pp: int, tp: int) -> DeviceMesh:
    """("dp", "tp"), or ("pp", "dp", "tp") when pp > 1; dp is what is left of the world."""
    if world.world_size % (pp * tp):
        raise ValueError(
            f"pp={pp} x tp={tp} does not divide the world size {world.world_size}; "
            f"run on a multiple of {pp * tp} ranks"
        )
    dp = world.world_size // (pp * tp)
    if pp == 1:
        return init_device_mesh(world.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(world.device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def plan_for_stage(stage: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """A pipeline stage holds some of the model's modules: the plan entries for the ones it has."""
    return {key: style for key, style in plan.items() if matching_modules(stage, key)}


# --8<-- [start:pipeline]
def cut_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """Keep this stage's part of the model, in place: an even share of the blocks (earlier stages
    take the rest), the embeddings on the first stage, the final norm and the head on the last.
    The model's forward skips what is None, and the names stay the model's (torchtitan cuts so)."""
    names = list(model.layers.keys())
    base, extra = divmod(len(names), num_stages)
    start = stage * base + min(stage, extra)
    for name in names[:start] + names[start + base + (stage < extra) :]:
        del model.layers[name]
    if stage > 0:
        model.tok_embeddings = model.pos_embeddings = None
    if stage < num_stages - 1:
        model.norm = model.output = None
    return model


def build_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    plan: Mapping[str, ParallelStyle],
    schedule: str,
    microbatches: int,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy | None = None,
):
    """(this pp rank's PipelineStage, its schedule): cut, then TP x fully_shard on the stage's own
    dp x tp sub-mesh. send/recv run on mesh["pp"]: the ranks with the same dp and tp coordinates."""
    stage_index, num_stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    module = cut_stage(model, stage_index, num_stages).to(device)
    module = apply_tp_and_fsdp(
        module,
        mesh,
        plan=plan_for_stage(module, plan),
        block_types=(Block,),
        in_pipeline=True,
        mp_policy=mp_policy,
    )
    stage = PipelineStage(module, stage_index, num_stages, device, group=mesh["pp"].get_group())
    # The loss per micro-batch on the last stage; scale_grads (the default) divides the summed
    # gradients by the micro-batch count: the whole batch's gradient.
    return stage, SCHEDULES[schedule](stage, n_microbatches=microbatches, loss_fn=lm_loss)


def pipeline_step(
    schedule,
    stage: PipelineStage,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    loss_holders: int,
) -> float:
    """One forward/backward over every micro-batch; the batch's mean loss on EVERY rank: the last
    stage's ranks hold their dp share's loss, a SUM over the world (the others add 0) divided by
    ``loss_holders`` (dp x tp ranks hold a last stage) shares it."""
    # Pitfall: a stage checks each micro-batch's strides against the ones it expects: a
    # non-contiguous batch (tokens[:, :-1]) fails with a stride mismatch.
    inputs, targets = inputs.contiguous(), targets.contiguous()
    microbatch_losses: list[torch.Tensor] = []
    if stage.is_first:
        schedule.step(inputs)
    elif stage.is_last:
        schedule.step(target=targets, losses=microbatch_losses)
    else:
        schedule.step()
    loss = (
        (
            torch.stack(microbatch_losses).mean().detach()
            if stage.is_last
            else torch.zeros((), device=inputs.device)
        )
        .reshape(1)
        .float()
        .clone()
    )
    dist.all_reduce(loss)
    return float(loss.item()) / loss_holders


# --8<-- [end:pipeline]


# --8<-- [start:train]
def train(cfg: HybridConfig, observer=None) -> HybridRun:
    """Train on this process's rank: TP x fully_shard (x pipeline) on one mesh (see the module)."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        device = world.device
        rank, use_cuda = world.rank, world.device.type == "cuda"
        mesh = build_mesh(world, pp=cfg.pp, tp=cfg.tp)
        dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        microbatches = cfg.microbatches if cfg.pp > 1 else 1
        if cfg.global_batch_size % (dp_size * microbatches):
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide into "
                f"{dp_size} dp ranks x {microbatches} micro-batches; use a multiple "
                f"of {dp_size * microbatches}"
            )
        per_dp_rank_batch = cfg.global_batch_size // dp_size
        low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            resolve_precision(cfg.precision, device)
        )
        # bf16/fp16: fully_shard's own policy (low-precision compute, fp32 reduction), no autocast.
        mp_policy = (
            MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32) if low else None
        )
        plan = transformer_lm_plan(sequence_parallel=cfg.sequence_parallel)
        groups = {
            dim: dist.get_process_group_ranks(mesh[dim].get_group()) for dim in mesh.mesh_dim_names
        }
        if rank == 0:
            print(rank_grid(mesh), flush=True)

        # --8<-- [start:loop]
        # Same seed everywhere: each rank builds the whole model, then keeps its part of it.
        model = build_model(cfg.model, seed=cfg.seed, device=device if cfg.pp == 1 else "cpu")
        if cfg.pp == 1:  # tensor parallel over mesh["tp"], then fully_shard over mesh["dp"]
            model = apply_tp_and_fsdp(
                model, mesh, plan=plan, block_types=(Block,), mp_policy=mp_policy
            )
        else:
            stage, schedule = build_pipeline(
                model,
                mesh,
                plan=plan,
                schedule=cfg.schedule,
                microbatches=cfg.microbatches,
                device=device,
                mp_policy=mp_policy,
            )
            model = stage.submod
        # After the split: AdamW's state is made like the parameters, as 2-D DTensor shards.
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)

        # Data: one share per dp coordinate. Ranks that differ only in tp (or pp) read the same
        # samples: a sampler over the WHOLE world would give each TP rank a different batch.
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        sampler = DistributedSampler(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset,
            batch_size=per_dp_rank_batch,
            sampler=sampler,
            drop_last=True,
            pin_memory=use_cuda,
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
                with warnings.catch_warnings():
                    # fully_shard warns when a module returns a view: here TP's local view of
                    # the all-gathered activations, which nothing modifies in place.
                    warnings.filterwarnings(
                        "ignore", message=r"FSDP2-wrapped module .* returned a view"
                    )
                    if cfg.pp == 1:
                        loss = lm_loss(model(inputs), targets)
                        loss.backward()  # fully_shard reduce-scatters (averages) over mesh["dp"]
                        loss = loss.detach().reshape(1).clone()
                        dist.all_reduce(loss, group=mesh["dp"].get_group())  # mean over dp
                        loss = float(loss.item()) / dp_size
                    else:
                        loss = pipeline_step(
                            schedule, stage, inputs, targets, loss_holders=dp_size * cfg.tp
                        )
                optimizer.step()
                losses.append(loss)
                if rank == 0:
                    print(f"step {step} loss {loss:.4f}", flush=True)
                if observer:
                    observer.step_end(step, loss)
                step += 1
            epoch += 1
        # --8<-- [end:loop]
        return HybridRun(
            losses, list(mesh.mesh_dim_names), list(mesh.mesh.shape), mesh.mesh.tolist(), groups
        )
    finally:
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(HybridConfig, prog="python -m recipes.hybrid_parallel", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), HybridConfig, argv)
    with exit_on_bad_input():  # bad input every rank sees: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
