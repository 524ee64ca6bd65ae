"""Profiling: see where a DDP step's time and memory go, and tell compute from communication.

    torchrun --standalone --nproc_per_node=2 -m recipes.profiling
    python -m recipes.profiling --model 100m   # a world of 1; on a GPU also a memory snapshot
    torchrun --standalone --nproc_per_node=2 -m recipes.profiling --trace-dir traces --active 3

The loop is ddp_torchrun's with the core speed settings, inside ``torch.profiler.profile``. Its
schedule skips ``--wait`` steps (step 0 allocates AdamW's state, DDP rebuilds its buckets), profiles
``--warmup`` steps and throws them away (the profiler's own start-up lands there), then records
``--active`` steps. What comes out:

- ``<trace-dir>/trace-rank<R>.json`` for every rank: a Chrome trace with "forward", "backward" and
  "optimizer" labelled (open it in https://ui.perfetto.dev or chrome://tracing);
- on rank 0, the top ops table (self CUDA time on a GPU, self CPU time on CPU);
- the communication in the profiled steps, by event name, and its milliseconds per step against the
  step's: names are matched, not guessed. In torch 2.13 DDP's gradient all-reduce is
  ``c10d::allreduce_`` on the thread that launches it, then ``gloo:all_reduce`` on a gloo worker
  thread for as long as it runs (NCCL: ``nccl:all_reduce`` on the CPU, an NCCL kernel on the GPU);
- on CUDA, ``<trace-dir>/memory-snapshot-rank<R>.pickle`` (drop it on pytorch.org/memory_viz): every
  allocation of the profiled steps with its Python stack, and the peak it records, checked against
  the result's ``peak_memory_bytes``.

The steps are timed with the profiler on: it costs time, so compare speeds with the recipes that
do not profile. ``--trace-dir`` defaults to a fresh temporary directory that rank 0 names for all.
"""

from __future__ import annotations

import collections
import os
import pickle
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, record_function

from recipes.core.cli import run_cli
from recipes.core.config import RecipeError, TrainConfig, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.paths import output_dir_problem, refuse
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.state import full_state_on_cpu
from recipes.core.speed import (autocast, check_autocast, make_adamw, make_grad_scaler,
                                setup_precision)
from recipes.core.throughput import Workload
from recipes.core.workload import (MODEL_PRESETS, build_model, distributed_loader, iterate_steps,
                                   lm_loss, make_dataset)
from recipes.core.world import join_world

log = get_logger(__name__)

# Substrings that mark a collective in a profiler event's name (lower-cased): "c10d" covers the
# launch (c10d::allreduce_, _c10d_functional::all_gather_into_tensor), "gloo" and "nccl" the work
# itself. Not "broadcast" or "all_reduce" alone: aten::broadcast_tensors is compute.
COLLECTIVE_MARKERS = ("c10d", "gloo", "nccl", "record_param_comms")


