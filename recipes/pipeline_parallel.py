"""Pipeline parallelism with torch.distributed.pipelining: consecutive blocks on consecutive ranks.

    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel --compare --n-layers 4
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel   # 1F1B, 2 stages
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel --schedule gpipe
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel \\
        --schedule dualpipev --n-layers 4           # or interleaved_1f1b, zbv_zero_bubble, ...
    torchrun --standalone --nproc_per_node=2 -m recipes.pipeline_parallel --split tracer
    python -m recipes.pipeline_parallel               # a world of 1: one stage, no bubble

Copy with it: recipes/toy.py, recipes/dist_setup.py, recipes/_pipeline_parallel_split.py (the
split by module names, the stage placement, the tied weights), recipes/options.py (the command
line, from the config).

Stages of consecutive modules, one or more per rank; activations and their gradients go between
neighbours by send/recv. A schedule orders the micro-batches' forwards (F) and backwards (B):
``gpipe`` (all F, then all B), ``1f1b`` (one F then one B: fewer live activations),
``interleaved_1f1b`` (rank r holds stages r, r+p, ...), ``interleaved_zero_bubble``,
``zbv_zero_bubble`` and ``dualpipev`` (backward split into input-gradient I and weight-gradient W
work, W filling idle slots; the last two place stages in a V: rank r holds r and 2p-1-r). With p
ranks, m micro-batches, v stages per rank, GPipe and 1F1B idle (p-1)/(v*m+p-1) of a step (the
bubble); rank 0 prints it for the run. ``--compare`` trains every schedule this torch has, one
after the other (same model, data and micro-batches); the cookbook's harness measures each one's
idle time and timeline from outside (``python -m recipes.core.prove pipeline_parallel``).

Cutting YOUR model (recipes/_pipeline_parallel_split.py, the second idea, in its own file):
``--split manual`` keeps each stage's modules, named by split points (``["layers.2"]``) and wired
by a ``StageWiring`` (ready-made for the cookbook's model, Llama and GPT-2); ``--split tracer``
traces the model with ``pipeline()`` (torch.export) and cuts it at ``SplitPoint.BEGINNING`` of the
same modules. Both keep the model's parameter names: checkpoints move between layouts.
The schedule divides the summed per-micro-batch gradients by m (``scale_grads``), so with the mean
loss a step equals the whole-batch step (tests/test_pipeline_parallel.py: every schedule, split).
``train`` returns the loss of each step of ``--schedule`` (the same on every rank); rank 0 prints
one line per step.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as torch_schedules
import torch.nn as nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline
from torch.utils.data import DataLoader, DistributedSampler

from recipes._pipeline_parallel_split import (
    SINGLE_STAGE_SCHEDULES,
    TRANSFORMER_LM,
    V_SCHEDULES,
    PipelineSplitError,
    StageModule,
    StageWiring,
    bubble_fraction,
    even_split,
    stage_modules,
    stage_placement,
    sync_tied_grads,
)
from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, ModelConfig, build_model, lm_loss, make_dataset

# torch's class for each schedule, looked up when used: an older torch may lack one (DualPipeV).
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# torch 2.11's stage set-up sends shape metadata between every pair of adjacent stages, also when
# one rank holds both, as a V puts stages 1 and 2 on rank 1: a send to itself, which gloo cannot
# make ("Pair is not connected"). NCCL can, and torch 2.13 runs it on gloo (tested).
SELF_SEND_FREE_TORCH = (2, 13)


@dataclass
class PPConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    # the whole pipeline reads each of them
    global_batch_size: int = option(
        12, "sequences per optimizer step, cut into the micro-batches", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    # no fp16: the schedule runs backward inside step(), where no loss scaler can scale the loss
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off); tf32: TF32 "
        "matmuls (CUDA)",
        choices=["auto", "fp32", "tf32", "bf16"],
    )
    schedule: str = option(
        "1f1b",
        "pipeline schedule: the order of the micro-batches' forwards and backwards",
        choices=list(SCHEDULES),
    )
    microbatches: int = option(
        4,
        "micro-batches per optimizer step: more of them shrink the bubble (p-1)/(m+p-1)",
        at_least=1,
    )
    stages_per_rank: int = option(
        0,
        "pipeline stages per rank; 0 = what the schedule needs (1 for gpipe/1f1b, 2 for the "
        "interleaved, zero-bubble and DualPipeV schedules)",
        at_least=0,
    )
    n_layers: int = option(
        0,
        "transformer blocks: the preset's dims with this many blocks (0 = the preset's own "
        "count; tiny has 2); every stage needs at least one",
        at_least=0,
    )
    split: str = option(
        "manual",
        "manual: each stage keeps its modules of the built model; tracer: pipeline() traces "
        "the model and cuts it at SplitPoint.BEGINNING of the same modules",
        choices=["manual", "tracer"],
    )
    compare: bool = option(
        False, "then train every other schedule this torch has (same model, data, micro-batches)"
    )
    backend: str = option(
        "auto",
        "auto: nccl with a GPU for each local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)

    def __post_init__(self):
        check_options(self)  # the ranges and choices above: one line each
        # What needs no world: the schedule's stages per rank, and equal micro-batches
        stage_placement(self.schedule, 0, 1, self.stages_per_rank)
        m, batch = self.microbatches, self.global_batch_size
        if batch % m:
            lower = max(m, batch - batch % m)
            raise ValueError(
                f"global_batch_size={batch} does not divide across 1 ranks x {m} "
                f"micro-batches; use a multiple of {m}, e.g. {lower} or {lower + m}"
            )


def torch_version() -> tuple[int, int]:
    return tuple(int(part) for part in torch.__version__.split(".")[:2])


def check_schedule_runs_here(schedule: str, backend: str) -> None:
    """A ValueError naming the fix where this torch cannot run ``schedule`` on ``backend``."""
    if not hasattr(torch_schedules, SCHEDULES[schedule]):
        raise ValueError(
            f"--schedule {schedule} needs torch.distributed.pipelining."
            f"{SCHEDULES[schedule]}, which torch {torch.__version__} lacks; "
            "upgrade torch or use --schedule 1f1b"
        )
    if schedule in V_SCHEDULES and backend == "gloo" and torch_version() < SELF_SEND_FREE_TORCH:
        raise ValueError(
            f"{schedule} on gloo needs torch >= 2.13 (torch {torch.__version__} sends "
            "from a rank to itself, which gloo cannot); use --backend nccl, or "
            "--schedule interleaved_zero_bubble"
        )


def model_config(model: str, n_layers: int = 0) -> ModelConfig:
    """A preset, with ``n_layers`` blocks instead of its own count when ``n_layers`` > 0."""
    preset = MODEL_PRESETS[model]
    return dataclasses.replace(preset, n_layers=n_layers) if n_layers else preset


def check_pipeline_fits(
    *,
    schedule: str,
    pp_size: int,
    n_layers: int,
    microbatches: int,
    batch_size: int,
    stages_per_rank: int = 0,
) -> None:
    """A ValueError naming the fix for a layout the schedule cannot run (before any stage exists):
    ``n_layers`` blocks, ``batch_size`` sequences a step cut into ``microbatches``."""
    _, num_stages = stage_placement(schedule, 0, pp_size, stages_per_rank)
    if n_layers < num_stages:
        raise ValueError(
            f"{n_layers} blocks cannot fill {num_stages} pipeline stages ({pp_size} "
            f"ranks x {num_stages // pp_size} stages); use --n-layers {num_stages} "
            "or more"
        )
    m = microbatches
    if schedule in ("1f1b", "dualpipev") and m < num_stages:
        raise ValueError(
            f"{schedule} needs at least one micro-batch per stage: microbatches="
            f"{m} < {num_stages} stages; use --microbatches {num_stages} or more"
        )
    rounds = max(1, m // pp_size)
    if schedule not in SINGLE_STAGE_SCHEDULES and m % rounds:
        raise ValueError(
            f"{schedule} runs micro-batches in rounds of {pp_size}: microbatches="
            f"{m} is not a multiple of {rounds} rounds; use a multiple of {pp_size}, "
            f"e.g. {rounds * pp_size}"
        )
    if batch_size % m:  # every micro-batch the same size
        lower = max(m, batch_size - batch_size % m)
        raise ValueError(
            f"global_batch_size={batch_size} does not divide across 1 ranks x {m} "
            f"micro-batches; use a multiple of {m}, e.g. {lower} or {lower + m}"
        )


def check_config_fits(cfg: PPConfig, pp_size: int) -> None:
    """``check_pipeline_fits`` for this recipe's config on ``pp_size`` pipeline ranks."""
    check_pipeline_fits(
        schedule=cfg.schedule,
        pp_size=pp_size,
        n_layers=model_config(cfg.model, cfg.n_layers).n_layers,
        microbatches=cfg.microbatches,
        batch_size=cfg.global_batch_size,
        stages_per_rank=cfg.stages_per_rank,
    )


