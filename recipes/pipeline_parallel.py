"""Pipeline parallelism with torch.distributed.pipelining: consecutive blocks on consecutive ranks.

    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel --compare --n-layers 4
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel   # 1F1B, 2 stages
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel --schedule gpipe
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel \\
        --schedule dualpipev --n-layers 4           # or interleaved_1f1b, zbv_zero_bubble, ...
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel --split tracer
    python -m recipes.pipeline_parallel               # a world of 1: one stage, no bubble

Stages of consecutive modules, one or more per rank; activations and their gradients go between
neighbours by send/recv. A schedule orders the micro-batches' forwards (F) and backwards (B):
``gpipe`` (all F, then all B), ``1f1b`` (one F then one B: fewer live activations),
``interleaved_1f1b`` (rank r holds stages r, r+p, ...), ``interleaved_zero_bubble``,
``zbv_zero_bubble`` and ``dualpipev`` (backward split into input-gradient I and weight-gradient W
work, W filling idle slots; the last two place stages in a V: rank r holds r and 2p-1-r). With p
ranks, m micro-batches, v stages per rank, GPipe and 1F1B idle (p-1)/(v*m+p-1) of a step (the
bubble). The result reports it beside each rank's measured idle fraction (1 - time in F/B/I/W /
step time) and a per-action timeline; ``--compare``: every schedule in one table
(the first command: 1F1B's result, plus each schedule's row in ``extras.schedule_table``).

Cutting YOUR model (recipes/core/pipeline.py: the second idea, in its own file, with the timeline):
``--split manual`` keeps each stage's modules, named by split points (``["layers.2"]``) and wired
by a ``StageWiring`` (ready-made for the cookbook's model, Llama and GPT-2); ``--split tracer``
traces the model with ``pipeline()`` (torch.export) and cuts it at ``SplitPoint.BEGINNING`` of the
same modules. Both keep the model's parameter names: checkpoints move between layouts.
The schedule divides the summed per-micro-batch gradients by m (``scale_grads``), so with the mean
loss a step equals the whole-batch step (tests/test_pipeline_parallel.py: every schedule, split).

Length: about 300 lines, the cookbook's limit: the split by module names, the step, the
checks each schedule's layout must pass and the comparison table of every schedule are one lesson.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as torch_schedules
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.pipeline import (SINGLE_STAGE_SCHEDULES, TRANSFORMER_LM, V_SCHEDULES,
                                   ActionTimeline, StageModule, StageWiring, bubble_fraction,
                                   even_split, full_state_of_stages, stage_modules,
                                   stage_placement, sync_tied_grads)
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.speed import autocast, make_adamw, setup_precision
from recipes.core.state import all_ranks
from recipes.core.throughput import Workload
from recipes.core.workload import (MODEL_PRESETS, ModelConfig, build_model, distributed_loader,
                                   iterate_steps, lm_loss, make_dataset)
from recipes.core.world import join_world

log = get_logger(__name__)

# torch's class for each schedule, looked up when used: an older torch may lack one (DualPipeV).
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
             "zbv_zero_bubble": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
# torch 2.11's stage set-up sends shape metadata between every pair of adjacent stages, also when
# one rank holds both, as a V puts stages 1 and 2 on rank 1: a send to itself, which gloo cannot
# make ("Pair is not connected"). NCCL can, and torch 2.13 runs it on gloo (tested).
SELF_SEND_FREE_TORCH = (2, 13)


def torch_version() -> tuple[int, int]:
    return tuple(int(part) for part in torch.__version__.split(".")[:2])


def check_schedule_runs_here(schedule: str, backend: str) -> None:
    """A RecipeError naming the fix where this torch cannot run ``schedule`` on ``backend``."""
    if not hasattr(torch_schedules, SCHEDULES[schedule]):
        raise RecipeError(f"--schedule {schedule} needs torch.distributed.pipelining."
                          f"{SCHEDULES[schedule]}, which torch {torch.__version__} lacks; "
                          "upgrade torch or use --schedule 1f1b")
    if schedule in V_SCHEDULES and backend == "gloo" and torch_version() < SELF_SEND_FREE_TORCH:
        raise RecipeError(
            f"{schedule} on gloo needs torch >= 2.13 (torch {torch.__version__} sends "
            "from a rank to itself, which gloo cannot); use --backend nccl, or "
            "--schedule interleaved_zero_bubble")


@dataclass
class PPConfig(TrainConfig):
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble",
                      "zbv_zero_bubble", "dualpipev"] = opt(
        "1f1b", "pipeline schedule: the order of the micro-batches' forwards and backwards")
    microbatches: int = opt(4, "micro-batches per optimizer step: more of them shrink the bubble "
                               "(p-1)/(m+p-1)", ge=1)
    stages_per_rank: int = opt(
        0, "pipeline stages per rank; 0 = what the schedule needs (1 for gpipe/1f1b, 2 for the "
        "interleaved, zero-bubble and DualPipeV schedules)", ge=0)
    n_layers: int = opt(0, "transformer blocks: the preset's dims with this many blocks (0 = the "
                           "preset's own count; tiny has 2); every stage needs at least one", ge=0)
    split: Literal["manual", "tracer"] = opt(
        "manual", "manual: each stage keeps its modules of the built model; tracer: pipeline() "
                  "traces the model and cuts it at SplitPoint.BEGINNING of the same modules")
    compare: bool = opt(
        False, "also run every other schedule this torch has (same model, data, micro-batches) "
               "and report each one's idle fraction and timeline in extras.schedule_table")


def model_config(model: str, n_layers: int = 0) -> ModelConfig:
    """A preset, with ``n_layers`` blocks instead of its own count when ``n_layers`` > 0."""
    preset = MODEL_PRESETS[model]
    return dataclasses.replace(preset, n_layers=n_layers) if n_layers else preset


def check_pipeline_fits(*, schedule: str, pp_size: int, n_layers: int, microbatches: int,
                        batch_size: int, stages_per_rank: int = 0) -> None:
    """RecipeError naming the fix for a layout the schedule cannot run (before any stage exists):
    ``n_layers`` blocks, ``batch_size`` sequences a step cut into ``microbatches``."""
    _, num_stages = stage_placement(schedule, 0, pp_size, stages_per_rank)
    if n_layers < num_stages:
        raise RecipeError(f"{n_layers} blocks cannot fill {num_stages} pipeline stages ({pp_size} "
                          f"ranks x {num_stages // pp_size} stages); use --n-layers {num_stages} "
                          "or more")
    m = microbatches
    if schedule in ("1f1b", "dualpipev") and m < num_stages:
        raise RecipeError(f"{schedule} needs at least one micro-batch per stage: microbatches="
                          f"{m} < {num_stages} stages; use --microbatches {num_stages} or more")
    rounds = max(1, m // pp_size)
    if schedule not in SINGLE_STAGE_SCHEDULES and m % rounds:
        raise RecipeError(f"{schedule} runs micro-batches in rounds of {pp_size}: microbatches="
                          f"{m} is not a multiple of {rounds} rounds; use a multiple of {pp_size}, "
                          f"e.g. {rounds * pp_size}")
    per_rank_batch_size(batch_size, 1, m)  # every micro-batch the same size


def check_config_fits(cfg: PPConfig, pp_size: int) -> None:
    """``check_pipeline_fits`` for this recipe's config on ``pp_size`` pipeline ranks."""
    check_pipeline_fits(schedule=cfg.schedule, pp_size=pp_size,
                        n_layers=model_config(cfg.model, cfg.n_layers).n_layers,
                        microbatches=cfg.microbatches, batch_size=cfg.global_batch_size,
                        stages_per_rank=cfg.stages_per_rank)


