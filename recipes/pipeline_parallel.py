"""Pipeline parallelism with torch.distributed.pipelining: consecutive blocks on consecutive ranks.

    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel                       # 1F1B, 2 stages
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel --schedule gpipe --microbatches 6
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel --schedule interleaved_1f1b --n-layers 4
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel --schedule zbv_zero_bubble --n-layers 4
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel --split tracer
    python -m recipes.pipeline_parallel                                 # a world of 1: one stage, no bubble

The model is cut into stages of consecutive blocks (stage 0 also owns the embeddings, the last stage the
final norm and the output head), each rank runs its stage(s), and activations / their gradients travel
between neighbours by point-to-point send/recv. Every optimizer step splits the batch into
``--microbatches`` micro-batches and a schedule orders their forwards (F) and backwards (B):

- ``gpipe``: all F, then all B. ``1f1b``: after a warm-up, one F then one B (fewer live activations).
- ``interleaved_1f1b``: several smaller stages per rank (rank r holds stages r, r+p, ...): the pipeline
  fills faster, so the bubble shrinks by the number of stages per rank.
- ``interleaved_zero_bubble`` (ZB1P) and ``zbv_zero_bubble`` (ZB-V, stages placed in a V: rank r holds
  r and 2p-1-r): the backward is split into input-gradient (I) and weight-gradient (W) work, and W fills
  the idle slots.

The pipeline's idle time: with p pipeline ranks and m micro-batches, GPipe and 1F1B leave each rank idle
for a fraction (p-1)/(m+p-1) of a step (the "bubble"); interleaving with v stages per rank makes it
(p-1)/(v*m+p-1). The result reports that figure beside the idle fraction measured on each rank (1 - time
in the stage's forward/backward / step time). The zero-bubble schedules fill the same bubble with W work,
so their measured idle time is the one to read; the formula shows what 1F1B-style scheduling would pay.

Two ways to cut: ``--split manual`` builds the model on every rank and deletes the blocks a stage does
not own (the model keeps its blocks in a ModuleDict, so names like ``layers.3.attn.wq.weight`` survive);
``--split tracer`` traces the whole model with ``pipeline()`` (torch.export) and cuts it at
``SplitPoint.BEGINNING`` of the first block of each stage. Both give stages whose parameters have the
unsplit model's names, so checkpoints are interchangeable.

Gradients are computed per micro-batch and summed; the schedule divides them by the micro-batch count
(``scale_grads``), so with the mean loss the step equals the whole-batch step: losses and weights equal
single-process training (tests/test_pipeline_parallel.py). Every schedule and both splits run on
gloo/CPU (checked with torch 2.13: send/recv are all they need). The tiny preset has 2 blocks: 4 stages
need more, hence ``--n-layers`` (the preset's dims with more blocks).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, SplitPoint, pipeline)

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import all_ranks
from recipes.core.speed import autocast, make_adamw, setup_precision
from recipes.core.throughput import Workload
from recipes.core.workload import (MODEL_PRESETS, ModelConfig, build_model, distributed_loader, iterate_steps,
                                   lm_loss, make_dataset)
from recipes.core.world import join_world
from recipes.tensor_parallel import full_state_gathered  # DTensor-aware: hybrid stages hold TP/FSDP shards

log = get_logger(__name__)

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
}
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
# torch 2.11's stage set-up sends shape metadata between every pair of adjacent stages, also when
# one rank holds both, as ZB-V's V puts stages 1 and 2 on rank 1: a send to itself, which gloo
# cannot make ("Pair is not connected"). NCCL can, and torch 2.13 runs it on gloo (tested).
SELF_SEND_FREE_TORCH = (2, 13)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def check_schedule_runs_here(schedule: str, backend: str) -> None:
    """A RecipeError naming the fix where this torch cannot run ``schedule`` on ``backend``."""
    if (
        schedule == "zbv_zero_bubble"
        and backend == "gloo"
        and torch_version() < SELF_SEND_FREE_TORCH
    ):
        raise RecipeError(
            f"zbv_zero_bubble on gloo needs torch >= 2.13 (torch {torch.__version__} sends "
            "from a rank to itself, which gloo cannot); use --backend nccl, or "
            "--schedule interleaved_zero_bubble"
        )


@dataclass
class PPConfig(TrainConfig):
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv_zero_bubble"] = opt(
        "1f1b", "pipeline schedule: the order of the micro-batches' forwards and backwards on each rank")
    microbatches: int = opt(4, "micro-batches per optimizer step: more of them shrink the bubble "
                               "(p-1)/(m+p-1)", ge=1)
    stages_per_rank: int = opt(
        0, "pipeline stages per rank; 0 = what the schedule needs (1 for gpipe/1f1b, 2 for the "
        "interleaved and zero-bubble schedules)", ge=0)
    n_layers: int = opt(0, "transformer blocks: the preset's dims with this many blocks (0 = the "
                           "preset's own count; tiny has 2); every stage needs at least one", ge=0)
    split: Literal["manual", "tracer"] = opt(
        "manual", "manual: each stage deletes the blocks it does not own; tracer: pipeline() traces the model "
                  "and cuts it at SplitPoint.BEGINNING of each stage's first block")


def model_config(model: str, n_layers: int = 0) -> ModelConfig:
    """A preset, with ``n_layers`` blocks instead of its own count when ``n_layers`` > 0."""
    preset = MODEL_PRESETS[model]
    return dataclasses.replace(preset, n_layers=n_layers) if n_layers else preset


def stage_placement(schedule: str, pp_rank: int, pp_size: int, stages_per_rank: int = 0) -> tuple[list[int], int]:
    """(the stage indices this pipeline rank holds, the number of stages): "loop" or, for ZB-V, "v" style."""
    if stages_per_rank == 0:
        stages_per_rank = 1 if schedule in SINGLE_STAGE_SCHEDULES else 2
    if schedule in SINGLE_STAGE_SCHEDULES and stages_per_rank != 1:
        raise RecipeError(f"schedule {schedule} runs one stage per rank, got stages_per_rank={stages_per_rank}; "
                          "use --schedule interleaved_1f1b (or a zero-bubble one) for several")
    if schedule == "zbv_zero_bubble":
        if stages_per_rank != 2:
            raise RecipeError(f"zbv_zero_bubble places exactly 2 stages per rank (a V), got "
                              f"stages_per_rank={stages_per_rank}; use --stages-per-rank 2 or 0")
        return [pp_rank, 2 * pp_size - 1 - pp_rank], 2 * pp_size  # rank 0 holds the first AND last stage
    return [pp_rank + k * pp_size for k in range(stages_per_rank)], stages_per_rank * pp_size


def check_pipeline_fits(cfg: PPConfig, pp_size: int) -> None:
    """RecipeError naming the fix for a layout the schedule cannot run (checked before any stage is built)."""
    _, num_stages = stage_placement(cfg.schedule, 0, pp_size, cfg.stages_per_rank)
    n_layers = model_config(cfg.model, cfg.n_layers).n_layers
    if n_layers < num_stages:
        raise RecipeError(f"{n_layers} blocks cannot fill {num_stages} pipeline stages ({pp_size} ranks x "
                          f"{num_stages // pp_size} stages); use --n-layers {num_stages} or more")
    m = cfg.microbatches
    if cfg.schedule == "1f1b" and m < num_stages:
        raise RecipeError(f"1f1b needs at least one micro-batch per stage: microbatches={m} < {num_stages} stages; "
                          f"use --microbatches {num_stages} or more")
    rounds = max(1, m // pp_size)
    if cfg.schedule not in SINGLE_STAGE_SCHEDULES and m % rounds:
        raise RecipeError(f"{cfg.schedule} runs micro-batches in rounds of {pp_size}: microbatches={m} is not a "
                          f"multiple of {rounds} rounds; use a multiple of {pp_size}, e.g. {rounds * pp_size}")
    per_rank_batch_size(cfg.global_batch_size, 1, m)  # every micro-batch the same size


def stage_blocks(n_layers: int, num_stages: int, stage_index: int) -> range:
    """The blocks of one stage: consecutive, as even as the counts allow (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, num_stages)
    start = stage_index * base + min(stage_index, extra)
    return range(start, start + base + (stage_index < extra))


