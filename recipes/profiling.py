"""Profiling: see where a DDP step's time and memory go, and tell compute from communication.

    torchrun --standalone --nproc_per_node=2 -m recipes.profiling
    python -m recipes.profiling --model 100m   # a world of 1; on a GPU also a memory snapshot
    torchrun --standalone --nproc_per_node=2 -m recipes.profiling --trace-dir traces --active 3

Copy with it: recipes/toy.py (the model and data you replace), recipes/dist_setup.py (joining and
leaving the world), recipes/options.py (the command line, from the config).

The loop is ddp_torchrun's inside ``torch.profiler.profile``. Its schedule skips ``--wait`` steps
(step 0 allocates AdamW's state, DDP rebuilds its buckets), profiles ``--warmup`` steps and throws
them away (the profiler's own start-up lands there), then records ``--active`` steps. What comes
out:

- ``<trace-dir>/trace-rank<R>.json`` for every rank: a Chrome trace with "forward", "backward" and
  "optimizer" labelled (open it in https://ui.perfetto.dev or chrome://tracing);
- on rank 0, the top ops table (self CUDA time on a GPU, self CPU time on CPU);
- the communication in the profiled steps, by event name, and its milliseconds per step against the
  step's: names are matched, not guessed. In torch 2.13 DDP's gradient all-reduce is
  ``c10d::allreduce_`` on the thread that launches it, then ``gloo:all_reduce`` on a gloo worker
  thread for as long as it runs (NCCL: ``nccl:all_reduce`` on the CPU, an NCCL kernel on the GPU);
- on CUDA, ``<trace-dir>/memory-snapshot-rank<R>.pickle`` (drop it on pytorch.org/memory_viz): every
  allocation of the profiled steps with its Python stack, and the peak it records, next to the
  allocator's own counters over the same steps and its peak before them.

``train`` returns a ``ProfileRun``: each step's loss averaged over the ranks, and those figures.
The profiler costs time: compare speeds with the recipes that do not profile. ``--trace-dir``
defaults to a fresh temporary directory that rank 0 names for all.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, record_function
from torch.utils.data import DataLoader, DistributedSampler

from recipes.dist_setup import cleanup_distributed, setup_distributed
from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset

# Substrings that mark a collective in a profiler event's name (lower-cased): "c10d" covers the
# launch (c10d::allreduce_, _c10d_functional::all_gather_into_tensor), "gloo" and "nccl" the work
# itself. Not "broadcast" or "all_reduce" alone: aten::broadcast_tensors is compute.
COLLECTIVE_MARKERS = ("c10d", "gloo", "nccl", "record_param_comms")


class TraceDirError(ValueError):
    """A trace_dir that no rank can write its trace into: one line that names the fix."""


@dataclass
class ProfilingConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(6, "optimizer steps", at_least=1)
    global_batch_size: int = option(
        12, "sequences per optimizer step, summed over all ranks", at_least=1
    )
    lr: float = option(1e-3, "AdamW's learning rate", above=0)
    # the same seed -> the same weights and data order on every rank, on any world size
    seed: int = option(0, "model init and data order", at_least=0)
    precision: str = option(
        "auto",
        "auto: bf16 autocast on a GPU, fp32 on CPU; fp32: exact (TF32 off)",
        choices=["auto", "fp32", "bf16"],
    )
    backend: str = option(
        "auto",
        "process-group backend; auto: nccl with a GPU per local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    timeout_s: float = option(300.0, "seconds a collective waits for its peers", above=0)
    # step 0 allocates AdamW's state and DDP rebuilds its buckets: not a typical step
    wait: int = option(
        1, "steps before the profiler starts (step 0 allocates state: not typical)", at_least=0
    )
    warmup: int = option(
        1,
        "steps profiled and thrown away: the profiler's start-up cost lands there",
        at_least=0,
    )
    active: int = option(2, "steps recorded into the trace, the table and the figures", at_least=1)
    trace_dir: str | None = option(
        None,
        "where traces and snapshots go (created if missing); default: a fresh temporary "
        "directory that rank 0 names for all",
    )
    top_ops: int = option(10, "rows of the top-ops table", at_least=1)
    memory_history_entries: int = option(
        100_000, "CUDA: allocator events the memory snapshot keeps", at_least=1
    )

    def __post_init__(self) -> None:
        # Checked before any rank joins: every rank refuses the same config at once.
        check_options(self)  # the ranges and choices above: one line each
        profiled = self.wait + self.warmup + self.active
        if profiled > self.steps:
            raise ValueError(
                f"wait {self.wait} + warmup {self.warmup} + active {self.active} = "
                f"{profiled} profiled steps, more than steps {self.steps}; use steps "
                f"{profiled} or profile fewer steps"
            )
        # a file where the folder goes (each rank checks its own node again, in train)
        problem = self.trace_dir and trace_dir_problem(self.trace_dir)
        if problem:
            raise TraceDirError(problem)


@dataclass
class ProfileRun:
    """What ``train`` returns on every rank: the losses, and what this rank's profile found."""

    losses: list[float]  # each step's loss, averaged over the ranks once, after the loop
    trace_dir: str
    trace_paths: list[str]  # every rank's trace (on several nodes, each on its own node)
    communication_events: dict[str, int]  # each collective's event name: calls in the window
    communication_ms_per_step: float  # the time a collective was running, per profiled step
    profiled_step_ms: float  # a profiled step's wall time
    top_ops_sorted_by: str
    top_ops: list[tuple[str, float, int]]  # (name, milliseconds, calls), the table's rows
    memory_snapshot: str  # CUDA: the snapshot's path; elsewhere, why there is none
    # CUDA only (None elsewhere): the snapshot's events and the peaks of the window
    memory_snapshot_events: int | None = None
    snapshot_peak_requested_bytes: int | None = None  # replayed from the snapshot
    window_peak_requested_bytes: int | None = None  # the allocator's counters, same steps
    window_peak_allocated_bytes: int | None = None
    peak_allocated_before_window_bytes: int | None = None  # the steps before the window