# --8<-- [start:split]
def manual_stages(model: nn.Module, split: Sequence, stage_indices: list[int], num_stages: int,
                  *, wiring: StageWiring, device: torch.device,
                  group: dist.ProcessGroup | None = None,
                  parallelize: Callable[[nn.Module], nn.Module] | None = None,
                  ) -> list[PipelineStage]:
    """This rank's stages of YOUR model, cut where ``split`` says (module names, see core/pipeline).

    Every rank builds the same model (same seed: same weights) and keeps its stages' modules; a big
    model is built on "meta" and materialised per stage. ``parallelize`` (e.g. TP then FSDP) is
    applied to each stage's module first.
    """
    modules = stage_modules(model, split, wiring)
    if len(modules) != num_stages:
        raise RecipeError(f"the split gives {len(modules)} stages, the schedule places "
                          f"{num_stages}; give {num_stages - 1} split points")
    stages = []
    for s in stage_indices:
        module = StageModule(model, modules, s, wiring).to(device)
        if parallelize is not None:
            module = parallelize(module)
        stages.append(PipelineStage(module, s, num_stages, device, group=group))
    return stages


def traced_stages(model: nn.Module, split_points: list[str], stage_indices: list[int], *,
                  device: torch.device, example_microbatch: torch.Tensor,
                  group: dist.ProcessGroup | None = None) -> list[PipelineStage]:
    """Trace the whole model once (torch.export), cut it before each split point, keep ours."""
    stage_modules(model, split_points, StageWiring(blocks=""))  # unknown names: one clear line
    # Pitfall: the example is ONE micro-batch, not the whole batch: the traced shapes are the ones
    # every stage will send and receive. contiguous: traced strides are checked at run time.
    pipe = pipeline(model.to(device), mb_args=(example_microbatch.contiguous(),),
                    split_spec={name: SplitPoint.BEGINNING for name in split_points})
    return [pipe.build_stage(s, device, group) for s in stage_indices]


