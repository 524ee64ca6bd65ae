"""Hybrid parallelism on a DeviceMesh: fully_shard x tensor parallel (2-D), and x pipeline (3-D).

    torchrun --standalone --nproc_per_node=4 -m recipes.hybrid_parallel          # dp 2, tp 2
    torchrun --standalone --nproc_per_node=8 -m recipes.hybrid_parallel --pp 2   # pp, dp, tp 2
    torchrun --standalone --nproc_per_node=4 -m recipes.hybrid_parallel --sequence-parallel

The world is one mesh; each parallelism takes one named dimension of it, from the outside in:

- ``pp`` (3-D only, outermost): pipeline stages (recipes.pipeline_parallel), point-to-point between
  stage neighbours: the least traffic, so it may cross the slowest links (between nodes);
- ``dp``: ``fully_shard`` (``recipes.parallelize.apply_fully_shard``): each data-parallel rank
  reads its own share of the batch, parameters are sharded across the dp ranks and all-gathered
  per block;
- ``tp`` (innermost: consecutive ranks, i.e. one node's NVLink): tensor parallel
  (recipes.parallelize's ``apply_tp``), collectives inside every layer.

With 8 ranks as pp 2 x dp 2 x tp 2, rank 5 is stage 1, data shard 0, tensor slice 1. The rank layout
is logged as a grid (recipes.process_groups explains how mesh dims map to process groups). The
groups each piece uses are taken from the mesh: ``mesh["tp"]`` for TP, ``mesh["dp"]`` for
fully_shard, ``mesh["pp"].get_group()`` for the pipeline's send/recv, ``mesh["dp"].get_group()`` for
the loss average.

Order matters: tensor parallel first, then fully_shard (it shards the TP DTensors again along dp,
giving 2-D DTensors), then the optimizer; a pipeline stage is cut before both. Losses and weights
equal single-process training (tests/test_hybrid_parallel.py). Runs on gloo/CPU (checked with torch
2.13).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ParallelStyle

from recipes import pipeline_parallel as pp_recipe
from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.memory import model_state_bytes
from recipes.core.pipeline import TRANSFORMER_LM, even_split, full_state_of_stages
from recipes.core.result import RecipeResult, StepTimer, make_result, param_checksum
from recipes.core.state import full_state_on_rank0
from recipes.core.speed import make_adamw, mixed_precision_policy, setup_precision
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
from recipes.parallelize import (apply_tp_and_fsdp, check_tp_fits,  # noqa: F401 (re-exported)
                                 matching_modules, transformer_lm_plan)
from recipes.process_groups import rank_grid

log = get_logger(__name__)


@dataclass
class HybridConfig(TrainConfig):
    tp: int = opt(2, "tensor-parallel size (innermost mesh dim)", ge=1)
    pp: int = opt(
        1, "pipeline stages, one per pp rank (outermost mesh dim); 1 = the 2-D dp x tp mesh", ge=1)
    sequence_parallel: bool = opt(
        False, "tensor parallel with the sequence split between blocks (see tensor_parallel)")
    schedule: Literal["gpipe", "1f1b"] = opt("1f1b", "pipeline schedule when pp > 1")
    microbatches: int = opt(2, "pipeline micro-batches per optimizer step, per data-parallel rank "
                               "(pp > 1)", ge=1)


def build_mesh(world, *, pp: int, tp: int) -> DeviceMesh:
    """("dp", "tp"), or ("pp", "dp", "tp") when pp > 1; dp is what is left of the world."""
    if world.world_size % (pp * tp):
        raise RecipeError(f"pp={pp} x tp={tp} does not divide the world size {world.world_size}; "
                          f"run on a multiple of {pp * tp} ranks")
    dp = world.world_size // (pp * tp)
    if pp == 1:
        return init_device_mesh(world.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(world.device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def plan_for_stage(stage: nn.Module, plan: Mapping[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """A pipeline stage holds some of the model's modules: the plan entries for the ones it has."""
    return {key: style for key, style in plan.items() if matching_modules(stage, key)}


