"""Hang diagnosis: which rank, and which collective, a stuck world is waiting on.

    torchrun --standalone --nproc_per_node=2 -m recipes.hang_diagnosis --skip-rank 1 --timeout-s 10
    python -m torch.distributed.flight_recorder.fr_trace hang_traces --prefix rank_
    torchrun --standalone --nproc_per_node=2 -m recipes.hang_diagnosis --skip-rank 1 --mode detail

Copy with it: recipes/toy.py (the model and data you replace), recipes/options.py (the command
line, from the config).

A data-parallel loop (the shared model; each step all-reduces the gradients, then all-gathers the
losses) in which ``--skip-rank`` skips one gradient all-reduce on purpose, as a rank does that takes
another branch. The other rank waits in the all-reduce; the skipping rank waits in the next
all-gather. ``--skip-rank`` / ``--skip-step`` are options of the recipe, not a test's fault
injection: making one rank skip a call is how a user watches each tool find it. Three tools, each
shown here, find out why:

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

The process group is created here in the open, not by a shared helper: its timeout and what must be
set before it exists (the recorder's variables, the DETAIL level) are the lesson. ``train`` returns
a ``HangRun``: the losses of a clean run (equal to one process's), else the error and the finding.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import glob
import os
import pickle
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader, DistributedSampler

from recipes.options import check_options, config_parser, exit_on_bad_input, option, parse_config
from recipes.toy import MODEL_PRESETS, build_model, lm_loss, make_dataset


@dataclass
class HangConfig:
    model: str = option("tiny", "model size", choices=sorted(MODEL_PRESETS))
    steps: int = option(4, "optimizer steps of the data-parallel loop", at_least=1)
    global_batch_size: int = option(12, "sequences per step, summed over all ranks", at_least=1)
    skip_rank: int = option(
        -1,
        "this rank skips the gradient all_reduce of --skip-step on purpose; -1 = none (a "
        "clean run)",
        at_least=-1,
    )
    skip_step: int = option(1, "the step whose all_reduce --skip-rank skips", at_least=0)
    mode: str = option(
        "flight_recorder",
        "flight_recorder: wait for the timeout, then dump every rank's recorder and find the "
        "mismatch; detail: TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective first",
        choices=["flight_recorder", "detail"],
    )
    trace_dir: str = option(
        "hang_traces",
        "where each rank writes rank_<r> (flight recorder) and stack_<r>.txt (its stack)",
    )
    buffer_size: int = option(
        2000, "flight recorder entries kept per rank (TORCH_FR_BUFFER_SIZE)", at_least=1
    )
    timeout_s: float = option(
        10.0, "collective timeout: a rank stuck in a collective raises after it", above=0
    )
    stack_after_s: float = option(
        0.0,
        "write every rank's stack when a step runs longer than this; 0 = half of --timeout-s",
        at_least=0,
    )
    backend: str = option(
        "auto",
        "process-group backend; auto: nccl with a GPU per local rank, else gloo",
        choices=["auto", "nccl", "gloo"],
    )
    seed: int = option(0, "model init and data order", at_least=0)

    def __post_init__(self) -> None:
        check_options(self)  # the ranges and choices above: one line each
        if self.skip_rank >= 0 and self.skip_step >= self.steps:
            # a skip past the last step: a clean run that looks diagnosed
            raise ValueError(
                f"skip_step={self.skip_step} is never reached: the steps are 0 to "
                f"{self.steps - 1}; use --skip-step {self.steps - 1} or less, or --steps "
                f"{self.skip_step + 1} or more"
            )
        if os.path.exists(self.trace_dir) and not os.path.isdir(self.trace_dir):
            raise ValueError(
                f"trace_dir {self.trace_dir} is a file; name a directory (created if missing)"
            )
        if self.backend == "nccl" and not torch.cuda.is_available():
            # this recipe creates its process group itself (dist_setup would say the same)
            raise ValueError(
                "backend nccl needs a CUDA device per rank and there is none; "
                "use backend gloo (or auto)"
            )


@dataclass
class HangRun:
    losses: list[float]  # each step's global loss; [] when the world hung
    error: str | None  # the first line of the timeout or of DETAIL's mismatch; None: clean
    finding: str | None  # the rank and the collective the ranks disagree on; None: none found
    stuck_in: str | None  # the torch.distributed call of this rank's last stack dump


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
        raise RuntimeError(
            f"torch {torch.__version__} has no flight recorder dump; "
            "use --mode detail, or torch >= 2.11 with NCCL"
        )
    trace = pickle.loads(dump())
    if not trace.get("entries"):
        raise RuntimeError(
            f"torch {torch.__version__} recorded no collectives on backend "
            f"{dist.get_backend()}; use --mode detail (or NCCL) here"
        )
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
            (e["process_group"][1], e["collective_seq_id"]): e for e in entries
        }
    for group, seq in sorted({key for per_rank in calls.values() for key in per_rank}):
        ops = {rank: per_rank.get((group, seq)) for rank, per_rank in sorted(calls.items())}
        names = {rank: e["profiling_name"] if e else "nothing" for rank, e in ops.items()}
        if len(set(names.values())) == 1:
            continue
        votes = Counter(names.values())
        expected = max(
            votes,
            key=lambda name: (votes[name], -min(rank for rank in names if names[rank] == name)),
        )
        odd = [rank for rank in names if names[rank] != expected]
        where = _user_frame(next(ops[r] for r in names if names[r] == expected))
        ran = ", ".join(f"rank {rank} ran {names[rank]}" for rank in odd)
        return (
            f"collective #{seq} on {group}: the others ran {expected} (at {where}); {ran}: "
            f"rank {', '.join(map(str, odd))} skipped or reordered {expected}"
        )
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
    # faulthandler writes the innermost frame first: the first public call of torch.distributed
    for filename, func in re.findall(r'File "(.+?)", line \d+ in (\S+)', last):
        if filename.endswith("distributed_c10d.py") and not func.startswith("_"):
            return func
    return None


# --8<-- [end:stacks]


def detail_mismatch(error: str) -> str | None:
    """DETAIL's error, short: "rank 0 ran ALLREDUCE #3, rank 1 ran ALLGATHER #3"."""
    calls = re.findall(
        r"Rank (\d+) is running collective: CollectiveFingerPrint\("
        r"SequenceNumber=(\d+), OpType=(\w+)",
        error,
    )
    return ", ".join(f"rank {rank} ran {op} #{seq}" for rank, seq, op in calls) or None