# --8<-- [start:train]
def train(cfg: ProfilingConfig, observer=None) -> ProfileRun:
    """Train under torch.profiler on this process's rank; returns the losses and the figures."""
    world = setup_distributed(cfg.backend, timeout_s=cfg.timeout_s)
    try:
        rank, local_rank, world_size, device = (
            world.rank,
            world.local_rank,
            world.world_size,
            world.device,
        )
        if cfg.global_batch_size % world_size:
            lower = max(world_size, cfg.global_batch_size - cfg.global_batch_size % world_size)
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} does not divide across {world_size} "
                f"ranks; use a multiple of {world_size}, e.g. {lower} or {lower + world_size}"
            )
        use_cuda = device.type == "cuda"
        per_rank_batch = cfg.global_batch_size // world_size
        bf16 = cfg.precision == "bf16" or (
            cfg.precision == "auto" and use_cuda and torch.cuda.is_bf16_supported()
        )
        if use_cuda and not bf16:  # fp32 means fp32: no TF32 matmuls (a process-wide switch)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        trace_dir = shared_trace_dir(cfg.trace_dir)
        first_active = cfg.wait + cfg.warmup  # the steps the profiler records
        last_active = first_active + cfg.active - 1

        # --8<-- [start:loop]
        # Pitfall: the same seed on every rank, or the replicas start different (DDP broadcasts
        # rank 0's weights at construction, but a model built differently still diverges)
        model = build_model(cfg.model, seed=cfg.seed, device=device)
        model = DDP(model, device_ids=[local_rank] if use_cuda else None)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, fused=True if use_cuda else None
        )  # one kernel on CUDA
        if observer:
            observer.model_ready(model, optimizer)

        dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
        # Each rank reads a disjoint 1/world_size of every epoch: the union of the ranks' batches
        # at step s is one process's batch s. drop_last keeps every global batch full.
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True
        )
        loader = DataLoader(
            dataset, batch_size=per_rank_batch, sampler=sampler, drop_last=True, pin_memory=use_cuda
        )
        profiler = torch.profiler.profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else []),
            # repeat=1: one cycle. The default (0) starts a new cycle after each, and each cycle
            # replaces the last one's events.
            schedule=torch.profiler.schedule(
                wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1
            ),
            record_shapes=False,
        )  # shapes split the table's rows and cost time; turn on to debug
        memory = {}  # CUDA: the peaks of the memory window

        local_losses, step, epoch = [], 0, 0
        with profiler:
            while step < cfg.steps:
                # Pitfall: without set_epoch every epoch repeats the first epoch's order
                sampler.set_epoch(epoch)
                for inputs, targets in loader:
                    if step == cfg.steps:
                        break
                    if use_cuda and step == first_active:
                        memory["peak_allocated_before_window_bytes"] = start_memory_window(
                            device, cfg.memory_history_entries
                        )
                    inputs = inputs.to(device, non_blocking=True)
                    targets = targets.to(device, non_blocking=True)
                    optimizer.zero_grad(set_to_none=True)
                    with (
                        record_function("forward"),
                        torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16),
                    ):
                        loss = lm_loss(model(inputs), targets)  # this rank's sequences' mean
                    with record_function("backward"):  # DDP launches its all-reduces in here
                        loss.backward()
                    with record_function("optimizer"):
                        optimizer.step()  # every rank applies the same averaged gradient
                    # Pitfall: a global loss every step is an all-reduce every step, and the
                    # trace would show it next to DDP's. Keep this rank's share; average later.
                    local_losses.append(loss.item())  # a float: no GPU scalar kept per step
                    if rank == 0:
                        print(
                            f"step {step} loss {local_losses[-1]:.4f} (rank 0's share)", flush=True
                        )
                    if use_cuda:  # the GPU's work is in this step's span, not the next one's
                        torch.cuda.synchronize(device)
                    profiler.step()
                    if use_cuda and step == last_active:
                        memory.update(
                            end_memory_window(
                                device,
                                os.path.join(trace_dir, f"memory-snapshot-rank{rank}.pickle"),
                            )
                        )
                    # after profiler.step(): whatever an observer does is not in the profile
                    if observer:
                        observer.step_end(step, local_losses[-1])
                    step += 1
                epoch += 1
        # --8<-- [end:loop]

        profiler.export_chrome_trace(os.path.join(trace_dir, f"trace-rank{rank}.json"))
        figures, table = profile_figures(
            profiler, on_cuda=use_cuda, active_steps=cfg.active, top_ops=cfg.top_ops
        )
        losses = mean_over_ranks_each(local_losses, device)
        if rank == 0:
            print(f"top {cfg.top_ops} ops by {figures['top_ops_sorted_by']}:\n{table}")
            print(
                f"communication {figures['communication_ms_per_step']:.2f} ms of "
                f"{figures['profiled_step_ms']:.2f} ms per profiled step: "
                f"{figures['communication_events']}; traces in {trace_dir}"
            )
            print(
                "losses (mean over the ranks): " + " ".join(f"{x:.4f}" for x in losses), flush=True
            )
        if not use_cuda:
            memory["memory_snapshot"] = (
                f"needs CUDA (it records the CUDA caching allocator); this run is on {device.type}"
            )
        # One file per rank. On several nodes each node holds its own ranks' files.
        trace_paths = [os.path.join(trace_dir, f"trace-rank{r}.json") for r in range(world_size)]
        return ProfileRun(
            losses=losses, trace_dir=trace_dir, trace_paths=trace_paths, **figures, **memory
        )
    finally:
        cleanup_distributed()


