"""Hang diagnosis: which rank, and which collective, a stuck world is waiting on.

    torchrun --standalone --nproc_per_node=2 -m recipes.hang_diagnosis --skip-rank 1 --timeout-s 10
    python -m torch.distributed.flight_recorder.fr_trace hang_traces --prefix rank_
    torchrun --standalone --nproc_per_node=2 -m recipes.hang_diagnosis --skip-rank 1 --mode detail

A data-parallel loop (the shared model; each step all-reduces the gradients, then all-gathers the
losses) in which ``--skip-rank`` skips one gradient all-reduce on purpose, as a rank does that takes
another branch. The other rank waits in the all-reduce; the skipping rank waits in the next
all-gather. Three tools, each shown here, find out why:

1. The flight recorder. ``TORCH_FR_BUFFER_SIZE=N`` before the process group exists makes every
   rank keep its last N collectives (name, sequence number, sizes, Python stack). When the timeout
   fires, each rank dumps its ring to ``<trace-dir>/rank_<r>``; ``find_mismatch`` (here) and
   torch's ``fr_trace`` compare the ranks' sequences and name the first collective they disagree
   on. On NCCL the watchdog dumps by itself on a timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` and
   ``TORCH_FR_DUMP_TEMP_FILE``, set here too); gloo has no watchdog, so the rank that catches the
   timeout dumps. torch 2.13 records gloo collectives; ``dump_flight_recorder`` says so when the
   installed torch does not (an empty ring). torch 2.11's ``fr_trace`` reads NCCL/XCCL dumps only
   (it asserts the backend on a gloo dump); ``find_mismatch`` reads both.
2. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``--mode detail``): before every collective the ranks
   compare fingerprints (op, sequence number, shapes), and a mismatch raises at once on every rank,
   naming both calls, instead of waiting for the timeout. It costs an extra check per collective.
3. The Python stack of every rank, without py-spy: ``faulthandler`` writes each rank's stack to
   ``stack_<r>.txt`` when a step runs longer than ``--stack-after-s`` (a C-level watchdog thread:
   it works while the main thread is blocked inside a collective), and on ``kill -USR1 <pid>``.

Without a skipping rank the loop is plain data parallelism: its losses equal one process's.
"""

from __future__ import annotations

import contextlib
import faulthandler
import glob
import os
import pickle
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from recipes.core.cli import run_cli
from recipes.core.config import Config, RecipeError, check_step_reached, opt, per_rank_batch_size
from recipes.core.log import get_logger
from recipes.core.paths import output_dir_problem, refuse
from recipes.core.result import RecipeResult, StepTimer, make_result
from recipes.core.workload import (
    build_model,
    distributed_loader,
    iterate_steps,
    lm_loss,
    make_dataset,
)
from recipes.core.world import World, collective_in_frames, join_world

log = get_logger(__name__)