# --8<-- [start:split]
def manual_stage(model_cfg: ModelConfig, stage_index: int, num_stages: int, *, seed: int,
                 device: torch.device) -> nn.Module:
    """The unsplit model minus what this stage does not own. Same seed on every rank: same weights."""
    model = build_model(model_cfg, seed=seed, device=device)  # big models: build on "meta", then initialize
    own = {str(i) for i in stage_blocks(model_cfg.n_layers, num_stages, stage_index)}
    for key in [key for key in model.layers if key not in own]:
        del model.layers[key]  # a ModuleDict keeps the remaining keys: "layers.3..." stays "layers.3..."
    if stage_index != 0:  # forward() skips the parts set to None: a middle stage maps hidden -> hidden
        model.tok_embeddings = model.pos_embeddings = None
    if stage_index != num_stages - 1:
        model.norm = model.output = None
    return model


def traced_stages(model_cfg: ModelConfig, stage_indices: list[int], num_stages: int, *, seed: int,
                  device: torch.device, example_microbatch: torch.Tensor,
                  group: dist.ProcessGroup | None = None) -> list[PipelineStage]:
    """Trace the whole model once (torch.export), cut it before each stage's first block, keep our stages."""
    model = build_model(model_cfg, seed=seed, device=device)
    split_spec = {f"layers.{stage_blocks(model_cfg.n_layers, num_stages, s).start}": SplitPoint.BEGINNING
                  for s in range(1, num_stages)}
    # Pitfall: the example is ONE micro-batch, not the whole batch: the traced shapes are the ones
    # every stage will send and receive.
    # contiguous: the traced strides are checked at run time (torch 2.11), and pipeline_step sends
    # contiguous micro-batches.
    pipe = pipeline(model, mb_args=(example_microbatch.contiguous(),), split_spec=split_spec)
    return [pipe.build_stage(s, device, group) for s in stage_indices]