def build_schedule(name: str, stages: list[PipelineStage], microbatches: int):
    """The schedule runs forward, loss (``lm_loss`` per micro-batch, last stage), backward."""
    schedule_cls = getattr(torch_schedules, SCHEDULES[name])
    # scale_grads=True (the default): gradients are divided by the micro-batch count, so summed
    # per-micro-batch gradients of the mean loss equal the whole batch's gradient.
    first = stages[0] if name in SINGLE_STAGE_SCHEDULES else stages
    return schedule_cls(first, n_microbatches=microbatches, loss_fn=lm_loss)
# --8<-- [end:split]


# --8<-- [start:step]
def pipeline_step(schedule, stages: list[PipelineStage], inputs: torch.Tensor,
                  targets: torch.Tensor, *, loss_holders: int = 1) -> float:
    """One forward/backward over all micro-batches; returns the batch's mean loss on EVERY rank.

    Only the first stage needs the inputs and only the last the targets. The per-micro-batch losses
    appear on the rank of the last stage; a SUM all-reduce (the others add 0) shares them, divided
    by ``loss_holders``: how many ranks hold a last stage (data- or tensor-parallel copies of it).
    """
    has_first, has_last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    # Pitfall: a stage checks each micro-batch's strides against the ones it expects (torch 2.11:
    # PipeliningShapeError "stride mismatch"): a non-contiguous batch, e.g. tokens[:, :-1], fails.
    inputs, targets = inputs.contiguous(), targets.contiguous()
    microbatch_losses: list[torch.Tensor] = []
    if has_first:
        schedule.step(inputs, target=targets if has_last else None, losses=microbatch_losses)
    elif has_last:
        schedule.step(target=targets, losses=microbatch_losses)
    else:
        schedule.step()
    # Weights tied across stages (GPT-2's lm_head and wte): sum the copies' gradients.
    sync_tied_grads([s.submod for s in stages], stages[0].group)
    zero = torch.zeros((), device=inputs.device)
    loss = torch.stack(microbatch_losses).mean().detach() if has_last else zero
    loss = loss.reshape(1).float().clone()
    dist.all_reduce(loss)
    return float(loss.item()) / loss_holders
# --8<-- [end:step]