# --8<-- [end:train]


def shared_trace_dir(requested: str | None) -> str:
    """``requested``, or a fresh temporary directory that rank 0 names for every rank."""
    fresh = not requested and dist.get_rank() == 0
    path = [tempfile.mkdtemp(prefix="recipes-profile-") if fresh else requested]
    dist.broadcast_object_list(path, src=0)  # before profiling: this collective is not in the trace
    # Every rank writes its trace there. A problem one rank sees (on its node) stops every rank,
    # with the same line, rather than leaving the others waiting in the first all-reduce.
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, trace_dir_problem(path[0]))
    problem = next((p for p in problems if p), None)
    if problem:
        raise TraceDirError(problem)
    os.makedirs(path[0], exist_ok=True)  # on other nodes, rank 0's temporary name is created anew
    return path[0]


def trace_dir_problem(path: str) -> str | None:
    if os.path.exists(path) and not os.path.isdir(path):
        return f"trace_dir {path} is a file; name a directory (created if missing)"
    above = os.path.abspath(path)
    while not os.path.exists(above):  # the nearest folder that exists is where it is created
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        return (
            f"trace_dir {path}: {above} is a file, so nothing can be created under it; "
            "name a directory you can write to"
        )
    if not os.access(above, os.W_OK | os.X_OK):
        return f"trace_dir {path}: cannot write in {above}; name a directory you can write to"
    return None