# --8<-- [start:train]
def train(cfg: HangConfig, observer=None) -> HangRun:
    """The loop on this process's rank, then (if it stopped) which rank skipped which call."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # set by torchrun, 0 when alone
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    # Checked before joining: every rank refuses at once, with the same line
    if cfg.skip_rank >= world_size or (cfg.skip_rank >= 0 and world_size == 1):
        raise ValueError(
            f"skip_rank={cfg.skip_rank} needs a world of at least 2 that has that "
            f"rank; this one has {world_size}"
        )
    if cfg.global_batch_size % world_size:
        lower = max(world_size, cfg.global_batch_size - cfg.global_batch_size % world_size)
        raise ValueError(
            f"global_batch_size={cfg.global_batch_size} does not divide across {world_size} "
            f"ranks; use a multiple of {world_size}, e.g. {lower} or {lower + world_size}"
        )
    try:
        enable_flight_recorder(cfg.trace_dir, cfg.buffer_size)
        if not os.access(cfg.trace_dir, os.W_OK | os.X_OK):
            raise PermissionError(13, "permission denied")
    except OSError as exc:  # a file on the way, no permission
        raise ValueError(
            f"--trace-dir {cfg.trace_dir}: {exc.strerror.lower()}; name a directory "
            "you can write to"
        ) from None
    if cfg.mode == "detail":  # = TORCH_DISTRIBUTED_DEBUG=DETAIL, read when the group is created
        dist.set_debug_level(dist.DebugLevel.DETAIL)
    use_cuda = cfg.backend == "nccl" or (
        cfg.backend == "auto"
        and torch.cuda.is_available()
        and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    )
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)  # Pitfall: else every rank's NCCL work lands on cuda:0
    # The timeout turns a hang into an error: the stuck call raises (gloo) or the watchdog
    # aborts (NCCL) after it, instead of waiting forever
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if "RANK" in os.environ:  # torchrun: meet at MASTER_ADDR:MASTER_PORT
        dist.init_process_group(
            "nccl" if use_cuda else "gloo", timeout=timeout, device_id=device if use_cuda else None
        )
    else:  # alone: a world of 1, which needs no rendezvous
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    try:
        rank = dist.get_rank()
        for stale in glob.glob(os.path.join(cfg.trace_dir, "rank_*")):
            os.remove(stale)  # a previous run's dumps would join this run's analysis
        per_rank_batch = cfg.global_batch_size // world_size
        losses, error = [], None
        with stack_dumps(cfg.trace_dir, rank) as stack_file:
            try:
                # --8<-- [start:loop]
                # Pitfall: the same seed on every rank: nothing here broadcasts rank 0's weights
                model = build_model(cfg.model, seed=cfg.seed, device=device)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
                if observer:
                    observer.model_ready(model, optimizer)

                dataset = make_dataset(cfg.model, cfg.global_batch_size, seed=cfg.seed)
                sampler = DistributedSampler(
                    dataset,
                    num_replicas=world_size,
                    rank=rank,
                    shuffle=True,
                    seed=cfg.seed,
                    drop_last=True,
                )
                loader = DataLoader(
                    dataset,
                    batch_size=per_rank_batch,
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
                        # a step that overruns writes this rank's stack: where it is blocked
                        with watchdog(stack_file, cfg.stack_after_s or cfg.timeout_s / 2):
                            inputs = inputs.to(device, non_blocking=True)
                            targets = targets.to(device, non_blocking=True)
                            optimizer.zero_grad(set_to_none=True)
                            loss = lm_loss(model(inputs), targets)  # this rank's sequences' mean
                            loss.backward()
                            # data parallelism by hand: one all_reduce of the flat gradient
                            grads = [p.grad for p in model.parameters()]
                            flat = torch.cat([g.reshape(-1) for g in grads])
                            if not (rank == cfg.skip_rank and step == cfg.skip_step):
                                dist.all_reduce(flat)  # the call a rank must never skip alone
                            flat /= world_size
                            for grad, chunk in zip(grads, flat.split([g.numel() for g in grads])):
                                grad.copy_(chunk.view_as(grad))
                            optimizer.step()
                            # all_gather, not all_reduce: a rank that skipped the all_reduce
                            # meets a call of another type, which every tool below tells apart
                            gathered = [torch.zeros(1, device=device) for _ in range(world_size)]
                            dist.all_gather(gathered, loss.detach().reshape(1))
                        losses.append(float(torch.cat(gathered).mean()))
                        if rank == 0:
                            print(f"step {step} loss {losses[-1]:.4f}", flush=True)
                        if observer:
                            observer.step_end(step, losses[-1])
                        step += 1
                    epoch += 1
                # --8<-- [end:loop]
            except (RuntimeError, dist.DistError) as exc:  # the timeout, or DETAIL's mismatch
                error = next(
                    (line.strip() for line in str(exc).splitlines() if line.strip()), repr(exc)
                )
        finding = diagnose(cfg, rank, world_size, error)
        stuck_in = last_collective_in_stack(os.path.join(cfg.trace_dir, f"stack_{rank}.txt"))
        return HangRun([] if error else losses, error, finding, stuck_in)
    finally:
        dist.destroy_process_group()
        dist.set_debug_level_from_env()  # DETAIL was for this group only


# --8<-- [end:train]


def diagnose(cfg: HangConfig, rank: int, world_size: int, error: str | None) -> str | None:
    """After the loop: dump the recorder, wait for every rank's dump, and find the mismatch."""
    finding = None
    if cfg.mode == "flight_recorder":
        dump_flight_recorder(cfg.trace_dir, rank)
        # The group may be broken now: wait for the other ranks' files, not on a collective.
        deadline = time.monotonic() + cfg.timeout_s
        while (
            len(glob.glob(os.path.join(cfg.trace_dir, "rank_[0-9]*"))) < world_size
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        finding = find_mismatch(cfg.trace_dir)
    elif error:
        finding = detail_mismatch(error)
    if error:
        print(f"rank {rank}: {error[:300]}", file=sys.stderr, flush=True)
        if rank == 0:
            print(
                f"diagnosis: {finding or 'no mismatch found: see the stack_<rank>.txt files'}",
                flush=True,
            )
    return finding


def make_parser() -> argparse.ArgumentParser:
    return config_parser(HangConfig, prog="python -m recipes.hang_diagnosis", doc=__doc__)


@record  # under torchrun, the failure summary names this rank's exception and traceback
def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(make_parser(), HangConfig, argv)
    with exit_on_bad_input():  # a skip_rank outside the world: one line from rank 0, exit 2
        train(cfg)


if __name__ == "__main__":
    main()