@dataclass
class ProfilingConfig(TrainConfig):
    wait: int = opt(
        1, "steps before the profiler starts (step 0 allocates state: not typical)", ge=0)
    warmup: int = opt(
        1, "steps profiled and discarded: the profiler's start-up cost lands there", ge=0)
    active: int = opt(2, "steps recorded into the trace, the table and the figures", ge=1)
    trace_dir: str = opt("", "where traces and snapshots go; empty = a fresh temporary directory")
    top_ops: int = opt(10, "rows of the top-ops table", ge=1)
    memory_history_entries: int = opt(
        100_000, "CUDA: allocator events the memory snapshot keeps", ge=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        profiled = self.wait + self.warmup + self.active
        if profiled > self.steps:
            raise RecipeError(f"--wait {self.wait} + --warmup {self.warmup} + --active "
                              f"{self.active} = {profiled} profiled steps, more than --steps "
                              f"{self.steps}; use --steps {profiled} or profile fewer steps")


# --8<-- [start:train]
def train(cfg: ProfilingConfig) -> RecipeResult:
    with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
        precision = setup_precision(cfg.precision, world.device)
        check_autocast(world.device, precision)
        per_rank_batch = per_rank_batch_size(cfg.global_batch_size, world.world_size)
        trace_dir = shared_trace_dir(cfg.trace_dir)
        model = build_model(cfg.model, seed=cfg.seed, device=world.device)
        on_cuda = world.device.type == "cuda"
        ddp_model = DDP(model, device_ids=[world.device.index] if on_cuda else None)
        optimizer = make_adamw(ddp_model.parameters(), lr=cfg.lr, device=world.device)
        scaler = make_grad_scaler(world.device, precision)
        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        loader, sampler = distributed_loader(dataset, rank=world.rank, world_size=world.world_size,
                                             per_rank_batch_size=per_rank_batch, seed=cfg.seed)
        first_active = cfg.wait + cfg.warmup
        last_active = first_active + cfg.active - 1
        snapshot_path = os.path.join(trace_dir, f"memory-snapshot-rank{world.rank}.pickle")

        profiler = torch.profiler.profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else []),
            # repeat=1: one cycle. The default (0) starts a new cycle after each, and each cycle
            # replaces the last one's events.
            schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active,
                                             repeat=1),
            record_shapes=False)  # shapes split the table's rows and cost time; turn on to debug
        local_losses, timer = [], StepTimer(world.device)
        with profiler:
            for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
                if on_cuda and step == first_active:
                    peak_before = start_memory_window(world.device, cfg.memory_history_entries)
                with timer:
                    inputs, targets = inputs.to(world.device), targets.to(world.device)
                    with record_function("forward"), autocast(world.device, precision):
                        loss = lm_loss(ddp_model(inputs), targets)
                    optimizer.zero_grad(set_to_none=True)
                    with record_function("backward"):  # DDP launches its all-reduces in here
                        scaler.scale(loss).backward()
                    with record_function("optimizer"):
                        scaler.step(optimizer)
                        scaler.update()
                profiler.step()  # after the timer's synchronize: the GPU's work is in this step
                if on_cuda and step == last_active:
                    memory = end_memory_window(world.device, snapshot_path)
                # Pitfall: a global loss logged every step is an all-reduce every step, and the
                # trace would show it next to DDP's. Log rank 0's share; average them at the end.
                local_losses.append(loss.item())  # a float: no GPU scalar kept alive per step
                log.info("step %d loss %.4f (rank 0's share) time %.1f ms", step, local_losses[-1],
                         timer.durations[-1] * 1e3)

        profiler.export_chrome_trace(os.path.join(trace_dir, f"trace-rank{world.rank}.json"))
        # One file per rank. On several nodes each node holds its own ranks' files.
        trace_paths = [os.path.join(trace_dir, f"trace-rank{rank}.json")
                       for rank in range(world.world_size)]
        figures, table = profile_figures(profiler, on_cuda=on_cuda, active_steps=cfg.active,
                                         top_ops=cfg.top_ops)
        log.info("top %d ops by %s:\n%s", cfg.top_ops, figures["top_ops_sorted_by"], table)
        result = make_result(
            "profiling", world, mean_over_ranks_each(local_losses, world.device),
            model.parameters(), timer,
            keep_final_state=full_state_on_cpu(model) if cfg.keep_final_state else None,
            workload=Workload(MODEL_PRESETS[cfg.model], cfg.global_batch_size, precision),
            trace_dir=trace_dir, trace_paths=trace_paths, **figures)
        if on_cuda:  # make_result read the peak since the window reset it: earlier steps count too
            result.peak_memory_bytes = max(result.peak_memory_bytes, peak_before)
            result.extras.update(memory)
        else:
            result.extras["memory_snapshot"] = ("needs CUDA (it records the CUDA caching "
                                                f"allocator); this run is on {world.device.type}")
        return result
# --8<-- [end:train]


def shared_trace_dir(requested: str) -> str:
    """``requested``, or a fresh temporary directory that rank 0 names for every rank."""
    fresh = not requested and dist.get_rank() == 0
    path = [tempfile.mkdtemp(prefix="recipes-profile-") if fresh else requested]
    dist.broadcast_object_list(path, src=0)  # before profiling: this collective is not in the trace
    # Every rank writes its trace there: a file in its place, or above it, stops every rank.
    refuse(output_dir_problem(path[0], "--trace-dir"))
    os.makedirs(path[0], exist_ok=True)  # on other nodes, rank 0's temporary name is created anew
    return path[0]