def mean_over_ranks_each(local_losses: list[float], device: torch.device) -> list[float]:
    """Every step's global loss (the mean over the ranks), in one all-reduce after the loop."""
    losses = torch.tensor(local_losses, dtype=torch.float32, device=device)  # exact: fp32 losses
    if dist.get_world_size() > 1:
        dist.all_reduce(losses, op=dist.ReduceOp.SUM)
        losses /= dist.get_world_size()
    return losses.tolist()


# --8<-- [start:profile_figures]
def profile_figures(
    profiler: torch.profiler.profile, *, on_cuda: bool, active_steps: int, top_ops: int
) -> tuple[dict, str]:
    """Communication vs the whole step, and the top ops (and their table), from the active steps."""
    events = profiler.events()
    steps = [
        (e.time_range.start, e.time_range.end) for e in events if e.name.startswith("ProfilerStep")
    ]
    collectives = [e for e in events if any(m in e.name.lower() for m in COLLECTIVE_MARKERS)]
    # Time is measured where the work runs: on the GPU its kernels (the CPU only launches them), on
    # CPU the launching thread and gloo's worker threads. Overlapping events (several threads,
    # streams, nested annotations) count once: the union of their intervals, within the steps.
    timeline = DeviceType.CUDA if on_cuda else DeviceType.CPU
    busy = [
        (e.time_range.start, e.time_range.end) for e in collectives if e.device_type == timeline
    ]
    step_us = sum(end - start for start, end in steps)
    communication_us = sum(
        union_length([(max(s, lo), min(e, hi)) for s, e in busy if s < hi and e > lo])
        for lo, hi in steps
    )
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
    allocated = sum(
        block["requested_size"]
        for segment in snapshot["segments"]
        if segment["device"] == device.index
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )
    trace = snapshot["device_traces"][device.index]
    deltas = [
        (1 if e["action"] == "alloc" else -1) * e["size"]
        for e in trace
        if e["action"] in ("alloc", "free_requested")
    ]  # when the allocated bytes change
    level = peak = allocated - sum(deltas)  # allocated when the oldest kept event happened
    for delta in deltas:
        level += delta
        peak = max(peak, level)
    return {
        "memory_snapshot": path,
        "memory_snapshot_events": len(trace),
        "snapshot_peak_requested_bytes": peak,
        "window_peak_requested_bytes": stats["requested_bytes.all.peak"],
        "window_peak_allocated_bytes": stats["allocated_bytes.all.peak"],
    }


# --8<-- [end:memory_window]


def make_parser() -> argparse.ArgumentParser:
    return config_parser(ProfilingConfig, prog="python -m recipes.profiling", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), ProfilingConfig, argv)
    with exit_on_bad_input():  # bad input every rank sees: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