def manual_stages(model_cfg: ModelConfig, stage_indices: list[int], num_stages: int, *, seed: int,
                  device: torch.device, group: dist.ProcessGroup | None = None,
                  parallelize: Callable[[nn.Module], nn.Module] | None = None) -> list[PipelineStage]:
    """One PipelineStage per stage index; ``parallelize`` (e.g. TP then FSDP) is applied to each stage first."""
    stages = []
    for s in stage_indices:
        module = manual_stage(model_cfg, s, num_stages, seed=seed, device=device)
        if parallelize is not None:
            module = parallelize(module)
        stages.append(PipelineStage(module, s, num_stages, device, group=group))
    return stages


def build_schedule(name: str, stages: list[PipelineStage], microbatches: int):
    """The schedule runs forward, loss (``lm_loss`` per micro-batch, on the last stage) and backward."""
    schedule_cls = SCHEDULES[name]
    # scale_grads=True (the default): gradients are divided by the micro-batch count, so summed
    # per-micro-batch gradients of the mean loss equal the whole batch's gradient.
    if name in SINGLE_STAGE_SCHEDULES:
        return schedule_cls(stages[0], n_microbatches=microbatches, loss_fn=lm_loss)
    return schedule_cls(stages, n_microbatches=microbatches, loss_fn=lm_loss)
# --8<-- [end:split]


# --8<-- [start:step]
def pipeline_step(schedule, stages: list[PipelineStage], inputs: torch.Tensor, targets: torch.Tensor,
                  *, loss_holders: int = 1) -> float:
    """One forward/backward over all micro-batches; returns the batch's mean loss on EVERY rank.

    Only the first stage needs the inputs and only the last the targets. The per-micro-batch losses
    appear on the rank holding the last stage; a SUM all-reduce (the others add 0) shares them, divided
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
    device = inputs.device
    loss = torch.stack(microbatch_losses).mean().detach() if has_last else torch.zeros((), device=device)
    loss = loss.reshape(1).float().clone()
    dist.all_reduce(loss)
    return float(loss.item()) / loss_holders
# --8<-- [end:step]


class ComputeTimer:
    """Seconds this rank spends inside its stages' forward and backward (the rest of a step is waiting).

    Wraps the stages' ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``:
    the methods every schedule calls (torch 2.4+); a receive's wait happens before them, in the schedule.
    """

    def __init__(self, stages: list[PipelineStage]):
        self.seconds = 0.0
        for stage in stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def bubble_fraction(pp_size: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a step an ideal GPipe/1F1B pipeline pays: (p-1)/(v*m+p-1) with v stages per rank."""
    return (pp_size - 1) / (stages_per_rank * microbatches + pp_size - 1)