def mean_over_ranks_each(local_losses: list[float], device: torch.device) -> list[float]:
    """Every step's global loss (the mean over the ranks), in one all-reduce after the loop."""
    losses = torch.tensor(local_losses, dtype=torch.float32, device=device)  # exact: fp32 losses
    if dist.get_world_size() > 1:
        dist.all_reduce(losses, op=dist.ReduceOp.SUM)
        losses /= dist.get_world_size()
    return losses.tolist()


# --8<-- [start:profile_figures]
def profile_figures(profiler: torch.profiler.profile, *, on_cuda: bool, active_steps: int,
                    top_ops: int) -> tuple[dict, str]:
    """Communication vs the whole step, and the top ops (and their table), from the active steps."""
    events = profiler.events()
    steps = [(e.time_range.start, e.time_range.end) for e in events
             if e.name.startswith("ProfilerStep")]
    collectives = [e for e in events if any(m in e.name.lower() for m in COLLECTIVE_MARKERS)]
    # Time is measured where the work runs: on the GPU its kernels (the CPU only launches them), on
    # CPU the launching thread and gloo's worker threads. Overlapping events (several threads,
    # streams, nested annotations) count once: the union of their intervals, within the steps.
    timeline = DeviceType.CUDA if on_cuda else DeviceType.CPU
    busy = [(e.time_range.start, e.time_range.end) for e in collectives
            if e.device_type == timeline]
    step_us = sum(end - start for start, end in steps)
    communication_us = sum(
        union_length([(max(s, lo), min(e, hi)) for s, e in busy if s < hi and e > lo])
        for lo, hi in steps)
    # Ops only: an annotation (ProfilerStep*, forward, DistributedDataParallel.forward) is a
    # region, whose "self" time is what its ops leave over, and on a GPU its whole span.
    sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    averages = profiler.key_averages()
    averages[:] = [a for a in averages if not a.is_user_annotation]
    ranked = sorted(averages, key=lambda a: getattr(a, sort_by), reverse=True)[:top_ops]
    return {
        "communication_events": dict(collections.Counter(e.name for e in collectives)),
        "communication_ms_per_step": communication_us / 1e3 / active_steps,
        "profiled_step_ms": step_us / 1e3 / active_steps,
        "top_ops_sorted_by": sort_by,
        "top_ops": [(a.key, getattr(a, sort_by) / 1e3, a.count) for a in ranked],
    }, averages.table(sort_by=sort_by, row_limit=top_ops)
# --8<-- [end:profile_figures]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


# --8<-- [start:memory_window]
def start_memory_window(device: torch.device, max_entries: int) -> int:
    """Record every CUDA allocation from here on; returns the peak allocated bytes until now."""
    torch.cuda.synchronize(device)
    peak_before = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)  # from here, the allocator's peaks are the window's
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")  # C++: slow
    return peak_before


def end_memory_window(device: torch.device, path: str) -> dict:
    """Dump the snapshot to ``path`` and stop; the window's peaks, replayed from it and counted."""
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    # The snapshot holds the blocks allocated at the dump and the trace of every alloc and free
    # before it; replayed backwards from the dump, the trace gives the bytes allocated at each
    # event. Its sizes are the sizes asked for, so its peak is the allocator's requested-bytes peak.
    # max_memory_allocated (the result's peak_memory_bytes) counts whole blocks (rounded up to
    # 512 bytes, or a cached block too big to split): a little more.
    allocated = sum(block["requested_size"] for segment in snapshot["segments"]
                    if segment["device"] == device.index for block in segment["blocks"]
                    if block["state"] == "active_allocated")
    trace = snapshot["device_traces"][device.index]
    deltas = [(1 if e["action"] == "alloc" else -1) * e["size"] for e in trace
              if e["action"] in ("alloc", "free_requested")]  # when the allocated bytes change
    level = peak = allocated - sum(deltas)  # allocated when the oldest kept event happened
    for delta in deltas:
        level += delta
        peak = max(peak, level)
    return {"memory_snapshot": path, "memory_snapshot_events": len(trace),
            "snapshot_peak_requested_bytes": peak,
            "window_peak_requested_bytes": stats["requested_bytes.all.peak"],
            "window_peak_allocated_bytes": stats["allocated_bytes.all.peak"]}
# --8<-- [end:memory_window]


if __name__ == "__main__":
    run_cli(train, ProfilingConfig, __doc__)