# --8<-- [start:train]
def train(cfg: HybridConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        mesh = build_mesh(world, pp=cfg.pp, tp=cfg.tp)
        precision = setup_precision(cfg.precision, world.device)
        # bf16/fp16: fully_shard's own policy (low-precision compute, fp32 reduction), no autocast.
        mp_policy = mixed_precision_policy(precision)
        model_cfg = MODEL_PRESETS[cfg.model]
        check_tp_fits(cfg.tp, n_heads=model_cfg.n_heads,
                      mlp_width=model_cfg.mlp_ratio * model_cfg.dim,
                      vocab_size=model_cfg.vocab_size, seq_len=model_cfg.seq_len)
        plan = transformer_lm_plan(sequence_parallel=cfg.sequence_parallel)
        dp_size, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
        microbatches = cfg.microbatches if cfg.pp > 1 else 1
        per_dp_rank_batch = microbatches * per_rank_batch_size(cfg.global_batch_size, dp_size,
                                                               microbatches)
        log.info("%s", rank_grid(mesh))
        groups = {dim: dist.get_process_group_ranks(mesh[dim].get_group())
                  for dim in mesh.mesh_dim_names}

        if cfg.pp == 1:
            model = build_model(cfg.model, seed=cfg.seed, device=world.device)
            params_unsplit_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            apply_tp_and_fsdp(model, mesh, plan=plan, block_types=(Block,), mp_policy=mp_policy)
            modules = [model]
        else:
            pp_recipe.check_pipeline_fits(schedule=cfg.schedule, pp_size=cfg.pp,
                                          n_layers=model_cfg.n_layers,
                                          microbatches=cfg.microbatches,
                                          batch_size=per_dp_rank_batch)
            params_unsplit_bytes = sum(p.numel() * p.element_size()
                                       for p in build_model(model_cfg).parameters())
            stage_ids, num_stages = pp_recipe.stage_placement(
                cfg.schedule, mesh["pp"].get_local_rank(), cfg.pp)
            # Each pp rank cuts its stage, then splits it over its tp x dp sub-mesh; send/recv
            # between stages run on the pp group: the ranks with the same dp and tp coordinates.
            model = build_model(model_cfg, seed=cfg.seed)
            stages = pp_recipe.manual_stages(
                model, even_split(model, TRANSFORMER_LM, num_stages), stage_ids, num_stages,
                wiring=TRANSFORMER_LM, device=world.device, group=mesh["pp"].get_group(),
                parallelize=lambda m: apply_tp_and_fsdp(
                    m, mesh, plan=plan_for_stage(m, plan), block_types=(Block,), in_pipeline=True,
                    mp_policy=mp_policy))
            schedule = pp_recipe.build_schedule(cfg.schedule, stages, cfg.microbatches)
            modules = [stage.submod for stage in stages]
        optimizer = make_adamw(
            [p for m in modules for p in m.parameters()], lr=cfg.lr, device=world.device
        )

        # Data: one share per dp coordinate. Ranks that differ only in tp (or pp) read the same
        # samples.
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=dp_rank, world_size=dp_size,
                                             per_rank_batch_size=per_dp_rank_batch, seed=cfg.seed)
        dp_group = mesh["dp"].get_group()

        losses, timer = [], StepTimer(world.device)
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            with timer, warnings.catch_warnings():
                # fully_shard warns when a module returns a view: here it is TP's local view of the
                # all-gathered activations, and nothing modifies it in place.
                warnings.filterwarnings("ignore",
                                        message=r"FSDP2-wrapped module .* returned a view")
                inputs, targets = inputs.to(world.device), targets.to(world.device)
                optimizer.zero_grad(set_to_none=True)
                if cfg.pp == 1:
                    loss = lm_loss(model(inputs), targets)
                    # fully_shard reduce-scatters (averages) gradients over mesh["dp"].
                    loss.backward()
                    loss = loss.detach().reshape(1).clone()
                    dist.all_reduce(loss, group=dp_group)  # the global batch's loss: mean over dp
                    loss = float(loss.item()) / dp_size
                else:
                    # Every dp x tp rank of the last stage holds its dp share's loss: sum / (dp *
                    # tp).
                    loss = pp_recipe.pipeline_step(schedule, stages, inputs, targets,
                                                   loss_holders=dp_size * cfg.tp)
                optimizer.step()
                if step == 0:
                    state_bytes = [model_state_bytes(m, optimizer)["param_bytes"] for m in modules]
            losses.append(loss)
            log.info("step %d loss %.4f time %.1f ms", step, loss, timer.durations[-1] * 1e3)

        if cfg.pp == 1:
            state, checksum = full_state_on_rank0(model)  # all-gathers over dp and tp
        else:
            state = full_state_of_stages([s.submod for s in stages], stage_ids)
            checksum = param_checksum(state.values())
        return make_result(
            "hybrid_parallel", world, losses, checksum, timer,
            keep_final_state=state if cfg.keep_final_state and world.is_main else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            mesh_shape=list(mesh.mesh.shape), mesh_dim_names=list(mesh.mesh_dim_names),
            rank_grid=mesh.mesh.tolist(),
            groups_of_this_rank=groups, sequence_parallel=cfg.sequence_parallel,
            param_bytes_per_rank=sum(state_bytes), param_bytes_unsplit=params_unsplit_bytes,
            param_fraction_per_rank=sum(state_bytes) / params_unsplit_bytes,
        )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, HybridConfig, __doc__)