# --8<-- [start:split]
def manual_stages(
    model: nn.Module,
    split: Sequence,
    stage_indices: list[int],
    num_stages: int,
    *,
    wiring: StageWiring,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    parallelize: Callable[[nn.Module], nn.Module] | None = None,
) -> list[PipelineStage]:
    """This rank's stages of YOUR model, cut where ``split`` says (module names, see
    recipes/_pipeline_parallel_split.py).

    Every rank builds the same model (same seed: same weights) and keeps its stages' modules; a big
    model is built on "meta" and materialised per stage. ``parallelize`` (e.g. TP then FSDP) is
    applied to each stage's module first.
    """
    modules = stage_modules(model, split, wiring)
    if len(modules) != num_stages:
        raise PipelineSplitError(
            f"the split gives {len(modules)} stages, the schedule places "
            f"{num_stages}; give {num_stages - 1} split points"
        )
    stages = []
    for s in stage_indices:
        module = StageModule(model, modules, s, wiring).to(device)
        if parallelize is not None:
            module = parallelize(module)
        stages.append(PipelineStage(module, s, num_stages, device, group=group))
    return stages


def traced_stages(
    model: nn.Module,
    split_points: list[str],
    stage_indices: list[int],
    *,
    device: torch.device,
    example_microbatch: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> list[PipelineStage]:
    """Trace the whole model once (torch.export), cut it before each split point, keep ours."""
    stage_modules(model, split_points, StageWiring(blocks=""))  # unknown names: one clear line
    # Pitfall: the example is ONE micro-batch, not the whole batch: the traced shapes are the ones
    # every stage will send and receive. contiguous: traced strides are checked at run time.
    pipe = pipeline(
        model.to(device),
        mb_args=(example_microbatch.contiguous(),),
        split_spec={name: SplitPoint.BEGINNING for name in split_points},
    )
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
def pipeline_step(
    schedule,
    stages: list[PipelineStage],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    loss_holders: int = 1,
) -> float:
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
def train(cfg: PPConfig, observer=None) -> list[float]:
    """Train on this process's rank; returns the loss of each step of ``cfg.schedule``. With
    ``compare``, then every other schedule this torch can run here, each from the same start."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        # Checked on every rank before any stage exists: each refuses the same way, at once
        check_config_fits(cfg, world.world_size)
        check_schedule_runs_here(cfg.schedule, world.backend)
        losses = train_schedule(cfg, world, observer)
        for schedule in SCHEDULES if cfg.compare else ():
            if schedule == cfg.schedule:
                continue
            try:
                other = dataclasses.replace(cfg, schedule=schedule)  # may refuse its stages
                check_schedule_runs_here(schedule, world.backend)
                check_config_fits(other, world.world_size)
            except ValueError as refused:  # the same on every rank: said, and the next one runs
                if world.rank == 0:
                    print(f"schedule {schedule} refused: {refused}", flush=True)
                continue
            train_schedule(other, world, observer)
        return losses
    finally:
        cleanup_distributed()  # every way out: NCCL's communicators are freed, not leaked


def train_schedule(cfg: PPConfig, world, observer=None) -> list[float]:
    device, rank, pp_size = world.device, world.rank, world.world_size  # one pipeline: the world
    use_cuda = device.type == "cuda"
    bf16 = cfg.precision == "bf16" or (
        cfg.precision == "auto" and use_cuda and torch.cuda.is_bf16_supported()
    )
    if cfg.precision == "tf32" and not use_cuda:  # else it would run fp32 and say tf32
        raise ValueError(
            f"--precision tf32 is a CUDA matmul mode and this run is on "
            f"{device.type}; use --precision fp32 (or bf16)"
        )
    if use_cuda:  # a process-wide switch: set it every run, never inherit it
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
            cfg.precision == "tf32"
        )
    model_cfg = model_config(cfg.model, cfg.n_layers)
    stage_ids, num_stages = stage_placement(cfg.schedule, rank, pp_size, cfg.stages_per_rank)
    microbatch_size = cfg.global_batch_size // cfg.microbatches
    if rank == 0:
        print(
            f"pipeline: {pp_size} rank(s), {cfg.schedule}, {num_stages} stages, "
            f"{cfg.microbatches} micro-batches of {microbatch_size}; bubble (p-1)/(v*m+p-1) = "
            f"{bubble_fraction(pp_size, cfg.microbatches, len(stage_ids)):.0%}",
            flush=True,
        )

    # --8<-- [start:loop]
    # The same seed on every rank: each builds the whole model, then keeps its stages' modules
    # (big models: build on "meta", then initialize each stage)
    model = build_model(model_cfg, seed=cfg.seed)
    split = even_split(model, TRANSFORMER_LM, num_stages)  # e.g. ["layers.2"]: 2 stages of 4
    if cfg.split == "manual":
        stages = manual_stages(
            model, split, stage_ids, num_stages, wiring=TRANSFORMER_LM, device=device
        )
    else:
        example = torch.zeros(microbatch_size, model_cfg.seq_len, dtype=torch.long)
        stages = traced_stages(
            model, split, stage_ids, device=device, example_microbatch=example.to(device)
        )
    schedule = build_schedule(cfg.schedule, stages, cfg.microbatches)
    # One optimizer over every stage this rank holds
    optimizer = torch.optim.AdamW(
        [p for s in stages for p in s.submod.parameters()],
        lr=cfg.lr,
        fused=True if use_cuda else None,
    )  # one kernel on CUDA
    if observer:
        observer.model_ready(nn.ModuleList(s.submod for s in stages), optimizer)

    dataset = make_dataset(model_cfg, cfg.global_batch_size, seed=cfg.seed)
    # Every rank reads the whole batch (only the first and last stage use it): the pipeline is one
    # data-parallel replica. Data parallel across pipelines: see recipes/hybrid_parallel.py.
    sampler = DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=cfg.global_batch_size,
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
            # The schedule runs forward, loss and backward of every micro-batch inside step()
            # (in this thread: autocast applies); the batch's mean loss comes back on every rank
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                losses.append(pipeline_step(schedule, stages, inputs, targets))
            optimizer.step()
            if rank == 0:
                print(f"step {step} loss {losses[-1]:.4f}", flush=True)
            if observer:
                observer.step_end(step, losses[-1])
            step += 1
        epoch += 1
    # --8<-- [end:loop]
    return losses


# --8<-- [end:train]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(PPConfig, prog="python -m recipes.pipeline_parallel", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), PPConfig, argv)
    with exit_on_bad_input():  # a layout the schedule cannot run: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