def gathered_state(stages: list[PipelineStage]) -> dict[str, torch.Tensor]:
    """The whole model's parameters on every rank, from every rank's stages (a collective)."""
    local: dict[str, torch.Tensor] = {}
    for stage in stages:
        local.update(full_state_gathered(stage.submod))  # all-gathers any DTensor (TP/FSDP) shards
    return {name: tensor for piece in all_ranks(local) for name, tensor in piece.items()}


def sorted_by_model_order(state: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    names = [name for name, _ in build_model(model_cfg).named_parameters()]
    return {name: state[name] for name in names}


# --8<-- [start:train]
def train(cfg: PPConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        pp_size, pp_rank = world.world_size, world.rank  # the whole world is one pipeline
        check_pipeline_fits(cfg, pp_size)
        check_schedule_runs_here(cfg.schedule, world.backend)
        precision = setup_precision(cfg.precision, world.device)
        # the schedule runs backward inside step(): no place to scale the loss
        if precision == "fp16":
            raise RecipeError("pipeline_parallel has no loss scaler for fp16; use --precision bf16")
        model_cfg = model_config(cfg.model, cfg.n_layers)
        stage_ids, num_stages = stage_placement(cfg.schedule, pp_rank, pp_size, cfg.stages_per_rank)
        microbatch_size = per_rank_batch_size(cfg.global_batch_size, 1, cfg.microbatches)
        if cfg.split == "manual":
            stages = manual_stages(model_cfg, stage_ids, num_stages, seed=cfg.seed, device=world.device)
        else:
            example = torch.zeros(microbatch_size, model_cfg.seq_len, dtype=torch.long, device=world.device)
            stages = traced_stages(model_cfg, stage_ids, num_stages, seed=cfg.seed, device=world.device,
                                   example_microbatch=example)
        schedule = build_schedule(cfg.schedule, stages, cfg.microbatches)
        # One optimizer over every stage this rank holds.
        params = [p for s in stages for p in s.submod.parameters()]
        optimizer = make_adamw(params, lr=cfg.lr, device=world.device)
        # Every rank reads the whole batch (only the first and last stage use it): the pipeline is one
        # data-parallel replica. Data parallel across pipelines: see recipes.hybrid_parallel.
        dataset = make_dataset(model_cfg, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=0, world_size=1,
                                             per_rank_batch_size=cfg.global_batch_size, seed=cfg.seed)
        log.info("pipeline: %d rank(s), schedule %s, %d stages (this rank: %s), %d micro-batches of %d, split %s",
                 pp_size, cfg.schedule, num_stages, stage_ids, cfg.microbatches, microbatch_size, cfg.split)

        losses, timer, compute = [], StepTimer(world.device), ComputeTimer(stages)
        idle_fractions = []
        for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
            compute.seconds = 0.0
            with timer:
                optimizer.zero_grad(set_to_none=True)
                # bf16: the stages' forwards run in this thread, inside the schedule's step().
                with autocast(world.device, precision):
                    loss = pipeline_step(schedule, stages, inputs.to(world.device),
                                         targets.to(world.device))
                optimizer.step()
            idle_fractions.append(max(0.0, 1.0 - compute.seconds / timer.durations[-1]))
            losses.append(loss)
            log.info("step %d loss %.4f time %.1f ms idle %.0f%%", step, loss, timer.durations[-1] * 1e3,
                     100 * idle_fractions[-1])

        # Idle fraction per pipeline rank, after the first (warm-up) step, gathered for rank 0's report.
        steady = idle_fractions[1:] or idle_fractions
        idle_per_rank = all_ranks(sum(steady) / len(steady))
        state = sorted_by_model_order(gathered_state(stages), model_cfg)
        return make_result(
            "pipeline_parallel", world, losses, state.values(), timer,
            keep_final_state=state if cfg.keep_final_state else None,
            workload=Workload(model_cfg, cfg.global_batch_size, precision),
            schedule=cfg.schedule, split=cfg.split, pp_size=pp_size, num_stages=num_stages,
            stages_per_rank=len(stage_ids), microbatches=cfg.microbatches, n_layers=model_cfg.n_layers,
            stage_ids_per_rank=[stage_placement(cfg.schedule, r, pp_size, cfg.stages_per_rank)[0]
                                for r in range(pp_size)],
            bubble_fraction_theory=bubble_fraction(pp_size, cfg.microbatches, len(stage_ids)),
            idle_fraction_measured_per_rank=idle_per_rank,
        )
# --8<-- [end:train]


if __name__ == "__main__":
    run_cli(train, PPConfig, __doc__)