@dataclass
class HangConfig(Config):
    steps: int = opt(4, "optimizer steps of the data-parallel loop", ge=1)
    global_batch_size: int = opt(12, "sequences per step, summed over all ranks", ge=1)
    skip_rank: int = opt(-1, "this rank skips the gradient all_reduce of --skip-step on purpose; "
                             "-1 = none (a clean run)", ge=-1)
    skip_step: int = opt(1, "the step whose all_reduce --skip-rank skips", ge=0)
    mode: Literal["flight_recorder", "detail"] = opt(
        "flight_recorder", "flight_recorder: wait for the timeout, then dump every rank's recorder "
        "and find the mismatch; detail: TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective "
        "first")
    trace_dir: str = opt("hang_traces", "where each rank writes rank_<r> (flight recorder) and "
                                        "stack_<r>.txt (its Python stack)")
    buffer_size: int = opt(2000, "flight recorder entries kept per rank (TORCH_FR_BUFFER_SIZE)",
                           ge=1)
    timeout_s: float = opt(10.0, "collective timeout: a rank stuck in a collective raises after it",
                           gt=0)
    stack_after_s: float = opt(0.0, "write every rank's stack when a step runs longer than this; "
                                    "0 = half of --timeout-s", ge=0)
    backend: Literal["auto", "gloo", "nccl"] = opt("auto", "process-group backend (see core.world)")
    seed: int = opt(0, "seed for model init and data order", ge=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.skip_rank >= 0:  # a skip past the last step: a clean run that looks diagnosed
            check_step_reached("skip_step", self.skip_step, self.steps)


# --8<-- [start:recorder]
def enable_flight_recorder(trace_dir: str, buffer_size: int) -> None:
    """Turn the flight recorder on: must run before ``init_process_group`` (it reads these once)."""
    os.makedirs(trace_dir, exist_ok=True)
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(buffer_size)
    # NCCL: the watchdog writes <prefix><rank> itself when a collective times out.
    os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(os.path.abspath(trace_dir), "rank_")


def dump_flight_recorder(trace_dir: str, rank: int) -> str:
    """Write this rank's recorder to ``<trace_dir>/rank_<rank>``, in the format fr_trace reads."""
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        raise RecipeError(f"torch {torch.__version__} has no flight recorder dump; "
                          "use --mode detail, or torch >= 2.11 with NCCL")
    trace = pickle.loads(dump())
    if not trace.get("entries"):
        raise RecipeError(f"torch {torch.__version__} recorded no collectives on backend "
                          f"{dist.get_backend()}; use --mode detail (or NCCL) here")
    # torch 2.13's gloo dump leaves each group's name empty in pg_config, and fr_trace then stops
    # with KeyError ('0', 0): name the groups the entries use, with their ranks.
    groups = {name: pg for pg, name in dist.distributed_c10d._world.pg_names.items()}
    for name, desc in {tuple(entry["process_group"]) for entry in trace["entries"]}:
        if name not in trace["pg_config"] and name in groups:
            ranks = dist.get_process_group_ranks(groups[name])
            trace["pg_config"][name] = {"name": name, "desc": desc, "ranks": str(ranks)}
    trace["pg_config"].pop("", None)
    path = os.path.join(trace_dir, f"rank_{rank}")
    # Whole or absent: the analysis waits for every rank_<r>. The partial file's name must not
    # match rank_* (the other ranks would count and read it half-written, as fr_trace would).
    partial = os.path.join(trace_dir, f".partial_rank_{rank}")
    with open(partial, "wb") as f:
        pickle.dump(trace, f)
    os.replace(partial, path)
    return path


def find_mismatch(trace_dir: str) -> str | None:
    """The first collective the ranks disagree on, as one line, or None if they all agree.

    Each rank numbers its collectives per group (``collective_seq_id``): number k must be the same
    call on every rank. The call most ranks made is the expected one, and the ranks that made
    another are named. With two ranks there is no majority: the lower rank is taken as right, as
    torch's ``fr_trace`` does, so run three ranks (or read the stacks) to tell who skipped.
    """
    calls = {}
    for path in glob.glob(os.path.join(trace_dir, "rank_*")):
        with open(path, "rb") as f:
            entries = pickle.load(f)["entries"]
        calls[int(path.rsplit("_", 1)[1])] = {
            (e["process_group"][1], e["collective_seq_id"]): e for e in entries}
    for group, seq in sorted({key for per_rank in calls.values() for key in per_rank}):
        ops = {rank: per_rank.get((group, seq)) for rank, per_rank in sorted(calls.items())}
        names = {rank: e["profiling_name"] if e else "nothing" for rank, e in ops.items()}
        if len(set(names.values())) == 1:
            continue
        votes = Counter(names.values())
        expected = max(votes, key=lambda name: (votes[name], -min(
            rank for rank in names if names[rank] == name)))
        odd = [rank for rank in names if names[rank] != expected]
        where = _user_frame(next(ops[r] for r in names if names[r] == expected))
        ran = ", ".join(f"rank {rank} ran {names[rank]}" for rank in odd)
        return (f"collective #{seq} on {group}: the others ran {expected} (at {where}); {ran}: "
                f"rank {', '.join(map(str, odd))} skipped or reordered {expected}")
    return None


def _user_frame(entry: dict) -> str:
    frames = [f for f in entry.get("frames", []) if "/torch/" not in f["filename"]]
    return f"{os.path.basename(frames[0]['filename'])}:{frames[0]['line']}" if frames else "?"
# --8<-- [end:recorder]


# --8<-- [start:stacks]
@contextlib.contextmanager
def stack_dumps(trace_dir: str, rank: int) -> Iterator[object]:
    """``stack_<rank>.txt`` gets this rank's stack on ``kill -USR1 <pid>``, or from ``watchdog``."""
    with open(os.path.join(trace_dir, f"stack_{rank}.txt"), "w") as file:
        faulthandler.register(signal.SIGUSR1, file=file, all_threads=True)
        try:
            yield file
        finally:
            faulthandler.cancel_dump_traceback_later()
            faulthandler.unregister(signal.SIGUSR1)


@contextlib.contextmanager
def watchdog(file: object, seconds: float) -> Iterator[None]:
    """Write every thread's stack to ``file`` if the block runs longer than ``seconds``."""
    faulthandler.dump_traceback_later(seconds, file=file)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def last_collective_in_stack(path: str) -> str | None:
    """The torch.distributed call in the last stack written to ``path`` (None: not in one)."""
    with open(path) as f:
        last = f.read().rsplit("Thread 0x", 1)[-1]
    frames = re.findall(r'File "(.+?)", line (\d+) in (\S+)', last)
    return collective_in_frames([(name, int(line), func) for name, line, func in frames])
# --8<-- [end:stacks]


def detail_mismatch(error: str) -> str | None:
    """DETAIL's error, short: "rank 0 ran ALLREDUCE #3, rank 1 ran ALLGATHER #3"."""
    calls = re.findall(r"Rank (\d+) is running collective: CollectiveFingerPrint\("
                       r"SequenceNumber=(\d+), OpType=(\w+)", error)
    return ", ".join(f"rank {rank} ran {op} #{seq}" for rank, seq, op in calls) or None


# --8<-- [start:loop]
def train_steps(cfg: HangConfig, world: World, stack_file: object) -> list[float]:
    """Data parallelism by hand: all_reduce the flat gradient, all_gather the losses, step."""
    model = build_model("tiny", seed=cfg.seed, device=world.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    per_rank = per_rank_batch_size(cfg.global_batch_size, world.world_size)
    loader, sampler = distributed_loader(make_dataset("tiny", cfg.global_batch_size, seed=cfg.seed),
                                         rank=world.rank, world_size=world.world_size,
                                         per_rank_batch_size=per_rank, seed=cfg.seed)
    losses = []
    for step, (inputs, targets) in iterate_steps(loader, sampler, cfg.steps):
        with watchdog(stack_file, cfg.stack_after_s or cfg.timeout_s / 2):
            loss = lm_loss(model(inputs.to(world.device)), targets.to(world.device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if not (world.rank == cfg.skip_rank and step == cfg.skip_step):
                dist.all_reduce(flat)  # the call a rank must never skip alone
            flat /= world.world_size
            for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
                grad.copy_(chunk.view_as(grad))
            gathered = [torch.zeros(1, device=world.device) for _ in range(world.world_size)]
            dist.all_gather(gathered, loss.detach().reshape(1))
            optimizer.step()
        losses.append(float(torch.cat(gathered).mean()))
        log.info("step %d loss %.4f", step, losses[-1])
    return losses
# --8<-- [end:loop]


# --8<-- [start:run]
def run(cfg: HangConfig) -> RecipeResult:
    refuse(output_dir_problem(cfg.trace_dir, "--trace-dir"))  # every rank writes there
    enable_flight_recorder(cfg.trace_dir, cfg.buffer_size)
    if cfg.mode == "detail":  # = TORCH_DISTRIBUTED_DEBUG=DETAIL, read when the group is created
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        with join_world(cfg.backend, timeout_s=cfg.timeout_s) as world:
            return _diagnose(cfg, world)
    finally:
        dist.set_debug_level_from_env()


def _diagnose(cfg: HangConfig, world: World) -> RecipeResult:
    if cfg.skip_rank >= world.world_size or (cfg.skip_rank >= 0 and world.world_size == 1):
        raise RecipeError(f"skip_rank={cfg.skip_rank} needs a world of at least 2 that has that "
                          f"rank; this one has {world.world_size}")
    for stale in glob.glob(os.path.join(cfg.trace_dir, "rank_*")):
        os.remove(stale)  # a previous run's dumps would join this run's analysis
    timer, losses, error = StepTimer(world.device), [], None
    with stack_dumps(cfg.trace_dir, world.rank) as stack_file, timer:
        try:
            losses = train_steps(cfg, world, stack_file)
        except (RuntimeError, dist.DistError) as exc:  # the timeout, or DETAIL's mismatch
            error = next((line.strip() for line in str(exc).splitlines() if line.strip()),
                         repr(exc))
    finding = None
    if cfg.mode == "flight_recorder":
        dump_flight_recorder(cfg.trace_dir, world.rank)
        # The group may be broken now: wait for the other ranks' files, not on a collective.
        deadline = time.monotonic() + cfg.timeout_s
        while (len(glob.glob(os.path.join(cfg.trace_dir, "rank_[0-9]*"))) < world.world_size
               and time.monotonic() < deadline):
            time.sleep(0.1)
        finding = find_mismatch(cfg.trace_dir)
    elif error:
        finding = detail_mismatch(error)
    if error:
        log.error("rank %d: %s", world.rank, error[:300])
        log.info("diagnosis: %s", finding or "no mismatch found: see the stack_<rank>.txt files")
    stack_file = os.path.join(cfg.trace_dir, f"stack_{world.rank}.txt")
    return make_result("hang_diagnosis", world, losses, [], timer, mode=cfg.mode, error=error,
                       finding=finding, stuck_in=last_collective_in_stack(stack_file),
                       trace_dir=cfg.trace_dir)
# --8<-- [end:run]


if __name__ == "__main__":
    run_cli(run, HangConfig, __doc__)