# --8<-- [start:train]
def train(cfg: PPConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        result = train_in_world(cfg, world)
        if cfg.compare:
            table = []
            for schedule in SCHEDULES:
                other = dataclasses.replace(cfg, schedule=schedule, compare=False)
                try:
                    check_schedule_runs_here(schedule, world.backend)
                    check_config_fits(other, world.world_size)
                except RecipeError as refused:  # the same on every rank: a row says why
                    table.append({"schedule": schedule, "refused": str(refused)})
                    continue
                run = result if schedule == cfg.schedule else train_in_world(other, world)
                table.append({"schedule": schedule, **{k: run.extras[k] for k in (
                    "stages_per_rank", "bubble_fraction_theory", "idle_fraction_measured_per_rank",
                    "timeline_per_rank")}, "seconds_per_step": run.seconds_per_step})
            result.extras["schedule_table"] = table
        return result


def train_in_world(cfg: PPConfig, world) -> RecipeResult:
    pp_size, pp_rank = world.world_size, world.rank  # the whole world is one pipeline
    check_config_fits(cfg, pp_size)
    check_schedule_runs_here(cfg.schedule, world.backend)
    precision = setup_precision(cfg.precision, world.device)
    if precision == "fp16":  # the schedule runs backward inside step(): no place to scale the loss
        raise RecipeError("pipeline_parallel has no loss scaler for fp16; use --precision bf16")
    model_cfg = model_config(cfg.model, cfg.n_layers)
    stage_ids, num_stages = stage_placement(cfg.schedule, pp_rank, pp_size, cfg.stages_per_rank)
    microbatch_size = per_rank_batch_size(cfg.global_batch_size, 1, cfg.microbatches)
    model = build_model(model_cfg, seed=cfg.seed)  # big models: build on "meta", then initialize
    split = even_split(model, TRANSFORMER_LM, num_stages)  # e.g. ["layers.2"] for 2 stages of 4
    if cfg.split == "manual":
        stages = manual_stages(model, split, stage_ids, num_stages, wiring=TRANSFORMER_LM,
                               device=world.device)
    else:
        example = torch.zeros(microbatch_size, model_cfg.seq_len, dtype=torch.long)
        stages = traced_stages(model, split, stage_ids, device=world.device,
                               example_microbatch=example.to(world.device))
    schedule = build_schedule(cfg.schedule, stages, cfg.microbatches)
    optimizer = make_adamw([p for s in stages for p in s.submod.parameters()], lr=cfg.lr,
                           device=world.device)  # one optimizer over every stage of this rank
    # Every rank reads the whole batch (only the first and last stage use it): the pipeline is one
    # data-parallel replica. Data parallel across pipelines: see recipes.hybrid_parallel.
    dataset = make_dataset(model_cfg, cfg.global_batch_size, seed=cfg.seed)
    loader, sampler = distributed_loader(dataset, rank=0, world_size=1,
                                         per_rank_batch_size=cfg.global_batch_size, seed=cfg.seed)
    log.info("pipeline: %d rank(s), %s, %d stages (this rank: %s), %d micro-batches of %d",
             pp_size, cfg.schedule, num_stages, stage_ids, cfg.microbatches, microbatch_size)
    losses, idle, timer, timeline = [], [], StepTimer(world.device), ActionTimeline(stages)
    for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
        with timer:
            optimizer.zero_grad(set_to_none=True)
            timeline.start()
            with autocast(world.device, precision):  # bf16: the stages run in this thread
                loss = pipeline_step(schedule, stages, inputs.to(world.device),
                                     targets.to(world.device))
            idle.append(timeline.stop())
            optimizer.step()
        losses.append(loss)
        log.info("step %d loss %.4f time %.1f ms idle %.0f%%", step, loss,
                 timer.durations[-1] * 1e3, 100 * idle[-1])
    steady = idle[1:] or idle  # after the first (warm-up) step
    # The last step's actions on every rank, in milliseconds: a rank x time chart of the schedule.
    actions = [(kind, s, mb, round(a * 1e3, 3), round(b * 1e3, 3))
               for kind, s, mb, a, b in timeline.actions]
    state = full_state_of_stages([s.submod for s in stages], stage_ids)
    return make_result(
        "pipeline_parallel", world, losses, state.values(), timer,
        keep_final_state=state if cfg.keep_final_state else None,
        workload=Workload(model_cfg, cfg.global_batch_size, precision),
        schedule=cfg.schedule, split=cfg.split, pp_size=pp_size, num_stages=num_stages,
        stages_per_rank=len(stage_ids), microbatches=cfg.microbatches, n_layers=model_cfg.n_layers,
        split_points=split, stage_ids_per_rank=all_ranks(stage_ids),
        bubble_fraction_theory=bubble_fraction(pp_size, cfg.microbatches, len(stage_ids)),
        idle_fraction_measured_per_rank=all_ranks(sum(steady) / len(steady)),
        step_window_ms_per_rank=all_ranks(round(timeline.window * 1e3, 3)),
        timeline_per_rank=all_ranks(actions),
    )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, PPConfig, __doc__)
